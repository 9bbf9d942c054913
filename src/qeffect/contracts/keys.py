"""Invocation keys: the logical identity of one stage execution, never an address.

Captured graphs reuse the same physical slots across microbatches and optimizer epochs, so an address
cannot say *which* invocation a buffer belongs to. ``K = (e, s, m, u, i)`` does.
"""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass(frozen=True, slots=True, order=True)
class InvocationKey:
    """``(e, s, m, u, i)``: optimizer epoch, stage, microbatch, sub-layer block, intra-module counter."""

    e: int
    s: int
    m: int
    u: int = 0
    i: int = 0

    def __post_init__(self) -> None:
        # Strict ints: a bool or a float key would compare equal to an int key and break injectivity
        # checks in subtle ways, so it is rejected here, at construction.
        for name in _FIELDS:
            v = getattr(self, name)
            if type(v) is int and v >= 0:  # the usual case, decided without the checks below
                continue
            if not isinstance(v, int) or isinstance(v, bool):
                raise ValueError(f"InvocationKey.{name} must be an int, got {type(v).__name__} {v!r}")
            if v < 0:
                raise ValueError(f"InvocationKey.{name} must be >= 0, got {v}")

    def __str__(self) -> str:
        return f"K(e={self.e},s={self.s},m={self.m},u={self.u},i={self.i})"


_FIELDS = tuple(f.name for f in fields(InvocationKey))  # (read once: `fields` costs more than the checks)
