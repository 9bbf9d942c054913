"""The training recipe: the learning-rate schedule and global gradient-norm clipping (`[optim]`).

Both runtimes (native eager and qeffect) take the recipe from here, so every qeffect path stays bitwise
equal to native eager with it on (docs/design.md §7).

**Learning rate.** `Recipe.lr(step)` is a pure function of the optimizer step, computed in Python floats
(the same bits in every process). Steps count from 1: step k is the k-th commit of the run, the step
number `qeffect train` prints and a checkpoint records (a resumed run continues the count; a step whose
commit `train.nonfinite = "skip"` dropped still counts). With W = `warmup_steps`, D = `decay_steps` (0:
`train.steps` - W) and t = k - W:

- warm-up, k = 1..W: ``lr * (k / W)`` (exactly ``lr`` at k = W);
- then ``constant``: ``lr``; ``cosine``: ``min_lr + (lr - min_lr) * (1 + cos(pi * t / D)) / 2``;
  ``linear``: ``min_lr + (lr - min_lr) * (1 - t / D)``, for t = 1..D (t = 0, the warm-up's last step,
  is ``lr``);
- after the decay, t > D: ``min_lr``.

The default (`constant`, no warm-up) gives ``lr`` at every step: the optimizer's own value, so existing
runs keep their bits.

**Clipping** (`clip_grad_norm` > 0). The global L2 norm over every parameter of every stage is reduced in
a fixed order: per stage, each gradient's fp32 norm (`torch.linalg.vector_norm` over a contiguous,
64-byte-aligned tensor, copied there if it is not: its bits then depend on the shape and values, not on
where the gradient lives, so an arena view and a `.grad` of the same values give the same norm) is
squared in float64 and added in parameter-name order (`stage_square_sum`); the stages' sums are added in
stage order and the square root taken (`global_norm`). Under torchrun every rank gathers every stage's sum and adds them in that order itself,
so all ranks hold the same bits; data-parallel replicas hold identical reduced gradients, so every
replica's sums are the same and one replica's (the first) are taken. The factor is ``min(1, clip /
(norm + 1e-6))`` as `torch.nn.utils.clip_grad_norm_` computes it, rounded to fp32 (`clip_factor`), and
every gradient is multiplied by it before the optimizer step (`scale_gradients`). The factor stays on the
device: nothing here waits for the device.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from qeffect.config import OptimConfig
from qeffect.fp8.te_compat import foreach_mul_

CLIP_EPS = 1e-6  # added to the norm before dividing, as torch's clip_grad_norm_ does
# A gradient is reduced where it lies when its first element is this aligned (CPU allocations are, CUDA's are
# 512-byte, the arena's views 256): every vectorized reduction then starts with no unaligned head, so its
# order is the shape's. Anything else (a view at an odd offset, a strided gradient) is copied first.
NORM_ALIGN_BYTES = 64


@dataclass(frozen=True)
class Recipe:
    """The `[optim]` recipe of a run of `total_steps` steps (`train.steps`: the decay's horizon when
    `decay_steps` is 0)."""

    optim: OptimConfig
    total_steps: int

    @property
    def clip(self) -> float:
        """The clipping threshold (0: no clipping)."""
        return float(self.optim.clip_grad_norm)

    @property
    def varies(self) -> bool:
        """Whether the learning rate changes between steps (a warm-up or a decaying schedule)."""
        return self.optim.warmup_steps > 0 or self.optim.schedule != "constant"

    def lr(self, step: int) -> float:
        """The learning rate of optimizer step `step` (counted from 1; see the module docstring)."""
        if step < 1:
            raise ValueError(f"optimizer steps count from 1, got {step}")
        o = self.optim
        peak, warmup = float(o.lr), o.warmup_steps
        if step <= warmup:
            return peak * (step / warmup)
        if o.schedule == "constant":
            return peak
        decay = o.decay_steps or max(self.total_steps - warmup, 0)
        t = step - warmup
        if t >= decay:
            return float(o.min_lr)
        frac = t / decay
        low = float(o.min_lr)
        if o.schedule == "cosine":
            return low + (peak - low) * 0.5 * (1.0 + math.cos(math.pi * frac))
        return low + (peak - low) * (1.0 - frac)


def stage_square_sum(grads: Iterable[tuple[str, torch.Tensor | None]]) -> torch.Tensor:
    """The sum of the squared L2 norms of one stage's gradients, as a float64 0-dim tensor on their
    device: each gradient's fp32 norm squared in float64, added in parameter-name order (None: skipped)."""
    total: torch.Tensor | None = None
    device = None
    for _, g in sorted(grads, key=lambda item: item[0]):
        if g is None:
            continue
        device = g.device
        g = g.detach()
        if not g.is_contiguous() or g.data_ptr() % NORM_ALIGN_BYTES:
            g = g.clone(memory_format=torch.contiguous_format)
        sq = torch.linalg.vector_norm(g).double().square()
        total = sq if total is None else total + sq
    if total is None:
        return torch.zeros((), dtype=torch.float64, device=device)
    return total


def global_norm(stage_sums: Sequence[torch.Tensor]) -> torch.Tensor:
    """The global L2 norm from every stage's square sum, given in stage order (added in that order)."""
    if not stage_sums:
        raise ValueError("global_norm needs every stage's square sum")
    total = stage_sums[0].clone()
    for s in stage_sums[1:]:
        total = total + s.to(total.device)
    return total.sqrt()


def clip_factor(norm: torch.Tensor, max_norm: float) -> torch.Tensor:
    """``min(1, max_norm / (norm + 1e-6))`` in float64, rounded to an fp32 0-dim tensor on norm's device."""
    return torch.clamp(max_norm / (norm + CLIP_EPS), max=1.0).float()


def scale_gradients(grads: list[torch.Tensor], factor: torch.Tensor) -> None:
    """Multiply every gradient by the fp32 factor in place (elementwise: the same bits wherever a
    gradient lives)."""
    if grads:
        foreach_mul_(grads, factor.to(grads[0].device))
