"""The reference backend's quantization as one GPU pass: FP8 cast, its transpose and the amax.

Why: the pure-torch quantization (`scaling.quantize` + `record_amax`, then `.t().contiguous()` for the
weight-gradient GEMM) is eight kernels and about 30 bytes of traffic per element; at hidden 4,096 it
was 29 ms of a 72 ms captured step (elementwise 14.7 ms, cast/amax 14.7 ms, H200 profile). One tiled
pass reads the input once and writes the FP8 tensor (and its transpose) once.

Bits, per element: ``v = float(x) * scale`` (one IEEE fp32 multiply), clamped to the format's largest
finite value with NaN passing through (as ``torch.clamp``), then cast round-to-nearest-even -- the
same value as ``(x.float() * scale).clamp(-fmax, fmax).to(fp8)``. The amax is the maximum of ``|x|``:
non-negative floats order like their bit patterns as integers, so an integer atomic max over the bits
gives the exact maximum in any block order (a NaN, whose bits exceed infinity's, wins, as in
``torch.amax``; only its payload may differ from torch's). The transpose is a copy of the same bytes.
GPU tests compare every bit pattern with the torch sequence, special values included.

The output gradient's pass can also sum its columns (`quantize_amax_colsum`: the bias gradient, which
torch's ``dy.sum(0)`` took 1.30 ms of a 30.7 ms h4096 reference step to compute with 128 more kernels):
that pass runs one program per column strip, which adds each 256-row tile's column sums in row order, in
fp32, and casts once. A fixed order, not torch's over the rows, so other bits than ``dy.sum(0)``, the
same in the native and the split paths (both call this), on every GPU run.

With a scaling state's scratch words the pass also completes the delayed-scaling transition
(`quantize_transition`): the program that finishes last records the amax, rolls the history and
updates the scale, instead of a zeroing kernel before and `fused_update`'s kernel after.

Triton is imported lazily and only for CUDA tensors; without it (CPU, below sm90, or no Triton) the torch
sequence runs. The kernel compiles on first use, which the eager warm-up before capture provides (no JIT
inside a CUDA graph capture).

Transposes (H200, Triton 3.6): storing the transpose from the kernel, through transposed fp8 pointers or as
an explicit byte transpose of the tile, wrote wrong bytes for some fp32 tiles (64x64, 256x4096) and right
ones for bf16: with garbage transposes of the fp32 master weights training went to NaN on both the
captured and the native side (the bitwise matrix agreed; verify-state fails on non-finite losses). So the
kernel transposes 16-bit inputs only; fp32 ones are quantized, then their bytes transposed by
`transpose_bytes`, a tiled Triton byte transpose (torch's strided copy of FP8 runs at a small fraction of
the bandwidth; `benchmarks/results/profile-h4096-reference-torch-transpose-h200.json` is a step with
torch's transposes).
"""

from __future__ import annotations

import torch
from torch import Tensor

from qeffect.fp8.fused_common import TransitionState, cast_fp8, sm90_or_newer
from qeffect.fp8.fused_update import history_block, transition_math
from qeffect.fp8.recipe import fp8_max
from qeffect.triton_lazy import on_device, triton_kernel

BLOCK_M, BLOCK_N, WARPS = 64, 64, 2  # the plain pass: rows x columns per tile, warps (no bits depend on them;
# 2 warps: 0.80 ms per h4096 step against 0.91-0.92 with 4, both with relaxed amax atomics, in
# `docs/results/2026-12-01-h200-kernels.md`)
COLSUM_BLOCK_M, COLSUM_BLOCK_N, COLSUM_WARPS = 256, 32, 8  # the pass that also sums the columns: one program per
# column strip (h4096's narrowest output gradient, 4,096 columns: 128 programs), over tiles of 256 rows (a
# 256-token microbatch in one tile, not four 64-row tiles one after another: four dependent loads per program)
COLSUM_WIDE_FROM, COLSUM_WIDE_BLOCK_N, COLSUM_WIDE_WARPS = 8192, 16, 1  # from this many columns on: strips of 16
# columns, one warp each (no cross-warp reduction). With relaxed atomics, per call: 9.9 against 13.9 us at
# 12,288 columns and 10.2 against 12.9 at 11,008 (64 passes per h4096 step), but 8.2 against 5.1 at 4,096
# (too few warps in flight). The column sums' bits follow the strip
# (`tl.sum`'s tree), the same for every caller of one shape: native and split paths alike.
TRANSPOSE_BLOCK = (64, 64, 4)  # `transpose_bytes`: rows x columns per tile, warps (`weight_cast_ab.py` sweeps it)
AMAX_SEM = "relaxed"  # each program's atomic max into the amax word: nothing needs it ordered but the ticket,
# whose acquire-release does that (and a kernel boundary without a transition). Relaxed was faster for every tile
# and strip `quantize_ab.py` timed: 1.38 -> 1.19 ms per h4096 step for the column-sum passes, and with 2 warps
# 0.93 -> 0.80 ms for the others. (With these settings the whole GPU suite twice failed on an invalidated capture
# before `GraphManager` paused the garbage collector during captures; since then it passes with either.)


