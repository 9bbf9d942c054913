"""The training loop behind `qeffect train`: data, pipeline steps, held-out evaluation, metrics.

Runs in one process (all ranks in one global order) or under torchrun (one pipeline rank per process,
`pipeline.pp x pipeline.dp` processes). Everything that can be wrong with the input (config, data,
tokenizer, world size, the checkpoint to resume from) is checked before the run folder is created, so bad
input writes nothing.

Checkpoints (`train.checkpoint_every`, `train.checkpoint_dir`) are taken after the commit of a step, at the
quiescent optimizer boundary, into `<dir>/step-<8 digits>/` with `<dir>/latest` naming the newest; the
last step is always saved when checkpointing is on. `resume=` loads one into the freshly built pipeline
before the first step (so before any graph is built) and continues the step count from it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from pydantic import BaseModel

from qeffect.config import RunConfig
from qeffect.data import DataStream, load_datasets, load_tokenizer
from qeffect.errors import ReportError, UserError
from qeffect.graphs.handshake import run_settings
from qeffect.runtime.build import build_single_process, capture_graphs

SCHEMA_VERSION = 1


class StepMetrics(BaseModel):
    step: int
    loss: float
    step_time_s: float
    tokens_per_s: float
    heldout_ce: float | None = None


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
    checkpoints: list[str] = []


@dataclass
class _Data:
    stream: DataStream
    heldout: list[tuple[torch.Tensor, torch.Tensor]]


def _prepare_data(cfg: RunConfig, dp_rank: int, dp_size: int) -> _Data:
    tok = load_tokenizer(cfg.train.tokenizer or None)
    if tok.get_vocab_size() > cfg.model.vocab_size:
        raise UserError(f"model.vocab_size ({cfg.model.vocab_size}) is smaller than the tokenizer's vocabulary "
                        f"({tok.get_vocab_size()})")
    train, held = load_datasets(cfg.train.data or None, tok, cfg.model.seq_len)
    mb = cfg.model.microbatch_size
    stream = DataStream(train, mb, cfg.train.seed, dp_rank=dp_rank, dp_size=dp_size)
    n = min(cfg.train.eval_batches, held.num_batches(mb))
    if n < 1:
        raise UserError(f"held-out data has fewer than one batch of {mb} x {cfg.model.seq_len + 1} tokens")
    return _Data(stream, [held.batch(i, mb) for i in range(n)])


def _new_run_dir(cfg: RunConfig, out: Path | None) -> Path:
    if out is None:
        stamp = time.strftime("%Y%m%d-%H%M%S")
        out = Path(cfg.train.run_dir) / f"{stamp}-{cfg.pipeline.schedule}-{cfg.fp8.backend}"
    if out.exists() and any(out.iterdir()):
        raise UserError(f"{out}: run folder exists and is not empty")
    return out


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
    if root is not None and root.exists() and not root.is_dir():
        raise UserError(f"train.checkpoint_dir {root}: exists and is not a folder")
    return root


def train(cfg: RunConfig, *, out: Path | None = None,
          on_step: Callable[[StepMetrics], None] | None = None,
          resume: str | Path | None = None) -> TrainSummary:
    """Train up to step `cfg.train.steps`; writes metrics.jsonl and summary.json on global rank 0.

    `resume`: a checkpoint folder (or a checkpoint root with a `latest` file) to continue from; the run
    must have the checkpoint's pipeline shape, schedule, recipe and model (`UserError` otherwise).
    Under torchrun, the process group this call creates is destroyed before it returns (after a barrier
    when training ended normally): a gloo or NCCL group left to the interpreter's exit is torn down with
    its threads still running, which can abort the process after a successful run.
    """
    from qeffect.runtime import distributed as D

    owns_group = D.launched_by_torchrun() and not torch.distributed.is_initialized()
    ended = False
    try:
        summary = _train(cfg, out=out, on_step=on_step, resume=resume)
        ended = True
        return summary
    finally:
        if owns_group and torch.distributed.is_initialized():
            if ended:  # after a failure, no barrier: another rank may never reach it
                torch.distributed.barrier()
            torch.distributed.destroy_process_group()


def _train(cfg: RunConfig, *, out: Path | None, on_step: Callable[[StepMetrics], None] | None,
           resume: str | Path | None) -> TrainSummary:
    from qeffect.runtime import distributed as D

    t_start = time.perf_counter()
    distributed = D.launched_by_torchrun()
    if cfg.train.device == "cuda" and not torch.cuda.is_available():
        raise UserError("train.device = cuda but no CUDA device is available")
    world = int(__import__("os").environ.get("WORLD_SIZE", "1"))
    p = cfg.pipeline
    if distributed:
        D.check_world(p.pp, p.dp, world)
    elif p.dp != 1:
        raise UserError(f"pipeline.dp = {p.dp} needs {p.pp * p.dp} processes: launch with "
                        f"torchrun --nproc-per-node {p.pp * p.dp} -m qeffect train ...")
    # A seeded run is reproducible down to the global RNG state that checkpoints save (torch seeds the
    # default generator randomly per process); nothing in training draws from it today.
    torch.manual_seed(cfg.train.seed)
    rank0 = True
    if distributed:
        D.init_from_env(cfg.train.device)
        rank0 = torch.distributed.get_rank() == 0
        pipe = D.DistributedPipeline(cfg, path=cfg.train.path, capture=resume is None)
        dp_rank, dp_size = pipe.topo.dp_rank, p.dp
    else:
        # Captured: state is loaded (resume) before any graph exists, then every action is captured.
        pipe = build_single_process(cfg, native=False, path=cfg.train.path, capture=resume is None)
        dp_rank, dp_size = 0, 1
    data = _prepare_data(cfg, dp_rank, dp_size)
    checkpointing = bool(cfg.train.checkpoint_every or cfg.train.checkpoint_dir)
    ck_root = _checkpoint_root(cfg)
    start, resumed_from = 0, None
    if resume is not None:
        from qeffect.checkpoint import load_checkpoint, resolve_checkpoint

        try:
            folder = resolve_checkpoint(resume)
            payload = load_checkpoint(pipe, folder, cfg, stream=data.stream)
        except (UserError, ReportError) as err:
            raise type(err)(f"--resume {err}") from None
        start, resumed_from = payload.step, str(folder)
        if distributed:
            pipe.capture()  # no-op on the eager path
        else:
            capture_graphs(cfg, pipe)
        if start >= cfg.train.steps:
            raise UserError(f"--resume {folder}: the checkpoint is at step {start}; train.steps = "
                            f"{cfg.train.steps} leaves nothing to train")
    run_dir = _new_run_dir(cfg, out) if rank0 else None
    if run_dir is not None:
        run_dir.mkdir(parents=True, exist_ok=True)
        (run_dir / "config.json").write_text(json.dumps(cfg.model_dump(), indent=2) + "\n")
    if checkpointing and ck_root is None:
        ck_root = run_dir / "checkpoints" if run_dir is not None else None
        if distributed:  # only global rank 0 knows its run folder
            box = [ck_root]
            torch.distributed.broadcast_object_list(box, src=0)
            ck_root = box[0]
    checkpoints: list[str] = []
    metrics_f = (run_dir / "metrics.jsonl").open("w") if run_dir is not None else None

    device = torch.device(cfg.train.device)
    tokens_per_step = p.microbatches * cfg.model.microbatch_size * cfg.model.seq_len * p.dp
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
        return ce

    def save(step: int) -> None:
        from qeffect.checkpoint import save_checkpoint, step_dir, update_latest

        assert ck_root is not None
        folder = save_checkpoint(pipe, step_dir(ck_root, step), cfg, stream=data.stream, overwrite=True)
        if rank0:
            update_latest(ck_root, folder)
        checkpoints.append(str(folder))

    try:
        if cfg.train.eval_every:
            run_eval(start)
        for step in range(start + 1, cfg.train.steps + 1):
            batches = [tuple(t.to(device) for t in data.stream.next_batch()) for _ in range(p.microbatches)]
            t0 = time.perf_counter()
            loss = float(pipe.step(batches))
            if device.type == "cuda":
                torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            losses.append(loss)
            times.append(dt)
            ce = None
            if cfg.train.eval_every and (step % cfg.train.eval_every == 0 or step == cfg.train.steps):
                ce = run_eval(step)
            m = StepMetrics(step=step, loss=loss, step_time_s=dt, tokens_per_s=tokens_per_step / dt, heldout_ce=ce)
            if metrics_f is not None:
                metrics_f.write(m.model_dump_json() + "\n")
                metrics_f.flush()
            if checkpointing and ((cfg.train.checkpoint_every and step % cfg.train.checkpoint_every == 0)
                                  or step == cfg.train.steps):
                save(step)
            if on_step is not None and rank0:
                on_step(m)
    finally:
        if metrics_f is not None:
            metrics_f.close()
    pipe.settle()  # whoever reads the model after the run sees every row up to date

    k = min(10, len(losses))
    first, last = sum(losses[:k]) / k, sum(losses[-k:]) / k
    st = sorted(times)
    med = st[len(st) // 2]
    summary = TrainSummary(
        run_dir=str(run_dir) if run_dir else None, config=cfg.model_dump(), settings=run_settings(cfg),
        steps=cfg.train.steps, world_size=world,
        tokens_per_step=tokens_per_step, first_ten_ce=first, last_ten_ce=last, last_to_first_ratio=last / first,
        heldout_ce=heldout, heldout_first=heldout[0][1] if heldout else None,
        heldout_last=heldout[-1][1] if heldout else None, median_step_time_s=med,
        tokens_per_s=tokens_per_step / med, seconds=time.perf_counter() - t_start, torch_version=torch.__version__,
        start_step=start, resumed_from=resumed_from, checkpoints=checkpoints,
    )
    if run_dir is not None:
        (run_dir / "summary.json").write_text(summary.model_dump_json(indent=2) + "\n")
    return summary
