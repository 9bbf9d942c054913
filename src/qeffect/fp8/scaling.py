"""Delayed scaling with exactly Transformer Engine's `DelayedScaling` semantics.

A tensor is quantized with the scale computed from *earlier* amaxes (that is what "delayed" means);
its own amax is then recorded and the scale is updated for the next use. The update mirrors TE's
`_default_get_amax_and_update_history` followed by `_default_sf_compute`, op for op, so the reference
backend and TE walk through the same sequence of scales.

Everything here is device tensor ops only (no `.item()`, no host branching on values): the same code
runs eagerly and inside a captured CUDA graph, and the state tensors are updated in place so their
addresses stay fixed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from qeffect.fp8.fused_common import cast_fp8
from qeffect.fp8.fused_quantize import fused_available, quantize_amax, quantize_amax_colsum, transition_launch
from qeffect.fp8.fused_update import fused_update_available, update_scale_fused
from qeffect.fp8.recipe import DelayedScalingRecipe, fp8_max

_FP32_MAX = torch.finfo(torch.float32).max


def quantize(x: Tensor, scale: Tensor, fp8_dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """Quantize `x` with the current `scale`; return `(q, scale_inv)`.

    `scale_inv` is a new tensor taken now: the state's scale is updated in place afterwards, and the
    GEMM that consumes `q` (possibly much later, in `dW`) must see the scale `q` was made with.
    Saturates at the format's largest finite value (E4M3FN has no infinity: an unclamped cast of an
    out-of-range value would give NaN).
    """
    scale_inv = scale.reciprocal()
    return cast_fp8(x, scale, fp8_dtype), scale_inv


def record_amax(x: Tensor, amax_history: Tensor) -> None:
    """Write the current amax of `x` into `amax_history[0]` (in place)."""
    amax_history[0].copy_(x.abs().amax().float())


def update_scale(
    amax_history: Tensor, scale: Tensor, fmax: float, margin: int, amax_compute_algo: str
) -> None:
    """TE's amax reduction, history roll and scale computation, in place on both tensors."""
    # _default_get_amax_and_update_history
    if amax_compute_algo == "max":
        amax = torch.max(amax_history, dim=0).values
    elif amax_compute_algo == "most_recent":
        amax = amax_history[0].clone()
    else:
        raise ValueError(f"unknown amax_compute_algo {amax_compute_algo!r}")
    if amax_history.shape[0] > 1:
        amax_history.copy_(torch.roll(amax_history, -1, 0))
    amax_history[0].fill_(0.0)
    # _default_sf_compute. `fmax / amax` is a correctly rounded fp32 division, as in TE's fused update
    # kernel (its default path); Python's `float / tensor` would be reciprocal-then-multiply, which can
    # differ in the last bit. A tiny amax whose scale overflows gets FLT_MAX, as in TE 2.x.
    sf = (torch.full_like(amax, fmax) / amax) / (2**margin)
    sf = torch.where(amax > 0.0, sf, scale)
    sf = torch.where(torch.isfinite(amax), sf, scale)
    sf = torch.where(torch.isinf(sf), torch.full_like(sf, _FP32_MAX), sf)
    scale.copy_(sf)


