"""The model's causal attention, on a named SDPA backend (config: `model.attention`).

Why a named backend: the bitwise oracle compares whole runs, so attention must give the same bits every
run. Flash attention's and cuDNN's backward gave the same bits every run at 256 tokens per sequence but
not at 2,048 (on the H100, also under torch's deterministic flag). A likely reason: dQ adds the key
blocks' parts in the order their thread blocks finish, and at 256 tokens there are at most two parts,
whose sum does not depend on the order.

The memory-efficient backend has the same hazard unless told otherwise: SDPA's backward lets a heuristic
split the keys over several thread blocks whenever batch x heads leaves SMs idle, and those blocks add
into dQ in the order they finish (on the H100: 36 of 16.8 M gradient elements differed between two runs
at 2,048 tokens, batch 2, 32 heads). "efficient" here is SDPA's forward with a backward that keeps one
thread block per key range (`num_splits_key=1`, what torch itself does under its deterministic flag), so
dQ's parts are added in one fixed order. It is slower than flash (fewer thread blocks in the backward).

"auto" leaves the choice to torch up to 256 tokens per sequence (flash, at every shape this project
runs; the call is the one the model always made, with no context to enter) and takes memory-efficient
above. A clean repeat is evidence at the shapes measured, not a promise torch makes.
"""

from __future__ import annotations

from typing import get_args

import torch
from torch import Tensor
from torch.nn import functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from qeffect.config import AttentionKind
from qeffect.fp8.te_compat import efficient_attention_backward, sdpa_efficient_forward

ATTENTION_KINDS: tuple[str, ...] = get_args(AttentionKind)  # config: model.attention
FLASH_REPEATS_UP_TO = 256  # tokens per sequence where flash attention's backward gave the same bits every run
RESOLVED: tuple[str, ...] = ("torch", "flash", "efficient")  # what `resolve_attention` returns
CAUSAL_FROM_TOP_LEFT = 1  # the memory-efficient kernel's `custom_mask_type` for SDPA's `is_causal=True`


def resolve_attention(kind: str, seq_len: int) -> str:
    """What `kind` runs at sequences of `seq_len` tokens: "torch" (torch's own choice), "flash" or
    "efficient"."""
    if kind not in ATTENTION_KINDS:
        raise ValueError(f"unknown attention {kind!r}; choose one of: {', '.join(ATTENTION_KINDS)}")
    if kind == "auto":
        return "torch" if seq_len <= FLASH_REPEATS_UP_TO else "efficient"
    return kind


class _EfficientAttention(torch.autograd.Function):
    """Causal memory-efficient attention of `[b, heads, t, d]` views whose backward does not split the keys
    (see the module docstring): the same bits every run."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor) -> Tensor:
        out, lse, seed, offset = sdpa_efficient_forward(q, k, v, None, True, 0.0, True)
        ctx.save_for_backward(q, k, v, out, lse, seed, offset)
        return out

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        q, k, v, out, lse, seed, offset = ctx.saved_tensors
        if grad.stride(-1) != 1:  # the kernel reads rows of the head dimension
            grad = grad.contiguous()
        # the kernel's layout is [b, t, heads, d]: the same memory as SDPA's views, transposed
        dq, dk, dv, _ = efficient_attention_backward(
            grad.transpose(1, 2), q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), None,
            out.transpose(1, 2), None, None, q.shape[2], k.shape[2], lse, 0.0, seed, offset,
            CAUSAL_FROM_TOP_LEFT, False, num_splits_key=1)
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)


def causal_attention(q: Tensor, k: Tensor, v: Tensor, backend: str) -> Tensor:
    """Causal SDPA of `[b, heads, t, d]` views on `backend` (`resolve_attention`) where the tensors are on
    CUDA; elsewhere, or for "torch", torch's own choice (a CPU has one kernel). Fewer key/value heads than
    query heads: grouped-query attention (torch's `enable_gqa`; on "efficient", each key/value head repeated
    for its query heads, so that autograd sums their gradients in a fixed order)."""
    gqa = k.shape[1] != q.shape[1]
    if backend == "torch" or not q.is_cuda:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    if backend == "efficient":
        if gqa:
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        return _EfficientAttention.apply(q, k, v)
    with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
