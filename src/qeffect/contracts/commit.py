"""Commit barrier: the optimizer step happens only at quiescence, then every epoch advances together.

Quiescence for a commit: no live tapes, every arena view written exactly once, every data-parallel
reduction finished. A checkpoint needs the same, except that the arena must have no writes *in flight*
(a checkpoint is taken between steps, after the arenas advanced). A refused commit, or an optimizer step
that raises, aborts the epoch: outstanding tapes are purged and the arenas are marked unusable, while
``e_W`` and the parameters stay at the last committed state.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from .arena import GradientArena
from .epochs import EpochClock
from .errors import CommitViolation
from .keys import InvocationKey
from .tape import TapePool

PURPOSES = ("commit", "checkpoint")


class ReductionTracker:
    """Host-side ledger of asynchronous data-parallel reductions that the commit must wait for."""

    def __init__(self, name: str = "reductions") -> None:
        self.name = name
        self._pending: dict[int, str] = {}
        self._next = 0
        self._epoch = 0

    @property
    def epoch(self) -> int:
        return self._epoch

    def start(self, name: str) -> int:
        """Register a launched reduction; returns the handle to :meth:`finish` it with."""
        handle = self._next
        self._next += 1
        self._pending[handle] = name
        return handle

    def finish(self, handle: int) -> None:
        """Mark a reduction complete (after waiting on its work handle)."""
        if handle not in self._pending:
            raise CommitViolation(
                f"unknown reduction for tracker '{self.name}': expected a pending handle, found {handle!r} "
                "(never started or already finished)",
                relation="unknown reduction", key=handle, expected=sorted(self._pending), found=handle)
        del self._pending[handle]

    def pending(self) -> list[str]:
        """Names of unfinished reductions, in start order."""
        return list(self._pending.values())

    def advance_epoch(self) -> int:
        """Called by the commit barrier; refuses while reductions are pending."""
        if self._pending:
            raise CommitViolation(
                f"premature advance for tracker '{self.name}': expected no pending reductions, found "
                f"{self.pending()}",
                relation="pending reduction", key=None, expected=[], found=self.pending())
        self._epoch += 1
        return self._epoch

    def snapshot(self) -> tuple:
        return (self.name, self._epoch, tuple(sorted(self._pending.items())))


class CommitBarrier:
    """Guards the optimizer step of one rank: tapes, arenas and reductions must all be resolved."""

    def __init__(
        self,
        clock: EpochClock,
        pools: Sequence[TapePool],
        arenas: Sequence[GradientArena],
        reductions: ReductionTracker | None = None,
    ) -> None:
        self.clock = clock
        self.pools = list(pools)
        self.arenas = list(arenas)
        self.reductions = reductions

    def reasons(self, purpose: str = "commit") -> list[str]:
        """Every reason the state is not quiescent for ``purpose`` (empty list: quiescent)."""
        if purpose not in PURPOSES:
            raise ValueError(f"purpose must be one of {PURPOSES}, got {purpose!r}")
        out: list[str] = []
        for pool in self.pools:
            live = pool.live_keys()
            if live:
                out.append(f"pool '{pool.name}' has {len(live)} live tape(s) [{', '.join(map(str, live))}]")
        for arena in self.arenas:
            if not arena.usable:
                out.append(f"arena '{arena.name}' is aborted (rebuild() it)")
                continue
            if purpose == "commit":
                missing = arena.missing()
                if missing:
                    names = ", ".join(f"{n}[m={m}]" for n, m in missing)
                    out.append(f"arena '{arena.name}' has {len(missing)} missing write(s) [{names}]")
            elif arena.written:
                names = ", ".join(f"{n}[m={m}]" for n, m in sorted(arena.written))
                out.append(f"arena '{arena.name}' has writes in flight [{names}]")
        if self.reductions is not None:
            pending = self.reductions.pending()
            if pending:
                out.append(f"tracker '{self.reductions.name}' has {len(pending)} pending reduction(s) "
                           f"[{', '.join(pending)}]")
        return out

    def check_quiescent(self, purpose: str = "commit") -> None:
        """Raise :class:`CommitViolation` listing every reason the state is not quiescent. No mutation."""
        reasons = self.reasons(purpose)
        if reasons:
            raise CommitViolation(
                f"premature {purpose} at e_W={self.clock.e_W}: expected quiescence, found: "
                + "; ".join(reasons),
                relation=f"premature {purpose}", key=None, expected="quiescence", found=reasons)

    def commit(self, step: Callable[[], None]) -> None:
        """Barrier -> ``step()`` (the optimizer) -> advance ``e_W``, arenas and reductions together.

        On a refused barrier or a failing ``step`` the epoch is aborted and the error re-raised; the
        committed state (``e_W``, arena and reducer epochs) does not advance.
        """
        try:
            self.check_quiescent("commit")
            for arena in self.arenas:
                arena.finalize()
            step()
        except BaseException:
            self.abort_epoch()
            raise
        self.clock.advance()
        for arena in self.arenas:
            arena.advance_epoch()
        if self.reductions is not None:
            self.reductions.advance_epoch()

    def abort_epoch(self) -> list[InvocationKey]:
        """Purge the current epoch's tapes from every pool and mark every arena unusable."""
        purged: list[InvocationKey] = []
        for pool in self.pools:
            purged.extend(pool.purge(self.clock.e_W))
        for arena in self.arenas:
            arena.abort()
        return purged
