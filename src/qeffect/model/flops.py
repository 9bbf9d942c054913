"""Matrix FLOPs of one optimizer step of the GPT pipeline: the count both `qeffect profile` and the
training loop's MFU use (pure arithmetic on the config; nothing runs).

Counting: every backend linear (qkv, proj, fc1, fc2 per GPT layer; qkv, proj, gate, up, down per Llama layer,
whose qkv is narrower with grouped-query attention; the head once) costs 2 * N * in * out FLOPs
forward and twice that backward (dI's dgrad plus dW's wgrad), for N = microbatch_size * seq_len tokens per
microbatch, over all microbatches of one pipeline replica. Attention score products, norms and the
optimizer are not matrix FLOPs of this count.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pydantic import BaseModel

if TYPE_CHECKING:
    from qeffect.config import RunConfig

HEAD = "head"


class LinearFlops(BaseModel):
    name: str
    in_features: int
    out_features: int
    instances: int  # how many such linears the model has (layers; 1 for the head)
    forward_flops: int  # per step, all instances and microbatches
    backward_flops: int  # dgrad + wgrad, per step


class MatrixFlops(BaseModel):
    tokens_per_microbatch: int
    microbatches: int
    linears: list[LinearFlops]
    total: int
    layers_only: int  # without the head: what a stack of transformer layers alone (the TE anchor) does


def linear_shapes(cfg: RunConfig) -> list[tuple[str, int, int, int]]:
    """(name, in, out, instances) of every backend linear kind of the model (all stages), as the chunks of
    `model/gpt.py` (GPT) or `model/llama.py` (Llama) build them."""
    mc = cfg.model
    h, f = mc.hidden, mc.ffn
    layers = mc.layers_per_chunk * cfg.pipeline.num_stages
    if mc.family == "llama":
        qkv = (mc.heads + 2 * mc.num_kv_heads) * (h // mc.heads)
        return [("qkv", h, qkv, layers), ("proj", h, h, layers), ("gate", h, f, layers), ("up", h, f, layers),
                ("down", f, h, layers), (HEAD, h, mc.vocab_size, 1)]
    return [("qkv", h, 3 * h, layers), ("proj", h, h, layers), ("fc1", h, f, layers), ("fc2", f, h, layers),
            (HEAD, h, mc.vocab_size, 1)]


def count_matrix_flops(cfg: RunConfig, microbatches: int | None = None) -> MatrixFlops:
    """Matrix FLOPs of one step: 2*N*in*out forward and 4*N*in*out backward per linear and microbatch."""
    mc = cfg.model
    m = microbatches or cfg.pipeline.microbatches
    n = mc.microbatch_size * mc.seq_len
    rows = []
    for name, fin, fout, count in linear_shapes(cfg):
        fwd = 2 * n * fin * fout * count * m
        rows.append(LinearFlops(name=name, in_features=fin, out_features=fout, instances=count,
                                forward_flops=fwd, backward_flops=2 * fwd))
    total = sum(r.forward_flops + r.backward_flops for r in rows)
    head = sum(r.forward_flops + r.backward_flops for r in rows if r.name == HEAD)
    return MatrixFlops(tokens_per_microbatch=n, microbatches=m, linears=rows, total=total,
                       layers_only=total - head)
