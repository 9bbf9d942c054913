"""Llama-family layer: RMSNorm, rotary position embeddings, grouped-query attention, SwiGLU, no biases.

`model/gpt.py`'s `StageChunk` builds these layers when `model.family = "llama"` (docs/models.md). As in
the GPT, every matrix product is a backend linear (its weight gradient is `dW` work, its FP8 state the
backend's) and everything else is plain PyTorch, so both FP8 backends, the split actions, the captured
paths and the native reference run it unchanged:

    h = x + proj(attention(rope(q), rope(k), v))    q, k, v = qkv(rms_norm(x)), k and v with kv_heads heads
    y = h + down(silu(gate(n)) * up(n))              n = rms_norm(h)

The norms' statistics and the rotation are computed in fp32 (the activations are upcast, the results cast
back), as `gpt._layer_norm` does for the GPT's LayerNorm.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from qeffect.fp8.base import FP8Backend
from qeffect.model.attention import causal_attention

ROPE_BUFFERS: tuple[str, str] = ("rope_cos", "rope_sin")  # a llama chunk's non-persistent rotary tables


def rms_norm(norm: nn.RMSNorm, x: Tensor) -> Tensor:
    """RMSNorm in fp32 with the fp32 master weight, back in the activation dtype."""
    return F.rms_norm(x.float(), norm.normalized_shape, norm.weight, norm.eps).to(x.dtype)


def rope_tables(seq_len: int, head_dim: int, theta: float, device: torch.device | str | None = None
                ) -> tuple[Tensor, Tensor]:
    """cos and sin `[seq_len, head_dim]` fp32 in the rotate-half layout (each frequency twice: TE's and
    Hugging Face's non-interleaved form). Computed in float64 on the CPU, then rounded once, so every
    device gets the same tables."""
    if head_dim % 2:
        raise ValueError(f"rotary positions need an even head dimension, got {head_dim}")
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float64), inv_freq)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos().float().to(device), angles.sin().float().to(device)


def rotate_half(x: Tensor) -> Tensor:
    """`[x1, x2] -> [-x2, x1]` over the last dimension."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """`x * cos + rotate_half(x) * sin` in fp32, back in x's dtype. `cos`/`sin` broadcast against x
    (`[t, 1, d]` for x `[b, t, heads, d]`)."""
    xf = x.float()
    return (xf * cos + rotate_half(xf) * sin).to(x.dtype)


def unapply_rope(g: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """The gradient of `apply_rope` for an output gradient `g`: `g cos - rotate_half(g sin)` in fp32, the
    bits autograd's route gives (rotate_half's adjoint is its negative; `a - b` is `a + (-b)` exactly)."""
    gf = g.float()
    return (gf * cos - rotate_half(gf * sin)).to(g.dtype)


class _RopeSplit(torch.autograd.Function):
    """q, k, v as `[b, heads, t, d]` views from the fused projection `[b, t, (H + 2K) d]`, q and k
    rotated. Why a Function: autograd's route would save the rotary tables for its backward (an offloaded
    action would then copy those constants out and back) and assemble the projection's gradient from
    zero-filled slices; this saves nothing and writes the gradient in one tensor. Same values as the
    composition (tests/test_llama.py)."""

    @staticmethod
    def forward(ctx: Any, qkv: Tensor, heads: int, kv_heads: int, cos: Tensor, sin: Tensor
                ) -> tuple[Tensor, Tensor, Tensor]:
        b, t, width = qkv.shape
        n = heads + 2 * kv_heads
        x = qkv.view(b, t, n, width // n)
        cos, sin = cos[:t, None, :], sin[:t, None, :]
        ctx.tables = (cos, sin)  # constants (module buffers): kept by reference, not saved
        ctx.split = (heads, kv_heads)
        qk = apply_rope(x[:, :, : heads + kv_heads], cos, sin)
        return (qk[:, :, :heads].transpose(1, 2), qk[:, :, heads:].transpose(1, 2),
                x[:, :, heads + kv_heads:].transpose(1, 2))

    @staticmethod
    def backward(ctx: Any, dq: Tensor, dk: Tensor, dv: Tensor) -> tuple[Tensor | None, ...]:
        cos, sin = ctx.tables
        heads, kv_heads = ctx.split
        b, _, t, d = dq.shape
        grad = torch.empty(b, t, heads + 2 * kv_heads, d, dtype=dq.dtype, device=dq.device)
        dqk = torch.cat([dq.transpose(1, 2), dk.transpose(1, 2)], dim=2)
        grad[:, :, : heads + kv_heads] = unapply_rope(dqk, cos, sin)
        grad[:, :, heads + kv_heads:] = dv.transpose(1, 2)
        return grad.view(b, t, -1), None, None, None, None


def rope_split(qkv: Tensor, heads: int, kv_heads: int, cos: Tensor, sin: Tensor
               ) -> tuple[Tensor, Tensor, Tensor]:
    """q `[b, heads, t, d]`, k and v `[b, kv_heads, t, d]` from the fused projection, q and k rotated."""
    return _RopeSplit.apply(qkv, heads, kv_heads, cos, sin)


def attention(q: Tensor, k: Tensor, v: Tensor, backend: str = "torch") -> Tensor:
    """Causal attention on `backend` (`model.attention`); with fewer key/value heads than query heads each
    serves `heads / kv_heads` consecutive query heads (grouped-query attention, torch's `enable_gqa`)."""
    return causal_attention(q, k, v, backend)


def swiglu(gate: Tensor, up: Tensor) -> Tensor:
    """SwiGLU's gating: `silu(gate) * up`."""
    return F.silu(gate) * up


class LlamaBlock(nn.Module):
    """Pre-RMSNorm Llama layer with grouped-query attention and a SwiGLU feed-forward (module doc).

    Parameters: `ln1`, `ln2` (RMSNorm weights) and the backend linears `qkv` (hidden -> (heads +
    2 kv_heads) head_dim), `proj`, `gate`, `up` (hidden -> ffn) and `down` (ffn -> hidden), without biases.
    """

    def __init__(self, hidden: int, ffn: int, heads: int, kv_heads: int, norm_eps: float, backend: FP8Backend,
                 *, attention: str = "torch", device: torch.device | str | None = None) -> None:
        super().__init__()
        if hidden % heads or heads % kv_heads:
            raise ValueError(f"heads ({heads}) must divide hidden ({hidden}), and kv_heads ({kv_heads}) must divide heads")
        self.heads, self.kv_heads, self.attention = heads, kv_heads, attention
        head_dim = hidden // heads
        self.ln1 = nn.RMSNorm(hidden, eps=norm_eps, device=device)
        self.qkv = backend.linear(hidden, (heads + 2 * kv_heads) * head_dim, bias=False, device=device,
                                  dtype=torch.float32)
        self.proj = backend.linear(hidden, hidden, bias=False, device=device, dtype=torch.float32)
        self.ln2 = nn.RMSNorm(hidden, eps=norm_eps, device=device)
        self.gate = backend.linear(hidden, ffn, bias=False, device=device, dtype=torch.float32)
        self.up = backend.linear(hidden, ffn, bias=False, device=device, dtype=torch.float32)
        self.down = backend.linear(ffn, hidden, bias=False, device=device, dtype=torch.float32)

    def forward(self, x: Tensor, is_first_microbatch: bool,
                rope: tuple[Tensor, Tensor] | None = None) -> Tensor:
        if rope is None:
            raise ValueError("LlamaBlock needs the chunk's rotary tables (rope=(cos, sin))")
        b, t, h = x.shape
        q, k, v = rope_split(self.qkv(rms_norm(self.ln1, x), is_first_microbatch), self.heads, self.kv_heads,
                             *rope)
        a = attention(q, k, v, self.attention).transpose(1, 2).reshape(b, t, h)
        x = x + self.proj(a, is_first_microbatch)
        n = rms_norm(self.ln2, x)
        m = swiglu(self.gate(n, is_first_microbatch), self.up(n, is_first_microbatch))
        return x + self.down(m, is_first_microbatch)
