"""The loss on 16-bit CUDA logits: fp32 cross-entropy as Triton passes that read the logits directly.

Why: the model's torch form (`F.cross_entropy(logits.float(), ...)`) copies the [tokens, vocab] logits
to fp32, runs log-softmax (whose fp32 output autograd keeps for the backward), then the NLL; its
backward runs the NLL's and log-softmax's backward kernels in fp32 and copies the gradient back to the
activation dtype. At h4096's 256 tokens x 32,768 vocabulary that is seven kernels per microbatch and
0.7 ms of a captured step on the H200.
Here the forward is one pass over each row (a per-lane online max and sum of exponentials, in fp32) plus one
program for the mean, and the backward one pass that writes the gradient in the logits' dtype. What it keeps
for the backward: the fp32 log-sum-exp per row, not an fp32 copy of the logits.

Bits: deterministic (fixed block order, no atomics). Native eager and every qeffect path share the model
code, so they keep identical bits; the numbers differ from the torch form's by rounding (a different
summation order, Triton's `exp`/`log`). Same semantics as `F.cross_entropy(..., reduction="mean")`:
targets equal to ``ignore_index`` (-100) add nothing and are not counted (all ignored: NaN, as torch);
a target outside [0, V) makes the loss and its row's gradient NaN (torch stops on a device assert).
The device chooses (`available`), so native and qeffect runs always take the same form.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from qeffect.triton_lazy import on_device, triton_kernel

IGNORE_INDEX = -100
BLOCK = 2048  # columns per iteration of a row's pass (h4096's 32,768 vocabulary: 16 iterations)
BACKWARD_BLOCK = 4096  # columns per backward program (one program per row and block)
MEAN_BLOCK = 1024


@triton_kernel
def _kernels(triton, tl):  # noqa: ANN001, ANN202 - builds Triton JIT functions
    @triton.jit
    def forward(x_ptr, t_ptr, lse_ptr, loss_ptr, v, ignore_index, BLOCK: tl.constexpr):
        """Row `pid`: lse = max + log(sum exp(x - max)) by per-lane online sums, loss = lse - x[target]
        (0 where the target is ignored)."""
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        m = tl.full([BLOCK], float("-inf"), tl.float32)
        s = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, v, BLOCK):
            mask = start + cols < v
            x = tl.load(x_ptr + row * v + start + cols, mask=mask, other=float("-inf")).to(tl.float32)
            m_new = tl.maximum(m, x)
            # lanes still at -inf (masked tail) keep s = 0: exp(-inf - -inf) would be NaN
            scale = tl.where(m_new == float("-inf"), 0.0, tl.exp(m - m_new))
            s = s * scale + tl.where(m_new == float("-inf"), 0.0, tl.exp(x - m_new))
            m = m_new
        big = tl.max(m, axis=0)
        total = tl.sum(s * tl.exp(m - big), axis=0)
        lse = big + tl.log(total)
        t = tl.load(t_ptr + row)
        inside = (t >= 0) & (t < v)  # a target outside [0, V) that is not ignored makes the loss NaN
        xt = tl.load(x_ptr + row * v + tl.where(inside, t, 0)).to(tl.float32)
        tl.store(lse_ptr + row, lse)
        tl.store(loss_ptr + row, tl.where(t == ignore_index, 0.0, tl.where(inside, lse - xt, float("nan"))))

    @triton.jit
    def mean(loss_ptr, t_ptr, out_ptr, count_ptr, rows, ignore_index, BLOCK: tl.constexpr):
        """One program: the sum of the row losses in row order, over the count of targets not ignored."""
        offs = tl.arange(0, BLOCK)
        acc = tl.zeros([BLOCK], dtype=tl.float32)
        cnt = tl.zeros([BLOCK], dtype=tl.float32)
        for start in range(0, rows, BLOCK):
            mask = start + offs < rows
            acc += tl.load(loss_ptr + start + offs, mask=mask, other=0.0)
            t = tl.load(t_ptr + start + offs, mask=mask, other=ignore_index)
            cnt += tl.where(t != ignore_index, 1.0, 0.0)
        total = tl.sum(acc, axis=0)
        count = tl.sum(cnt, axis=0)
        tl.store(count_ptr, count)
        tl.store(out_ptr, tl.div_rn(total, count))

    @triton.jit
    def backward(x_ptr, t_ptr, lse_ptr, g_ptr, count_ptr, dx_ptr, v, ignore_index, BLOCK: tl.constexpr):
        """Row `program_id(0)`, columns block `program_id(1)`: (softmax - onehot) * g / count, as
        log-softmax's backward forms it: exp(x - lse) * w - w at the target, w = g / count."""
        row = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < v
        t = tl.load(t_ptr + row)
        w = tl.div_rn(tl.load(g_ptr), tl.load(count_ptr))
        w = tl.where(t == ignore_index, 0.0, tl.where((t >= 0) & (t < v), w, float("nan")))
        x = tl.load(x_ptr + row * v + cols, mask=mask, other=0.0).to(tl.float32)
        p = tl.exp(x - tl.load(lse_ptr + row))
        dx = p * w - tl.where(cols == t, w, 0.0)
        tl.store(dx_ptr + row * v + cols, dx.to(dx_ptr.dtype.element_ty), mask=mask)

    return forward, mean, backward


def available(logits: Tensor, targets: Tensor) -> bool:
    """Whether these kernels take `logits` [..., V]: 16-bit CUDA logits, int64 targets, Triton present."""
    return (logits.is_cuda and logits.dtype in (torch.bfloat16, torch.float16) and targets.dtype == torch.int64
            and logits.shape[:-1] == targets.shape and _kernels() is not None)


class _TritonCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, logits: Tensor, targets: Tensor) -> Tensor:
        v = logits.shape[-1]
        x = logits.reshape(-1, v).contiguous()
        t = targets.reshape(-1).contiguous()
        rows = x.shape[0]
        lse = torch.empty(rows, dtype=torch.float32, device=x.device)
        losses = torch.empty(rows, dtype=torch.float32, device=x.device)
        out = torch.empty((), dtype=torch.float32, device=x.device)
        count = torch.empty((), dtype=torch.float32, device=x.device)
        fwd, mean, _ = _kernels()
        with on_device(x.device):
            fwd[(rows,)](x, t, lse, losses, v, IGNORE_INDEX, BLOCK=BLOCK, num_warps=8)
            mean[(1,)](losses, t, out, count, rows, IGNORE_INDEX, BLOCK=MEAN_BLOCK, num_warps=4)
        ctx.save_for_backward(x, t, lse, count)
        ctx.shape = logits.shape
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        x, t, lse, count = ctx.saved_tensors
        rows, v = x.shape
        dx = torch.empty_like(x)
        g = grad.to(torch.float32).contiguous()
        with on_device(x.device):
            _kernels()[2][(rows, -(-v // BACKWARD_BLOCK))](x, t, lse, g, count, dx, v, IGNORE_INDEX,
                                                          BLOCK=BACKWARD_BLOCK, num_warps=8)
        return dx.view(ctx.shape), None


def triton_cross_entropy(logits: Tensor, targets: Tensor) -> Tensor:
    """Mean fp32 cross-entropy of 16-bit CUDA `logits` [..., V] against `targets` [...] (see the module
    docstring); `available(logits, targets)` must hold."""
    return _TritonCrossEntropy.apply(logits, targets)
