"""What the reference backend's fused passes share: the GPU gate, the cast they must match, the state they update.

Why a module of its own: `scaling` (the delayed-scaling states) calls `fused_quantize` and `fused_update` (the
Triton passes), and both passes need the cast and the gate. Kept here, below all three, every import points
down: scaling -> fused_quantize -> fused_update -> fused_common.
"""

from __future__ import annotations

import functools
from typing import Protocol

import torch
from torch import Tensor

from qeffect.fp8.recipe import fp8_max


@functools.cache
def sm90_or_newer(index: int | None) -> bool:
    """Whether CUDA device `index` is sm90 or newer: there Triton's fp32->fp8 cast is one round-to-nearest-even
    `cvt` (below, it rounds through fp16 first or cannot cast E4M3), so the fused passes give the torch bits.
    Cached: asked once per quantization, and capture time is host time."""
    return torch.cuda.get_device_capability(index) >= (9, 0)


def cast_fp8(x: Tensor, scale: Tensor, fp8_dtype: torch.dtype) -> Tensor:
    """`x * scale` saturated at the format's largest finite value, cast round-to-nearest-even: the bits
    every quantization path (`scaling.quantize`, the fused kernel's reference sequence) must produce."""
    fmax = fp8_max(fp8_dtype)
    return (x.float() * scale).clamp(-fmax, fmax).to(fp8_dtype).contiguous()


class TransitionState(Protocol):
    """What the fused quantize pass reads and updates of a delayed-scaling state (`scaling.ScalingState`)."""

    amax_history: Tensor
    scale: Tensor
    fp8_dtype: torch.dtype
    margin: int
    amax_compute_algo: str
    scratch: Tensor | None
