"""Where a cached FP8 weight is cast when the optimizer casts it: the target and its freshness.

Why: with Transformer Engine's delayed scaling the first forward of every step casts each fp32 weight
to E4M3 and its transpose (`cast_transpose_optimized_kernel`): one more read of every weight, 1.23 ms
of a 29.6 ms captured h4096 step on the H200. The
optimizer wrote those weights just before; `runtime.adamw.TritonAdamW` casts them in the same pass
(`cast_after_step`), so the cast's reads come free.

Bits: TE's cast exactly (GPU-tested against it): ``q = rn(clamp(w * scale, +-fmax))`` with the fp32
product, its transpose as the same bytes, ``amax = max |w|`` and ``scale_inv = 1 / scale`` correctly
rounded. The scale is the module's forward weight scale at the commit: scaling updates run after F and
dI only, none between the commit and the next step's first forward, so it is the scale that forward's
own cast would read.

State: the amax goes to a private slot (`pending_amax`), not into the amax history, so the FP8 state
at a step boundary keeps native's bits; the first forward folds it into the history's current row
(``row = max(row, pending)``, ``pending = 0``: what TE's atomic max onto that row does). The host side
(`stamp`) says whether the cache holds the cast of the weight as it is now: the weight's version
counter when it was cast, dropped when the first forward consumed it or the module's cache or scaling
state was reset. A forward that finds it stale has it cast first (`TritonAdamW.cast_now`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor


@dataclass(eq=False)
class WeightCastTarget:
    """One linear's FP8 weight cache as the optimizer writes it."""

    name: str
    weight: Tensor  # fp32 [out, in], contiguous
    data: Tensor  # E4M3 [out, in]: the cache's rowwise bytes
    transpose: Tensor | None  # E4M3 [in, out]: the columnwise bytes (dgrad), when the cache has them
    scale: Tensor  # the forward weight scale (a one-element view of the module's scaling state)
    scale_inv: Tensor  # the cache's 1 / scale
    amax_row: Tensor  # the weight's slot in the amax history's current row (one element)
    pending_amax: Tensor = field(init=False)  # max |w| of the last cast, not yet in the history
    stamp: int | None = field(default=None, init=False)
    # captured: a first forward captured into a graph takes the cache as it is (the caller casts a stale
    # one before each replay). An eager first forward (evaluation) takes it only when fresh, else casts.
    captured: bool = field(default=False, init=False)

    def __post_init__(self) -> None:
        rows, cols = self.weight.shape
        if self.weight.dtype != torch.float32 or not self.weight.is_contiguous():
            raise ValueError(f"{self.name}: the cast reads a contiguous fp32 weight, got {self.weight.dtype}")
        if tuple(self.data.shape) != (rows, cols) or (
                self.transpose is not None and tuple(self.transpose.shape) != (cols, rows)):
            raise ValueError(f"{self.name}: cache {tuple(self.data.shape)} / transpose "
                             f"{None if self.transpose is None else tuple(self.transpose.shape)} for a weight "
                             f"{(rows, cols)}")
        self.pending_amax = torch.zeros(1, dtype=torch.float32, device=self.weight.device)

    @property
    def fresh(self) -> bool:
        """The cache holds the cast of the weight as it is now, and its amax is pending."""
        return self.stamp is not None and self.stamp == self.weight._version

    def use_cache(self, capturing: bool) -> bool:
        """Whether a first forward takes the cache (and folds the pending amax) instead of casting:
        `capturing` one into a graph of captured actions, or one that finds the cache fresh."""
        return (self.captured and capturing) or self.fresh

    def mark_cast(self) -> None:
        self.stamp = self.weight._version

    def mark_consumed(self) -> None:
        self.stamp = None

    def fold_pending_amax(self) -> None:
        """Inside the first forward: the pending amax into the history's current row, then zero it."""
        torch.maximum(self.amax_row, self.pending_amax, out=self.amax_row)
        self.pending_amax.zero_()
