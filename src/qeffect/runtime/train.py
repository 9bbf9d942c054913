"""The training loop behind `qeffect train`: data, pipeline steps, held-out evaluation, metrics.

Runs in one process (all ranks in one global order) or under torchrun (one pipeline rank per process,
`pipeline.pp x pipeline.dp` processes). Everything that can be wrong with the input (config, data,
tokenizer, world size, the checkpoint to resume from) is checked before the run folder is created, so bad
input writes nothing.

Checkpoints (`train.checkpoint_every`, `train.checkpoint_dir`) are taken after the commit of a step, at the
quiescent optimizer boundary, into `<dir>/step-<8 digits>/` with `<dir>/latest` naming the newest; the
last step is always saved when checkpointing is on. `train.keep_checkpoints = K` then deletes all but the
newest K `step-<N>` folders (by step; never the one just written, which `latest` names), and each save
first removes what a killed earlier save left (`*.tmp-*` folders). `resume=` loads one into the freshly
built pipeline before the first step (so before any graph is built) and continues the step count from it;
`resume="auto"` looks in the run's checkpoint folder (`train.checkpoint_dir`, else `<out>/checkpoints`),
resumes from its newest checkpoint if it holds one (reusing the run folder `out`) and starts fresh if not.

Metrics: one metrics.jsonl record per step (`StepMetrics`: loss, lr, grad norm, tokens/s, MFU, peak device
memory, wall time), the same scalars in TensorBoard with `[logging] tensorboard = true`
(`qeffect.runtime.metrics`), and `on_step` / `on_eval` callbacks on global rank 0 for the CLI's output.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel

from qeffect.config import RunConfig
from qeffect.data.loader import DataStream, load_plan
from qeffect.data.plan import plan_from_config
from qeffect.errors import ReportError, UserError
from qeffect.graphs.handshake import run_settings
from qeffect.runtime.build import build_single_process, capture_graphs
from qeffect.runtime.memory_cap import apply_memory_fraction, refuse_out_of_memory
from qeffect.runtime.outputs import check_folder_target

SCHEMA_VERSION = 1


class StepMetrics(BaseModel):
    step: int
    loss: float
    step_time_s: float
    tokens_per_s: float
    lr: float  # the learning rate of the step's commit (`runtime.recipe`: the [optim] schedule)
    # the global gradient L2 norm before clipping: with optim.clip_grad_norm > 0 or train.nonfinite = "skip"
    # (both compute it anyway) and on the steps the log shows (every train.log_every-th and the last), else
    # None (no extra pass over the gradients, no extra device sync)
    grad_norm: float | None = None
    skipped: bool = False  # train.nonfinite = "skip" dropped this step's optimizer commit (non-finite values)
    heldout_ce: float | None = None
    # model matrix FLOPs per second over the device peak (`qeffect.runtime.metrics`; None: no known peak)
    mfu: float | None = None
    # global rank 0's running peak of allocated device memory since its start (None off CUDA)
    peak_allocated_bytes: int | None = None
    wall_s: float = 0.0  # seconds since the run started (before the pipeline was built)


class TrainSummary(BaseModel):
    schema_version: int = SCHEMA_VERSION
    kind: str = "train-summary"
    run_dir: str | None
    config: dict
    # every bit-changing setting and the [runtime] section, `section.field -> value` (`run_settings`): what
    # another run must match to compare bits with this one
    settings: dict[str, Any] = {}
    steps: int
    world_size: int
    tokens_per_step: int
    first_ten_ce: float
    last_ten_ce: float
    last_to_first_ratio: float
    heldout_ce: list[tuple[int, float]]
    heldout_first: float | None
    heldout_last: float | None
    median_step_time_s: float
    tokens_per_s: float
    seconds: float
    torch_version: str
    start_step: int = 0
    resumed_from: str | None = None
    # how the run lays out the checkpoint's model otherwise (`checkpoint.layout_change`), None: the same
    resumed_layout: str | None = None
    skipped_steps: int = 0  # steps whose commit train.nonfinite = "skip" dropped (`StepMetrics.skipped`)
    checkpoints: list[str] = []  # every checkpoint this run wrote
    checkpoints_removed: list[str] = []  # those of them (and older ones) train.keep_checkpoints deleted
    # MFU at the median step time, and what it divides by (`qeffect.runtime.metrics`); None with `mfu_note`
    # saying why (the CPU, an unknown device)
    mfu: float | None = None
    mfu_flops_per_step: int = 0
    mfu_peak_flops: float | None = None
    mfu_peak_name: str | None = None
    mfu_peak_source: str | None = None
    mfu_note: str = ""
    peak_allocated_bytes: int | None = None
    # the caching allocator's running peak of reserved device memory, which `train.memory_fraction` bounds
    peak_reserved_bytes: int | None = None
    # offload's slots and banks (CUDA VMM, outside the caching allocator): the most mapped at once, as the host
    # saw it; under a cap they count against it with the reserved bytes (None without offload)
    offload_peak_mapped_bytes: int | None = None


@dataclass
class _Data:
    stream: DataStream
    heldout: list[tuple[torch.Tensor, torch.Tensor]]


def _offload_peak_mapped(pipe: object) -> int | None:
    """The pipeline's offload slots' peak mapped bytes (None without offload)."""
    offload = getattr(pipe, "offload", None)
    return None if offload is None else offload.stats.peak_mapped_bytes


def _prepare_data(cfg: RunConfig, dp_rank: int, dp_size: int) -> _Data:
    """This rank's data stream and the held-out batches. Runs before any model is built: every problem
    with the data or the tokenizer is one line (`plan_data`), and a prepared folder is only mapped."""
    plan = plan_from_config(cfg.data, vocab_size=cfg.model.vocab_size)
    train, held = load_plan(plan, cfg.model.seq_len)
    mb = cfg.model.microbatch_size
    stream = DataStream(train, mb, cfg.train.seed, dp_rank=dp_rank, dp_size=dp_size)
    if held is None:
        if cfg.train.eval_every:
            raise UserError(f"no held-out data (data.heldout_fraction = 0 and no data.heldout_path), but "
                            f"train.eval_every = {cfg.train.eval_every}: set one of them, or train.eval_every = 0")
        return _Data(stream, [])
    n = min(cfg.train.eval_batches, held.num_batches(mb))
    if n < 1:
        raise UserError(f"held-out data has fewer than one batch of {mb} x {cfg.model.seq_len + 1} tokens")
    return _Data(stream, [held.batch(i, mb) for i in range(n)])


def _new_run_dir(cfg: RunConfig, out: Path | None, *, reuse: bool = False) -> Path:
    """`out` or a new time-stamped folder; an existing non-empty one only with `reuse` (`--resume auto`)
    and when it is a run folder (it has config.json)."""
    if out is None:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        out = Path(cfg.train.run_dir) / f"{stamp}-{cfg.pipeline.schedule}-{cfg.fp8.backend}"
    check_folder_target(out, "run folder")
    if out.exists() and any(out.iterdir()) and not (reuse and (out / "config.json").is_file()):
        raise UserError(f"{out}: run folder exists and is not empty" +
                        (" (and is not a run folder)" if reuse else ""))
    return out


def auto_resume(cfg: RunConfig, out: Path | None) -> Path | None:
    """`--resume auto`: the newest checkpoint of the run's checkpoint folder (`train.checkpoint_dir`, else
    `<out>/checkpoints`), or None (start fresh) when it holds none; `UserError` when neither is given."""
    from qeffect.checkpoint import latest_checkpoint

    if cfg.train.checkpoint_dir:
        root = _checkpoint_root(cfg)
    elif out is not None:
        root = out / "checkpoints"
    else:
        raise UserError("--resume auto needs --out or train.checkpoint_dir to know where the run's "
                        "checkpoints are (without either, each run gets a new time-stamped folder)")
    return latest_checkpoint(root)


def _kept_metrics(path: Path, upto: int) -> list[str]:
    """The records of an earlier attempt's metrics.jsonl up to step `upto` (a resumed run continues it)."""
    if not path.is_file():
        return []
    kept = []
    for line in path.read_text().splitlines():
        try:
            step = json.loads(line)["step"]
        except (ValueError, KeyError, TypeError):
            continue  # a line cut short by the kill
        if isinstance(step, int) and step <= upto:
            kept.append(line)
    return kept


