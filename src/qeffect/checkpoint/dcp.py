"""Save and resume a qeffect pipeline with `torch.distributed.checkpoint` (DCP), in one or many processes.

Save (at a quiescent optimizer boundary only):
  1. every local rank passes `barrier.check_quiescent("checkpoint")`; in several processes the reasons are
     gathered first, so either every process writes or none does (a premature checkpoint writes nothing);
  2. DCP writes the tensors into `<DIR>.tmp-<token>` beside `DIR` (same file system, so a rename works);
  3. global rank 0 hashes every file and writes `qeffect.json` (schema version, step, epochs, config,
     recipe, stages, data position, RNG, file manifest) *last*, then renames the folder to `DIR`.
A crash at any point leaves at most a `*.tmp-*` folder, never a half checkpoint under the final name; the
next save into the same folder removes such leftovers (`remove_stale_saves`: global rank 0, only folders
whose writing process is gone). `prune_checkpoints` keeps the newest K `step-<N>` folders of a root.
An existing non-empty `DIR` is refused unless it is a qeffect checkpoint and `overwrite=True` (the
training loop replaces the checkpoint of the same step of an abandoned earlier attempt this way): the old
folder is renamed aside, the new one renamed in, and the old one deleted.

Resume (before any graph is built, into the already-built pipeline, in place): verify the manifest,
refuse a different recipe / model / microbatch count (naming each difference; another pipeline layout of
the same model is accepted, `layout_change` names it), load the numbers with DCP by global name (each
process reads the modules it holds now, wherever they were when saved), restore `e_W` and the step,
re-synchronize the arena epoch, invalidate every weight cache (the first forward refreshes it), then
restore the data position (mapped onto another data-parallel degree: `_data_position`) and the RNG.
Native eager ranks (`NativeRank`) load the same way, so the oracle can start from a checkpoint too.
"""

from __future__ import annotations

import os
import re
import shutil
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import qeffect
from qeffect.checkpoint.files import (
    DCP_ERRORS,
    first_line,
    fsync_dir,
    quiet_dcp,
    sha256_file,
    write_text_atomic,
)
from qeffect.checkpoint.inspect import is_checkpoint, open_checkpoint, resolve_checkpoint
from qeffect.checkpoint.state import (
    LATEST_FILE,
    PAYLOAD_FILE,
    CheckpointPayload,
    FileEntry,
    LocalView,
    ProcessPayload,
    StagePayload,
    checkpoint_key,
    global_name,
    has_contracts,
    layers_of,
    local_view,
    parse_key,
    restore_rng,
    resume_differences,
    rng_state,
    saved_layers_per_chunk,
    tensor_state,
)
from qeffect.contracts import CommitViolation
from qeffect.errors import ReportError, UserError

if TYPE_CHECKING:
    from qeffect.config import RunConfig


# ------------------------------------------------------------------------------------------ helpers
def _gather(view: LocalView, obj: Any) -> list[Any]:
    """Every process's `obj` (in global rank order); just `[obj]` in one process."""
    if not view.distributed:
        return [obj]
    out: list[Any] = [None] * view.world_size
    dist.all_gather_object(out, obj)
    return out


def _broadcast(view: LocalView, obj: Any) -> Any:
    if not view.distributed:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _barrier(view: LocalView) -> None:
    if view.distributed:
        dist.barrier()


def _agree(view: LocalView, error: Any) -> list[Any]:
    """Collect every process's error before a collective, so that all raise together or none does."""
    return [e for e in _gather(view, error) if e]


def _device(view: LocalView) -> torch.device:
    return next(next(iter(view.ranks[0].chunks.values())).parameters()).device


def step_dir(root: str | Path, step: int) -> Path:
    return Path(root) / f"step-{step:08d}"


# --------------------------------------------------------------------------------------------- save
def check_quiescent(view: LocalView) -> None:
    """Every local rank (and, in several processes, every process) must be quiescent for a checkpoint."""
    local = [f"pipeline rank {r.rank}: {why}" for r in view.ranks if has_contracts(r)
             for why in r.barrier.reasons("checkpoint")]
    everywhere = [why for reasons in _gather(view, local) for why in reasons]
    if everywhere:
        e_W = next((r.clock.e_W for r in view.ranks if has_contracts(r)), None)
        raise CommitViolation(
            f"premature checkpoint at e_W={e_W}: expected quiescence (no live tapes, no arena writes or "
            f"reductions in flight), found: " + "; ".join(everywhere),
            relation="premature checkpoint", key=None, expected="quiescence", found=everywhere)


