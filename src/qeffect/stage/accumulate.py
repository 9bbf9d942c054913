"""The staged gradient fold as one GPU pass (see `contracts/arena.py`, "Staged accumulation").

Adding each microbatch's weight gradient into the fp32 region as it comes reads and writes the region
once per microbatch. Folding a group of staged gradients in one kernel reads each staged slot once and
the region at most once, and writes the region once: at 256 tokens per microbatch those passes, not the
GEMMs, are what the weight-gradient work costs.

Bits: per element, ``acc = region (or slot 0); acc = acc + float(slot j)`` for j in order, each addition
an IEEE fp32 round-to-nearest add -- exactly what ``region.add_(slot)`` computes (fp32 op math, one
rounding), so the fused pass and the ``copy_``/``add_`` sequence give identical bits (GPU-tested).

Triton is imported lazily and only for CUDA tensors; without it (CPU, or no Triton) the fold runs as
the plain tensor sequence. ``QEFFECT_FUSED_FOLD=0`` forces the sequence (for A/B measurements).
"""

from __future__ import annotations

import os

import torch

from qeffect.contracts.arena import sequential_reduce
from qeffect.triton_lazy import triton_kernel

BLOCK = 2048


@triton_kernel
def _kernel(triton, tl):  # noqa: ANN001, ANN202 - builds a Triton JIT function
    @triton.jit
    def fold(region_ptr, block_ptr, slot_stride, n, count, INIT: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        if INIT:
            acc = tl.load(block_ptr + offs, mask=mask).to(tl.float32)
            for j in range(1, count):
                acc = acc + tl.load(block_ptr + j * slot_stride + offs, mask=mask).to(tl.float32)
        else:
            acc = tl.load(region_ptr + offs, mask=mask)
            for j in range(0, count):
                acc = acc + tl.load(block_ptr + j * slot_stride + offs, mask=mask).to(tl.float32)
        tl.store(region_ptr + offs, acc, mask=mask)

    return fold


def fused_available(t: torch.Tensor) -> bool:
    """Whether the fold of `t` runs as the fused kernel (CUDA fp32 region, Triton present, not disabled)."""
    return (t.is_cuda and t.dtype == torch.float32 and os.environ.get("QEFFECT_FUSED_FOLD", "1") != "0"
            and _kernel() is not None)


def fold_staged(region: torch.Tensor, block: torch.Tensor, count: int, init: bool) -> None:
    """`contracts.arena.Reduce`: fold `block[0:count]` into `region` in slot order, fused where possible."""
    # the kernel's slot offsets are 32-bit products (j * slot_stride): larger blocks take the sequence
    if (not fused_available(region) or not region.is_contiguous() or block.stride(1) != 1
            or block.numel() >= 2**31):
        sequential_reduce(region, block, count, init)
        return
    n = region.numel()
    if not 1 <= count <= block.shape[0] or block.shape[1] < n:
        raise ValueError(f"fold of {count} slots of {tuple(block.shape)} into {n} elements")
    _kernel()[(-(-n // BLOCK),)](region, block, block.stride(0), n, count, INIT=init, BLOCK=BLOCK)