def evaluate(chunks: dict[int, torch.nn.Module], num_stages: int, batches, get, put) -> float | None:
    """Held-out cross-entropy with forward passes only; FP8 state is restored so training is unaffected.

    `get`/`put` move activations between stages (local dict or point-to-point); each process walks its own
    stages in (batch, stage) order, so stages on other ranks never wait on each other in a cycle.
    """
    saved = {s: {k: v.clone() for k, v in c.fp8_state().items()} for s, c in chunks.items()}
    total, count = 0.0, 0
    with torch.no_grad():
        for i, (inputs, targets) in enumerate(batches):
            for s in sorted(chunks):
                x = inputs.to(next(chunks[s].parameters()).device) if s == 0 else get(s - 1, i)
                last = s == num_stages - 1
                y = chunks[s](x, is_first_microbatch=(i == 0),
                              targets=targets.to(x.device) if last else None)
                if last:
                    total += float(y)
                    count += 1
                else:
                    put(s, i, y)
    for s, c in chunks.items():
        for k, v in c.fp8_state().items():
            v.copy_(saved[s][k])
        c.invalidate_caches()
    return total / count if count else None


def _checkpoint_root(cfg: RunConfig) -> Path | None:
    """The configured checkpoint folder (None: under the run folder); refuse one that is a file."""
    root = Path(cfg.train.checkpoint_dir) if cfg.train.checkpoint_dir else None
    if root is not None:
        check_folder_target(root, "train.checkpoint_dir")
    return root