@dataclass
class ScalingState:
    """One tensor's delayed-scaling state: `amax_history` (fp32 [L]) and `scale` (fp32, 0-dim).

    It holds references, not copies: a module builds one over its own buffers at each use, so updates
    land in the buffers (fixed addresses, part of the state_dict).
    """

    amax_history: Tensor
    scale: Tensor
    fp8_dtype: torch.dtype
    margin: int = 0
    amax_compute_algo: str = "max"
    # Two int32 words, zero between launches, through which the quantize kernel completes the transition
    # itself (`fused_quantize.quantize_transition`); None: quantize, then update, as two launches.
    scratch: Tensor | None = None

    def __post_init__(self) -> None:
        s = self.scratch  # checked once here, not on every quantization (`fused_quantize.transition_launch`)
        if s is not None and (s.dtype != torch.int32 or s.numel() != 2 or not s.is_contiguous()):
            raise ValueError(f"ScalingState.scratch must be two contiguous int32 words, got {s.dtype} "
                             f"{tuple(s.shape)}")

    @classmethod
    def new(
        cls, recipe: DelayedScalingRecipe, fp8_dtype: torch.dtype, device: torch.device | str | None = None
    ) -> ScalingState:
        """Fresh state: zero history, scale 1.0 (TE's initial values)."""
        return cls(
            amax_history=torch.zeros(recipe.amax_history_len, dtype=torch.float32, device=device),
            scale=torch.ones((), dtype=torch.float32, device=device),
            fp8_dtype=fp8_dtype,
            margin=recipe.margin,
            amax_compute_algo=recipe.amax_compute_algo,
        )

    @property
    def fmax(self) -> float:
        return fp8_max(self.fp8_dtype)

    def update(self) -> None:
        self._update(fused_update_available(self.scale))

    def _update(self, fused: bool, scale_inv_out: Tensor | None = None) -> None:
        """The transition, as one kernel (`fused`, which can also write `scale_inv_out`) or torch's sequence."""
        if fused:
            update_scale_fused(self.amax_history, self.scale, self.fmax, self.margin, self.amax_compute_algo,
                               scale_inv_out=scale_inv_out)
        else:
            update_scale(self.amax_history, self.scale, self.fmax, self.margin, self.amax_compute_algo)

    def quantize(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """Quantize with the current scale, record the amax of `x`, update the scale: one transition."""
        q, _, scale_inv = self._transition(x, transpose=False)
        return q, scale_inv

    def quantize_pair(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """`quantize` of a 2-D `x` that also returns `q^T` (contiguous, for the weight-gradient GEMM):
        `(q, q_t, scale_inv)`. On a GPU one fused pass (`fp8.fused_quantize`), same bits."""
        if x.dim() != 2:
            raise ValueError(f"quantize_pair wants a 2-D tensor, got {tuple(x.shape)}")
        q, q_t, scale_inv = self._transition(x, transpose=True)
        assert q_t is not None
        return q, q_t, scale_inv

    def quantize_pair_colsum(self, x: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """`quantize_pair` that also returns the column sums of `x` in `dtype` (a bias gradient), from the
        same pass on a GPU (`fused_quantize.quantize_amax_colsum`): `(q, q_t, scale_inv, sums)`."""
        if x.dim() != 2:
            raise ValueError(f"quantize_pair_colsum wants a 2-D tensor, got {tuple(x.shape)}")
        q, q_t, scale_inv, sums = self._transition(x, transpose=True, colsum=dtype)
        assert q_t is not None and sums is not None
        return q, q_t, scale_inv, sums

    def _transition(self, x: Tensor, transpose: bool, colsum: torch.dtype | None = None) -> tuple:
        """`quantize_amax` (one fused pass on a GPU, the torch sequence elsewhere and for non-2-D `x`),
        with `scale_inv` taken before and the scale update after; with `colsum`, the column sums too.
        With a `scratch` on a GPU the pass completes the update itself (`quantize_transition`): one launch
        instead of three (the amax slot's zeroing, the pass, the update), the same bits."""
        fused = fused_update_available(self.scale)  # the update kernel also writes 1 / (the scale before it)
        scale_inv = torch.empty_like(self.scale) if fused else self.scale.reciprocal()  # before the update
        if fused and self.scratch is not None and fused_available(x):
            q, q_t, sums = transition_launch(x, self, scale_inv, transpose, colsum)  # (scratch: __post_init__)
        else:
            if colsum is None:
                (q, q_t), sums = quantize_amax(x, self.scale, self.amax_history[0], self.fp8_dtype,
                                               transpose=transpose), None
            else:
                q, q_t, sums = quantize_amax_colsum(x, self.scale, self.amax_history[0], self.fp8_dtype, colsum)
            self._update(fused, scale_inv if fused else None)
        return (q, q_t, scale_inv) if colsum is None else (q, q_t, scale_inv, sums)
