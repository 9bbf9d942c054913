"""Where one rank's training step goes under torchrun: an opt-in, synchronised time breakdown.

The step is cut into consecutive laps; each lap ends where the next begins and is charged to one
category, so the categories add up to the step's wall time (up to the clock reads around them):

- `compute`: this rank's actions (`F`, `dI`, `dW`, graph replays included), less the hand-offs below.
- `recv_wait`: inside a receive until the tensor is usable here: waiting for the peer to produce it
  (the pipeline bubble as this rank sees it) plus the transfer.
- `send`: posting sends, and waiting at the step's end until every send completed.
- `loss_reduce`: the step loss's all-reduce (ranks before the last stage wait there for it).
- `reduction`: the data-parallel gradient all-reduce and FP8 state merge (0 without replicas).
- `optimizer`: the commit (barrier checks, AdamW, epochs), less the reduction.
- `barrier`: the step-end synchronisation: this rank waiting for the slowest one.

`idle` = recv_wait + loss_reduce + barrier is the time the rank had nothing to run.

Honesty on a GPU: the host queues kernels and returns, so a host timer sees launch time, not kernel
time. Every lap therefore first synchronises the caller's stream (captured replays end on it), so a lap
ends when its device work has finished; only the caller's stream, never the whole device, because an
NCCL send completes only once the peer posts its receive and waiting for it mid-step could deadlock two
ranks sending to each other (a receive then blocks the host as a gloo receive does, which every schedule
already runs under on the CPU). That synchronisation removes the overlap of launch with execution, so a
breakdown step is slower than an unperturbed one: take it on extra steps, after the timed ones, and report
it beside (never instead of) the unperturbed step time. Nothing here runs unless asked: otherwise the
executor pays one None check per data-parallel reduction and nothing per action.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch

CATEGORIES: tuple[str, ...] = ("compute", "recv_wait", "send", "loss_reduce", "reduction", "optimizer", "barrier")
IDLE: tuple[str, ...] = ("recv_wait", "loss_reduce", "barrier")  # the rank had nothing to run
# The laps cover the step; what the sum may miss is the few statements after the last lap, where a loaded
# host may also preempt the process for a few milliseconds. A phase left out of the laps (a commit, a
# reduction) is far above this.
SUM_TOLERANCE_SECONDS = 0.005
SUM_TOLERANCE_FRACTION = 0.05


def stream_sync(device: torch.device) -> Callable[[], None]:
    """What ends a lap on `device`: the caller's current stream drained (see the module docstring); on a
    CPU nothing (gloo and eager CPU work block the host already)."""
    if device.type != "cuda":
        return lambda: None
    return lambda: torch.cuda.current_stream(device).synchronize()


class StepLaps:
    """Consecutive laps of one step, each charged to a category. `clock` and `sync` are injectable for tests."""

    def __init__(self, sync: Callable[[], None], clock: Callable[[], float] = time.perf_counter) -> None:
        self._sync, self._clock = sync, clock
        self._last: float | None = None
        self._start = 0.0
        self.seconds: dict[str, float] = {}

    def start(self, at: float | None = None) -> None:
        """Begin a step at clock reading `at` (None: now): every category back to zero."""
        self.seconds = dict.fromkeys(CATEGORIES, 0.0)
        self._start = self._last = self._clock() if at is None else at

    def lap(self, category: str) -> None:
        """Charge the time since the last lap to `category`, once this rank's queued work has finished."""
        if self._last is None:
            raise RuntimeError("StepLaps.lap before start()")
        if category not in CATEGORIES:
            raise ValueError(f"unknown step category {category!r}; expected one of {', '.join(CATEGORIES)}")
        self._sync()
        now = self._clock()
        self.seconds[category] += now - self._last
        self._last = now

    def observer(self, _action: Any, _rank: Any) -> None:
        """The executor's per-action observer: the action just run was compute."""
        self.lap("compute")

    def finish(self) -> dict[str, float]:
        """The step's categories, and `laps_seconds` (their sum: from start() to the last lap)."""
        if self._last is None:
            raise RuntimeError("StepLaps.finish before start()")
        out = dict(self.seconds)
        out["laps_seconds"] = self._last - self._start
        self._last = None
        return out


class TimedTransport:
    """A transport that charges its receives to `recv_wait` and its sends to `send` (the time before each
    call to `compute`), delegating everything to the executor's transport."""

    def __init__(self, inner: Any, laps: StepLaps) -> None:
        self.inner, self.laps = inner, laps

    def put(self, kind: str, stage: int, m: int, tensor: torch.Tensor) -> None:
        self.laps.lap("compute")
        self.inner.put(kind, stage, m, tensor)
        self.laps.lap("send")

    def get(self, kind: str, stage: int, m: int) -> torch.Tensor:
        self.laps.lap("compute")
        out = self.inner.get(kind, stage, m)
        self.laps.lap("recv_wait")
        return out

    def finish(self) -> None:
        self.laps.lap("compute")
        self.inner.finish()
        self.laps.lap("send")


class TimedPipeline(Protocol):
    """What `breakdown_step` needs of an executor (`runtime.distributed.DistributedPipeline`)."""

    transport: Any
    step_laps: StepLaps | None

    def run_actions(self, batches: Sequence[Any], observer: Any = None) -> torch.Tensor: ...
    def commit(self) -> None: ...


def breakdown_step(pipe: TimedPipeline, batches: Sequence[Any], laps: StepLaps,
                   sync_all: Callable[[], None], clock: Callable[[], float] = time.perf_counter) -> dict[str, Any]:
    """One training step of `pipe` (its actions, then its commit) cut into laps. `sync_all`: the step-start
    and step-end synchronisation of every rank, as the unperturbed timing's. Returns the categories,
    `wall_seconds` (timed around them independently, as an unperturbed step is) and `unattributed_seconds`
    (the wall less the categories' sum: the clock reads at the two ends). The transport and the laps are
    put back as they were, also when the step raises."""
    inner = pipe.transport
    sync_all()
    t0 = clock()
    laps.start(at=t0)  # the first lap starts where the wall time does
    pipe.transport, pipe.step_laps = TimedTransport(inner, laps), laps
    try:
        loss = pipe.run_actions(batches, laps.observer)
        laps.lap("loss_reduce")
        pipe.commit()
        laps.lap("optimizer")
        sync_all()
        laps.lap("barrier")
    finally:
        pipe.transport, pipe.step_laps = inner, None
    wall = clock() - t0
    out = laps.finish()
    out["wall_seconds"] = wall
    out["unattributed_seconds"] = wall - sum(out[c] for c in CATEGORIES)
    out["loss"] = float(loss)
    return out


def within_tolerance(step: dict[str, float]) -> bool:
    """Whether a step's categories add up to its wall time within the stated tolerance (5 ms + 5%)."""
    return abs(step["unattributed_seconds"]) <= SUM_TOLERANCE_SECONDS + SUM_TOLERANCE_FRACTION * step["wall_seconds"]


def summarize(steps: Sequence[dict[str, float]]) -> dict[str, float]:
    """Median over steps of each category, of `idle` (see the module docstring) and of the wall time (`wall`)."""
    if not steps:
        raise ValueError("no breakdown steps to summarize")
    out = {c: statistics.median(s[c] for s in steps) for c in CATEGORIES}
    out["idle"] = statistics.median(sum(s[c] for c in IDLE) for s in steps)
    out["wall"] = statistics.median(s["wall_seconds"] for s in steps)
    return out


__all__ = ["CATEGORIES", "IDLE", "StepLaps", "TimedTransport", "breakdown_step", "stream_sync", "summarize",
           "within_tolerance"]
