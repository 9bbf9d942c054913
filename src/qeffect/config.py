"""Validated run configuration, loaded from TOML. One pydantic model per section.

Errors name the file and the dotted field so that a user can fix the TOML without reading code. Every
field has a description (docs/configuration.md is generated from them: scripts/config_docs.py). A field marked
``changes_bits`` changes the numbers a run computes: a resume must keep it (`bit_changing_fields`).
"""

from __future__ import annotations

import difflib
import tomllib
from collections.abc import Sequence
from importlib import resources
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic.fields import FieldInfo

from qeffect.errors import UserError

DEFAULT_CONFIG = "tiny.toml"

# Defaults of the [offload] section's sizes and counts, named for the tests and scripts that compare with them.
DEFAULT_COPY_CHUNK_MIB = 2.0
DEFAULT_STORE_BATCH_MIB = 0.25
DEFAULT_SHARE_GAP = 4
DEFAULT_SEARCH_TRIES = 400


def _bits(description: str, default: Any, **kw: Any) -> Any:
    """A field that changes the numbers a run computes (recorded, and kept on resume)."""
    return Field(default, description=description, json_schema_extra={"changes_bits": True}, **kw)


AttentionKind = Literal["auto", "flash", "efficient"]  # model.attention (`model.attention.resolve_attention`)
GraphPools = Literal["private", "shared"]  # runtime.graph_pools (`graphs.captured`)
StepGraph = Literal["auto"] | bool  # runtime.step_graph (`graphs.step_graph`)
WgradAccumulation = Literal["add", "fused"]  # pipeline.wgrad_accumulation (`fp8` backends, `runtime.build`)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