def train(cfg: RunConfig, *, out: Path | None = None,
          on_step: Callable[[StepMetrics], None] | None = None,
          resume: str | Path | None = None,
          on_eval: Callable[[int, float | None], None] | None = None,
          on_resume: Callable[[str], None] | None = None) -> TrainSummary:
    """Train up to step `cfg.train.steps`; writes metrics.jsonl and summary.json on global rank 0.

    `resume`: a checkpoint folder (or a checkpoint root with a `latest` file) to continue from; the run
    must have the checkpoint's recipe, model and microbatch count (`UserError` otherwise) and may lay the
    model out otherwise (pipeline ranks, chunks per rank with the same layer count, data-parallel
    replicas, schedule): `on_resume(line)` then names the change, on global rank 0, once it is loaded.
    `resume="auto"`: the newest checkpoint of the run's checkpoint folder if it holds one, else a fresh
    start (`auto_resume`); the run folder `out` of the earlier attempt is reused (its metrics.jsonl keeps
    the records up to the checkpoint's step).
    `on_step(metrics)` after every step and `on_eval(step, held-out CE)` after every evaluation (the
    first before step 1), on global rank 0 only.
    Under torchrun, the process group this call creates is destroyed before it returns (after a barrier
    when training ended normally): a gloo or NCCL group left to the interpreter's exit is torn down with
    its threads still running, which can abort the process after a successful run.
    """
    from qeffect.runtime import distributed as D

    owns_group = D.launched_by_torchrun() and not torch.distributed.is_initialized()
    ended = False
    try:
        with refuse_out_of_memory(cfg):  # `train.memory_fraction`: a run over its cap stops in one line
            summary = _train(cfg, out=out, on_step=on_step, resume=resume, on_eval=on_eval, on_resume=on_resume)
        ended = True
        return summary
    finally:
        if owns_group and torch.distributed.is_initialized():
            if ended:  # after a failure, no barrier: another rank may never reach it
                torch.distributed.barrier()
            torch.distributed.destroy_process_group()


