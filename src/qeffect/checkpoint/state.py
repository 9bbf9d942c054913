"""What a qeffect checkpoint holds: tensor keys, the JSON payload schema, and the local view of a pipeline.

Persistent (saved): parameters, AdamW state, every module's FP8 numerical state (amax histories,
scales), the logical optimizer epochs, the precision recipe, the static configuration, the data
position and the RNG state. Process-local (never saved, rebuilt or invalidated on resume): graphs,
streams, events, tape generations, arena addresses, effect tokens and weight-cache contents. The split
is the paper's: a checkpoint restores *numbers and logical epochs*, never addresses.

Tensor keys are stage-qualified so that they do not depend on how stages map to processes (a
single-process checkpoint and a torchrun PP=2 checkpoint of the same run hold the same keys):

- ``model.s{stage}.{param}``: a parameter;
- ``optim.s{stage}.{param}.{state}``: its AdamW state (``exp_avg``, ``exp_avg_sq``, ``step``);
- ``fp8.s{stage}.{linear}.{state}``: FP8 state. With data parallelism the replicas' FP8 states differ
  (each replica records the amaxes of its own data), so then every replica has its own keys,
  ``fp8.dp{replica}.s{stage}.{linear}.{state}``. Parameters and optimizer state are identical across
  replicas and saved once (DCP de-duplicates identical keys).
"""

from __future__ import annotations

import base64
import re
from dataclasses import dataclass
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict

from qeffect.config import RunConfig, bit_changing_fields

SCHEMA_VERSION = 1
SUPPORTED_SCHEMA_VERSIONS = (1,)
PAYLOAD_FILE = "qeffect.json"
DCP_METADATA_FILE = ".metadata"
LATEST_FILE = "latest"

CACHE_SEMANTICS = (
    "invalidated on resume: weight-cache contents and versions e_C are process-local and not saved; "
    "every cache is invalidated on load and the first forward of the first step refreshes it (e_C <- e_W)"
)
NOT_SAVED = [
    "CUDA graphs",
    "streams",
    "events",
    "tape generations and slots",
    "gradient-arena addresses and contents",
    "effect tokens",
    "weight-cache contents (quantized weights) and versions e_C",
]

# Fields a resumed run must share with the checkpoint: every setting that changes the numbers a run computes
# (`config.bit_changing_fields`: model shape, recipe and backend, optimizer hyper-parameters, seed, activation
# dtype, ...) and the layout the checkpoint's keys and data positions depend on (pipeline shape, schedule,
# microbatches). Everything else (steps, evaluation, paths, device, action path, runtime and offload choices,
# staged weight-gradient accumulation) may change between a save and a resume: it leaves the bits alone.
LAYOUT_FIELDS = ("pipeline.pp", "pipeline.dp", "pipeline.chunks_per_rank", "pipeline.microbatches",
                 "pipeline.schedule")
RESUME_FIELDS: tuple[str, ...] = tuple(dict.fromkeys(bit_changing_fields() + LAYOUT_FIELDS))


def param_key(stage: int, name: str) -> str:
    return f"model.s{stage}.{name}"


def optim_key(stage: int, name: str, state: str) -> str:
    return f"optim.s{stage}.{name}.{state}"


def fp8_key(stage: int, name: str, dp_rank: int, dp: int) -> str:
    return f"fp8.s{stage}.{name}" if dp == 1 else f"fp8.dp{dp_rank}.s{stage}.{name}"


_KEY_RE = {
    "model": re.compile(r"^model\.s(?P<stage>\d+)\.(?P<name>.+)$"),
    "optim": re.compile(r"^optim\.s(?P<stage>\d+)\.(?P<name>.+)\.(?P<state>[^.]+)$"),
    "fp8": re.compile(r"^fp8\.(?:dp(?P<dp>\d+)\.)?s(?P<stage>\d+)\.(?P<name>.+)\.(?P<state>[^.]+)$"),
}


@dataclass(frozen=True)
class ParsedKey:
    section: str  # model | optim | fp8 | other
    stage: int | None = None
    name: str = ""  # parameter or linear name inside the stage
    state: str = ""  # optimizer or FP8 state name
    dp: int | None = None  # replica of a per-replica FP8 key


def parse_key(key: str) -> ParsedKey:
    for section, rx in _KEY_RE.items():
        m = rx.match(key)
        if m:
            g = m.groupdict()
            return ParsedKey(section, int(g["stage"]), g["name"], g.get("state") or "",
                             int(g["dp"]) if g.get("dp") else None)
    return ParsedKey("other")


# ---------------------------------------------------------------------------------------------- payload
class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StagePayload(_Model):
    """One stage chunk: who owns it and what it holds (names only; the numbers are DCP tensors)."""

    stage: int
    pp_rank: int
    params: list[str]
    fp8_linears: list[str]
    cache: str = "invalidated on resume"


class ProcessPayload(_Model):
    """Per-process state that is not a tensor: data position and RNG (base64 of the generator bytes)."""

    global_rank: int
    dp_rank: int
    pp_ranks: list[int]
    data: dict[str, Any] | None
    rng: dict[str, Any]


class FileEntry(_Model):
    bytes: int
    sha256: str


