"""Validated run configuration, loaded from TOML. One pydantic model per concern.

Errors name the file and the dotted field so that a user can fix the TOML without reading code.
"""

from __future__ import annotations

import tomllib
from importlib import resources
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from qeffect.errors import UserError

DEFAULT_CONFIG = "tiny.toml"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelConfig(_Strict):
    vocab_size: int = Field(32768, ge=2)
    hidden: int = Field(64, ge=1)
    ffn: int = Field(256, ge=1)
    heads: int = Field(4, ge=1)
    layers_per_chunk: int = Field(1, ge=1)
    seq_len: int = Field(32, ge=2)
    microbatch_size: int = Field(2, ge=1)

    @model_validator(mode="after")
    def _heads_divide_hidden(self) -> ModelConfig:
        if self.hidden % self.heads:
            raise ValueError(f"heads ({self.heads}) must divide hidden ({self.hidden})")
        return self


class PipelineConfig(_Strict):
    pp: int = Field(2, ge=1)
    dp: int = Field(1, ge=1)
    chunks_per_rank: int = Field(2, ge=1)
    microbatches: int = Field(4, ge=1)
    schedule: Literal["interleaved", "zbv"] = "interleaved"
    wgrad_staging: int = Field(8, ge=0)
    """Staged weight-gradient accumulation: microbatch weight gradients kept in the GEMM's own dtype and
    folded into the fp32 gradient in one pass per group of this many (0: add each as it comes). Used when
    every stage runs dW in microbatch order; same bits either way, fewer memory passes, more memory."""

    @property
    def num_stages(self) -> int:
        return self.pp * self.chunks_per_rank


class FP8Config(_Strict):
    backend: Literal["reference", "te"] = "reference"
    margin: int = Field(0, ge=0)
    amax_history_len: int = Field(4, ge=1)
    amax_compute_algo: Literal["max", "most_recent"] = "max"
    head: Literal["backend", "torchao"] = "backend"
    """The last chunk's output head. "backend": the backend's delayed-scaling linear (a matrix linear: dW
    work, checkpointed FP8 state). "torchao": torchao's dynamic tensorwise `Float8Linear` (the torchao
    extra; model.hidden, model.vocab_size and microbatch_size * seq_len multiples of 16): stateless, so
    no FP8 state to checkpoint, and its weight gradient comes in dI like the non-matrix parameters."""


class OptimConfig(_Strict):
    lr: float = Field(3e-3, gt=0)
    beta1: float = Field(0.9, ge=0, lt=1)
    beta2: float = Field(0.95, ge=0, lt=1)
    eps: float = Field(1e-8, gt=0)
    weight_decay: float = Field(0.0, ge=0)


