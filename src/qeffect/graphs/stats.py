"""Counters of the graph manager: what capture costs once and what replay costs every step.

Setup cost (capture host time, memory taken by captures) and steady-state cost (replays, caller/graph
handoffs, persistent memory growth per step) are kept apart, because the first decides whether graphs
pay off at all and the second what they cost per step once they do.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, TypeVar

from pydantic import BaseModel, Field

T = TypeVar("T")


class GraphStats(BaseModel):
    """Live statistics of one `GraphManager`; `model_dump_json` gives the report."""

    protocol: str = "two-way"
    graph_count: int = 0
    replay_count: int = 0
    # One edge each way per two-way replay (caller -> graph stream, graph tail -> caller); 0 for one-way.
    handoffs: int = 0
    # dynamic-input copies a replay left out: the static buffer still held that constant source
    input_copies_skipped: int = 0
    capture_host_seconds: float = 0.0
    capture_host_seconds_per_graph: dict[str, float] = Field(default_factory=dict)
    # Memory around all captures: "before" is read before the first capture, "after" after the latest.
    memory_allocated_before_capture: int | None = None
    memory_reserved_before_capture: int | None = None
    memory_allocated_after_capture: int | None = None
    memory_reserved_after_capture: int | None = None
    # memory_allocated() sampled once per step by `mark_step`.
    step_allocated: list[int] = Field(default_factory=list)

    def record_capture(self, name: str, seconds: float, allocated_before: int, reserved_before: int,
                       allocated_after: int, reserved_after: int) -> None:
        self.graph_count += 1
        self.capture_host_seconds += seconds
        self.capture_host_seconds_per_graph[name] = seconds
        if self.memory_allocated_before_capture is None:
            self.memory_allocated_before_capture = allocated_before
            self.memory_reserved_before_capture = reserved_before
        self.memory_allocated_after_capture = allocated_after
        self.memory_reserved_after_capture = reserved_after

    def record_replay(self, handoffs: int) -> None:
        self.replay_count += 1
        if handoffs:  # a model's assignment is not free, and stream-ordered replays hand off nothing
            self.handoffs += handoffs

    def mark_step(self, allocated: int) -> None:
        """Store the allocated bytes at the end of one step (the manager passes memory_allocated())."""
        self.step_allocated.append(int(allocated))

    @property
    def capture_memory_allocated(self) -> int:
        """Bytes that all captures together added to allocated memory (setup cost)."""
        if self.memory_allocated_before_capture is None or self.memory_allocated_after_capture is None:
            return 0
        return self.memory_allocated_after_capture - self.memory_allocated_before_capture

    def persistent_growth_bytes(self) -> int:
        """Largest rise of allocated memory over the first marked step (0 when it never rose)."""
        s = self.step_allocated
        if len(s) < 2:
            return 0
        return max(0, max(s[1:]) - s[0])

    def persistent_growth_per_step(self) -> float:
        """Worst average growth per step since the first marked step: max over k of (s[k] - s[0]) / k.

        The first mark is the baseline (the first step may legitimately allocate, e.g. caching-allocator
        blocks for outputs). Any leak of b bytes per step shows up as at least b; a steady state gives 0.
        """
        s = self.step_allocated
        if len(s) < 2:
            return 0.0
        return max(0.0, max((s[k] - s[0]) / k for k in range(1, len(s))))


# The phases of a step's host time that `HostPhases` names; the rest of the queue time is the runtime's own
# bookkeeping (contracts, ledger, tape pool, arena checks, Python).
LAUNCH, COPY, HANDOFF, OPTIMIZER = "graph launches", "input copies", "streams and hand-offs", "optimizer"
HOST_PHASES: tuple[str, ...] = (LAUNCH, COPY, HANDOFF, OPTIMIZER)
RUNTIME_PHASE = "runtime"  # a report's name for the rest


class HostPhases:
    """Host seconds and calls per phase, summed over the steps that run while `on` (off: nothing is read).

    Why: a host-bound step's queue time says that the host is too slow, not which part of it; `qeffect
    profile` turns this on after its timed steps, times a few more and reports each phase per step, the rest
    being the runtime's bookkeeping. Each timed call costs two clock reads, far below the calls it times."""

    __slots__ = ("on", "seconds", "calls")

    def __init__(self) -> None:
        self.on = False
        self.seconds: dict[str, float] = dict.fromkeys(HOST_PHASES, 0.0)
        self.calls: dict[str, int] = dict.fromkeys(HOST_PHASES, 0)

    def add(self, phase: str, since: float, now: float, calls: int = 1) -> None:
        """`calls` of `phase` (input copies: the copies made) from `since` to `now` (`time.perf_counter`)."""
        self.seconds[phase] += now - since
        self.calls[phase] += calls

    def call(self, phase: str, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)`, timed as one call of `phase` while on."""
        if not self.on:
            return fn(*args)
        t = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self.add(phase, t, time.perf_counter())

    def snapshot(self) -> tuple[dict[str, float], dict[str, int]]:
        """The totals so far (copies): take one before and after a step for that step's share."""
        return dict(self.seconds), dict(self.calls)
