"""What a qeffect checkpoint holds: tensor keys, the JSON payload schema, and the local view of a pipeline.

Persistent (saved): parameters, AdamW state, every module's FP8 numerical state (amax histories,
scales), the logical optimizer epochs, the precision recipe, the static configuration, the data
position and the RNG state. Process-local (never saved, rebuilt or invalidated on resume): graphs,
streams, events, tape generations, arena addresses, effect tokens and weight-cache contents. The split
is the paper's: a checkpoint restores *numbers and logical epochs*, never addresses.

Tensor keys name the model's global structure, never a rank or a stage index, so a checkpoint loads
into any pipeline layout of the same model (other `pipeline.pp`, `chunks_per_rank` with the same layer
count, `dp`, schedule). A module's global name is its name inside its chunk with `blocks.{j}` replaced by
`layers.{stage * layers_per_chunk + j}` (`global_name`); the embeddings, final norm and head keep theirs:

- ``model.{name}``: a parameter (``model.layers.3.qkv.weight``, ``model.tok_emb.weight``);
- ``optim.{name}.{state}``: its AdamW state (``exp_avg``, ``exp_avg_sq``, ``step``);
- ``fp8.{linear}.{state}``: a backend linear's FP8 state (``fp8.layers.3.qkv.input_amax_history``).

Everything is written once, by data-parallel replica 0: replicas hold identical parameters and AdamW
state, and the commit merges their FP8 state (`runtime.distributed`), so at a checkpoint they agree.
Schema 1 (before layouts could change) keyed by stage, ``model.s{stage}.{param}``, with per-replica FP8
keys ``fp8.dp{replica}.s{stage}...`` under data parallelism; it still loads, into any layout too: its
stage keys are translated through the layers per chunk it was written with (`checkpoint_key`).
"""

from __future__ import annotations

import base64
import re
from dataclasses import dataclass
from typing import Any, Literal

import torch
from pydantic import BaseModel, ConfigDict

from qeffect.config import RunConfig, bit_changing_fields

SCHEMA_VERSION = 2
SUPPORTED_SCHEMA_VERSIONS = (1, 2)
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

# Fields a checkpoint diff compares as the run's shape: every setting that changes the numbers a run computes
# (`config.bit_changing_fields`: model shape, recipe and backend, optimizer hyper-parameters, seed, activation
# dtype, ...) and the pipeline layout. Everything else (steps, evaluation, paths, device, action path, runtime
# and offload choices, staged weight-gradient accumulation) may change between a save and a resume: it leaves
# the bits alone.
RESUME_FIELDS: tuple[str, ...] = tuple(dict.fromkeys(bit_changing_fields() + (
    "pipeline.pp", "pipeline.dp", "pipeline.chunks_per_rank", "pipeline.microbatches", "pipeline.schedule")))
# Of those, what a resume may change: how the same model is laid out over processes. The keys do not depend
# on it, and the run's layer count (layers_per_chunk x pp x chunks_per_rank) must stay, so layers_per_chunk
# changes only together with the stage count. `pipeline.microbatches` stays: it is the step's batch.
LAYOUT_FIELDS = ("pipeline.pp", "pipeline.dp", "pipeline.chunks_per_rank", "pipeline.schedule",
                 "model.layers_per_chunk")
# Modules outside the transformer layers, by the stage that holds them (first / last).
FIRST_STAGE_MODULES = ("tok_emb", "pos_emb")

_BLOCK_RE = re.compile(r"^blocks\.(?P<j>\d+)\.(?P<rest>.+)$")
_LAYER_RE = re.compile(r"^layers\.(?P<g>\d+)\.(?P<rest>.+)$")


def global_name(stage: int, name: str, layers_per_chunk: int) -> str:
    """A chunk-local parameter, linear or FP8-state name as the model's global name (module docstring)."""
    m = _BLOCK_RE.match(name)
    return f"layers.{stage * layers_per_chunk + int(m['j'])}.{m['rest']}" if m else name


def local_name(name: str, layers_per_chunk: int, num_stages: int) -> tuple[int, str]:
    """(stage, chunk-local name) of a global name in a layout with `layers_per_chunk` and `num_stages`."""
    m = _LAYER_RE.match(name)
    if m:
        g = int(m["g"])
        return g // layers_per_chunk, f"blocks.{g % layers_per_chunk}.{m['rest']}"
    return (0 if name.split(".", 1)[0] in FIRST_STAGE_MODULES else num_stages - 1), name


