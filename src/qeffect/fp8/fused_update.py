"""The delayed-scaling transition (`scaling.update_scale`) and the `scale_inv` it follows, as one GPU kernel.

Why: `update_scale` is about a dozen tiny torch kernels (max over the history, roll, fill, divisions,
three `where`s, `isinf`, copy), and the reference backend runs one transition per quantization: at
hidden 4,096 that is some 289 transitions and 3,500 kernel launches in each captured step, each a
microsecond or two of GPU time, with `scale.reciprocal()` before each. One program per transition does
the same arithmetic on the same fp32 values:

- `scale_inv = 1 / scale` (the scale before the update), correctly rounded, as torch's `reciprocal`;
- `amax` = the history's maximum (a NaN anywhere makes it NaN, as `torch.max`), or its first entry;
- the history rolled left by one, its first entry then zero;
- `sf = (fmax / amax) / 2**margin`, kept at the old scale where `amax` is not > 0 or not finite, and
  FLT_MAX where it overflowed to infinity. Both divisions are correctly rounded (`tl.div_rn`): Triton's
  `/` is approximate, and Triton 3.6 on the H200 ignored `tl.fdiv`'s `ieee_rounding` (1-ulp differences
  from torch).

GPU tests compare the bits with the torch sequence over histories with zeros, NaNs, infinities and
tiny amaxes. Triton is imported lazily; without it (CPU, or below sm90) the torch sequence runs.

CPU tests run the kernel under Triton's interpreter, whose float arithmetic is numpy's (IEEE): they
check the semantics, not the GPU's rounding. That is what `tests/test_fused_update_gpu.py` is for: it
caught `tl.fdiv(..., ieee_rounding=True)` rounding approximately on the H200 (Triton 3.6).
"""

from __future__ import annotations

import torch
from torch import Tensor

from qeffect.fp8.fused_common import sm90_or_newer
from qeffect.triton_lazy import triton_kernel

_FP32_MAX = torch.finfo(torch.float32).max


@triton_kernel
def transition_math(triton, tl):  # noqa: ANN001, ANN202 - builds a Triton JIT function
    @triton.jit
    def _scale_transition(hist, first, rolled, idx, inside, scale, fmax, inv_pow2_margin, flt_max,
                          MOST_RECENT: tl.constexpr):
        """The transition on loaded values: ``hist`` (the history, ``first`` its entry 0) and ``rolled``
        (entry ``(i + 1) % L`` at ``i``); returns (the history to store, the new scale). Shared by this
        module's kernel and the quantize kernel's own transition (`fused_quantize`): the same bits."""
        if MOST_RECENT:
            amax = first
        else:
            # tl.max does not promise NaN propagation; torch.max does: count the NaNs apart
            nans = tl.sum(tl.where(inside & (hist != hist), 1, 0), axis=0)
            amax = tl.max(tl.where(inside, hist, -float("inf")), axis=0)
            amax = tl.where(nans > 0, float("nan"), amax)
        rolled = tl.where(idx == 0, 0.0, rolled)  # roll left by one, then entry 0 is zero
        sf = tl.div_rn(fmax, amax) * inv_pow2_margin  # torch: `/ 2**m` is `* 2**-m`
        sf = tl.where(amax > 0.0, sf, scale)
        finite = (amax == amax) & (amax != float("inf")) & (amax != -float("inf"))
        sf = tl.where(finite, sf, scale)
        sf = tl.where((sf == float("inf")) | (sf == -float("inf")), flt_max, sf)
        return rolled, sf

    globals()["_scale_transition"] = _scale_transition  # module globals: every Triton version resolves those
    globals()["tl"] = tl  # Triton's interpreter looks for `tl` in a called function's module globals (CPU tests)
    return _scale_transition


@triton_kernel
def _kernel(triton, tl):  # noqa: ANN001, ANN202 - builds a Triton JIT function
    _scale_transition = transition_math()  # module globals too (see `transition_math`)

    @triton.jit
    def update_scale(hist_ptr, scale_ptr, scale_inv_ptr, L, fmax, inv_pow2_margin, flt_max,
                     MOST_RECENT: tl.constexpr, WRITE_INV: tl.constexpr, BLOCK: tl.constexpr):
        idx = tl.arange(0, BLOCK)
        inside = idx < L
        hist = tl.load(hist_ptr + idx, mask=inside, other=0.0)
        scale = tl.load(scale_ptr)
        if WRITE_INV:
            tl.store(scale_inv_ptr, tl.div_rn(1.0, scale))
        rolled = tl.load(hist_ptr + (idx + 1) % L, mask=inside, other=0.0)
        rolled, sf = _scale_transition(hist, tl.load(hist_ptr), rolled, idx, inside, scale, fmax, inv_pow2_margin,
                                       flt_max, MOST_RECENT)
        tl.debug_barrier()  # every load above before the stores
        tl.store(hist_ptr + idx, rolled, mask=inside)
        tl.store(scale_ptr, sf)

    return update_scale


def fused_update_available(scale: Tensor) -> bool:
    """CUDA on sm90 or newer with Triton (`fused_common.sm90_or_newer`), as the fused quantization."""
    return scale.is_cuda and sm90_or_newer(scale.device.index) and _kernel() is not None


def history_block(length: int) -> int:
    """The block a kernel loads an amax history of `length` entries in (a power of two, at least 16)."""
    return max(16, 1 << (length - 1).bit_length())


def update_scale_fused(amax_history: Tensor, scale: Tensor, fmax: float, margin: int, amax_compute_algo: str,
                       scale_inv_out: Tensor | None = None) -> None:
    """`scaling.update_scale` in one launch; with `scale_inv_out` also `scale_inv_out = 1 / scale` taken
    before the update (what `scaling.quantize` hands the GEMM). In place; same bits as the torch sequence."""
    if amax_compute_algo not in ("max", "most_recent"):
        raise ValueError(f"unknown amax_compute_algo {amax_compute_algo!r}")
    if amax_history.dim() != 1 or not amax_history.is_contiguous() or amax_history.dtype != torch.float32:
        raise ValueError(f"amax_history must be a contiguous 1-D fp32 tensor, got {amax_history.dtype} "
                         f"{tuple(amax_history.shape)}")
    if scale.numel() != 1 or scale.dtype != torch.float32:
        raise ValueError(f"scale must be one fp32 element, got {scale.dtype} {tuple(scale.shape)}")
    n = amax_history.numel()
    block = history_block(n)
    inv = scale_inv_out if scale_inv_out is not None else scale
    with torch.cuda.device(scale.device):
        _kernel()[(1,)](amax_history, scale, inv, n, float(fmax), 2.0 ** -margin, _FP32_MAX,
                        MOST_RECENT=amax_compute_algo == "most_recent", WRITE_INV=scale_inv_out is not None,
                        BLOCK=block)