def _train(cfg: RunConfig, *, out: Path | None, on_step: Callable[[StepMetrics], None] | None,
           resume: str | Path | None, on_eval: Callable[[int, float | None], None] | None,
           on_resume: Callable[[str], None] | None = None) -> TrainSummary:
    from qeffect.runtime import distributed as D
    from qeffect.runtime import metrics as M

    t_start = time.perf_counter()
    distributed = D.launched_by_torchrun()
    if cfg.train.device == "cuda" and not torch.cuda.is_available():
        raise UserError("train.device = cuda but no CUDA device is available")
    if cfg.logging.tensorboard:
        M.check_tensorboard()
    reuse = False
    if isinstance(resume, str) and resume == "auto":
        resume = auto_resume(cfg, out)
        reuse = out is not None
    world = int(os.environ.get("WORLD_SIZE", "1"))
    p = cfg.pipeline
    if distributed:
        D.check_world(p.pp, p.dp, world)
    elif p.dp != 1:
        raise UserError(f"pipeline.dp = {p.dp} needs {p.pp * p.dp} processes: launch with "
                        f"torchrun --nproc-per-node {p.pp * p.dp} -m qeffect train ...")
    # The run folder is global rank 0's; it is judged before the data, the process group and the model,
    # so a taken folder costs no build, and under torchrun the other ranks wait in the rendezvous until
    # the launcher stops them instead of failing on a peer that left.
    first = not distributed or os.environ.get("RANK") == "0"  # global rank 0 (torchrun's RANK)
    planned_dir = _new_run_dir(cfg, out, reuse=reuse) if first else None
    ck_root = _checkpoint_root(cfg)  # every rank writes its shards there
    # A seeded run is reproducible down to the global RNG state that checkpoints save (torch seeds the
    # default generator randomly per process); nothing in training draws from it today.
    torch.manual_seed(cfg.train.seed)
    rank0 = True
    # the data and the tokenizer before any model: a bad input fails in one line within seconds
    dp_size = p.dp
    dp_rank = D.Topology(p.pp, p.dp, int(os.environ.get("RANK", "0"))).dp_rank if distributed else 0
    data = _prepare_data(cfg, dp_rank, dp_size)
    if distributed:
        D.init_from_env(cfg.train.device)
        apply_memory_fraction(cfg)  # on the device the process group bound, before any model memory
        rank0 = torch.distributed.get_rank() == 0
        pipe = D.DistributedPipeline(cfg, path=cfg.train.path, capture=resume is None)
        if pipe.topo.dp_rank != dp_rank:
            raise RuntimeError(f"data-parallel rank {pipe.topo.dp_rank} of the process group, {dp_rank} from RANK")
    else:
        apply_memory_fraction(cfg)
        # Captured: state is loaded (resume) before any graph exists, then every action is captured.
        pipe = build_single_process(cfg, native=False, path=cfg.train.path, capture=resume is None)
    checkpointing = bool(cfg.train.checkpoint_every or cfg.train.checkpoint_dir)
    start, resumed_from, resumed_layout = 0, None, None
    if resume is not None:
        from qeffect.checkpoint import layout_change, load_checkpoint, resolve_checkpoint

        try:
            folder = resolve_checkpoint(resume)
            payload = load_checkpoint(pipe, folder, cfg, stream=data.stream)
        except (UserError, ReportError) as err:
            raise type(err)(f"--resume {err}") from None
        start, resumed_from = payload.step, str(folder)
        resumed_layout = layout_change(payload, cfg)
        if resumed_layout is not None and rank0 and on_resume is not None:
            on_resume(f"--resume {folder}: {resumed_layout}")
        if distributed:
            pipe.capture()  # no-op on the eager path
        else:
            capture_graphs(cfg, pipe)
        if start >= cfg.train.steps:
            raise UserError(f"--resume {folder}: the checkpoint is at step {start}; train.steps = "
                            f"{cfg.train.steps} leaves nothing to train")
    run_dir = _new_run_dir(cfg, planned_dir, reuse=reuse) if rank0 else None  # again: the build took time
    kept: list[str] = []
    if run_dir is not None:
        if reuse:  # an earlier attempt's run folder: its records up to the checkpoint stay, its summary goes
            kept = _kept_metrics(run_dir / "metrics.jsonl", start)
            (run_dir / "summary.json").unlink(missing_ok=True)
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.json").write_text(json.dumps(cfg.model_dump(), indent=2) + "\n")
    if checkpointing and ck_root is None:
        ck_root = run_dir / "checkpoints" if run_dir is not None else None
        if distributed:  # only global rank 0 knows its run folder
            box = [ck_root]
            torch.distributed.broadcast_object_list(box, src=0)
            ck_root = box[0]
    checkpoints: list[str] = []
    removed: list[str] = []
    metrics_f = (run_dir / "metrics.jsonl").open("w") if run_dir is not None else None
    if metrics_f is not None and kept:
        metrics_f.write("\n".join(kept) + "\n")
        metrics_f.flush()
    scalars = M.Scalars(run_dir, purge_step=start + 1 if reuse else None) \
        if run_dir is not None and cfg.logging.tensorboard else None

    device = torch.device(cfg.train.device)
    tokens_per_step = p.microbatches * cfg.model.microbatch_size * cfg.model.seq_len * p.dp
    mfu = M.mfu_basis(cfg, device, world if distributed else 1)
    losses: list[float] = []
    times: list[float] = []
    heldout: list[tuple[int, float]] = []

    def run_eval(step: int) -> float | None:
        pipe.settle()  # a row-lazy token table: the rows evaluation reads up to date
        if distributed:
            chunks = pipe.rank.chunks
            tr = pipe.transport
            ce = evaluate(chunks, pipe.schedule.num_stages, data.heldout,
                          lambda s, i: tr.get("eval", s, i), lambda s, i, y: tr.put("eval", s, i, y))
            tr.finish()
            t = torch.tensor(0.0 if ce is None else ce, dtype=torch.float64, device=pipe.device)
            torch.distributed.all_reduce(t)
            ce = float(t) / dp_size
        else:
            chunks = {s: c for r in pipe.ranks for s, c in r.chunks.items()}
            local: dict = {}
            ce = evaluate(chunks, pipe.schedule.num_stages, data.heldout,
                          lambda s, i: local.pop((s, i)), lambda s, i, y: local.__setitem__((s, i), y))
        heldout.append((step, ce))
        if rank0 and scalars is not None:
            scalars.eval(step, ce)
        return ce

    def report_eval(step: int, ce: float | None) -> None:
        if rank0 and on_eval is not None:
            on_eval(step, ce)

    def save(step: int) -> None:
        from qeffect.checkpoint import prune_checkpoints, save_checkpoint, step_dir, update_latest

        assert ck_root is not None
        folder = save_checkpoint(pipe, step_dir(ck_root, step), cfg, stream=data.stream, overwrite=True)
        if rank0:
            update_latest(ck_root, folder)
            if cfg.train.keep_checkpoints:
                removed.extend(str(f) for f in prune_checkpoints(ck_root, cfg.train.keep_checkpoints,
                                                                 protect=folder))
        checkpoints.append(str(folder))

    skip_nonfinite = cfg.train.nonfinite == "skip"
    pipe.track_grad_norm = skip_nonfinite  # the skip decision needs the norm before the commit
    skipped_steps = 0

    def run_step(step: int, batches: list) -> tuple[float, float | None, bool]:
        """One step: (loss, global gradient norm or None, whether its commit was skipped). A non-finite
        loss or norm: with nonfinite = skip, the commit is dropped (read on the host before it); with stop
        (the default, no host read before the commit) a one-line `UserError` after it."""
        if skip_nonfinite:
            loss = float(pipe.run_actions(batches))
            norm = float(pipe.grad_norm())
            skip = not (math.isfinite(loss) and math.isfinite(norm))
            pipe.commit(skip=skip)
            return loss, norm, skip
        loss = float(pipe.step(batches))
        norm = None if pipe.last_grad_norm is None else float(pipe.last_grad_norm)
        bad = [f"{what} ({v})" for what, v in (("loss", loss), ("gradient norm", norm))
               if v is not None and not math.isfinite(v)]
        if bad:
            last_good = checkpoints[-1] if checkpoints else resumed_from
            raise UserError(f"step {step}: non-finite {' and '.join(bad)}; last good checkpoint: "
                            f"{last_good or 'none'} (train.nonfinite = skip drops such steps instead)")
        return loss, norm, False

    try:
        if cfg.train.eval_every:
            report_eval(start, run_eval(start))
        for step in range(start + 1, cfg.train.steps + 1):
            batches = [tuple(t.to(device) for t in data.stream.next_batch()) for _ in range(p.microbatches)]
            # the norm also on the steps the log shows (every train.log_every-th and the last): a pass over
            # the gradients there only; the same bits (clip factor None), the same decision on every process
            logged = step % cfg.train.log_every == 0 or step == cfg.train.steps
            pipe.track_grad_norm = skip_nonfinite or logged
            t0 = time.perf_counter()
            loss, grad_norm, skipped = run_step(step, batches)
            if device.type == "cuda":
                torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            skipped_steps += skipped
            if math.isfinite(loss):  # a skipped step's NaN stays out of the summary's averages
                losses.append(loss)
            times.append(dt)
            ce = None
            evaluated = bool(cfg.train.eval_every) and (step % cfg.train.eval_every == 0
                                                         or step == cfg.train.steps)
            if evaluated:
                ce = run_eval(step)
            m = StepMetrics(step=step, loss=loss, step_time_s=dt, tokens_per_s=tokens_per_step / dt,
                            lr=pipe.last_lr, grad_norm=grad_norm, skipped=skipped, heldout_ce=ce,
                            mfu=mfu.mfu(dt), peak_allocated_bytes=M.peak_allocated_bytes(device),
                            wall_s=time.perf_counter() - t_start)
            if metrics_f is not None:
                metrics_f.write(m.model_dump_json() + "\n")
                metrics_f.flush()
            if scalars is not None:
                scalars.step(m.model_dump())
            if checkpointing and ((cfg.train.checkpoint_every and step % cfg.train.checkpoint_every == 0)
                                  or step == cfg.train.steps):
                save(step)
            if on_step is not None and rank0:
                on_step(m)
            if evaluated:  # after the step's own line
                report_eval(step, ce)
    finally:
        if metrics_f is not None:
            metrics_f.close()
        if scalars is not None:
            scalars.close()
    pipe.settle()  # whoever reads the model after the run sees every row up to date

    k = min(10, len(losses))
    first, last = (sum(losses[:k]) / k, sum(losses[-k:]) / k) if k else (math.nan, math.nan)
    st = sorted(times)
    med = st[len(st) // 2]
    summary = TrainSummary(
        run_dir=str(run_dir) if run_dir else None, config=cfg.model_dump(), settings=run_settings(cfg),
        steps=cfg.train.steps, world_size=world,
        tokens_per_step=tokens_per_step, first_ten_ce=first, last_ten_ce=last, last_to_first_ratio=last / first,
        heldout_ce=heldout, heldout_first=heldout[0][1] if heldout else None,
        heldout_last=heldout[-1][1] if heldout else None, median_step_time_s=med,
        tokens_per_s=tokens_per_step / med, seconds=time.perf_counter() - t_start, torch_version=torch.__version__,
        start_step=start, resumed_from=resumed_from, resumed_layout=resumed_layout, skipped_steps=skipped_steps,
        checkpoints=checkpoints,
        checkpoints_removed=removed,
        mfu=mfu.mfu(med), mfu_flops_per_step=mfu.flops_per_step, mfu_peak_flops=mfu.peak_flops,
        mfu_peak_name=mfu.peak_name, mfu_peak_source=mfu.peak_source, mfu_note=mfu.note,
        peak_allocated_bytes=M.peak_allocated_bytes(device), peak_reserved_bytes=M.peak_reserved_bytes(device),
        offload_peak_mapped_bytes=_offload_peak_mapped(pipe),
    )
    if run_dir is not None:
        (run_dir / "summary.json").write_text(summary.model_dump_json(indent=2) + "\n")
    return summary