def layers_of(config: dict[str, Any]) -> int:
    """Transformer layers of the model a (possibly older, dict-form) config describes."""
    d = RunConfig().model_dump()
    model, pipe = {**d["model"], **config.get("model", {})}, {**d["pipeline"], **config.get("pipeline", {})}
    return int(model["layers_per_chunk"]) * int(pipe["pp"]) * int(pipe["chunks_per_rank"])


def param_key(name: str) -> str:
    """Key of a parameter by its global name."""
    return f"model.{name}"


def optim_key(name: str, state: str) -> str:
    """Key of one AdamW state tensor of a parameter (global name); `state` "" gives the parameter's prefix."""
    return f"optim.{name}.{state}"


def fp8_key(name: str) -> str:
    """Key of an FP8 state tensor by its global `{linear}.{state}` name."""
    return f"fp8.{name}"


def v1_key(section: str, stage: int, name: str, *, replica: int | None = None) -> str:
    """Schema 1's stage-qualified key (`name` chunk-local, with the state for optim and fp8)."""
    dp = f"dp{replica}." if section == "fp8" and replica is not None else ""
    return f"{section}.{dp}s{stage}.{name}"


_KEY_RE = {
    "model": re.compile(r"^model\.s(?P<stage>\d+)\.(?P<name>.+)$"),
    "optim": re.compile(r"^optim\.s(?P<stage>\d+)\.(?P<name>.+)\.(?P<state>[^.]+)$"),
    "fp8": re.compile(r"^fp8\.(?:dp(?P<dp>\d+)\.)?s(?P<stage>\d+)\.(?P<name>.+)\.(?P<state>[^.]+)$"),
}


@dataclass(frozen=True)
class ParsedKey:
    section: str  # model | optim | fp8 | other
    stage: int | None = None  # schema 1: the stage in the key
    name: str = ""  # parameter or linear name: global (schema 2) or inside the stage (schema 1)
    state: str = ""  # optimizer or FP8 state name
    dp: int | None = None  # schema 1: replica of a per-replica FP8 key
    layer: int | None = None  # schema 2: the global transformer layer, None outside the layers


def parse_key(key: str) -> ParsedKey:
    """Either schema's key (a global name never starts with `s<digits>.`, a stage key always does)."""
    for section, rx in _KEY_RE.items():
        m = rx.match(key)
        if m:
            g = m.groupdict()
            return ParsedKey(section, int(g["stage"]), g["name"], g.get("state") or "",
                             int(g["dp"]) if g.get("dp") else None)
    section, _, rest = key.partition(".")
    if section not in ("model", "optim", "fp8") or not rest:
        return ParsedKey("other")
    name, state = (rest, "") if section == "model" else (rest.rsplit(".", 1) + [""])[:2]
    layer = _LAYER_RE.match(name)
    return ParsedKey(section, None, name, state, None, int(layer["g"]) if layer else None)


def checkpoint_key(section: str, name: str, payload: CheckpointPayload, *, dp_rank: int = 0) -> str:
    """The key under which `payload`'s checkpoint holds the tensor of global `name` (for optim and fp8 with
    its state: `{param}.{state}`, `{linear}.{state}`). Schema 1 keyed by the stage of the layout it was
    written in: translated through that layout's layers per chunk; its per-replica FP8 state (identical
    after the commit's merge) is read from this replica where it existed, else from replica 0."""
    if payload.schema_version >= 2:
        return f"{section}.{name}"
    stage, local = local_name(name, saved_layers_per_chunk(payload), payload.num_stages)
    replica = None
    if section == "fp8" and payload.dp > 1:
        replica = dp_rank if dp_rank < payload.dp else 0
    return v1_key(section, stage, local, replica=replica)


def key_stage(key: str, payload: CheckpointPayload) -> int | None:
    """The stage of the writer's layout a key belongs to (per-stage accounting); None for other keys."""
    pk = parse_key(key)
    if pk.section == "other":
        return None
    if pk.stage is not None:
        return pk.stage
    return local_name(pk.name, saved_layers_per_chunk(payload), payload.num_stages)[0]


