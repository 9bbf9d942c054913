"""LayerNorm for 16-bit CUDA activations with fp32 statistics and fp32 parameters, as two Triton passes.

Why: the model's torch form (`gpt._layer_norm`) upcasts the input, runs an fp32 LayerNorm and downcasts
the output, and its backward does the same with the gradients: four full-size copies around each
LayerNorm's forward and backward (288 kernels of a 36 ms h4096 step). torch refuses a 16-bit input with
fp32 weights on CUDA, and Transformer Engine has no kernel for that combination ("Unavailable kernel for
this normalization config"). These kernels read and write the activation dtype directly and keep every
statistic, parameter and parameter gradient in fp32.

Bits: deterministic. Forward: one program per row, mean and variance by fp32 tree sums over the row.
Backward: one program per group of rows writes fp32 partial weight and bias gradients, summed over the
groups by torch in a fixed order; the input gradient is per row. Native eager and every qeffect path
share the model code, so they keep identical bits; the numbers differ from the torch form's by the
rounding of a different summation order.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from qeffect.triton_lazy import triton_kernel

ROWS_PER_PROGRAM = 4  # backward: rows per partial weight/bias gradient (fixed: the bits depend on it)
MAX_HIDDEN = 16384


@triton_kernel
def _kernels(triton, tl):  # noqa: ANN001, ANN202 - builds Triton JIT functions
    @triton.jit
    def forward(x_ptr, w_ptr, b_ptr, y_ptr, mean_ptr, rstd_ptr, n, eps, BLOCK: tl.constexpr):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < n
        x = tl.load(x_ptr + row * n + cols, mask=mask, other=0.0).to(tl.float32)
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
    def backward(dy_ptr, x_ptr, w_ptr, mean_ptr, rstd_ptr, dx_ptr, part_ptr, rows, n,
                 ROWS: tl.constexpr, BLOCK: tl.constexpr):
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
                dx = (wdy - (xhat * c1 + c2)) * rstd
                tl.store(dx_ptr + row * n + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)
                dw += dy * xhat
                db += dy
        tl.store(part_ptr + pid * 2 * n + cols, dw, mask=mask)  # part[pid, 0] = dw, part[pid, 1] = db
        tl.store(part_ptr + pid * 2 * n + n + cols, db, mask=mask)

    return forward, backward


def available(x: Tensor, weight: Tensor) -> bool:
    """Whether `x` can take these kernels: 16-bit CUDA activations, fp32 parameters, Triton present."""
    return (x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and weight.dtype == torch.float32
            and x.shape[-1] <= MAX_HIDDEN and _kernels() is not None)


def _block(n: int) -> int:
    return max(16, 1 << (n - 1).bit_length())


def _warps(block: int) -> int:
    return min(16, max(4, block // 512))


class _TritonLayerNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: Tensor, weight: Tensor, bias: Tensor, eps: float) -> Tensor:
        n = x.shape[-1]
        x2 = x.reshape(-1, n).contiguous()
        rows = x2.shape[0]
        y = torch.empty_like(x2)
        mean = torch.empty(rows, dtype=torch.float32, device=x.device)
        rstd = torch.empty(rows, dtype=torch.float32, device=x.device)
        block = _block(n)
        _kernels()[0][(rows,)](x2, weight.contiguous(), bias.contiguous(), y, mean, rstd, n, eps, BLOCK=block,
                               num_warps=_warps(block))
        ctx.save_for_backward(x2, weight, mean, rstd)
        return y.view(x.shape)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, Tensor, Tensor, None]:
        x2, weight, mean, rstd = ctx.saved_tensors
        rows, n = x2.shape
        dy = grad.reshape(rows, n).contiguous()
        dx = torch.empty_like(x2)
        programs = -(-rows // ROWS_PER_PROGRAM)
        part = torch.empty(programs, 2, n, dtype=torch.float32, device=x2.device)
        block = _block(n)
        _kernels()[1][(programs,)](dy, x2, weight.contiguous(), mean, rstd, dx, part, rows, n,
                                   ROWS=ROWS_PER_PROGRAM, BLOCK=block, num_warps=_warps(block))
        dw, db = part.sum(0)  # one fixed-order reduction over the groups for both
        return dx.view(grad.shape), dw, db, None


def triton_layer_norm(ln: torch.nn.LayerNorm, x: Tensor) -> Tensor:
    """`ln` applied to 16-bit CUDA `x` (see the module docstring); `available(x, ln.weight)` must hold."""
    return _TritonLayerNorm.apply(x, ln.weight, ln.bias, ln.eps)
