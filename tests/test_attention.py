"""The model's attention backend (`model.attention`): resolution, threading into the layers, and (GPU)
that the backend "auto" picks gives the same bits every run."""

from __future__ import annotations

import pytest
import torch

from qeffect.config import load_config
from qeffect.errors import UserError
from qeffect.fp8 import DelayedScalingRecipe, ReferenceBackend
from qeffect.model import GPTShape
from qeffect.model.attention import FLASH_REPEATS_UP_TO, causal_attention, resolve_attention
from qeffect.model.gpt import build_chunks

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize(("kind", "seq_len", "want"), [
    ("auto", FLASH_REPEATS_UP_TO, "torch"), ("auto", FLASH_REPEATS_UP_TO + 1, "efficient"),
    ("auto", 2048, "efficient"), ("flash", 2048, "flash"), ("efficient", 32, "efficient")])
def test_auto_leaves_torch_its_choice_only_where_flash_repeats(kind: str, seq_len: int, want: str) -> None:
    assert resolve_attention(kind, seq_len) == want


def test_an_unknown_backend_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown attention 'cudnn'"):
        resolve_attention("cudnn", 32)
    with pytest.raises(UserError, match="model.attention: Input should be 'auto', 'flash' or 'efficient'"):
        load_config().with_overrides(**{"model.attention": "cudnn"})


@pytest.mark.parametrize("family", ["gpt", "llama"])
def test_every_layer_gets_the_resolved_backend(family: str) -> None:
    cfg = load_config().with_overrides(**{"model.family": family, "model.seq_len": 512})
    shape = GPTShape.from_config(cfg)
    assert shape.attention == "efficient"
    backend = ReferenceBackend(DelayedScalingRecipe(margin=0, amax_history_len=4, amax_compute_algo="max"))
    chunk = build_chunks(shape, backend, seed=0, stages=[0])[0]
    assert [b.attention for b in chunk.blocks] == ["efficient"] * shape.layers_per_chunk


def test_on_a_cpu_the_backend_does_not_change_the_bits() -> None:
    q, k, v = (torch.randn(1, 2, 8, 4) for _ in range(3))
    want = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
    for backend in ("torch", "flash", "efficient"):
        assert torch.equal(causal_attention(q, k, v, backend), want)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize(("seq_len", "batch", "heads"),
                         [(256, 1, 32), (2048, 2, 32), (2048, 2, 16), (2048, 1, 16), (4096, 1, 32)])
def test_the_auto_backend_repeats_its_bits(seq_len: int, batch: int, heads: int) -> None:
    """Forward and backward four times on the same inputs: outputs and all three input gradients equal.
    (SDPA's own memory-efficient backward failed this at 2,048 tokens, batch 2, 32 heads.)"""
    backend = resolve_attention("auto", seq_len)
    torch.manual_seed(0)
    q, k, v = (torch.randn(batch, heads, seq_len, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    go = torch.randn(batch, heads, seq_len, 128, device="cuda", dtype=torch.bfloat16)
    runs = []
    for _ in range(4):
        q.grad = k.grad = v.grad = None
        out = causal_attention(q, k, v, backend)
        out.backward(go)
        runs.append([t.detach().clone() for t in (out, q.grad, k.grad, v.grad)])
    for run in runs[1:]:
        for a, b in zip(runs[0], run, strict=True):
            torch.testing.assert_close(b, a, rtol=0, atol=0)


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("kv_heads", [16, 4])
def test_efficient_attention_computes_what_sdpa_computes(kv_heads: int) -> None:
    """The unsplit backward is SDPA's memory-efficient attention: the same output bits, and gradients
    within bf16 rounding of SDPA's own (their dQ adds the same parts in another order)."""
    torch.manual_seed(0)
    q = torch.randn(2, 16, 1024, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k, v = (torch.randn(2, kv_heads, 1024, 128, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            for _ in range(2))
    go = torch.randn(2, 16, 1024, 128, device="cuda", dtype=torch.bfloat16)
    out = causal_attention(q, k, v, "efficient")
    grads = torch.autograd.grad(out, (q, k, v), go)
    rep = 16 // kv_heads
    with torch.nn.attention.sdpa_kernel([torch.nn.attention.SDPBackend.EFFICIENT_ATTENTION]):
        want = torch.nn.functional.scaled_dot_product_attention(
            q, k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1), is_causal=True)
    want_grads = torch.autograd.grad(want, (q, k, v), go)
    torch.testing.assert_close(out, want, rtol=0, atol=0)
    for got, ref in zip(grads, want_grads, strict=True):
        torch.testing.assert_close(got, ref, rtol=2e-2, atol=2e-2)
