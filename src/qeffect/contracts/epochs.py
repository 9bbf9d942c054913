"""Optimizer epoch ``e_W`` and quantized-weight-cache epoch ``e_C`` (cache-version relation).

A captured graph keeps fixed pointers to the cached FP8 weights; only these counters tell whether
that cache still matches the parameters. The first forward microbatch of a step refreshes the cache
(``e_C <- e_W``); every later forward verifies ``e_C == e_W``, so a cache left over from before a
commit can never be reused silently.
"""

from __future__ import annotations

from .errors import CacheEpochViolation
from .keys import InvocationKey


class EpochClock:
    """The logical optimizer epoch ``e_W``. Advanced only by the commit barrier."""

    def __init__(self, e_W: int = 0) -> None:
        _check_epoch(e_W)
        self._e_W = e_W

    @property
    def e_W(self) -> int:
        return self._e_W

    def advance(self) -> int:
        """Move to the next optimizer epoch. Only :class:`CommitBarrier` calls this."""
        self._e_W += 1
        return self._e_W

    def restore(self, e_W: int) -> None:
        """Set the epoch from a checkpoint on resume (then invalidate every weight cache)."""
        _check_epoch(e_W)
        self._e_W = e_W

    def snapshot(self) -> tuple:
        return ("clock", self._e_W)


class WeightCacheVersion:
    """Version ``e_C`` of one quantized-weight cache. ``None`` means invalid (fresh, or after resume)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.e_C: int | None = None

    def check_forward(self, clock: EpochClock, first_microbatch: bool, key: InvocationKey | None = None) -> bool:
        """Check (and on the first microbatch, refresh) the cache version for a forward.

        Returns True when the caller must refresh the cache (first microbatch of the step). A later
        microbatch with ``e_C != e_W`` raises :class:`CacheEpochViolation`; nothing is mutated then.
        ``key`` (the forward's invocation key) only makes the message more precise.
        """
        if first_microbatch:
            self.e_C = clock.e_W
            return True
        if self.e_C != clock.e_W:
            where = f"cache '{self.name}'" + (f" at {key}" if key is not None else "")
            raise CacheEpochViolation(
                f"stale weight cache for {where}: expected e_C == e_W = {clock.e_W}, found e_C = {self.e_C}; "
                "only the first microbatch of a step may refresh the cache",
                relation="stale weight cache", key=key if key is not None else self.name,
                expected=clock.e_W, found=self.e_C)
        return False

    def invalidate(self) -> None:
        """Forget the version (process restart / resume): the next first forward must refresh."""
        self.e_C = None

    def snapshot(self) -> tuple:
        return ("cache", self.name, self.e_C)


def _check_epoch(e: int) -> None:
    if not isinstance(e, int) or isinstance(e, bool) or e < 0:
        raise ValueError(f"epoch must be an int >= 0, got {e!r}")
