"""LayerNorm for 16-bit CUDA activations with fp32 statistics and fp32 parameters, as two Triton passes.

Why: the model's torch form (`gpt._layer_norm`) upcasts the input, runs an fp32 LayerNorm and downcasts
the output, and its backward does the same with the gradients: four full-size copies around each
LayerNorm's forward and backward (288 kernels of a 36 ms h4096 step). torch refuses a 16-bit input with
fp32 weights on CUDA, and Transformer Engine has no kernel for that combination ("Unavailable kernel for
this normalization config"). These kernels read and write the activation dtype directly and keep every
statistic, parameter and parameter gradient in fp32.

Bits: deterministic. Forward: one program per row, mean and variance by fp32 tree sums over the row.
Backward: one program per group of rows writes fp32 partial weight and bias gradients, summed over the
groups by a third pass in a fixed order (one tile sum per column block); the input gradient is per row.
Native eager and every qeffect path share the model code, so they keep identical bits; the numbers
differ from the torch form's by the rounding of a different summation order.

The pre-norm block's residual adds ride in these passes (`triton_add_layer_norm`: s = x + r and its
norm; `triton_fork_layer_norm`: a norm whose input is used again): the forward adds in the activation
dtype as torch's add does (an fp32 sum, one rounding), and the backward adds the input's other gradient
to the rounded input gradient as autograd's add does, so the bits are those of the add and the norm
apart (GPU-tested), with one kernel and one read and write of the activation fewer per add.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from qeffect.triton_lazy import triton_kernel

ROWS_PER_PROGRAM = 2  # backward: rows per partial weight/bias gradient (fixed: the bits depend on it). Best of
# `benchmarks/layernorm_backward.py` (1/2/4/8 on the H200, backward + sum per call in a graph;
# `docs/results/2026-12-01-h200-kernels.md`): 7.03 us at
# h4096 and 5.55 at h2048 with 2, against 7.92 and 6.38 with 4 (and 9.26 and 7.76 with 4 and torch's sum)
MAX_HIDDEN = 16384
SUM_TILE = 4096  # elements per program of the partial sums' reduction


@triton_kernel
def _kernels(triton, tl):  # noqa: ANN001, ANN202 - builds Triton JIT functions
    @triton.jit
    def forward(x_ptr, r_ptr, s_ptr, w_ptr, b_ptr, y_ptr, mean_ptr, rstd_ptr, n, eps, RESIDUAL: tl.constexpr,
                BLOCK: tl.constexpr):
        """With ``RESIDUAL``: s = x + r rounded to the activation dtype (torch's 16-bit add: an fp32
        sum, one rounding), stored, and normalized in place of x."""
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < n
        x = tl.load(x_ptr + row * n + cols, mask=mask, other=0.0).to(tl.float32)
        if RESIDUAL:
            r = tl.load(r_ptr + row * n + cols, mask=mask, other=0.0).to(tl.float32)
            sq = (x + r).to(s_ptr.dtype.element_ty)
            tl.store(s_ptr + row * n + cols, sq, mask=mask)
            x = sq.to(tl.float32)
        mean = tl.sum(x, axis=0) / n
        xc = tl.where(mask, x - mean, 0.0)
        var = tl.sum(xc * xc, axis=0) / n
        rstd = 1.0 / tl.sqrt_rn(var + eps)
        w = tl.load(w_ptr + cols, mask=mask, other=0.0)
        b = tl.load(b_ptr + cols, mask=mask, other=0.0)
        y = xc * rstd * w + b
        tl.store(y_ptr + row * n + cols, y.to(y_ptr.dtype.element_ty), mask=mask)
        tl.store(mean_ptr + row, mean)
        tl.store(rstd_ptr + row, rstd)

    @triton.jit
    def backward(dy_ptr, x_ptr, w_ptr, mean_ptr, rstd_ptr, dx_ptr, dres_ptr, part_ptr, rows, n,
                 RESIDUAL: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr):
        """With ``RESIDUAL``: dx = (LayerNorm's dx rounded to the activation dtype) + dres, rounded again:
        what autograd's 16-bit add of the two gradients of a tensor with two uses makes."""
        pid = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        mask = cols < n
        w = tl.load(w_ptr + cols, mask=mask, other=0.0)
        dw = tl.zeros([BLOCK], dtype=tl.float32)
        db = tl.zeros([BLOCK], dtype=tl.float32)
        for i in range(ROWS):
            row = pid.to(tl.int64) * ROWS + i
            if row < rows:
                x = tl.load(x_ptr + row * n + cols, mask=mask, other=0.0).to(tl.float32)
                dy = tl.load(dy_ptr + row * n + cols, mask=mask, other=0.0).to(tl.float32)
                mean = tl.load(mean_ptr + row)
                rstd = tl.load(rstd_ptr + row)
                xhat = tl.where(mask, (x - mean) * rstd, 0.0)
                wdy = w * dy
                c1 = tl.sum(xhat * wdy, axis=0) / n
                c2 = tl.sum(wdy, axis=0) / n
                dx = ((wdy - (xhat * c1 + c2)) * rstd).to(dx_ptr.dtype.element_ty)
                if RESIDUAL:
                    dres = tl.load(dres_ptr + row * n + cols, mask=mask, other=0.0).to(tl.float32)
                    dx = (dx.to(tl.float32) + dres).to(dx_ptr.dtype.element_ty)
                tl.store(dx_ptr + row * n + cols, dx, mask=mask)
                dw += dy * xhat
                db += dy
        tl.store(part_ptr + pid * 2 * n + cols, dw, mask=mask)  # part[pid, 0] = dw, part[pid, 1] = db
        tl.store(part_ptr + pid * 2 * n + n + cols, db, mask=mask)

    @triton.jit
    def column_sum(part_ptr, out_ptr, cols, PARTS: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_C: tl.constexpr):
        """out[c] = the sum over the ``PARTS`` rows of part[:, c] (fp32), one tile and one fixed tree per
        column block: the same bits every run."""
        c = tl.program_id(0) * BLOCK_C + tl.arange(0, BLOCK_C)
        r = tl.arange(0, BLOCK_P)
        mask = (r[:, None] < PARTS) & (c[None, :] < cols)
        tile = tl.load(part_ptr + r[:, None].to(tl.int64) * cols + c[None, :], mask=mask, other=0.0)
        tl.store(out_ptr + c, tl.sum(tile, axis=0), mask=c < cols)

    return forward, backward, column_sum


def available(x: Tensor, weight: Tensor) -> bool:
    """Whether `x` can take these kernels: 16-bit CUDA activations, fp32 parameters, Triton present."""
    return (x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and weight.dtype == torch.float32
            and x.shape[-1] <= MAX_HIDDEN and _kernels() is not None)


def _block(n: int) -> int:
    return max(16, 1 << (n - 1).bit_length())


def _warps(block: int) -> int:
    return min(16, max(4, block // 512))


def _forward(x: Tensor, residual: Tensor | None, weight: Tensor, bias: Tensor,
             eps: float) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(y, the normalized input (x, or x + residual stored), mean, rstd), all [rows, n]."""
    n = x.shape[-1]
    x2 = x.reshape(-1, n).contiguous()
    rows = x2.shape[0]
    y = torch.empty_like(x2)
    if residual is not None:
        r2 = residual.reshape(rows, n).contiguous()
        s2 = torch.empty_like(x2)
    else:
        r2 = s2 = x2  # not read
    mean = torch.empty(rows, dtype=torch.float32, device=x.device)
    rstd = torch.empty(rows, dtype=torch.float32, device=x.device)
    block = _block(n)
    _kernels()[0][(rows,)](x2, r2, s2, weight.contiguous(), bias.contiguous(), y, mean, rstd, n, eps,
                           RESIDUAL=residual is not None, BLOCK=block, num_warps=_warps(block))
    return y, (s2 if residual is not None else x2), mean, rstd


def _backward(grad: Tensor, dres: Tensor | None, x2: Tensor, weight: Tensor, mean: Tensor,
              rstd: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(dx [rows, n], plus `dres` where given; dw, db), the parameter gradients one fixed-order sum."""
    rows, n = x2.shape
    dy = grad.reshape(rows, n).contiguous()
    dr = dres.reshape(rows, n).contiguous() if dres is not None else dy  # not read without
    dx = torch.empty_like(x2)
    programs = -(-rows // ROWS_PER_PROGRAM)
    part = torch.empty(programs, 2, n, dtype=torch.float32, device=x2.device)
    block = _block(n)
    _kernels()[1][(programs,)](dy, x2, weight.contiguous(), mean, rstd, dx, dr, part, rows, n,
                               RESIDUAL=dres is not None, ROWS=ROWS_PER_PROGRAM, BLOCK=block,
                               num_warps=_warps(block))
    dw, db = _sum_partials(part)
    return dx, dw, db


def _sum_partials(part: Tensor) -> Tensor:
    """[programs, 2, n] -> [2, n]: one fixed-order reduction over the groups, for dw and db together,
    as one Triton tile sum per column block (torch's reduction kernel took 4.7 us for h4096's, launch-bound)."""
    programs, two, n = part.shape
    out = torch.empty(two, n, dtype=part.dtype, device=part.device)
    block_p = _block(programs)
    block_c = max(16, min(SUM_TILE // block_p, 1024))
    _kernels()[2][(-(-two * n // block_c),)](part, out, two * n, PARTS=programs, BLOCK_P=block_p, BLOCK_C=block_c,
                                            num_warps=4)
    return out


class _TritonLayerNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, bias: Tensor, eps: float) -> Tensor:
        y, x2, mean, rstd = _forward(x, None, weight, bias, eps)
        ctx.save_for_backward(x2, weight, mean, rstd)
        return y.view(x.shape)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor, Tensor, None]:
        dx, dw, db = _backward(grad, None, *ctx.saved_tensors)
        return dx.view(grad.shape), dw, db, None


class _TritonAddLayerNorm(torch.autograd.Function):
    """(s, LayerNorm(s)) for s = x + r: the pre-norm block's residual add and the norm after it, one pass
    each way. Backward: s's two gradients (its own use, the norm's) added as autograd adds them, and
    that sum is x's and r's gradient, as the add's backward hands it to both."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, r: Tensor, weight: Tensor, bias: Tensor, eps: float) -> tuple[Tensor, Tensor]:
        y, s2, mean, rstd = _forward(x, r, weight, bias, eps)
        ctx.save_for_backward(s2, weight, mean, rstd)
        ctx.set_materialize_grads(False)  # an unused output's gradient is no gradient, not +0.0 added
        return s2.view(x.shape), y.view(x.shape)

    @staticmethod
    def backward(ctx: Any, ds: Tensor | None, dy: Tensor | None) -> tuple[Tensor | None, ...]:
        if dy is None:
            return ds, ds, None, None, None
        dx, dw, db = _backward(dy, ds, *ctx.saved_tensors)
        dx = dx.view(dy.shape)
        return dx, dx, dw, db, None


class _TritonForkLayerNorm(torch.autograd.Function):
    """(x, LayerNorm(x)) for an x that is also used elsewhere (the block input: the residual): backward
    adds x's two gradients in the norm's pass, as autograd's 16-bit add of them would."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, bias: Tensor, eps: float) -> tuple[Tensor, Tensor]:
        y, x2, mean, rstd = _forward(x, None, weight, bias, eps)
        ctx.save_for_backward(x2, weight, mean, rstd)
        ctx.set_materialize_grads(False)  # an unused output's gradient is no gradient, not +0.0 added
        return x, y.view(x.shape)

    @staticmethod
    def backward(ctx: Any, dpass: Tensor | None, dy: Tensor | None) -> tuple[Tensor | None, ...]:
        if dy is None:
            return dpass, None, None, None
        dx, dw, db = _backward(dy, dpass, *ctx.saved_tensors)
        return dx.view(dy.shape), dw, db, None


def triton_layer_norm(ln: torch.nn.LayerNorm, x: Tensor) -> Tensor:
    """`ln` applied to 16-bit CUDA `x` (see the module docstring); `available(x, ln.weight)` must hold."""
    return _TritonLayerNorm.apply(x, ln.weight, ln.bias, ln.eps)


def triton_add_layer_norm(ln: torch.nn.LayerNorm, x: Tensor, r: Tensor) -> tuple[Tensor, Tensor]:
    """``s = x + r`` and ``ln(s)`` in one pass each way, the bits of the add then `triton_layer_norm`."""
    return _TritonAddLayerNorm.apply(x, r, ln.weight, ln.bias, ln.eps)


def triton_fork_layer_norm(ln: torch.nn.LayerNorm, x: Tensor) -> tuple[Tensor, Tensor]:
    """``x`` and ``ln(x)``, for an x used again: its two gradients are added in the norm's backward pass,
    the bits of autograd's add."""
    return _TritonForkLayerNorm.apply(x, ln.weight, ln.bias, ln.eps)