class CheckpointPayload(_Model):
    """`qeffect.json`: everything qeffect needs besides the DCP tensors, written last by global rank 0."""

    schema_version: int = SCHEMA_VERSION
    kind: Literal["qeffect-checkpoint"] = "qeffect-checkpoint"
    step: int
    epochs: dict[str, int]  # pipeline rank -> e_W (all equal after a commit)
    config: dict[str, Any]
    recipe: dict[str, Any]
    schedule: str
    pp: int
    dp: int
    chunks_per_rank: int
    microbatches: int
    num_stages: int
    world_size: int
    launch: Literal["single-process", "torchrun"]
    stages: list[StagePayload]
    processes: list[ProcessPayload]
    cache_semantics: str = CACHE_SEMANTICS
    not_saved: list[str] = NOT_SAVED
    files: dict[str, FileEntry]  # every file of the checkpoint except qeffect.json itself
    qeffect_version: str
    torch_version: str


# ------------------------------------------------------------------------------------------ local view
@dataclass
class LocalView:
    """The pipeline ranks this process holds, and where the process sits in the job."""

    ranks: list  # QEffectRank
    schedule: Any
    pp: int
    dp: int
    dp_rank: int
    global_rank: int
    world_size: int
    distributed: bool


def local_view(pipe: Any) -> LocalView:
    """Accept a `SingleProcessPipeline` (all ranks here) or a `DistributedPipeline` (one rank here)."""
    from qeffect.runtime.rank import QEffectRank

    if hasattr(pipe, "topo"):
        import torch.distributed as dist

        ranks = [pipe.rank]
        topo = pipe.topo
        view = LocalView(ranks, pipe.schedule, topo.pp, topo.dp, topo.dp_rank, topo.rank, dist.get_world_size(),
                         True)
    else:
        view = LocalView(list(pipe.ranks), pipe.schedule, pipe.schedule.pp, 1, 0, 0, 1, False)
    for r in view.ranks:
        if not isinstance(r, QEffectRank):
            raise TypeError(f"checkpoints hold qeffect runtime ranks (QEffectRank), got {type(r).__name__}")
    return view


def tensor_state(view: LocalView) -> dict[str, torch.Tensor]:
    """Live tensors of this process by checkpoint key (no copies: DCP reads them while saving)."""
    out: dict[str, torch.Tensor] = {}
    for r in view.ranks:
        r.settle()  # a row-lazy token table: every row and moment up to date first
        owner: dict[int, tuple[int, str]] = {}
        for s, chunk in r.chunks.items():
            for name, p in chunk.named_parameters():
                out[param_key(s, name)] = p.detach()
                owner[id(p)] = (s, name)
            for name, t in chunk.fp8_state().items():
                out[fp8_key(s, name, view.dp_rank, view.dp)] = t
        for p, st in r.optimizer.state.items():
            s, name = owner[id(p)]
            for k, v in st.items():
                if not isinstance(v, torch.Tensor):
                    raise TypeError(f"optimizer state {name}.{k} is a {type(v).__name__}, not a tensor")
                out[optim_key(s, name, k)] = v
    return out


# -------------------------------------------------------------------------------------------------- rng
def _bytes_text(state: torch.Tensor) -> str:
    """A uint8 state tensor as base64, without numpy interop: the bytes of a storage of its own."""
    return base64.b64encode(bytes(state.clone().untyped_storage())).decode()


def rng_state(device: torch.device | None) -> dict[str, Any]:
    out: dict[str, Any] = {"cpu": _bytes_text(torch.get_rng_state())}
    if device is not None and device.type == "cuda" and torch.cuda.is_initialized():
        out["cuda"] = _bytes_text(torch.cuda.get_rng_state(device))
    return out


def _bytes_tensor(text: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(text)), dtype=torch.uint8)


def restore_rng(state: dict[str, Any], device: torch.device | None) -> None:
    torch.set_rng_state(_bytes_tensor(state["cpu"]))
    if "cuda" in state and device is not None and device.type == "cuda":
        torch.cuda.set_rng_state(_bytes_tensor(state["cuda"]), device)


# ------------------------------------------------------------------------------------------ config diff
def _flatten(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


_ABSENT = object()


def _decays_to_the_last_step(flat: dict[str, Any]) -> bool:
    """Whether the learning rate of this config depends on `train.steps` (a decay with decay_steps = 0)."""
    return flat.get("optim.schedule", "constant") != "constant" and flat.get("optim.decay_steps", 0) == 0


def config_differences(saved: dict[str, Any], current: dict[str, Any], *, only_resume_fields: bool = True,
                       labels: tuple[str, str] = ("checkpoint", "run")) -> list[str]:
    """`field: checkpoint X, run Y` for every differing field (`RESUME_FIELDS` by default, and
    `train.steps` where a decay ends at the last step: another length bends the learning-rate curve).
    Stored configs are compared as dicts over today's defaults, so a checkpoint written under another
    config schema still loads: a field it lacks counts as its default (the value it ran with), and a field
    it has that is gone (e.g. `train.offload*`, now `[offload]`) is compared only where both have it."""
    defaults = _flatten(RunConfig().model_dump())
    a, b = {**defaults, **_flatten(saved)}, {**defaults, **_flatten(current)}
    steps_matter = _decays_to_the_last_step(a) or _decays_to_the_last_step(b)

    def relevant(k: str) -> bool:
        return not only_resume_fields or k in RESUME_FIELDS or (steps_matter and k == "train.steps")

    out = []
    for k in sorted(set(a) | set(b)):
        if not relevant(k):
            continue
        va, vb = a.get(k, _ABSENT), b.get(k, _ABSENT)
        if va != vb:
            sa = "absent" if va is _ABSENT else repr(va)
            sb = "absent" if vb is _ABSENT else repr(vb)
            out.append(f"{k}: {labels[0]} {sa}, {labels[1]} {sb}")
    return out
