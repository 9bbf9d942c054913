"""Read a qeffect checkpoint without building a model: validation, size accounting, FP8 summaries, diff.

`open_checkpoint` is the one gate every reader passes (resume included). It turns each way a folder can
fail to be a usable checkpoint into one `ReportError` line naming the path: not a folder, not a
checkpoint, no qeffect payload, unknown schema version, a payload that does not match its schema, a
missing shard, a truncated or corrupted file (checked against the size and SHA-256 manifest that the
save wrote last), or DCP metadata that cannot be read. Tensors are then loaded with
`torch.distributed.checkpoint.load` into buffers allocated from the DCP metadata, with no process group.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from pydantic import BaseModel, ValidationError

from qeffect.checkpoint.files import DCP_ERRORS, first_line, quiet_dcp, sha256_file
from qeffect.checkpoint.state import (
    DCP_METADATA_FILE,
    LATEST_FILE,
    PAYLOAD_FILE,
    SUPPORTED_SCHEMA_VERSIONS,
    CheckpointPayload,
    config_differences,
    global_name,
    key_stage,
    layers_of,
    parse_key,
    saved_layers_per_chunk,
)
from qeffect.errors import ReportError

REPORT_SCHEMA_VERSION = 1


@dataclass
class OpenCheckpoint:
    path: Path
    payload: CheckpointPayload
    metadata: Any  # torch.distributed.checkpoint.Metadata
    payload_bytes: int


def is_checkpoint(path: Path) -> bool:
    return (path / PAYLOAD_FILE).is_file() or (path / DCP_METADATA_FILE).is_file()


def resolve_checkpoint(path: str | Path) -> Path:
    """A checkpoint folder, or a `--checkpoint-dir` root whose `latest` file names one."""
    p = Path(path)
    if not p.exists():
        raise ReportError(f"{p}: no such checkpoint folder")
    if not p.is_dir():
        raise ReportError(f"{p}: not a folder (a checkpoint is a folder)")
    if not is_checkpoint(p) and (p / LATEST_FILE).is_file():
        name = (p / LATEST_FILE).read_text().strip()
        if not name or "/" in name or name.startswith("."):
            raise ReportError(f"{p / LATEST_FILE}: does not name a checkpoint folder ({name!r})")
        return p / name
    return p


def open_checkpoint(path: str | Path, *, verify: bool = True) -> OpenCheckpoint:
    """Validate the folder and read its payload and DCP metadata (no tensor data is loaded)."""
    try:
        return _open(Path(path), verify)
    except OSError as err:  # unreadable file, permissions: still one line naming the path
        raise ReportError(f"{path}: cannot read the checkpoint ({err.strerror or err})") from None


def _open(p: Path, verify: bool) -> OpenCheckpoint:
    if not p.exists():
        raise ReportError(f"{p}: no such checkpoint folder")
    if not p.is_dir():
        raise ReportError(f"{p}: not a folder (a checkpoint is a folder)")
    has_payload, has_md = (p / PAYLOAD_FILE).is_file(), (p / DCP_METADATA_FILE).is_file()
    if not has_payload and not has_md:
        raise ReportError(f"{p}: not a checkpoint (no {PAYLOAD_FILE} and no DCP {DCP_METADATA_FILE})")
    if not has_payload:
        raise ReportError(f"{p}: no qeffect payload ({PAYLOAD_FILE} missing): not written by qeffect, "
                          "or the save did not finish")
    raw = (p / PAYLOAD_FILE).read_bytes()
    try:
        data = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ReportError(f"{p}: {PAYLOAD_FILE} is corrupted (not JSON: {err})") from None
    if not isinstance(data, dict):
        raise ReportError(f"{p}: {PAYLOAD_FILE} is corrupted (not a JSON object)")
    version = data.get("schema_version")
    if version not in SUPPORTED_SCHEMA_VERSIONS:
        raise ReportError(f"{p}: unknown checkpoint schema version {version!r} (this qeffect reads "
                          f"{', '.join(map(str, SUPPORTED_SCHEMA_VERSIONS))})")
    try:
        payload = CheckpointPayload.model_validate(data)
    except ValidationError as err:
        first = err.errors()[0]
        loc = ".".join(str(x) for x in first["loc"]) or "<root>"
        raise ReportError(f"{p}: {PAYLOAD_FILE} does not match schema {version}: {loc}: {first['msg']}") from None
    if DCP_METADATA_FILE not in payload.files:
        raise ReportError(f"{p}: {PAYLOAD_FILE} lists no DCP {DCP_METADATA_FILE}")
    for name, entry in payload.files.items():
        f = p / name
        kind = "shard" if name.endswith(".distcp") else "file"
        if not f.is_file():
            raise ReportError(f"{p}: missing {kind} {name}")
        size = f.stat().st_size
        if size < entry.bytes:
            raise ReportError(f"{p}: {kind} {name} is truncated ({size} of {entry.bytes} bytes)")
        if size > entry.bytes:
            raise ReportError(f"{p}: {kind} {name} is corrupted ({size} bytes, expected {entry.bytes})")
        if verify and sha256_file(f) != entry.sha256:
            raise ReportError(f"{p}: {kind} {name} is corrupted (SHA-256 differs from the manifest)")
    try:
        md = dcp.FileSystemReader(str(p)).read_metadata()
    except DCP_ERRORS as err:  # any unpickling failure means the same thing here
        raise ReportError(f"{p}: DCP {DCP_METADATA_FILE} cannot be read ({type(err).__name__}: {err})") from None
    for info in md.storage_data.values():
        f = p / info.relative_path
        if not f.is_file():
            raise ReportError(f"{p}: missing shard {info.relative_path}")
        if f.stat().st_size < info.offset + info.length:
            raise ReportError(f"{p}: shard {info.relative_path} is truncated")
    return OpenCheckpoint(p, payload, md, len(raw))


def load_tensors(ck: OpenCheckpoint, keys: list[str] | None = None) -> dict[str, torch.Tensor]:
    """Load `keys` (default: all) on CPU into tensors allocated from the metadata; no process group."""
    meta = ck.metadata.state_dict_metadata
    keys = sorted(meta) if keys is None else keys
    out = {}
    for k in keys:
        m = meta[k]
        if not hasattr(m, "size"):
            continue  # a non-tensor (bytes) entry: qeffect writes none
        out[k] = torch.empty(tuple(m.size), dtype=m.properties.dtype)
    if not out:
        return out
    try:
        with quiet_dcp():
            dcp.load(out, storage_reader=dcp.FileSystemReader(str(ck.path)), no_dist=True)
    except DCP_ERRORS as err:  # DCP's CheckpointException carries whole tracebacks: keep one line

        raise ReportError(f"{ck.path}: cannot read checkpoint tensors ({first_line(err)})") from None
    return out


# ---------------------------------------------------------------------------------------------- report
class FileSize(BaseModel):
    name: str
    bytes: int


class SectionBytes(BaseModel):
    tensors: int
    logical_bytes: int  # numel x element size
    stored_bytes: int  # bytes in the shard files (DCP serializes each tensor with torch.save)


class StageSize(BaseModel):
    stage: int
    pp_rank: int
    params: int
    param_bytes: int
    optim_bytes: int
    fp8_tensors: int
    fp8_bytes: int
    fp8_stored_bytes: int
    payload_json_bytes: int  # this stage's entry in qeffect.json
    qeffect_payload_bytes: int  # fp8_stored_bytes + payload_json_bytes


class FP8TensorState(BaseModel):
    history_len: int
    amax_last: float  # the most recently recorded amax (last history slot after the roll)
    amax_max: float  # largest amax in the history window
    scale: float


class FP8ModuleSummary(BaseModel):
    module: str  # the linear's global name (layers.{layer}.{linear}, head), the key's middle part
    stage: int  # the stage that held it in the layout that wrote the checkpoint
    replica: int | None  # schema 1 under data parallelism: the replica of per-replica state
    history_len: int
    amax_range: tuple[float, float]  # over the module's tensors (input / weight / grad) of their window max
    scale_range: tuple[float, float]
    tensors: dict[str, FP8TensorState]  # input / weight / grad


class CheckpointReport(BaseModel):
    schema_version: int = REPORT_SCHEMA_VERSION
    kind: str = "checkpoint-report"
    path: str
    checkpoint_schema_version: int
    step: int
    epochs: dict[str, int]
    launch: str
    world_size: int
    schedule: str
    pipeline: dict[str, int]  # the layout that wrote it (a resume may use another: docs/multinode.md)
    layers: int = 0  # transformer layers of the model: what any layout that loads it must keep
    keys: str = "global"  # "global" (layers / parameters: loads into any layout) or "stage" (schema 1)
    recipe: dict[str, Any]
    config: dict[str, Any]
    files: list[FileSize]
    total_bytes: int
    sections: dict[str, SectionBytes]  # model / optim / fp8
    payload_bytes: int
    qeffect_runtime_state_bytes: int  # FP8 tensors as stored + qeffect.json
    qeffect_runtime_state_fraction: float
    stages: list[StageSize]
    fp8_modules: list[FP8ModuleSummary]
    data: list[dict[str, Any]]
    cache_semantics: str
    not_saved: list[str]


def _logical(m: Any) -> int:
    n = 1
    for d in m.size:
        n *= d
    return n * torch.empty((), dtype=m.properties.dtype).element_size()


def inspect_checkpoint(path: str | Path) -> CheckpointReport:
    """Sizes, epochs, recipe, configuration and per-module FP8 summaries of one checkpoint."""
    ck = open_checkpoint(resolve_checkpoint(path))
    pl, md = ck.payload, ck.metadata
    stored: dict[str, int] = {}
    for idx, info in md.storage_data.items():
        stored[idx.fqn] = stored.get(idx.fqn, 0) + info.length
    sections = {s: SectionBytes(tensors=0, logical_bytes=0, stored_bytes=0) for s in ("model", "optim", "fp8", "other")}
    per_stage: dict[int, dict[str, int]] = {}
    fp8_keys = []
    for key, m in md.state_dict_metadata.items():
        pk = parse_key(key)
        sec = sections[pk.section]
        logical = _logical(m) if hasattr(m, "size") else 0
        sec.tensors += 1
        sec.logical_bytes += logical
        sec.stored_bytes += stored.get(key, 0)
        stage = key_stage(key, pl)
        if stage is None:
            continue
        st = per_stage.setdefault(stage, {"params": 0, "param_bytes": 0, "optim_bytes": 0, "fp8_tensors": 0,
                                             "fp8_bytes": 0, "fp8_stored_bytes": 0})
        if pk.section == "model":
            st["params"] += 1
            st["param_bytes"] += logical
        elif pk.section == "optim":
            st["optim_bytes"] += logical
        elif pk.section == "fp8":
            st["fp8_tensors"] += 1
            st["fp8_bytes"] += logical
            st["fp8_stored_bytes"] += stored.get(key, 0)
            fp8_keys.append(key)
    if sections["other"].tensors == 0:
        del sections["other"]
    stages = []
    for sp in pl.stages:
        st = per_stage.get(sp.stage, {"params": 0, "param_bytes": 0, "optim_bytes": 0, "fp8_tensors": 0,
                                      "fp8_bytes": 0, "fp8_stored_bytes": 0})
        jb = len(sp.model_dump_json().encode())
        stages.append(StageSize(stage=sp.stage, pp_rank=sp.pp_rank, payload_json_bytes=jb,
                                qeffect_payload_bytes=st["fp8_stored_bytes"] + jb, **st))
    files = [FileSize(name=f.relative_to(ck.path).as_posix(), bytes=f.stat().st_size)
             for f in sorted(ck.path.rglob("*")) if f.is_file()]
    total = sum(f.bytes for f in files)
    runtime = sections["fp8"].stored_bytes + ck.payload_bytes
    fp8 = load_tensors(ck, fp8_keys)
    return CheckpointReport(
        path=str(ck.path), checkpoint_schema_version=pl.schema_version, step=pl.step, epochs=pl.epochs,
        launch=pl.launch, world_size=pl.world_size, schedule=pl.schedule,
        pipeline={"pp": pl.pp, "dp": pl.dp, "chunks_per_rank": pl.chunks_per_rank,
                  "microbatches": pl.microbatches, "num_stages": pl.num_stages},
        layers=layers_of(pl.config), keys="global" if pl.schema_version >= 2 else "stage",
        recipe=pl.recipe, config=pl.config, files=files, total_bytes=total, sections=sections,
        payload_bytes=ck.payload_bytes, qeffect_runtime_state_bytes=runtime,
        qeffect_runtime_state_fraction=runtime / total if total else 0.0, stages=stages,
        fp8_modules=fp8_summaries(fp8, pl), data=[p.data or {} for p in pl.processes],
        cache_semantics=pl.cache_semantics, not_saved=pl.not_saved,
    )


def fp8_summaries(tensors: dict[str, torch.Tensor], payload: CheckpointPayload) -> list[FP8ModuleSummary]:
    """Group `fp8.*` tensors by module (global name, also for schema 1's stage keys); `{kind}_amax_history`
    + `{kind}_scale` form one tensor state."""
    modules: dict[tuple[int | None, int, str], dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        pk = parse_key(key)
        if pk.section == "fp8":
            name = pk.name if pk.stage is None else global_name(pk.stage, pk.name, saved_layers_per_chunk(payload))
            stage = key_stage(key, payload)
            modules.setdefault((pk.dp, stage, name), {})[pk.state] = t
    out = []
    for (dp, stage, name), states in sorted(modules.items(), key=lambda kv: (kv[0][0] or 0, kv[0][1], kv[0][2])):
        kinds = sorted({k[: -len("_amax_history")] for k in states if k.endswith("_amax_history")})
        per: dict[str, FP8TensorState] = {}
        for kind in kinds:
            h = states[f"{kind}_amax_history"].float().reshape(-1)
            sc = states.get(f"{kind}_scale")
            per[kind] = FP8TensorState(history_len=h.numel(), amax_last=float(h[-1]) if h.numel() else 0.0,
                                       amax_max=float(h.max()) if h.numel() else 0.0,
                                       scale=float(sc.reshape(-1)[0]) if sc is not None else float("nan"))
        if not per:
            continue
        amaxes = [p.amax_max for p in per.values()]
        scales = [p.scale for p in per.values()]
        out.append(FP8ModuleSummary(
            module=name, stage=stage, replica=dp,
            history_len=max(p.history_len for p in per.values()),
            amax_range=(min(amaxes), max(amaxes)), scale_range=(min(scales), max(scales)),
            tensors=per))
    return out


# ------------------------------------------------------------------------------------------------ diff
class TensorDifference(BaseModel):
    key: str
    reason: str  # "bits" | "dtype" | "shape"
    differing_elements: int | None = None
    elements: int | None = None


class CheckpointDiff(BaseModel):
    schema_version: int = REPORT_SCHEMA_VERSION
    kind: str = "checkpoint-diff"
    a: str
    b: str
    identical: bool
    tensors_compared: int
    tensors_differing: list[TensorDifference]
    only_in_a: list[str]
    only_in_b: list[str]
    state_differences: list[str]  # step, epochs, data positions, RNG, recipe, run-shape config
    other_config_differences: list[str]  # steps, paths, evaluation...: listed, not counted


_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bits as integers (so NaN payloads, -0.0 and +0.0 are told apart)."""
    t = t.detach().cpu().contiguous()
    size = t.element_size()
    if size in _INT_OF_SIZE and t.dtype is not torch.bool:
        return t.view(_INT_OF_SIZE[size]).reshape(-1)
    return t.reshape(-1).view(torch.uint8) if t.dtype is not torch.bool else t.reshape(-1).to(torch.uint8)


def compare_tensors(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> list[TensorDifference]:
    out = []
    for k in sorted(set(a) & set(b)):
        x, y = a[k], b[k]
        if x.dtype != y.dtype:
            out.append(TensorDifference(key=k, reason=f"dtype {x.dtype} vs {y.dtype}"))
        elif x.shape != y.shape:
            out.append(TensorDifference(key=k, reason=f"shape {tuple(x.shape)} vs {tuple(y.shape)}"))
        else:
            bx, by = _bits(x), _bits(y)
            n = int((bx != by).sum())
            if n:
                out.append(TensorDifference(key=k, reason="bits", differing_elements=n, elements=bx.numel()))
    return out


def _state_differences(a: CheckpointPayload, b: CheckpointPayload) -> list[str]:
    out = []
    for field in ("step", "epochs", "schedule", "recipe", "pp", "dp", "chunks_per_rank", "microbatches"):
        va, vb = getattr(a, field), getattr(b, field)
        if va != vb:
            out.append(f"{field}: {va!r} vs {vb!r}")
    procs_a = {p.dp_rank: p for p in reversed(a.processes)}
    procs_b = {p.dp_rank: p for p in reversed(b.processes)}
    for d in sorted(set(procs_a) | set(procs_b)):
        pa, pb = procs_a.get(d), procs_b.get(d)
        if pa is None or pb is None:
            out.append(f"data-parallel rank {d}: only in {'a' if pb is None else 'b'}")
            continue
        if pa.data != pb.data:
            out.append(f"data position of data-parallel rank {d}: {pa.data!r} vs {pb.data!r}")
        if pa.rng != pb.rng:
            out.append(f"RNG state of data-parallel rank {d} differs")
    out += config_differences(a.config, b.config, labels=("a", "b"))
    return out


def diff_checkpoints(a: str | Path, b: str | Path) -> CheckpointDiff:
    """Bitwise, tensor by tensor; plus the training state in the payloads. `identical` decides exit 0/1."""
    ca, cb = open_checkpoint(resolve_checkpoint(a)), open_checkpoint(resolve_checkpoint(b))
    ta, tb = load_tensors(ca), load_tensors(cb)
    tensors = compare_tensors(ta, tb)
    only_a, only_b = sorted(set(ta) - set(tb)), sorted(set(tb) - set(ta))
    state = _state_differences(ca.payload, cb.payload)
    shape = set(config_differences(ca.payload.config, cb.payload.config, labels=("a", "b")))
    other = [d for d in config_differences(ca.payload.config, cb.payload.config, only_resume_fields=False,
                                           labels=("a", "b")) if d not in shape]
    return CheckpointDiff(
        a=str(ca.path), b=str(cb.path), identical=not (tensors or only_a or only_b or state),
        tensors_compared=len(set(ta) & set(tb)), tensors_differing=tensors, only_in_a=only_a, only_in_b=only_b,
        state_differences=state, other_config_differences=other,
    )