def _stages(view: LocalView) -> list[dict]:
    if view.dp_rank != 0:
        return []
    lpc = view.layers_per_chunk
    return [StagePayload(stage=s, pp_rank=r.rank, params=[n for n, _ in c.named_parameters()],
                         fp8_linears=list(c.matrix_linears()),
                         layers=list(range(s * lpc, (s + 1) * lpc))).model_dump()
            for r in view.ranks for s, c in r.chunks.items()]


def save_checkpoint(pipe: Any, path: str | Path, cfg: RunConfig, *, stream: Any = None,
                    overwrite: bool = False) -> Path:
    """Write a checkpoint of `pipe` (at an optimizer boundary) to `path`; every process must call this.

    `stream` is this process's `DataStream` (its position is saved). Returns the final folder.
    Raises `CommitViolation` (nothing written) unless every rank is quiescent, `UserError` when `path`
    exists and may not be replaced.
    """
    view = local_view(pipe)
    final = Path(path)
    check_quiescent(view)
    error = None
    if view.global_rank == 0 and final.exists():
        if not final.is_dir():
            error = f"{final}: exists and is not a folder"
        elif any(final.iterdir()) and not (overwrite and is_checkpoint(final)):
            error = (f"{final}: folder exists and is not empty" +
                     ("" if is_checkpoint(final) else " (and is not a checkpoint)") + "; not overwriting it")
    errors = _agree(view, error)
    if errors:
        raise UserError(errors[0])

    steps = {r.step_index for r in view.ranks}
    epochs = {str(r.rank): r.clock.e_W if has_contracts(r) else r.step_index for r in view.ranks}
    device = _device(view)
    me = ProcessPayload(global_rank=view.global_rank, dp_rank=view.dp_rank, pp_ranks=[r.rank for r in view.ranks],
                        data=stream.state_dict() if stream is not None else None, rng=rng_state(device))
    gathered = _gather(view, (sorted(steps), epochs, me.model_dump(), _stages(view)))
    all_steps = {s for g in gathered for s in g[0]}
    if len(all_steps) != 1:
        raise RuntimeError(f"ranks disagree on the step index: {sorted(all_steps)}")
    all_epochs: dict[str, int] = {}
    for g in gathered:
        all_epochs.update(g[1])
    token = _broadcast(view, f"{os.getpid()}-{time.time_ns():x}")
    tmp = final.with_name(f"{final.name}.tmp-{token}")
    if view.global_rank == 0:
        if final.parent.is_dir():
            remove_stale_saves(final.parent)
        tmp.mkdir(parents=True)
    _barrier(view)

    try:
        with quiet_dcp():
            dcp.save(tensor_state(view), storage_writer=dcp.FileSystemWriter(str(tmp)),
                     no_dist=not view.distributed)
    except DCP_ERRORS as err:
        if view.global_rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise RuntimeError(f"{final}: checkpoint not written ({first_line(err)})") from err
    except BaseException:
        if view.global_rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
        raise
    _barrier(view)
    error = None
    if view.global_rank == 0:
        try:
            payload = _payload(cfg, view, tmp, all_steps.pop(), all_epochs, gathered)
            write_text_atomic(tmp / PAYLOAD_FILE, payload.model_dump_json(indent=2) + "\n")
            fsync_dir(tmp)
            _install(tmp, final, token)
        except Exception as err:  # noqa: BLE001 - every process must learn that the save failed
            shutil.rmtree(tmp, ignore_errors=True)
            if not view.distributed:
                raise
            error = f"{final}: checkpoint not written: {err}"
    errors = _agree(view, error)
    if errors:
        raise RuntimeError(errors[0])
    return final