class TrainConfig(_Strict):
    steps: int = Field(60, ge=1)
    seed: int = 0
    device: Literal["cpu", "cuda"] = "cpu"
    dtype: Literal["float32", "bfloat16"] = "float32"
    path: Literal["eager", "captured-copy", "captured-direct"] = "eager"
    offload: Literal["off", "release", "resident"] = "off"
    # resident offload: the bank plan (which groups share a bank: which are copied out, which copies a
    # forward or a backward waits for). "search" (default): the plan with the shortest step that
    # offload.timing simulates, over 400 tries of valid plans at capture (on the H200's host about 0.9 s at
    # h2048, 2.6 s at h4096), within the bank memory the colouring maps with `offload_search_banks` banks;
    # "colour": the greedy colouring with at least `offload_banks` banks (offload.plan.assign_banks; the
    # A/B). QEFFECT_OFFLOAD_BANKS=b0:b1:... (one bank per group, in backward order) overrides both.
    offload_bank_plan: Literal["search", "colour"] = "search"
    # resident offload, "colour": at least this many banks (more: fewer evictions and reloads, more memory)
    offload_banks: int = Field(2, ge=2, le=64)
    # resident offload, "search": no more bank memory than the colouring maps with this many banks. H200
    # (f253344): 6 against 4, h2048 ZB-V x1.043 / 1.042 against x1.076 / 1.131, Interleaved x1.050 / 1.053
    # against x1.052 (in less memory: 88-100 MiB of banks against 110), h4096 x1.043 against x1.064 (176
    # MiB against 140)
    offload_search_banks: int = Field(6, ge=2, le=64)
    # resident offload, "search": among plans the simulation times as fast, the one that copies fewer bytes
    # to and from the host ("copies", default: it keeps more groups in their banks, within the same memory
    # budget) or the one that maps less bank memory ("memory"; the A/B). H200, the modes timed in alternating
    # rounds, of no offload: d76cd7b h2048 Interleaved x1.026 against x1.034, ZB-V x1.024 against x1.033,
    # h4096 x1.022 against x1.028; 05a12ea x1.029 / 1.029, x1.027 / 1.028, x1.025 / 1.025
    offload_search_prefer: Literal["memory", "copies"] = "copies"
    # release offload: also release a slot after its backward (its memory comes back until the group's next
    # forward, for one more unmap and remap per group per step); false (default) keeps it mapped from the
    # backward to the next forward, which writes it anyway. Either way the slot's memory is returned
    # between the forward and the backward. H200, h2048 ZB-V: x1.047 of no offload kept, x1.149 reaped.
    offload_reap: bool = False
    # resident offload: no D2H for a group whose bank, by the schedule's static plan, no other group claims
    # between its forward and its backward (its bytes are still there); false copies every group (the A/B)
    offload_skip_kept_d2h: bool = True
    # release and resident offload: a group whose input gradient comes within fewer than this many other
    # actions of its forward is not offloaded (12: at M = 4, the last two virtual stages' groups in
    # Interleaved, six of sixteen in ZB-V; 2: the last stage's alone). Release: its D2H could hardly finish
    # and its memory come back before the backward. Resident: the plan would mostly keep it in its bank
    # anyway; left on the device it needs no bank and no slot copies in the forward graph. Such a group's
    # activations stay in the graph pool, which at these shapes is not the step's peak: h2048 on the H200
    # (b21ab02) resident x1.017 / 1.025 of off with 12 against x1.031 / 1.029 with 2, peak allocated
    # 7.83 / 7.81 GiB against 7.79 (off 7.94). 0 offloads every group (the A/B)
    offload_min_window: int = Field(12, ge=0, le=1_000_000)
    # release and resident offload: each backward restores this many offloaded groups ahead (next in
    # backward order) on the copy stream; deeper hides a copy longer than one backward, and maps the
    # slots (release) earlier; 0 restores each group only at its own backward (the A/B: for release on the
    # H200, 0 was faster in 8 of 10 schedule-runs, by less than the host moves the step; CHANGELOG)
    offload_lookahead: int = Field(1, ge=0, le=64)
    eval_every: int = Field(20, ge=0)
    eval_batches: int = Field(4, ge=1)
    data: str = ""
    tokenizer: str = ""
    run_dir: str = "runs"
    # Checkpoints: every N steps (0: none) and always at the last step when either field is set;
    # "" puts them under <run folder>/checkpoints.
    checkpoint_every: int = Field(0, ge=0)
    checkpoint_dir: str = ""


class RunConfig(_Strict):
    model: ModelConfig = ModelConfig()
    pipeline: PipelineConfig = PipelineConfig()
    fp8: FP8Config = FP8Config()
    optim: OptimConfig = OptimConfig()
    train: TrainConfig = TrainConfig()

    def with_overrides(self, **dotted: object) -> RunConfig:
        """Return a copy with `section.field` overrides applied (None values are ignored)."""
        data = self.model_dump()
        for key, value in dotted.items():
            if value is None:
                continue
            section, field = key.split(".", 1)
            data[section][field] = value
        return validate_config(data, source="command line")


def _format_errors(err: ValidationError, source: str) -> str:
    parts = []
    for e in err.errors():
        loc = ".".join(str(x) for x in e["loc"]) or "<root>"
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            msg = "unknown field"
        parts.append(f"{loc}: {msg}")
    return f"{source}: invalid configuration: " + "; ".join(parts)


def validate_config(data: dict, source: str) -> RunConfig:
    try:
        return RunConfig.model_validate(data)
    except ValidationError as err:
        raise UserError(_format_errors(err, source)) from None


def load_config(path: str | Path | None = None) -> RunConfig:
    """Load a TOML file; `None` loads the embedded tiny CPU default."""
    if path is None:
        text = resources.files("qeffect.configs").joinpath(DEFAULT_CONFIG).read_text()
        source = f"<embedded {DEFAULT_CONFIG}>"
    else:
        p = Path(path)
        if not p.is_file():
            raise UserError(f"{p}: config file not found")
        text = p.read_text()
        source = str(p)
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        raise UserError(f"{source}: not valid TOML: {err}") from None
    return validate_config(data, source)
