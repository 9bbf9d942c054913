"""The model's causal attention, on a named SDPA backend (config: `model.attention`).

Why a named backend: the bitwise oracle compares whole runs, so attention must give the same bits every
run. Flash attention's and cuDNN's backward gave the same bits every run at 256 tokens per sequence but
not at 2,048 (on the H100, also under torch's deterministic flag). A likely reason: dQ adds the key
blocks' parts in the order their thread blocks finish, and at 256 tokens there are at most two parts,
whose sum does not depend on the order. The memory-efficient backend's backward gave the same bits at
every shape measured; it is about 1.2-1.3x slower than flash at 256 tokens.

"auto" leaves the choice to torch up to 256 tokens per sequence (flash, at every shape this project
runs; the call is the one the model always made, with no context to enter) and takes memory-efficient
above. A clean repeat is evidence at the shapes measured, not a promise torch makes.
"""

from __future__ import annotations

from typing import get_args

from torch import Tensor
from torch.nn import functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from qeffect.config import AttentionKind

ATTENTION_KINDS: tuple[str, ...] = get_args(AttentionKind)  # config: model.attention
FLASH_REPEATS_UP_TO = 256  # tokens per sequence where flash attention's backward gave the same bits every run
RESOLVED: tuple[str, ...] = ("torch", "flash", "efficient")  # what `resolve_attention` returns
_BACKENDS = {"flash": SDPBackend.FLASH_ATTENTION, "efficient": SDPBackend.EFFICIENT_ATTENTION}


def resolve_attention(kind: str, seq_len: int) -> str:
    """What `kind` runs at sequences of `seq_len` tokens: "torch" (torch's own choice), "flash" or
    "efficient"."""
    if kind not in ATTENTION_KINDS:
        raise ValueError(f"unknown attention {kind!r}; choose one of: {', '.join(ATTENTION_KINDS)}")
    if kind == "auto":
        return "torch" if seq_len <= FLASH_REPEATS_UP_TO else "efficient"
    return kind


def causal_attention(q: Tensor, k: Tensor, v: Tensor, backend: str) -> Tensor:
    """Causal SDPA of `[b, heads, t, d]` views on `backend` (`resolve_attention`) where the tensors are on
    CUDA; elsewhere, or for "torch", torch's own choice (a CPU has one kernel). Fewer key/value heads than
    query heads: grouped-query attention (torch's `enable_gqa`)."""
    gqa = k.shape[1] != q.shape[1]
    if backend == "torch" or not q.is_cuda:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    with sdpa_kernel([_BACKENDS[backend]]):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
