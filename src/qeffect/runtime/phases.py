"""Where a build's time goes: wall seconds per named phase, for `qeffect profile`'s setup breakdown.

Why: the break-even target compares whole setups (build + first step), and when it is missed the report
must say which part of a setup is long. Each phase starts and ends with a device synchronization, so the
GPU work a phase queued (copies to the device, captures) counts in the phase that queued it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext

import torch

Phase = Callable[[str], AbstractContextManager]  # `with phase("name"):` times the block under that name


class SetupClock:
    """Seconds per phase of one build; a phase entered again adds to its total (one per stage or rank)."""

    def __init__(self, device: str | torch.device) -> None:
        self.device = torch.device(device)
        self.seconds: dict[str, float] = {}

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        self._sync()
        t0 = time.perf_counter()
        try:
            yield
        finally:
            self._sync()
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - t0


def no_phase(name: str) -> AbstractContextManager:  # noqa: ARG001 - the `Phase` signature
    """The `Phase` of a build nobody times."""
    return nullcontext()


def phase_of(clock: SetupClock | None) -> Phase:
    return clock.phase if clock is not None else no_phase