@triton_kernel
def _kernel(triton, tl):  # noqa: ANN001, ANN202 - builds a Triton JIT function
    _scale_transition = transition_math()
    globals()["_scale_transition"] = _scale_transition  # module globals: every Triton version resolves those

    @triton.jit
    def _quantized(x_ptr, q_ptr, rows, cols, m, n, scale, fmax):
        """Quantize one tile: `(q, each column's largest |x| as bits, each column's fp32 sum)` (padding
        contributes 0)."""
        mask = (rows[:, None] < m) & (cols[None, :] < n)
        x = tl.load(x_ptr + rows[:, None] * n + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        v = x * scale
        v = tl.where(v > fmax, fmax, v)  # comparisons with NaN are false: NaN passes, as in torch.clamp
        v = tl.where(v < -fmax, -fmax, v)
        q = v.to(q_ptr.dtype.element_ty)
        # |x| as bits with the sign cleared by a mask (abs.f32 leaves a NaN's sign unspecified): >= 0, so
        # integer order is float order, and a NaN's bits exceed infinity's
        bits = tl.where(mask, x.to(tl.int32, bitcast=True) & 0x7FFFFFFF, 0)
        return q, tl.max(bits, axis=0), tl.sum(x, axis=0)

    @triton.jit
    def _store(q_ptr, qt_ptr, q, rows, cols, m, n, TRANSPOSE: tl.constexpr):
        """Store a quantized tile (and, with ``TRANSPOSE``, its bytes transposed)."""
        tl.store(q_ptr + rows[:, None] * n + cols[None, :], q, mask=(rows[:, None] < m) & (cols[None, :] < n))
        if TRANSPOSE:
            # opt-in, 16-bit inputs only (see `_transpose_in_kernel`): the tile transposed as bytes
            qbt = tl.trans(q.to(tl.uint8, bitcast=True))
            tl.store(qt_ptr + cols[:, None] * m + rows[None, :], qbt, mask=(cols[:, None] < n) & (rows[None, :] < m))

    globals()["_quantized"], globals()["_store"] = _quantized, _store

    @triton.jit
    def quantize_amax(x_ptr, scale_ptr, q_ptr, qt_ptr, amax_bits_ptr, m, n, fmax, sums_ptr,
                      hist_ptr, scale_inv_ptr, L, inv_pow2_margin, flt_max,
                      TRANSPOSE: tl.constexpr, COLSUM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                      TRANSITION: tl.constexpr = False, MOST_RECENT: tl.constexpr = False,
                      HBLOCK: tl.constexpr = 16, SUM_CAST: tl.constexpr = False,
                      AMAX_SEM: tl.constexpr = "acq_rel"):
        scale = tl.load(scale_ptr)
        cols = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
        if TRANSITION:  # loaded by every program, early: the last one then only waits for the amax
            idx = tl.arange(0, HBLOCK)
            inside = idx < L
            src = (idx + 1) % L
            hist = tl.load(hist_ptr + idx, mask=inside, other=0.0)
            rolled = tl.load(hist_ptr + src, mask=inside, other=0.0)
        if COLSUM:
            # one program per column strip, over its row blocks in order: the column sums are each tile's
            # (`tl.sum` over its BLOCK_M rows) added in row order in fp32, from 0.0, then cast once (so the
            # bits depend on BLOCK_M: every path here launches with `COLSUM_BLOCK_M`). The last row block's
            # tile is stored below, as the plain pass's.
            amax = tl.zeros((BLOCK_N,), dtype=tl.int32)
            acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
            last = ((m - 1) // BLOCK_M) * BLOCK_M
            for r0 in range(0, last, BLOCK_M):
                rows = r0 + tl.arange(0, BLOCK_M).to(tl.int64)
                q, tile_max, tile_sum = _quantized(x_ptr, q_ptr, rows, cols, m, n, scale, fmax)
                _store(q_ptr, qt_ptr, q, rows, cols, m, n, TRANSPOSE)
                amax = tl.maximum(amax, tile_max)
                acc = acc + tile_sum
            rows = last + tl.arange(0, BLOCK_M).to(tl.int64)
            q, tile_max, tile_sum = _quantized(x_ptr, q_ptr, rows, cols, m, n, scale, fmax)
            amax = tl.maximum(amax, tile_max)
            acc = acc + tile_sum
            if SUM_CAST:  # to a narrower float, rounded to nearest even as torch's `.to`
                acc = acc.to(sums_ptr.dtype.element_ty, fp_downcast_rounding="rtne")
            tl.store(sums_ptr + cols, acc, mask=cols < n)
            amax = tl.max(amax, axis=0)
        else:
            rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
            q, tile_max, _ = _quantized(x_ptr, q_ptr, rows, cols, m, n, scale, fmax)
            amax = tl.max(tile_max, axis=0)
        _store(q_ptr, qt_ptr, q, rows, cols, m, n, TRANSPOSE)
        tl.atomic_max(amax_bits_ptr, amax, sem=AMAX_SEM)
        if TRANSITION:
            # The program that finishes last (its ticket comes after every other program's amax and its
            # reads of the scale and history: the ticket is acquire-release, whose release also orders a
            # relaxed amax atomic of the same thread before it) completes the transition:
            # it takes the amax, leaves the scratch words zero for the next launch, then records the amax,
            # rolls the history and writes the new scale and 1 / the scale q was made with.
            tl.debug_barrier()  # the program's amax in before its ticket
            ticket = tl.atomic_add(amax_bits_ptr + 1, 1)
            if ticket == tl.num_programs(0) * tl.num_programs(1) - 1:
                amax_all = tl.atomic_xchg(amax_bits_ptr, 0).to(tl.float32, bitcast=True)
                tl.store(amax_bits_ptr + 1, 0)
                hist = tl.where(idx == 0, amax_all, hist)  # the amax recorded into entry 0
                rolled = tl.where(src == 0, amax_all, rolled)
                tl.store(scale_inv_ptr, tl.div_rn(1.0, scale))
                rolled, sf = _scale_transition(hist, amax_all, rolled, idx, inside, scale, fmax, inv_pow2_margin,
                                               flt_max, MOST_RECENT)
                tl.store(hist_ptr + idx, rolled, mask=inside)
                tl.store(scale_ptr, sf)

    return quantize_amax


@triton_kernel
def _transpose_kernel(triton, tl):  # noqa: ANN001, ANN202 - builds a Triton JIT function
    @triton.jit
    def transpose_bytes(src_ptr, dst_ptr, m, n, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
        """dst[n, m] = src[m, n]^T for bytes: a plain tiled transpose, no conversion anywhere."""
        rows = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
        cols = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
        tile = tl.load(src_ptr + rows[:, None] * n + cols[None, :], mask=(rows[:, None] < m) & (cols[None, :] < n))
        tl.store(dst_ptr + cols[:, None] * m + rows[None, :], tl.trans(tile),
                 mask=(cols[:, None] < n) & (rows[None, :] < m))

    return transpose_bytes


def transpose_bytes(q: Tensor, out: Tensor | None = None, block: tuple[int, int, int] | None = None) -> Tensor:
    """`q.t().contiguous()` of a 2-D one-byte tensor (FP8) on the GPU as a tiled Triton transpose: torch's
    strided copy of FP8 ran at a small fraction of the bandwidth (4.5 ms for 17 weight transposes per
    h4096 step on the H200). The quantize kernel's own transpose is wrong for fp32 inputs there, so those
    quantize first and transpose the bytes here (no FP8 conversion in this kernel). `block`: (rows,
    columns, warps) instead of `TRANSPOSE_BLOCK`."""
    m, n = q.shape
    qt = torch.empty((n, m), dtype=q.dtype, device=q.device) if out is None else out
    if qt.shape != (n, m) or qt.element_size() != 1 or not qt.is_contiguous():
        raise ValueError(f"transpose_bytes: out must be a contiguous one-byte [{n}, {m}] tensor, got {tuple(qt.shape)}")
    bm, bn, warps = block or TRANSPOSE_BLOCK
    grid = (-(-m // bm), -(-n // bn))
    with torch.cuda.device(q.device):
        _transpose_kernel()[grid](q.view(torch.uint8), qt.view(torch.uint8), m, n, BLOCK_M=bm, BLOCK_N=bn,
                                  num_warps=warps)
    return qt


def fused_available(x: Tensor) -> bool:
    """Whether `x` quantizes through the fused kernel: CUDA on sm90 or newer (Triton's fp32->fp8 cast is
    one round-to-nearest-even `cvt` there; below, it rounds through fp16 first or cannot cast E4M3), 2-D
    contiguous, Triton present."""
    return (x.is_cuda and x.dim() == 2 and x.is_contiguous()
            and x.dtype in (torch.bfloat16, torch.float16, torch.float32) and x.numel() > 0
            and sm90_or_newer(x.device.index) and _kernel() is not None)


def quantize_sequence(x: Tensor, scale: Tensor, amax_slot: Tensor, fp8_dtype: torch.dtype,
                      transpose: bool) -> tuple[Tensor, Tensor | None]:
    """The torch sequence the kernel replaces (the reference semantics): `(q, q.t().contiguous() or None)`,
    and `amax_slot` (a 0-dim fp32 view, e.g. `amax_history[0]`) set to the amax of `x`."""
    q = cast_fp8(x, scale, fp8_dtype)
    amax_slot.copy_(x.abs().amax().float())
    return q, (q.t().contiguous() if transpose else None)


def quantize_amax(x: Tensor, scale: Tensor, amax_slot: Tensor, fp8_dtype: torch.dtype,
                  transpose: bool = False) -> tuple[Tensor, Tensor | None]:
    """Quantize `x` with `scale`, record its amax into `amax_slot`; with `transpose` also `q^T` (contiguous).

    `amax_slot` must be a contiguous 0-dim fp32 tensor (the first element of an amax history)."""
    if not fused_available(x):  # (also every non-2-D `x`)
        return quantize_sequence(x, scale, amax_slot, fp8_dtype, transpose)
    q, qt, _ = _launch(x, scale, amax_slot, fp8_dtype, transpose, None)
    return q, qt


def quantize_amax_colsum(x: Tensor, scale: Tensor, amax_slot: Tensor, fp8_dtype: torch.dtype,
                         dtype: torch.dtype) -> tuple[Tensor, Tensor, Tensor]:
    """`quantize_amax(transpose=True)` of a 2-D `x` that also returns its column sums in `dtype` (a bias
    gradient: the output gradient summed over the tokens), `(q, q_t, sums)`.

    Fused (GPU): the pass runs one program per column strip, which sums
    each 256-row tile's columns and adds those in row order, in fp32, then casts once (fixed shapes, fixed
    order: the same bits every run, and the same as `quantize_transition`'s; not torch's order over the
    rows). Elsewhere ``x.sum(0, dtype=dtype)``."""
    if x.dim() != 2:
        raise ValueError(f"quantize_amax_colsum wants a 2-D tensor, got {tuple(x.shape)}")
    if not fused_available(x):
        q, qt = quantize_amax(x, scale, amax_slot, fp8_dtype, transpose=True)
        return q, qt, x.sum(0, dtype=dtype)
    return _launch(x, scale, amax_slot, fp8_dtype, True, dtype)


def quantize_transition(x: Tensor, state: TransitionState, scale_inv: Tensor, transpose: bool,
                        colsum: torch.dtype | None) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """One delayed-scaling transition of `state` (`ScalingState`, with its `scratch`) in one launch:
    quantize `x` with the scale, its amax recorded, `scale_inv` = 1 / that scale, the history rolled
    and the scale updated; with `colsum` the column sums of `x` in that dtype too (as
    `quantize_amax_colsum`). Returns `(q, q^T or None, sums or None)`.

    Why: the sequence (`quantize_amax`, then `fused_update.update_scale_fused`) is three launches per
    quantization, the amax slot's zeroing, the pass and the update: the two small ones were 544 of the
    2,700 kernels of a captured h4096 reference step (H200). Here the program that finishes last does
    the update once every other
    program's amax is in: the arithmetic of the sequence, so its bits (GPU-tested). The amax goes
    through `state.scratch` (two int32 words, zero between launches: the last program resets them), so
    the history's entry 0 is written, not max-ed into."""
    if state.scratch is None:  # (its form is checked where the state gets it: `ScalingState.__post_init__`)
        raise ValueError("quantize_transition needs the state's scratch: two contiguous int32 words")
    if not fused_available(x):
        raise ValueError("quantize_transition runs the fused kernel only (see `fused_available`)")
    return transition_launch(x, state, scale_inv, transpose, colsum)


def transition_launch(x: Tensor, state: TransitionState, scale_inv: Tensor, transpose: bool,
                      colsum: torch.dtype | None) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """`quantize_transition` without its checks, for a caller that has made them (`ScalingState`'s
    transition asks `fused_available` to choose this path: asking again is host time on every eager step)."""
    return _launch(x, state.scale, state.scratch, state.fp8_dtype, transpose, colsum, transition=(state, scale_inv))


def _launch(x: Tensor, scale: Tensor, amax: Tensor, fp8_dtype: torch.dtype, transpose: bool,
            colsum: torch.dtype | None, transition: tuple[TransitionState, Tensor] | None = None,
            ) -> tuple[Tensor, Tensor | None, Tensor | None]:
    """The kernel over `x` (fused path): `(q, q_t or None, the column sums in `colsum` or None)`.

    `amax`: the amax slot (one fp32 element, zeroed here), or with `transition` (the scaling state and
    the `scale_inv` to write) the state's scratch words."""
    if transition is None and (amax.dtype != torch.float32 or amax.numel() != 1):
        raise ValueError(f"amax_slot must be one fp32 element, got {amax.dtype} {tuple(amax.shape)}")
    m, n = x.shape
    q = torch.empty((m, n), dtype=fp8_dtype, device=x.device)
    in_kernel = transpose and _transpose_in_kernel(x)
    qt = torch.empty((n, m), dtype=fp8_dtype, device=x.device) if in_kernel else q
    sums = torch.empty(n, dtype=colsum, device=x.device) if colsum is not None else q
    block_m, block_n, warps = (COLSUM_BLOCK_M, *colsum_strip(n)) if colsum is not None else (BLOCK_M, BLOCK_N, WARPS)
    grid = (1 if colsum is not None else -(-m // block_m), -(-n // block_n))
    if transition is None:
        amax.zero_()  # the atomic max starts from 0 (|x| >= 0, so 0 is the identity)
        hist, scale_inv, inv_pow2_margin, algo, hblock = q, q, 1.0, "max", 16  # (not read)
    else:
        state, scale_inv = transition
        hist, inv_pow2_margin, algo = state.amax_history, 2.0 ** -state.margin, state.amax_compute_algo
        hblock = history_block(hist.numel())
    with on_device(x.device):  # Triton launches on the current device
        _kernel()[grid](x, scale, q, qt.view(torch.uint8), amax.view(torch.int32), m, n, fp8_max(fp8_dtype), sums,
                        hist, scale_inv, hist.numel(), inv_pow2_margin, torch.finfo(torch.float32).max,
                        TRANSPOSE=in_kernel, COLSUM=colsum is not None, BLOCK_M=block_m, BLOCK_N=block_n,
                        TRANSITION=transition is not None, MOST_RECENT=algo == "most_recent",
                        HBLOCK=hblock, SUM_CAST=colsum is not None and colsum != torch.float32,
                        AMAX_SEM=AMAX_SEM, num_warps=warps)
    if transpose and not in_kernel:
        qt = transpose_bytes(q)
    return q, (qt if transpose else None), (sums if colsum is not None else None)


def colsum_strip(n: int) -> tuple[int, int]:
    """The column-sum pass's (columns per strip, warps) for `n` columns: narrow strips of one warp for
    wide tensors, where there are programs enough (see `COLSUM_WIDE_FROM`)."""
    if n >= COLSUM_WIDE_FROM:
        return COLSUM_WIDE_BLOCK_N, COLSUM_WIDE_WARPS
    return COLSUM_BLOCK_N, COLSUM_WARPS


def _transpose_in_kernel(x: Tensor) -> bool:
    """Whether the quantize kernel also writes `q^T` (as bytes, from the same tile): 16-bit inputs.

    fp32 inputs (the master weights, once per step) are transposed by `transpose_bytes` after the
    quantize kernel: on the H200 (Triton 3.6) both forms of the in-kernel transpose wrote wrong bytes for
    some fp32 tiles, and right bytes for every bf16 case tested."""
    return x.dtype in (torch.bfloat16, torch.float16)
