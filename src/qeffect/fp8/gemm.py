"""The one FP8 GEMM of the reference backend.

Every matrix product of the reference backend (forward `Y`, input gradient `dX`, weight gradient `dW`)
goes through `fp8_mm`, in the native full-backward path and in the split F/dI/dW path alike, with or
without an output tensor. Bitwise equality between the paths then follows from construction: they run
the same function on the same operands; only *when* (and into *which* buffer) differs.

Layout: both operands are row-major contiguous FP8 matrices that share the inner dimension `K`
(`a [M, K]`, `b [N, K]`), and the result is `(a @ b.T) * a_scale_inv * b_scale_inv` of shape `[M, N]`.
That is what cuBLASLt's FP8 kernels want (`b.t()` of a row-major `[N, K]` is the column-major
`[K, N]` second operand), and callers keep transposed copies (`w_q_t`, `x_q_t`, `dy_q_t`) so that
every product has this form.
"""

from __future__ import annotations

import torch
from torch import Tensor

from qeffect.fp8.te_compat import scaled_mm

_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)


def _check(a_q: Tensor, a_scale_inv: Tensor, b_q: Tensor, b_scale_inv: Tensor) -> None:
    if a_q.dim() != 2 or b_q.dim() != 2:
        raise ValueError(f"fp8_mm wants 2-D operands, got {tuple(a_q.shape)} and {tuple(b_q.shape)}")
    if a_q.shape[1] != b_q.shape[1]:
        raise ValueError(
            f"fp8_mm inner dimensions differ: a {tuple(a_q.shape)}, b {tuple(b_q.shape)} (b is [N, K])"
        )
    if a_q.dtype not in _FP8 or b_q.dtype not in _FP8:
        raise ValueError(f"fp8_mm wants FP8 operands, got {a_q.dtype} and {b_q.dtype}")
    if a_q.dtype == torch.float8_e5m2 and b_q.dtype == torch.float8_e5m2:
        raise ValueError("fp8_mm: E5M2 x E5M2 is not supported by the FP8 tensor cores")
    if not (a_q.is_contiguous() and b_q.is_contiguous()):
        raise ValueError("fp8_mm wants row-major contiguous operands")
    if a_scale_inv.numel() != 1 or b_scale_inv.numel() != 1:
        raise ValueError("fp8_mm wants per-tensor scales (one element each)")


def _check_out(out: Tensor, shape: tuple[int, int], out_dtype: torch.dtype, device: torch.device) -> None:
    if tuple(out.shape) != shape or out.dtype != out_dtype or out.device != device:
        raise ValueError(
            f"fp8_mm out= must be {shape} {out_dtype} on {device}, got "
            f"{tuple(out.shape)} {out.dtype} on {out.device}"
        )
    if not out.is_contiguous():
        raise ValueError("fp8_mm out= must be a contiguous (row-major) tensor")
    if device.type == "cuda" and out.data_ptr() % 16:
        # cuBLASLt picks its kernel partly by pointer alignment (PyTorch reports up to 16 bytes);
        # a less aligned destination could select another kernel and change the bits.
        raise ValueError("fp8_mm out= must be 16-byte aligned on CUDA")


def bias_in_epilogue(device: torch.device, out_dtype: torch.dtype) -> bool:
    """Whether `fp8_mm` adds a bias inside the GEMM (cuBLASLt's bias epilogue: the fp32 result plus the
    bias, rounded once, as Transformer Engine's FP8 GEMMs add theirs): on CUDA for 16-bit outputs. Elsewhere
    (the CPU, fp32 outputs) the rounded product, then a separate add."""
    return device.type == "cuda" and out_dtype in (torch.bfloat16, torch.float16)


def fp8_mm(
    a_q: Tensor,
    a_scale_inv: Tensor,
    b_q: Tensor,
    b_scale_inv: Tensor,
    out_dtype: torch.dtype,
    out: Tensor | None = None,
    bias: Tensor | None = None,
) -> Tensor:
    """`(a_q @ b_q.T) * a_scale_inv * b_scale_inv (+ bias)` as `out_dtype`, written into `out` when given.

    CUDA: `torch._scaled_mm` (as `te_compat.scaled_mm`; FP8 tensor cores, fp32 accumulation). CPU: the
    FP8 values are exact in fp32, so the product is an fp32 matmul followed by the same scale
    multiplication and cast.
    With `out=` the bits are those of the call without it: on CUDA the same cuBLASLt call writes the
    destination directly (it must be contiguous and 16-byte aligned); on CPU the same ops are
    evaluated and copied in. `bias` (cast to `out_dtype`) is added in the GEMM's epilogue where
    `bias_in_epilogue` says so, else to the rounded product; not with `out=`.
    """
    _check(a_q, a_scale_inv, b_q, b_scale_inv)
    shape = (a_q.shape[0], b_q.shape[0])
    if out is not None:
        _check_out(out, shape, out_dtype, a_q.device)
    if bias is not None:
        if out is not None:
            raise ValueError("fp8_mm: bias= and out= together are not supported")
        bias = bias.to(out_dtype)
        if bias_in_epilogue(a_q.device, out_dtype):
            return scaled_mm(a_q, b_q.t(), scale_a=a_scale_inv, scale_b=b_scale_inv, bias=bias,
                             out_dtype=out_dtype)
        return fp8_mm(a_q, a_scale_inv, b_q, b_scale_inv, out_dtype) + bias
    if a_q.is_cuda:
        if out is None:
            return scaled_mm(
                a_q, b_q.t(), scale_a=a_scale_inv, scale_b=b_scale_inv, out_dtype=out_dtype
            )
        return scaled_mm(
            a_q, b_q.t(), scale_a=a_scale_inv, scale_b=b_scale_inv, out_dtype=out_dtype, out=out
        )
    prod = torch.mm(a_q.float(), b_q.float().t())
    result = (prod * (a_scale_inv * b_scale_inv)).to(out_dtype)
    if out is None:
        return result
    out.copy_(result)
    return out
