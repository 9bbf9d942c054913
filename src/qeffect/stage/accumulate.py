"""The staged gradient fold as one GPU pass (see `contracts/arena.py`, "Staged accumulation").

Adding each microbatch's weight gradient into the fp32 region as it comes reads and writes the region
once per microbatch. Folding a group of staged gradients in one kernel reads each staged slot once and
the region at most once, and writes the region once: at 256 tokens per microbatch those passes, not the
GEMMs, are what the weight-gradient work costs.

Bits: per element, ``acc = region (or slot 0); acc = acc + float(slot j)`` for j in order, each addition
an IEEE fp32 round-to-nearest add -- exactly what ``region.add_(slot)`` computes (fp32 op math, one
rounding), so the fused pass and the ``copy_``/``add_`` sequence give identical bits (GPU-tested).

Triton is imported lazily and only for CUDA tensors; without it (CPU, or no Triton) the fold runs as
the plain tensor sequence (the same bits).
"""

from __future__ import annotations

import torch

from qeffect.contracts.arena import gated_sequential_reduce, sequential_reduce
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


@triton_kernel
def _gated_kernel(triton, tl):  # noqa: ANN001, ANN202 - builds a Triton JIT function
    @triton.jit
    def fold_gated(region_ptr, block_ptr, mode_ptr, slot_stride, n, count, BLOCK: tl.constexpr):
        # the mode word (`FoldMode`: 0 skip, 1 overwrite, 2 add) is read on the device: one captured graph
        # folds every group of its slot; a skipped fold loads and stores nothing
        mode = tl.load(mode_ptr)
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = (offs < n) & (mode != 0)
        first = tl.load(block_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        prev = tl.load(region_ptr + offs, mask=mask & (mode == 2), other=0.0)
        acc = tl.where(mode == 1, first, prev + first)
        for j in range(1, count):
            acc = acc + tl.load(block_ptr + j * slot_stride + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(region_ptr + offs, acc, mask=mask)

    return fold_gated


def fused_available(t: torch.Tensor) -> bool:
    """Whether the fold of `t` runs as the fused kernel (CUDA fp32 region, Triton present)."""
    return t.is_cuda and t.dtype == torch.float32 and _kernel() is not None


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


def fold_staged_gated(region: torch.Tensor, block: torch.Tensor, count: int, mode: torch.Tensor) -> None:
    """`contracts.arena.GatedReduce`: `fold_staged` with its mode read from the device word `mode`."""
    if (not fused_available(region) or not region.is_contiguous() or block.stride(1) != 1
            or block.numel() >= 2**31 or _gated_kernel() is None):
        gated_sequential_reduce(region, block, count, mode)
        return
    n = region.numel()
    if not 1 <= count <= block.shape[0] or block.shape[1] < n:
        raise ValueError(f"fold of {count} slots of {tuple(block.shape)} into {n} elements")
    _gated_kernel()[(-(-n // BLOCK),)](region, block, mode, block.stride(0), n, count, BLOCK=BLOCK)


# --------------------------------------------------------------------------- non-matrix gradients
# A captured dI accumulates each microbatch's gradients of the norms, biases and position table into
# fixed fp32 buffers: dI(0) copies, later dIs add (AccumulateGrad's bits). One copy_/add_ per tensor is a
# launch of a few microseconds for a few thousand elements, about ten per dI graph; `accumulate_into`
# does up to `SLOTS` tensors of one source dtype per launch. Bits: ``dst = float(src)`` or
# ``dst = dst + float(src)``, one IEEE fp32 add, which is what ``copy_`` and ``add_`` compute.

SLOTS = 8
ACC_BLOCK = 1024
_ARGS = [f"{k}{i}" for i in range(SLOTS) for k in ("d", "s", "n")]
_ENDS = [f"e{i}" for i in range(1, SLOTS)]


@triton_kernel
def _multi_kernel(triton, tl):  # noqa: ANN001, ANN202 - builds a Triton JIT function
    @triton.jit
    def _acc_one(dst, src, n, pid, INIT: tl.constexpr, BLOCK: tl.constexpr):
        offs = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        g = tl.load(src + offs, mask=mask).to(tl.float32)
        if not INIT:
            g = tl.load(dst + offs, mask=mask) + g
        tl.store(dst + offs, g, mask=mask)

    globals()["_acc_one"] = _acc_one  # a module global: every Triton version resolves those (not all closures)

    @triton.jit(do_not_specialize=[a for a in _ARGS if a[0] == "n"] + _ENDS)
    def accumulate(d0, s0, n0, d1, s1, n1, d2, s2, n2, d3, s3, n3, d4, s4, n4, d5, s5, n5, d6, s6, n6,
                   d7, s7, n7, e1, e2, e3, e4, e5, e6, e7, INIT: tl.constexpr, BLOCK: tl.constexpr):
        """Tensor i covers programs [e_i, e_{i+1}) (e_0 = 0); unused slots repeat slot 0 with n = 0."""
        pid = tl.program_id(0)
        if pid < e1:
            _acc_one(d0, s0, n0, pid, INIT, BLOCK)
        elif pid < e2:
            _acc_one(d1, s1, n1, pid - e1, INIT, BLOCK)
        elif pid < e3:
            _acc_one(d2, s2, n2, pid - e2, INIT, BLOCK)
        elif pid < e4:
            _acc_one(d3, s3, n3, pid - e3, INIT, BLOCK)
        elif pid < e5:
            _acc_one(d4, s4, n4, pid - e4, INIT, BLOCK)
        elif pid < e6:
            _acc_one(d5, s5, n5, pid - e5, INIT, BLOCK)
        elif pid < e7:
            _acc_one(d6, s6, n6, pid - e6, INIT, BLOCK)
        else:
            _acc_one(d7, s7, n7, pid - e7, INIT, BLOCK)

    return accumulate


FUSED_SOURCES = (torch.float32, torch.bfloat16, torch.float16)


def _batchable(dst: torch.Tensor, src: torch.Tensor) -> bool:
    """Contiguous fp32 destination, a contiguous source of the same size in a float dtype, both 16-byte
    aligned (the kernel is compiled for aligned pointers only, so a capture never compiles a variant)."""
    return (dst.is_cuda and src.device == dst.device and dst.dtype == torch.float32 and src.dtype in FUSED_SOURCES
            and dst.is_contiguous() and src.is_contiguous() and dst.numel() == src.numel()
            and dst.data_ptr() % 16 == 0 and src.data_ptr() % 16 == 0)


def launch_multi(dsts: list[torch.Tensor], srcs: list[torch.Tensor], init: bool) -> None:
    """The kernel over pairs whose sources share one dtype, `SLOTS` pairs per launch (no checks)."""
    kernel = _multi_kernel()
    for at in range(0, len(dsts), SLOTS):
        pairs = list(zip(dsts[at:at + SLOTS], srcs[at:at + SLOTS], strict=True))
        args, ends, total = [], [], 0
        for i in range(SLOTS):
            d, s = pairs[i] if i < len(pairs) else pairs[0]
            n = d.numel() if i < len(pairs) else 0
            if i:
                ends.append(total)
            args += [d, s, n]
            total += -(-n // ACC_BLOCK)
        if total:  # empty tensors only: nothing to launch (a grid of 0 programs is an error)
            kernel[(total,)](*args, *ends, INIT=init, BLOCK=ACC_BLOCK)


def accumulate_into(dsts: list[torch.Tensor], srcs: list[torch.Tensor], *, init: bool) -> None:
    """``dst.copy_(src)`` (`init`) or ``dst.add_(src)`` for each pair, batched where the kernel covers it;
    the rest (CPU, other dtypes or layouts, no Triton) one by one."""
    fused = _multi_kernel() is not None
    by_dtype: dict[torch.dtype, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
    for d, s in zip(dsts, srcs, strict=True):
        if fused and _batchable(d, s):
            group = by_dtype.setdefault(s.dtype, ([], []))
            group[0].append(d)
            group[1].append(s)
        elif init:
            d.copy_(s)
        else:
            d.add_(s)
    for ds, ss in by_dtype.values():
        launch_multi(ds, ss, init)