class ModelConfig(_Strict):
    """The model's family and shape: every field changes the numbers (docs/models.md)."""

    family: Literal["gpt", "llama"] = _bits(
        "Model family. 'gpt': pre-LayerNorm, GELU feed-forward, learned positions, full multi-head "
        "attention, biases. 'llama': RMSNorm, SwiGLU feed-forward, rotary positions, grouped-query "
        "attention, no biases. Both have an output head untied from the token table.", "gpt")

    vocab_size: int = _bits("Vocabulary size (rows of the token table and the output head).", 32768, ge=2)
    hidden: int = _bits("Hidden width of every layer.", 64, ge=1)
    ffn: int = _bits("Width of the feed-forward layer's inner projection (llama: of the gate and the up "
                     "projection each).", 256, ge=1)
    heads: int = _bits("Attention heads; must divide `hidden`.", 4, ge=1)
    kv_heads: int = _bits("Llama: key/value heads of grouped-query attention, dividing `heads` (0: `heads`, "
                          "plain multi-head attention). GPT: must stay 0.", 0, ge=0)
    norm_eps: float = _bits("Llama: the RMSNorm epsilon. GPT: ignored (its LayerNorms keep torch's 1e-5).",
                            1e-5, gt=0)
    rope_theta: float = _bits("Llama: the base of the rotary position embedding's frequencies "
                              "(`hidden / heads` must be even). GPT: ignored (learned positions).", 10000.0,
                              gt=1)
    layers_per_chunk: int = _bits("Transformer layers in each pipeline chunk (stage).", 1, ge=1)
    seq_len: int = _bits("Tokens per sequence.", 32, ge=2)
    attention: AttentionKind = _bits(
        "Causal attention's SDPA backend on CUDA. Runs must repeat bit for bit: flash attention's backward "
        "did at 256 tokens per sequence but not at 2,048. 'efficient': the memory-efficient forward with a "
        "backward that keeps the keys unsplit (SDPA's own split them and differed run to run), about 2-3.5x "
        "flash's time at 2,048 tokens. 'auto': torch's own choice (flash) up to 256 tokens per sequence, "
        "'efficient' above (docs/models.md).", "auto")
    microbatch_size: int = _bits("Sequences per microbatch.", 2, ge=1)

    @model_validator(mode="after")
    def _heads_divide_hidden(self) -> ModelConfig:
        if self.hidden % self.heads:
            raise ValueError(f"heads ({self.heads}) must divide hidden ({self.hidden})")
        if self.family == "gpt" and self.kv_heads:
            raise ValueError(f"kv_heads ({self.kv_heads}) is a llama field: the gpt family has full "
                             "multi-head attention (leave it 0)")
        if self.heads % self.num_kv_heads:
            raise ValueError(f"kv_heads ({self.kv_heads}) must divide heads ({self.heads})")
        if self.family == "llama" and (self.hidden // self.heads) % 2:
            raise ValueError(f"rotary positions need an even head dimension; hidden / heads = "
                             f"{self.hidden // self.heads}")
        return self

    @property
    def num_kv_heads(self) -> int:
        """Key/value heads: `kv_heads`, or `heads` where it is 0."""
        return self.kv_heads or self.heads


class PipelineConfig(_Strict):
    """How the model is split over ranks and how a step is scheduled."""

    pp: int = _bits("Pipeline-parallel ranks.", 2, ge=1)
    dp: int = _bits("Data-parallel replicas of the pipeline (torchrun: pp x dp processes).", 1, ge=1)
    chunks_per_rank: int = _bits("Model chunks (virtual stages) per pipeline rank.", 2, ge=1)
    microbatches: int = _bits("Microbatches per step and replica.", 4, ge=1)
    schedule: Literal["interleaved", "zbv"] = Field(
        "interleaved", description="Schedule: 'interleaved' (1F1B over virtual stages) or 'zbv' (zero-bubble "
        "V, split backward with deferred weight gradients). Same bits either way.")
    wgrad_staging: int = Field(
        8, ge=0, description="Staged weight-gradient accumulation: microbatch weight gradients kept in the "
        "GEMM's dtype and folded into the fp32 gradient once per group of at most this many (0: add each as "
        "it comes). Used when every stage runs dW in microbatch order; same bits either way, fewer memory "
        "passes, more memory.")
    wgrad_staging_by_liveness: bool = Field(
        False, description="Direct placement: each stage stages at the largest divisor of its live tape bound "
        "K (schedule liveness) up to wgrad_staging, so that staging adds no captured graphs and its slots "
        "shrink with K: less memory, a fold pass every K microbatches (h4096 on the H200: peak 27.4 -> 18.6 "
        "GiB, step 25.8 -> 31.6 ms). Off: every stage stages at wgrad_staging, and each staging slot and fold "
        "gets graphs of its own. Same bits either way.")
    wgrad_accumulation: WgradAccumulation = _bits(
        "How a microbatch's weight gradient reaches the fp32 gradient. 'add': the wgrad GEMM writes the "
        "activation dtype and the fp32 gradient adds it (autograd's way; staged by wgrad_staging). 'fused': "
        "the GEMM accumulates in fp32 straight into the gradient (Megatron-LM's gradient-accumulation fusion, "
        "Transformer Engine's fuse_wgrad_accumulation): no bf16 gradient, no staging (wgrad_staging is "
        "unused), the gradient memory of native eager. Native eager and every path follow the choice, so "
        "each is bitwise equal to its own native eager; the two choices differ in the last bits of bf16 "
        "runs (with fp32 activations they agree). Each microbatch reads and writes the fp32 gradient: on an "
        "H100 captured-direct te takes +26% / +50% step time at h2048 / h4096 (256 tokens per microbatch) "
        "for a peak of 0.99x native eager's (was 1.14x / 1.53x), and +1.6% at 4,096 tokens per microbatch, "
        "saving 16 GiB.", "add")

    @property
    def num_stages(self) -> int:
        return self.pp * self.chunks_per_rank


class FP8Config(_Strict):
    """FP8 delayed scaling: the backend and its recipe."""

    backend: Literal["reference", "te"] = _bits(
        "FP8 backend: 'reference' (pure PyTorch, runs on the CPU) or 'te' (Transformer Engine, CUDA).",
        "reference")
    margin: int = _bits("Delayed-scaling margin: scale = fp8_max / amax / 2**margin.", 0, ge=0)
    amax_history_len: int = _bits("Length of each tensor's amax history.", 4, ge=1)
    amax_compute_algo: Literal["max", "most_recent"] = _bits(
        "How the scale's amax comes from the history: its maximum or its newest entry.", "max")
    head: Literal["backend", "torchao"] = _bits(
        "The last chunk's output head. 'backend': the backend's delayed-scaling linear (dW work, "
        "checkpointed FP8 state). 'torchao': torchao's dynamic tensorwise Float8Linear (the torchao "
        "extra; hidden, vocab_size and microbatch_size * seq_len multiples of 16): stateless, its weight "
        "gradient comes in dI.", "backend")


class OptimConfig(_Strict):
    """AdamW."""

    lr: float = _bits("Learning rate.", 3e-3, gt=0)
    beta1: float = _bits("AdamW's first-moment decay.", 0.9, ge=0, lt=1)
    beta2: float = _bits("AdamW's second-moment decay.", 0.95, ge=0, lt=1)
    eps: float = _bits("AdamW's epsilon.", 1e-8, gt=0)
    weight_decay: float = _bits("Decoupled weight decay.", 0.0, ge=0)
    schedule: Literal["constant", "cosine", "linear"] = _bits(
        "Learning-rate schedule after the warm-up: 'constant' (lr throughout), 'cosine' or 'linear' decay from "
        "lr to min_lr over decay_steps.", "constant")
    warmup_steps: int = _bits("Steps of linear warm-up from lr / warmup_steps to lr (0: none).", 0, ge=0)
    decay_steps: int = _bits("Steps of decay after the warm-up (0: until train.steps); min_lr after them.", 0,
                             ge=0)
    min_lr: float = _bits("Learning rate at the end of a cosine or linear decay.", 0.0, ge=0)
    clip_grad_norm: float = _bits(
        "Clip the global gradient L2 norm (every parameter of every stage and replica, reduced in a fixed "
        "order) to this value (0: no clipping).", 0.0, ge=0)

    @model_validator(mode="after")
    def _min_lr_below_lr(self) -> OptimConfig:
        if self.min_lr > self.lr:
            raise ValueError(f"min_lr ({self.min_lr}) must not exceed lr ({self.lr})")
        return self


class TrainConfig(_Strict):
    """The training run: length, device, action path, data, evaluation and checkpoints."""

    steps: int = Field(60, ge=1, description="Optimizer steps to run.")
    seed: int = _bits("Seed of the initial weights and the data order.", 0)
    device: Literal["cpu", "cuda"] = Field("cpu", description="Device to train on.")
    dtype: Literal["float32", "bfloat16"] = _bits("Activation dtype (master weights stay fp32).", "float32")
    path: Literal["eager", "captured-copy", "captured-direct"] = Field(
        "eager", description="How stage actions run: 'eager' (checked eager actions), 'captured-copy' (CUDA "
        "graphs, gradients copied out between replays) or 'captured-direct' (CUDA graphs writing gradients "
        "straight into the arena). Same bits on every path.")
    eval_every: int = Field(20, ge=0, description="Held-out evaluation before the first step, every N steps "
                            "and after the last (0: none).")
    eval_batches: int = Field(4, ge=1, description="Held-out batches per evaluation.")
    nonfinite: Literal["stop", "skip"] = Field(
        "stop", description="On a non-finite loss or gradient norm: 'stop' with a one-line message naming the "
        "step and the last good checkpoint, or 'skip' that step's optimizer commit (counted in metrics).")
    log_every: int = Field(10, ge=1, description="Without a terminal, print a plain progress line every N "
                           "steps (with a terminal: a progress bar).")
    run_dir: str = Field("runs", description="Folder under which each run writes its own folder.")
    checkpoint_every: int = Field(0, ge=0, description="Save a checkpoint every N steps (0: none), and at the "
                                  "last step when this or checkpoint_dir is set.")
    checkpoint_dir: str = Field("", description="Where checkpoints go ('': <run folder>/checkpoints).")
    keep_checkpoints: int = Field(0, ge=0, description="Keep the newest K checkpoints, deleting older ones after "
                                  "each save (0: keep all).")
    memory_fraction: float = Field(
        0.0, ge=0, le=1, description="Cap this process's CUDA memory at this fraction of the device's "
        "(torch.cuda.set_per_process_memory_fraction; 0: no cap), offload's slots (CUDA VMM, outside torch's "
        "allocator) counted with it. A captured run that does not fit stops with one line naming the cap; "
        "offload.mode = 'release' lowers the peak. Same bits with or without a cap.")

    @model_validator(mode="after")
    def _cap_needs_cuda(self) -> TrainConfig:
        if self.memory_fraction and self.device != "cuda":
            raise ValueError(f"memory_fraction ({self.memory_fraction}) caps CUDA memory: it needs device = cuda")
        return self


class DataConfig(_Strict):
    """Training and held-out data, and the tokenizer."""

    path: str = Field("", description="Training data: a prepared folder (qeffect prepare-data), a C4-format "
                      "JSON-lines file or glob of shards ('': the bundled Jargon File asset).")
    tokenizer: str = Field("", description="A tokenizers JSON file ('': the bundled byte-level BPE).")
    eot: str = Field("", description="The end-of-text token put between documents ('': the tokenizer's own).")
    heldout_fraction: float = Field(0.1, ge=0, lt=1, description="Fraction of the documents held out for "
                                    "evaluation when no heldout_path is given.")
    heldout_path: str = Field("", description="Held-out data, in the same forms as path ('': a fraction of path).")


class LoggingConfig(_Strict):
    """Where metrics go besides metrics.jsonl."""

    tensorboard: bool = Field(False, description="Also write the metrics as TensorBoard scalars under "
                              "<run folder>/tensorboard (the tensorboard extra).")


class RuntimeConfig(_Strict):
    """Runtime choices that change speed, not numbers."""

    rank_streams: bool = Field(
        True, description="One-process captured pipelines without offload: launch each rank's actions and "
        "optimizer step on its own CUDA stream, ordered by events at hand-offs, so ranks overlap on the "
        "device. False keeps one stream (less host work per step). Same bits either way.")
    step_graph: StepGraph = Field(
        "auto", description="Captured-direct pipelines: after two ordinary steps, record the next step's actions "
        "as one CUDA graph (each action's graph a child node, hand-offs as edges) and launch it once per later "
        "step; the host then runs the step's bookkeeping without issuing anything while the device works, and "
        "checks that it issues what the recorded step issued before the commit. Cuts the host's launches, "
        "events and input copies per step to one launch and the batch copies. Same bits. 'auto': where it "
        "applies (one process, a CUDA device, captured-direct, no offload); true: required (an error "
        "elsewhere); false: every action launched by the host.")
    graph_pools: GraphPools = Field(
        "private", description="Captured paths: the memory pools of a stage's action graphs. 'private': a pool "
        "per graph, so any replay order is safe, and each graph keeps the temporaries of its capture reserved. "
        "'shared': graphs whose replays follow their capture order share a pool, so temporaries are reserved "
        "once per pool: with one chain per microbatch (resident offload) a stage's F graphs share one and its "
        "dI graphs another; with chains bounded by liveness, each chain's F and dI share one. dW graphs keep private pools. Every replay is checked to follow its pool's capture order. "
        "Same bits (tests/test_graph_pools_gpu.py). Experimental: on an H100 the same step time, and peak "
        "reserved 26.7 -> 25.5 GiB at h4096 (allocated equal).")


class OffloadConfig(_Strict):
    """Activation offload of captured actions (one CUDA GPU, one process): modes and their knobs."""

    mode: Literal["off", "release", "resident"] = Field(
        "off", description="'off'; 'release': each offloaded group's device memory is unmapped while its "
        "activations live on the host; 'resident': groups share a few always-mapped banks (ping-pong). "
        "Needs a captured path. Same bits as no offload.")
    release_chains: Literal["liveness", "microbatch"] = Field(
        "liveness", description="Release: the captured chains, and with them the offload groups. 'liveness': "
        "bounded by the schedule's liveness, as without offload (a chain's one group holds each of its "
        "microbatches' saved tensors in turn: fewer graphs, less memory kept by them); 'microbatch': a chain "
        "and a group per microbatch, which lets groups share slots (`share_slots`). Resident mode always "
        "plans a group per microbatch. The bound applies where the graphs allow it: with direct placement "
        "and fixed-depth staging each microbatch's dW writes its own slot and keeps its own chain; fused "
        "accumulation or `wgrad_staging_by_liveness` lift that. h4096-long with fused accumulation and shared "
        "pools on an H100: release's peak allocated 41.0 -> 26.2 GiB, reserved 68.4 -> 46.1 GiB, the same "
        "losses and step time.")
    min_window: int = Field(
        12, ge=0, le=1_000_000, description="A group whose input gradient comes within fewer than this many "
        "other actions of its forward (for any microbatch it holds) is not offloaded (its copy could hardly "
        "finish in time); 0 offloads every group.")
    lookahead: int = Field(
        1, ge=0, le=64, description="Each backward restores this many offloaded groups ahead on the copy "
        "stream (0: each group only at its own backward).")
    copy_chunk_mib: float = Field(
        DEFAULT_COPY_CHUNK_MIB, ge=0, description="Resident: copy each group in chunks of this many MiB, so "
        "a restore into a bank whose previous owner's copy-out is still running follows it chunk by chunk "
        "(0: one copy per group).")
    store_batch_mib: float = Field(
        DEFAULT_STORE_BATCH_MIB, ge=0, description="At capture, saved tensors smaller than this many MiB go "
        "into their slot in batches, one multi-tensor copy (0: each tensor copied on its own).")
    reap: bool = Field(
        False, description="Release: also release a slot after its backward (its memory comes back until the "
        "group's next forward, for one more unmap and remap per group and step).")
    max_pending_copies: int = Field(
        0, ge=0, le=1024, description="Release: at most this many groups' slots stay mapped while their "
        "copy-out runs; beyond that the host waits for the oldest copy-out and releases its slot (0: never "
        "waits, releasing only what a query finds done). A host that runs far ahead of the device, as at "
        "thousands of tokens per microbatch, otherwise finds no copy-out done and releases nothing (h4096-long "
        "at microbatch size 2 on an H100: 0 of the slot bytes returned before their backward; with 2, 0.90 "
        "of them, at 1.29x no offload's step instead of 1.14x, and no lower peak of driver memory, since the "
        "caching allocator keeps its own).")
    map_slots: Literal["build", "forward"] = Field(
        "build", description="Release: when a slot first gets device memory. 'build': every slot is mapped when "
        "the graphs are built and stays mapped until a release (the build fails at once if the slots do not "
        "fit); 'forward': a slot is mapped only while a capture uses it (its chain's F, dI, dW) and then at "
        "each forward that writes it, so the build's peak (graph pools at their fullest) holds at most one "
        "slot; with every slot mapped there, release needed as much driver memory as no offload. Memory comes "
        "back during steps only where slots are released: `max_pending_copies` (host ahead of the device) and "
        "`reap` (after each backward). h4096-long on an H100 with both and every group offloaded: driver peak "
        "48.8 GiB against no offload's 53.5, at 1.22x its step.")
    release_at_backward: bool = Field(
        False, description="Release: a backward that finds its group's copy-out not yet seen done waits for "
        "it, releases the slot and restores it (false: keeps the slot mapped and reads the bytes in place).")
    share_slots: Literal["any", "nested", "off"] = Field(
        "any", description="Release: groups whose backwards follow one another share one slot ('any' run of "
        "them, only groups that 'nested', or 'off': a slot per group). Only with a group per microbatch "
        "(`release_chains = 'microbatch'`).")
    slot_members: int = Field(2, ge=1, le=64, description="Release: at most this many groups share one slot.")
    share_gap: int = Field(
        DEFAULT_SHARE_GAP, ge=0, le=1_000_000, description="Release: a shared slot's run needs this many "
        "actions between its last forward and its first backward (time for the last copy-out).")
    launch_first: bool = Field(
        True, description="Run look-ahead restores and reaps right after the backward's replay is launched, "
        "so their driver calls do not delay that launch (false: before the replay).")
    bank_plan: Literal["search", "colour"] = Field(
        "search", description="Resident: how groups are assigned to banks. 'search': the plan with the "
        "shortest step that offload.timing simulates over `search_tries` valid plans at capture; 'colour': "
        "the greedy colouring with at least `banks` banks.")
    banks: int = Field(2, ge=2, le=64, description="Resident, 'colour': at least this many banks.")
    search_banks: int = Field(
        6, ge=2, le=64, description="Resident, 'search': no more bank memory than the colouring maps with "
        "this many banks.")
    search_prefer: Literal["memory", "copies"] = Field(
        "copies", description="Resident, 'search': among plans simulated as fast, the one that copies fewer "
        "bytes ('copies') or maps less bank memory ('memory').")
    search_tries: int = Field(
        DEFAULT_SEARCH_TRIES, ge=0, le=1_000_000, description="Resident, 'search': plans tried at capture "
        "(0: the colouring with `search_banks` banks).")
    explicit_banks: list[int] = Field(
        default_factory=list, description="Resident: banks given by hand, one per group in backward order "
        "(as scripts/offload_sim.py --search prints them); overrides bank_plan. Empty: planned.")
    skip_kept_d2h: bool = Field(
        True, description="Resident: no copy-out for a group whose bank no other group claims between its "
        "forward and its backward (its bytes are still there).")
    skip_futile_restores: bool = Field(
        True, description="Resident: start no look-ahead restore that a forward would evict again before "
        "its backward.")
    driver_streams: bool = Field(
        True, description="Issue offload copies and events through the CUDA driver API (cheaper host calls) "
        "instead of torch's stream operations.")


class RunConfig(_Strict):
    """A whole run: every section of the TOML file."""

    model: ModelConfig = ModelConfig()
    pipeline: PipelineConfig = PipelineConfig()
    fp8: FP8Config = FP8Config()
    optim: OptimConfig = OptimConfig()
    train: TrainConfig = TrainConfig()
    data: DataConfig = DataConfig()
    logging: LoggingConfig = LoggingConfig()
    runtime: RuntimeConfig = RuntimeConfig()
    offload: OffloadConfig = OffloadConfig()

    def with_overrides(self, **dotted: object) -> RunConfig:
        """Return a copy with `section.field` overrides applied (None values are ignored)."""
        data = self.model_dump()
        for key, value in dotted.items():
            if value is None:
                continue
            section, field = key.split(".", 1)
            data[section][field] = value
        return validate_config(data, source="command line")


def changes_bits(field: FieldInfo) -> bool:
    """Whether a field is marked ``changes_bits`` (declared with `_bits`)."""
    extra = field.json_schema_extra
    return isinstance(extra, dict) and bool(extra.get("changes_bits"))


def bit_changing_fields() -> tuple[str, ...]:
    """Every `section.field` marked ``changes_bits``: what a resume must keep and every record carries."""
    return tuple(f"{section}.{name}" for section, info in RunConfig.model_fields.items()
                 for name, field in info.annotation.model_fields.items() if changes_bits(field))


def bit_changing_settings(cfg: RunConfig) -> dict[str, Any]:
    """`section.field -> value` for every bit-changing field of `cfg` (for summaries and reports)."""
    data = cfg.model_dump()
    return {key: data[key.split(".")[0]][key.split(".")[1]] for key in bit_changing_fields()}


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


# ------------------------------------------------------------------------------- --set section.field=value
SET_FORMAT = "section.field=value"


def _set_value(text: str, annotation: Any) -> Any:
    """The right-hand side of a `--set`: a TOML value (`3e-4`, `true`, `[0, 1]`, `"text"`), else the plain
    text (so `cuda` or `runs/a` need no quotes). A string field keeps the text as written when it parses as
    another TOML type (`data.eot=2024` is the string "2024", not an integer)."""
    try:
        value = tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        return text.strip()
    if annotation is str and not isinstance(value, str):
        return text.strip()
    return value


def _unknown(what: str, name: str, known: list[str], prefix: str = "") -> str:
    """`unknown field (did you mean optim.lr?)`, or the list of what there is when nothing is close."""
    close = difflib.get_close_matches(name, known, n=1)
    if close:
        return f"unknown {what} (did you mean {prefix}{close[0]}?)"
    listing = f"fields of [{prefix.rstrip('.')}]" if prefix else "sections"
    return f"unknown {what} ({listing}: {', '.join(known)})"


def parse_set(item: str, source: str = "--set") -> tuple[str, str, Any]:
    """`section.field=value` -> (section, field, value), the field checked against `RunConfig`'s models and
    the value parsed as in a TOML file (`_set_value`); a `UserError` of one line naming `item` otherwise."""
    where = f"{source} {item}"
    key, eq, text = item.partition("=")
    key = key.strip()
    if not eq:
        raise UserError(f"{where}: expected {SET_FORMAT} (no '=')")
    sections = RunConfig.model_fields
    section, dot, field = key.partition(".")
    if not dot or not section or not field:
        owners = [s for s, info in sections.items() if key in info.annotation.model_fields]
        hint = f" (did you mean {owners[0]}.{key}?)" if len(owners) == 1 else ""
        raise UserError(f"{where}: expected {SET_FORMAT}{hint}")
    if section not in sections:
        raise UserError(f"{where}: {_unknown('section', section, list(sections))}")
    fields = sections[section].annotation.model_fields
    if field not in fields:
        raise UserError(f"{where}: {_unknown('field', field, list(fields), prefix=f'{section}.')}")
    return section, field, _set_value(text, fields[field].annotation)


def apply_sets(cfg_or_data: RunConfig | dict, items: Sequence[str] | None,
               source: str = "--set") -> RunConfig:
    """Apply `section.field=value` items (later ones win) to a config, or to TOML data not yet validated,
    and validate the result like a TOML file: any error is one line naming the item or the field."""
    if isinstance(cfg_or_data, RunConfig):
        if not items:
            return cfg_or_data
        data = cfg_or_data.model_dump()
    else:
        data = {k: dict(v) if isinstance(v, dict) else v for k, v in cfg_or_data.items()}
    keys = []
    for item in items or ():
        section, field, value = parse_set(item, source)
        table = data.setdefault(section, {})
        if not isinstance(table, dict):
            raise UserError(f"{source} {item}: [{section}] is not a table")
        table[field] = value
        keys.append((item, section, field))
    try:
        return RunConfig.model_validate(data)
    except ValidationError as err:
        # name the items behind the errors: a field's, or a section's (a check across its fields)
        locs = {tuple(str(x) for x in e["loc"][:2]) for e in err.errors()}
        named = [item for item, section, field in keys if (section, field) in locs or (section,) in locs]
        raise UserError(_format_errors(err, " ".join([source, ", ".join(named)]) if named else source)) from None