def _payload(cfg: RunConfig, view: LocalView, tmp: Path, step: int, epochs: dict[str, int],
             gathered: list) -> CheckpointPayload:
    from qeffect.runtime.build import recipe_of

    files = {}
    for f in sorted(tmp.rglob("*")):
        if f.is_file():
            files[f.relative_to(tmp).as_posix()] = FileEntry(bytes=f.stat().st_size, sha256=sha256_file(f))
    p = cfg.pipeline
    return CheckpointPayload(
        step=step, epochs=dict(sorted(epochs.items(), key=lambda kv: int(kv[0]))),
        config=cfg.model_dump(), recipe={"backend": cfg.fp8.backend, **recipe_of(cfg).to_dict()},
        schedule=p.schedule, pp=p.pp, dp=p.dp, chunks_per_rank=p.chunks_per_rank,
        microbatches=p.microbatches, num_stages=p.num_stages, world_size=view.world_size,
        launch="torchrun" if view.distributed else "single-process",
        stages=sorted((StagePayload(**s) for g in gathered for s in g[3]), key=lambda s: s.stage),
        processes=[ProcessPayload(**g[2]) for g in gathered], files=files,
        qeffect_version=qeffect.__version__, torch_version=torch.__version__,
    )


def _install(tmp: Path, final: Path, token: str) -> None:
    """Rename the finished temporary folder to its final name (replacing an old checkpoint there)."""
    old = None
    if final.exists():
        if any(final.iterdir()):
            old = final.with_name(f"{final.name}.old-{token}")
            os.replace(final, old)
        else:
            final.rmdir()
    os.replace(tmp, final)
    fsync_dir(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def update_latest(root: str | Path, folder: Path) -> None:
    """Point `root/latest` at `folder` (atomically; written after the folder is in place)."""
    write_text_atomic(Path(root) / LATEST_FILE, folder.name + "\n")


# ------------------------------------------------------------------------------------- housekeeping
_STEP_RE = re.compile(r"step-(\d+)")
# what a save or a prune leaves beside its target while it runs: `<name>.tmp-<pid>-<hex>` (being written),
# `<name>.old-<pid>-<hex>` (a replaced checkpoint, deleted once the new one is in place),
# `<name>.del-<pid>-<hex>` (a pruned checkpoint being deleted), `.latest.tmp-<pid>` (the atomic write of
# `latest`)
_LEFTOVER_RE = re.compile(r"(?P<name>.+)\.(?P<kind>tmp|old|del)-(?P<pid>\d+)-[0-9a-f]+")
_FILE_TMP_RE = re.compile(rf"\.{LATEST_FILE}\.tmp-(?P<pid>\d+)")
# what a checkpoint folder (complete or not) holds: DCP's data and metadata files, ours, and their temp files
_PAYLOAD_RE = re.escape(PAYLOAD_FILE)
_SAVE_FILE_RE = re.compile(rf"(\.metadata|.*\.distcp|{_PAYLOAD_RE}|\.{_PAYLOAD_RE}\.tmp-\d+)(\.tmp)?")


def _process_gone(pid: int) -> bool:
    """Whether the process that wrote a leftover can no longer be writing it (this process counts as gone:
    its saves run one at a time, so a leftover of its own is from an earlier, failed one)."""
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # alive, under another user
        return False
    return False


def _holds_only_save_files(folder: Path) -> bool:
    """A leftover of ours holds nothing but checkpoint files (a folder of another program's is left alone)."""
    return all(f.is_file() and _SAVE_FILE_RE.fullmatch(f.name) for f in folder.iterdir())


def remove_stale_saves(root: str | Path) -> list[Path]:
    """Delete what killed saves left in `root` (`*.tmp-*` folders, a `.latest.tmp-*` file, deletions of pruned
    checkpoints), and `*.old-*` folders whose replacement is in place; returns what was removed.

    Only leftovers whose writing process (the pid in the name) is gone on this host and that hold nothing
    but checkpoint files are touched, so a save in progress elsewhere in the same folder, or another
    program's folder of a similar name, is left alone; an `.old-` folder whose final name is missing
    (a save killed between the two renames) is the only complete copy and is kept. The caller must own the
    folder: global rank 0 under torchrun.
    """
    removed = []
    for p in sorted(Path(root).iterdir()):
        m = _LEFTOVER_RE.fullmatch(p.name)
        if m is not None and p.is_dir() and not p.is_symlink():
            if not _process_gone(int(m["pid"])) or not _holds_only_save_files(p):
                continue
            if m["kind"] == "old" and not (p.parent / m["name"]).is_dir():
                continue
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
            continue
        f = _FILE_TMP_RE.fullmatch(p.name)
        if f is not None and p.is_file() and _process_gone(int(f["pid"])):
            p.unlink(missing_ok=True)
            removed.append(p)
    return removed


def _step_checkpoints(root: Path) -> list[tuple[int, Path]]:
    """The complete `step-<N>` checkpoints of `root` (with their `qeffect.json`), by step."""
    out = []
    for p in root.iterdir():
        m = _STEP_RE.fullmatch(p.name)
        if m is not None and p.is_dir() and not p.is_symlink() and (p / PAYLOAD_FILE).is_file():
            out.append((int(m[1]), p))
    return sorted(out)


def latest_checkpoint(root: str | Path) -> Path | None:
    """The checkpoint `root/latest` names, else the complete `step-<N>` folder of the highest step, else None
    (no folder, or nothing saved in it yet)."""
    root = Path(root)
    if not root.is_dir():
        return None
    latest = root / LATEST_FILE
    if latest.is_file():
        name = latest.read_text().strip()
        if name and "/" not in name and not name.startswith(".") and (root / name / PAYLOAD_FILE).is_file():
            return root / name
    found = _step_checkpoints(root)
    return found[-1][1] if found else None


def prune_checkpoints(root: str | Path, keep: int, *, protect: Path) -> list[Path]:
    """Keep `protect` (the checkpoint just written) and the newest `keep - 1` other `step-<N>` checkpoints of
    `root`, by step number; delete the rest and return them. `keep` 0: delete nothing.

    Never deleted: `protect`, the folder `latest` names, anything that is not a complete `step-<N>`
    checkpoint. Each folder is renamed to `<name>.del-<token>` first, so a deletion cut short leaves a
    leftover that the next save removes, never a half checkpoint under a step name.
    """
    if keep < 1:
        return []
    root = Path(root)
    spared = {Path(protect).resolve()}
    named = latest_checkpoint(root)
    if named is not None:
        spared.add(named.resolve())
    others = [p for _, p in _step_checkpoints(root) if p.resolve() not in spared]
    doomed = others[:max(0, len(others) - (keep - 1))]
    token = f"{os.getpid()}-{time.time_ns():x}"
    removed = []
    for p in doomed:
        gone = p.with_name(f"{p.name}.del-{token}")
        os.replace(p, gone)
        shutil.rmtree(gone, ignore_errors=True)
        removed.append(p)
    return removed


# --------------------------------------------------------------------------------------------- load
def load_checkpoint(pipe: Any, path: str | Path, cfg: RunConfig, *, stream: Any = None) -> CheckpointPayload:
    """Restore `pipe` (freshly built, no step run yet) from the checkpoint at `path`; every process calls it.

    `pipe` may lay the model out otherwise than the run that saved it (`LAYOUT_FIELDS`: pipeline ranks,
    chunks per rank with the same layer count, data-parallel replicas, schedule); `layout_change` names
    such a change. Raises `ReportError` for an unreadable checkpoint and `UserError` when the checkpoint's
    recipe, model or microbatch count differ from `cfg` (the message names each difference).
    """
    view = local_view(pipe)
    ck = open_checkpoint(resolve_checkpoint(path))
    payload, md, folder = ck.payload, ck.metadata, ck.path
    diffs, _ = resume_differences(payload.config, cfg.model_dump())
    if diffs:
        raise UserError(f"{folder}: checkpoint differs from this run: " + "; ".join(diffs))
    check_quiescent(view)

    want: dict[str, torch.Tensor] = {}
    new_state: list[tuple[Any, torch.nn.Parameter, dict[str, torch.Tensor]]] = []
    error = None
    saved = md.state_dict_metadata
    lpc = view.layers_per_chunk
    try:
        e_W = _saved_epoch(payload)
        linears: set[str] = set()
        for r in view.ranks:
            for s, chunk in r.chunks.items():
                for name, p in chunk.named_parameters():
                    g = global_name(s, name, lpc)
                    want[checkpoint_key("model", g, payload)] = p.detach()
                    prefix = checkpoint_key("optim", f"{g}.", payload)
                    targets = _optimizer_targets(saved, prefix, p, r.optimizer, want)
                    new_state.append((r.optimizer, p, targets))
                chunk.allocate_fp8_state()  # a native eager TE rank has run no forward yet
                for name, t in chunk.fp8_state().items():
                    want[checkpoint_key("fp8", global_name(s, name, lpc), payload, dp_rank=view.dp_rank)] = t
                linears |= {global_name(s, n, lpc) for n in chunk.matrix_linears()}
        error = _check_targets(folder, saved, want, linears, payload, view)
        proc = _process_entry(payload, view)
        if error is None and stream is not None:
            data = _data_position(payload, view, stream)
            if data is None:
                error = f"{folder}: no data-stream position saved for data-parallel rank {view.dp_rank}"
            else:
                stream.load_state_dict(data)  # checks that the data and batching match, then seeks
    except UserError as err:
        error = ("user", f"{folder}: {err}")
    except Exception as err:  # noqa: BLE001 - turned into one agreed error below
        error = f"{folder}: {err}"
    errors = _agree(view, error)
    if errors:  # every process raises, before any tensor is touched
        kind, msg = errors[0] if isinstance(errors[0], tuple) else ("report", errors[0])
        raise (UserError if kind == "user" else ReportError)(msg)

    failure = None
    try:
        with quiet_dcp():
            dcp.load(want, storage_reader=dcp.FileSystemReader(str(folder)), no_dist=not view.distributed)
    except DCP_ERRORS as err:  # DCP's CheckpointException carries whole tracebacks: keep one line
        failure = f"{folder}: cannot read checkpoint tensors ({first_line(err)})"
    if failure:
        raise ReportError(failure)

    for opt, p, st in new_state:  # the same tensors where they existed: addresses stay fixed
        if st:
            opt.state[p] = st
        else:
            opt.state.pop(p, None)
    for r in view.ranks:
        r.state_loaded()
    device = _device(view)
    for r in view.ranks:
        r.step_index = payload.step
        for chunk in r.chunks.values():
            chunk.invalidate_caches()
        if has_contracts(r):  # qeffect's contract objects; native eager refreshes its caches every step
            r.clock.restore(e_W)
            r.arena.rebuild(epoch=e_W)
            for act in r.actions.values():
                act.cache.invalidate()
    restore_rng(proc.rng, device)
    return payload


def layout_change(payload: CheckpointPayload, cfg: RunConfig) -> str | None:
    """One line naming how this run lays out the checkpoint's model otherwise (None: the same layout), e.g.
    `layout pipeline.pp 2 -> 4, pipeline.chunks_per_rank 2 -> 1 (4 layers)`; with another data-parallel
    degree also where the data stream goes on (`_data_position`)."""
    _, layout = resume_differences(payload.config, cfg.model_dump())
    if not layout:
        return None
    line = f"layout {', '.join(layout)} ({layers_of(payload.config)} layers)"
    if payload.dp != cfg.pipeline.dp:
        saved = next((p.data for p in payload.processes if p.dp_rank == 0 and p.data), None)
        if saved is not None:
            consumed = int(saved["cursor"]) * payload.dp
            skipped = -consumed % cfg.pipeline.dp
            line += f"; data epoch {saved['epoch']} goes on after {consumed} microbatches"
            if skipped:
                line += f" ({skipped} skipped to start a whole batch of {cfg.pipeline.dp} replicas)"
    return line


def _saved_epoch(payload: CheckpointPayload) -> int:
    """The optimizer epoch e_W of the checkpoint: every pipeline rank's, equal after a commit."""
    epochs = set(payload.epochs.values())
    if len(epochs) != 1:
        raise ValueError(f"pipeline ranks saved different optimizer epochs {payload.epochs}; a checkpoint is "
                         "taken after a commit, where all are equal")
    return epochs.pop()


def _optimizer_targets(saved: dict, prefix: str, p: torch.nn.Parameter, opt: Any,
                       want: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Load targets for one parameter's optimizer state (saved keys `prefix` + state name): its existing
    tensors (in place) or new ones. AdamW keeps `step` on the CPU unless it is capturable or fused (both
    runtimes' AdamW are fused: there it lives on the parameter's device), the moments on the parameter's
    device."""
    current = opt.state.get(p, {})
    on_device = bool(opt.defaults.get("fused") or opt.defaults.get("capturable"))
    out: dict[str, torch.Tensor] = {}
    for key, meta in saved.items():
        if not key.startswith(prefix) or "." in key[len(prefix):]:
            continue
        k = key[len(prefix):]
        size, dtype = tuple(meta.size), meta.properties.dtype
        old = current.get(k)
        if isinstance(old, torch.Tensor) and tuple(old.shape) == size and old.dtype == dtype:
            out[k] = old
        else:
            dev = torch.device("cpu") if k == "step" and not on_device else p.device
            out[k] = torch.empty(size, dtype=dtype, device=dev)
        want[key] = out[k]
    return out


def _check_targets(folder: Path, saved: dict, want: dict[str, torch.Tensor], linears: set[str],
                   payload: CheckpointPayload, view: LocalView) -> str | None:
    """Every tensor this run needs is saved with its shape and dtype, and no FP8 state of this process's
    linears (global names `linears`) is left over."""
    missing = [k for k in want if k not in saved]
    if missing:
        return f"{folder}: checkpoint lacks {len(missing)} tensor(s) this run needs, e.g. {missing[:3]}"
    bad = [f"{k} {tuple(saved[k].size)} {saved[k].properties.dtype} vs {tuple(t.shape)} {t.dtype}"
           for k, t in want.items()
           if tuple(saved[k].size) != tuple(t.shape) or saved[k].properties.dtype != t.dtype]
    if bad:
        return f"{folder}: tensor shape or dtype differs from this run: {bad[0]}"
    extra = []
    for k in saved:
        pk = parse_key(k)
        if pk.section != "fp8" or k in want:
            continue
        if pk.stage is not None:  # schema 1: the global linear of its stage key, this replica's keys only
            lpc = saved_layers_per_chunk(payload)
            if checkpoint_key("fp8", global_name(pk.stage, f"{pk.name}.{pk.state}", lpc), payload,
                              dp_rank=view.dp_rank) != k:
                continue
            name = global_name(pk.stage, pk.name, lpc)
        else:
            name = pk.name
        if name in linears:
            extra.append(k)
    if extra:  # e.g. FP8 state of a module that exposes none yet (a TE module before its first forward)
        return (f"{folder}: checkpoint holds {len(extra)} tensor(s) of this process's modules that the run "
                f"has no place for, e.g. {sorted(extra)[:3]}")
    return None


def _process_entry(payload: CheckpointPayload, view: LocalView) -> ProcessPayload:
    """The same process if the launch matches, else the first process of the same data-parallel replica
    (every pipeline rank of a replica reads the same data), else of replica 0 (another degree)."""
    same = (payload.world_size, payload.pp, payload.dp) == (view.world_size, view.pp, view.dp)
    for p in payload.processes:
        if same and p.global_rank == view.global_rank:
            return p
    replica = view.dp_rank if payload.dp == view.dp else 0
    for p in payload.processes:
        if p.dp_rank == replica:
            return p
    raise ValueError(f"no process state saved for data-parallel rank {replica}")


def _data_position(payload: CheckpointPayload, view: LocalView, stream: Any) -> dict[str, Any] | None:
    """The saved data-stream state for this process's stream. Under the same data-parallel degree, its
    replica's; under another, replica 0's position carried over: the epoch and the global microbatches
    served in it (`cursor x dp`), rounded up to a whole batch of the new replicas (so no sequence is read
    twice; `layout_change` names what is skipped), as this stream's `dp_rank` and `dp_size`."""
    proc = _process_entry(payload, view)
    data = proc.data
    if data is None or payload.dp == view.dp:
        return data
    consumed = int(data["cursor"]) * payload.dp
    cursor = min(-(-consumed // view.dp), stream.batches_per_epoch)
    return {**data, "cursor": cursor, "dp_rank": view.dp_rank, "dp_size": view.dp}