def saved_layers_per_chunk(payload: CheckpointPayload) -> int:
    """`model.layers_per_chunk` of the run that wrote `payload` (its default where its config lacks it)."""
    return int({**RunConfig().model_dump()["model"], **payload.config.get("model", {})}["layers_per_chunk"])


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
    layers: list[int] = []  # the global transformer layers of the stage (schema 1 did not record them)


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

    ranks: list  # QEffectRank, or NativeRank (native eager loads the same checkpoints: verify-state --resume)
    schedule: Any
    pp: int
    dp: int
    dp_rank: int
    global_rank: int
    world_size: int
    distributed: bool
    layers_per_chunk: int


def local_view(pipe: Any) -> LocalView:
    """Accept a `SingleProcessPipeline` (all ranks here) or a `DistributedPipeline` (one rank here)."""
    from qeffect.runtime.rank import BaseRank

    lpc = _layers_per_chunk(pipe)
    if hasattr(pipe, "topo"):
        import torch.distributed as dist

        ranks = [pipe.rank]
        topo = pipe.topo
        view = LocalView(ranks, pipe.schedule, topo.pp, topo.dp, topo.dp_rank, topo.rank,
                         dist.get_world_size(), True, lpc)
    else:
        view = LocalView(list(pipe.ranks), pipe.schedule, pipe.schedule.pp, 1, 0, 0, 1, False, lpc)
    for r in view.ranks:
        if not isinstance(r, BaseRank):
            raise TypeError(f"checkpoints hold qeffect runtime ranks (BaseRank), got {type(r).__name__}")
    return view


def has_contracts(rank: Any) -> bool:
    """Whether a rank is qeffect's (`QEffectRank`: epoch clock, arena, barrier, weight-cache versions) rather
    than native eager's, which holds numbers only and refreshes its caches every step."""
    from qeffect.runtime.rank import QEffectRank

    return isinstance(rank, QEffectRank)


def _layers_per_chunk(pipe: Any) -> int:
    ranks = [pipe.rank] if hasattr(pipe, "topo") else list(pipe.ranks)
    chunk = next(iter(ranks[0].chunks.values()))
    return int(chunk.shape.layers_per_chunk)


def tensor_state(view: LocalView) -> dict[str, torch.Tensor]:
    """Live tensors of this process by checkpoint key (no copies: DCP reads them while saving). Empty on
    data-parallel replicas other than 0: theirs are the same numbers (module docstring)."""
    out: dict[str, torch.Tensor] = {}
    if view.dp_rank != 0:
        return out
    lpc = view.layers_per_chunk
    for r in view.ranks:
        r.settle()  # a row-lazy token table: every row and moment up to date first
        owner: dict[int, str] = {}
        for s, chunk in r.chunks.items():
            for name, p in chunk.named_parameters():
                out[param_key(global_name(s, name, lpc))] = p.detach()
                owner[id(p)] = global_name(s, name, lpc)
            for name, t in chunk.fp8_state().items():
                out[fp8_key(global_name(s, name, lpc))] = t
        for p, st in r.optimizer.state.items():
            name = owner[id(p)]
            for k, v in st.items():
                if not isinstance(v, torch.Tensor):
                    raise TypeError(f"optimizer state {name}.{k} is a {type(v).__name__}, not a tensor")
                out[optim_key(name, k)] = v
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


def resume_differences(saved: dict[str, Any], current: dict[str, Any]) -> tuple[list[str], list[str]]:
    """(refused, layout) differences of a run from the checkpoint it resumes: refused are the fields of
    `config_differences` outside `LAYOUT_FIELDS`, and the layer count when it differs (another model);
    layout are `field a -> b` for each layout field that changed (accepted: the keys do not depend on it)."""
    refused, layout = [], []
    a, b = {**_flatten(RunConfig().model_dump()), **_flatten(saved)}, {**_flatten(RunConfig().model_dump()),
                                                                        **_flatten(current)}
    for d in config_differences(saved, current):
        field = d.split(":", 1)[0]
        if field in LAYOUT_FIELDS:
            layout.append(f"{field} {a.get(field)!r} -> {b.get(field)!r}")
        else:
            refused.append(d)
    la, lb = layers_of(saved), layers_of(current)
    if la != lb:
        refused.append(f"model layers (layers_per_chunk x pp x chunks_per_rank): checkpoint {la}, run {lb}")
    return refused, layout
