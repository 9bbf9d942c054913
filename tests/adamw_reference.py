"""An fp32 reference of `runtime.adamw_math._adamw_step` in plain torch, in the kernel's documented order.

The kernel (`runtime.adamw`'s docstring, torch's fused CUDA AdamW): decoupled weight decay first
(``p - (lr * wd) * p``), ``m = fma(b1, m, fma(-b1, g, g))``, ``v = fma(b2, v, fma(-b2, g*g, g*g))``,
``step_size = lr / bc1``, ``denom = sqrt(v) / bc2_sqrt + eps``, ``p - (step_size * m) / denom``: fp32
throughout, IEEE-rounded division and square root, each fma rounded once. The staged fold before it adds
the bf16 slots in fp32, in slot order.

Every operation is computed in fp64 and rounded once to fp32. For +, -, *, / and the square root that
is the correctly rounded fp32 result (fp64's 53 bits are at least 2 * 24 + 2: Figueroa, "When is double
rounding innocuous?", 1995), whatever the CPU's own fp32 kernels do (torch's vectorized fp32 `sqrt` on the
CPU is not correctly rounded: it differs from IEEE in the last bit for some inputs). torch has no
elementwise fused multiply-add, so `fma32` computes one exactly: the fp32 product is exact in fp64
(24 + 24 bits < 53), the sum with its rounding error comes from TwoSum, and the fp64 result is rounded to
odd (the neighbour with an odd last bit whenever the sum was inexact) before the one rounding to fp32.
Rounding to odd at 53 bits then to nearest at 24 is a correct rounding (Boldo and Melquiond, "Emulation of
FMA and correctly rounded sums: proved algorithms using rounding to odd", 2008), where plain fp64 and then
fp32 would round twice.

Triton's interpreter computes `tl.fma` with a single-rounding fp32 fma and `div_rn` / `sqrt_rn` with
numpy's IEEE fp32 division and square root, so on the CPU the kernel's bits equal these
(`tests/test_adamw.py`), with one difference the reference models (``interpreted=True``): the interpreter
hands float arguments to the kernel as Python floats, so the decay's ``lr * weight_decay`` (two arguments)
is Python's double product, rounded to fp32 only where it meets ``p``; compiled, the arguments are fp32 and
so is their product (they differ for lr 3e-4, wd 0.1, and then in the last bit of a rare parameter). On the
GPU torch's fused kernel equals the compiled form without weight decay (``interpreted=False``, the GPU
test); the GPU's rounding of the decay line is not modelled.
"""

from __future__ import annotations

import torch


def fma32(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """``a * b + c`` in fp32 with one rounding (broadcasting fp32 tensors; finite values)."""
    device = next((t.device for t in (a, b, c) if t.device.type != "cpu"), a.device)  # scalars live on the CPU
    a64, b64, c64 = (t.to(device=device, dtype=torch.float64) for t in torch.broadcast_tensors(a, b, c))
    prod = a64 * b64  # exact
    s = prod + c64
    bb = s - prod  # TwoSum: s + err == prod + c64 exactly
    err = (prod - (s - bb)) + (c64 - bb)
    even = (s.view(torch.int64) & 1) == 0
    toward = torch.nextafter(s, torch.where(err > 0, torch.inf, -torch.inf).to(torch.float64))
    odd = torch.where((err != 0) & even, toward, s)  # round to odd: the inexact sum's odd neighbour
    return odd.to(torch.float32)


def _f32(x: float) -> torch.Tensor:
    return torch.tensor(x, dtype=torch.float32)  # a Triton float argument is an fp32 scalar


def folded_gradient(g: torch.Tensor, slots: torch.Tensor, count: int, init: bool) -> torch.Tensor:
    """The fold the pass does before the update: slots ``0..count-1`` (rows of `slots`, any dtype) added in
    fp32 in slot order, onto slot 0 (`init`) or onto `g`."""
    n = g.numel()
    if not count:
        return g
    acc = slots[0, :n].to(torch.float32) if init else g
    for j in range(1 if init else 0, count):
        acc = add(acc, slots[j, :n].to(torch.float32))
    return acc


def _rn(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float32)


def _d(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.float64)


def add(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return _rn(_d(a) + _d(b))


def sub(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return _rn(_d(a) - _d(b))


def mul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return _rn(_d(a) * _d(b))


def div(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return _rn(_d(a) / _d(b))


def sqrt(a: torch.Tensor) -> torch.Tensor:
    return _rn(torch.sqrt(_d(a)))


def adamw_step(p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor, *, lr: float, beta1: float,
               beta2: float, weight_decay: float, eps: float, bc1: torch.Tensor,
               bc2_sqrt: torch.Tensor, interpreted: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(p, m, v) after one update, as new tensors (`adamw_math._adamw_step`'s operations, in its order).
    `interpreted`: the kernel under Triton's interpreter (``lr * weight_decay`` in Python's double)."""
    lr_, b1, b2, wd, eps_ = (_f32(x) for x in (lr, beta1, beta2, weight_decay, eps))
    if weight_decay != 0:  # DECAY: the kernel skips the line at wd == 0
        decay = _f32(lr * weight_decay) if interpreted else mul(lr_, wd)
        p = sub(p, mul(decay, p))
    m = fma32(b1, m, fma32(-b1, g, g))
    gg = mul(g, g)
    v = fma32(b2, v, fma32(-b2, gg, gg))
    step_size = div(lr_, bc1)
    denom = add(div(sqrt(v), bc2_sqrt), eps_)
    p = sub(p, div(mul(step_size, m), denom))
    return p, m, v
