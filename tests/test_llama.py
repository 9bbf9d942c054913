"""The Llama family on the CPU: its pieces against plain PyTorch formulas, its configuration, its chunks.

Bitwise (`torch.equal`) where the operations and their order are the same as the formula's; where the
formula computes the same function another way (silu as x * sigmoid(x), attention as an explicit
softmax, rotation as a complex product), a tolerance of a few fp32 rounding steps, stated with its reason.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from qeffect.config import load_config
from qeffect.errors import UserError
from qeffect.fp8 import DelayedScalingRecipe, ReferenceBackend
from qeffect.model import GPTShape, LlamaBlock, build_chunks
from qeffect.model.flops import count_matrix_flops, linear_shapes
from qeffect.model.llama import (
    ROPE_BUFFERS,
    apply_rope,
    attention,
    rms_norm,
    rope_split,
    rope_tables,
    rotate_half,
    swiglu,
)

ROOT = Path(__file__).resolve().parents[1]
LLAMA_TINY = ROOT / "examples/configs/llama-tiny.toml"
FP32_ULPS = dict(rtol=4e-6, atol=1e-6)  # a few fp32 roundings: the same function, another op order


def _gen(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ------------------------------------------------------------------------------------------ RMSNorm
def test_rms_norm_is_the_formula_bitwise() -> None:
    g = _gen()
    x = torch.randn(2, 8, 64, generator=g)
    norm = torch.nn.RMSNorm(64, eps=1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(64, generator=g))
    want = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * norm.weight
    assert torch.equal(rms_norm(norm, x), want)


def test_rms_norm_of_bf16_activations_is_fp32_then_cast_and_its_gradients_match() -> None:
    g = _gen(1)
    x = torch.randn(4, 64, generator=g).to(torch.bfloat16).requires_grad_()
    norm = torch.nn.RMSNorm(64, eps=1e-6)
    y = rms_norm(norm, x)
    assert y.dtype == torch.bfloat16
    xr = x.detach().float().requires_grad_()
    w = norm.weight.detach().clone().requires_grad_()
    want = (xr * torch.rsqrt(xr.pow(2).mean(-1, keepdim=True) + 1e-6) * w).to(torch.bfloat16)
    assert torch.equal(y, want)
    dy = torch.randn(4, 64, generator=g).to(torch.bfloat16)
    y.backward(dy)
    want.backward(dy)
    # F.rms_norm's backward is autograd's over the same composite: same ops, same order
    assert torch.equal(x.grad, xr.grad.to(torch.bfloat16))
    assert torch.equal(norm.weight.grad, w.grad)


# ------------------------------------------------------------------------------------------- SwiGLU
def test_swiglu_against_silu_formula() -> None:
    g = _gen(2)
    a, b = (torch.randn(16, 32, generator=g, requires_grad=True) for _ in range(2))
    y = swiglu(a, b)
    assert torch.equal(y, F.silu(a) * b)  # the same ops
    # x * sigmoid(x) is silu computed another way (torch's kernel: x / (1 + exp(-x))): rounding only
    a2, b2 = (t.detach().clone().requires_grad_() for t in (a, b))
    want = a2 * torch.sigmoid(a2) * b2
    torch.testing.assert_close(y, want, **FP32_ULPS)
    dy = torch.randn(16, 32, generator=g)
    y.backward(dy)
    want.backward(dy)
    torch.testing.assert_close(a.grad, a2.grad, **FP32_ULPS)
    torch.testing.assert_close(b.grad, b2.grad, **FP32_ULPS)


# ------------------------------------------------------------------------------------------ rotary
def test_rope_tables_are_the_frequencies_rounded_once() -> None:
    cos, sin = rope_tables(16, 8, 10000.0)
    assert cos.shape == sin.shape == (16, 8) and cos.dtype == torch.float32
    inv = 1.0 / 10000.0 ** (torch.arange(0, 8, 2, dtype=torch.float64) / 8)
    ang = torch.arange(16, dtype=torch.float64)[:, None] * inv[None, :]
    assert torch.equal(cos, torch.cat([ang, ang], -1).cos().float())
    assert torch.equal(sin, torch.cat([ang, ang], -1).sin().float())
    assert torch.equal(cos[0], torch.ones(8)) and torch.equal(sin[0], torch.zeros(8))
    with pytest.raises(ValueError, match="even head dimension"):
        rope_tables(4, 7, 10000.0)


def test_apply_rope_matches_the_complex_rotation() -> None:
    """torchtitan's form: pairs (x_i, x_{i+d/2}) as complex numbers times e^{i theta}. A complex product
    rounds in another order (ac - bd with one rounding per op, in C), so a tolerance."""
    g = _gen(3)
    t, d = 16, 8
    x = torch.randn(2, t, 3, d, generator=g)
    cos, sin = rope_tables(t, d, 500.0)
    y = apply_rope(x, cos[:, None], sin[:, None])
    z = torch.complex(x[..., : d // 2], x[..., d // 2:])
    rot = torch.polar(torch.ones(t, d // 2), torch.atan2(sin[:, : d // 2], cos[:, : d // 2]))[:, None]
    want = torch.cat([(z * rot).real, (z * rot).imag], -1)
    torch.testing.assert_close(y, want, **FP32_ULPS)
    assert torch.equal(apply_rope(x, cos[:, None], sin[:, None]),
                       x * cos[:, None] + rotate_half(x) * sin[:, None])  # the same ops: bitwise


def test_rope_scores_depend_only_on_the_offset() -> None:
    """The point of rotary positions: <rope(q, i), rope(k, j)> depends on i - j only (tolerance: the
    tables round the angles differently at different positions)."""
    g = _gen(4)
    d, t = 16, 12
    q, k = torch.randn(d, generator=g), torch.randn(d, generator=g)
    cos, sin = rope_tables(t, d, 10000.0)
    rq = apply_rope(q.expand(t, d), cos, sin)
    rk = apply_rope(k.expand(t, d), cos, sin)
    s = rq @ rk.T
    for off in range(-3, 4):
        diag = torch.diagonal(s, off)
        torch.testing.assert_close(diag, diag[:1].expand_as(diag), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_split_is_the_autograd_composition_bitwise(dtype: torch.dtype) -> None:
    """The fused projection split into heads and rotated, forward and backward, against the plain
    composition (views, apply_rope, autograd's backward): the same values, bit for bit."""
    g = _gen(5)
    b, t, heads, kv, d = 2, 6, 4, 2, 8
    qkv = torch.randn(b, t, (heads + 2 * kv) * d, generator=g).to(dtype).requires_grad_()
    cos, sin = rope_tables(t + 3, d, 10000.0)  # longer tables: the split takes the first t rows
    q, k, v = rope_split(qkv, heads, kv, cos, sin)
    assert q.shape == (b, heads, t, d) and k.shape == v.shape == (b, kv, t, d)

    ref = qkv.detach().clone().requires_grad_()
    x = ref.view(b, t, heads + 2 * kv, d)
    c, s = cos[:t, None], sin[:t, None]
    q2 = apply_rope(x[:, :, :heads], c, s).transpose(1, 2)
    k2 = apply_rope(x[:, :, heads:heads + kv], c, s).transpose(1, 2)
    v2 = x[:, :, heads + kv:].transpose(1, 2)
    for got, want in ((q, q2), (k, k2), (v, v2)):
        assert torch.equal(got, want)
    grads = [torch.randn(o.shape, generator=g).to(dtype) for o in (q, k, v)]
    torch.autograd.backward([q, k, v], grads)
    torch.autograd.backward([q2, k2, v2], grads)
    assert torch.equal(qkv.grad, ref.grad)


def test_rope_split_saves_no_tensor_for_backward() -> None:
    """The rotary tables are module constants: an offloaded action must not find them among the
    tensors autograd saves (the offload manager would copy them out and back every step)."""
    saved: list[torch.Tensor] = []
    qkv = torch.randn(1, 4, 4 * 8, requires_grad=True)
    cos, sin = rope_tables(4, 8, 10000.0)
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        q, k, v = rope_split(qkv, 2, 1, cos, sin)
    assert not any(t.data_ptr() in (cos.data_ptr(), sin.data_ptr()) for t in saved)
    assert saved == []


# --------------------------------------------------------------------------------------------- GQA
def test_grouped_query_attention_is_repeated_kv_attention_bitwise() -> None:
    """Query head i reads key/value head i // (heads / kv_heads): `enable_gqa` is the same computation as
    repeating each key/value head, forward and backward."""
    g = _gen(6)
    q = torch.randn(2, 4, 8, 16, generator=g, requires_grad=True)
    k, v = (torch.randn(2, 2, 8, 16, generator=g, requires_grad=True) for _ in range(2))
    y = attention(q, k, v)
    q2, k2, v2 = (t.detach().clone().requires_grad_() for t in (q, k, v))
    want = F.scaled_dot_product_attention(q2, k2.repeat_interleave(2, 1), v2.repeat_interleave(2, 1),
                                          is_causal=True)
    assert torch.equal(y, want)
    dy = torch.randn(y.shape, generator=g)
    y.backward(dy)
    want.backward(dy)
    for a, b in ((q, q2), (k, k2), (v, v2)):
        assert torch.equal(a.grad, b.grad)


def test_grouped_query_attention_against_explicit_softmax() -> None:
    """softmax(q k^T / sqrt(d) + causal mask) v written out: SDPA scales q and k before the product and
    fuses the softmax, so the sums round differently: a tolerance."""
    g = _gen(7)
    q = torch.randn(1, 6, 5, 8, generator=g)
    k, v = torch.randn(1, 3, 5, 8, generator=g), torch.randn(1, 3, 5, 8, generator=g)
    kr, vr = k.repeat_interleave(2, 1), v.repeat_interleave(2, 1)
    s = (q @ kr.transpose(-1, -2)) / 8**0.5
    s = s.masked_fill(torch.ones(5, 5, dtype=torch.bool).triu(1), float("-inf"))
    torch.testing.assert_close(attention(q, k, v), torch.softmax(s, -1) @ vr, **FP32_ULPS)
    assert torch.equal(attention(q, kr, vr), F.scaled_dot_product_attention(q, kr, vr, is_causal=True))


# ------------------------------------------------------------------------------------------- layer
def _backend() -> ReferenceBackend:
    return ReferenceBackend(DelayedScalingRecipe(margin=0, amax_history_len=4, amax_compute_algo="max"))


def test_llama_block_has_no_biases_and_a_narrow_gqa_projection() -> None:
    block = LlamaBlock(64, 96, heads=8, kv_heads=2, norm_eps=1e-6, backend=_backend())
    names = {n for n, _ in block.named_parameters()}
    assert names == {"ln1.weight", "ln2.weight", "qkv.weight", "proj.weight", "gate.weight", "up.weight",
                     "down.weight"}
    assert tuple(block.qkv.weight.shape) == ((8 + 2 * 2) * 8, 64)
    assert tuple(block.down.weight.shape) == (64, 96) and block.ln1.eps == 1e-6
    with pytest.raises(ValueError, match="rotary tables"):
        block(torch.zeros(1, 4, 64), True)


def test_llama_block_forward_is_the_formula_bitwise() -> None:
    """One layer's forward against its definition written with the same modules and functions (a copy of
    the block taken before, since every FP8 forward moves its module's scaling state on)."""
    torch.manual_seed(0)
    block = LlamaBlock(32, 48, heads=4, kv_heads=2, norm_eps=1e-5, backend=_backend())
    with torch.no_grad():
        for p in block.parameters():
            p.normal_(0.0, 0.2)
    ref = copy.deepcopy(block)
    x = torch.randn(2, 6, 32)
    cos, sin = rope_tables(6, 8, 10000.0)
    y = block(x, True, rope=(cos, sin))
    n1 = F.rms_norm(x, (32,), ref.ln1.weight, 1e-5)
    q, k, v = rope_split(ref.qkv(n1, True), 4, 2, cos, sin)
    a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    a = a.transpose(1, 2).reshape(2, 6, 32)
    h = x + ref.proj(a, True)
    n2 = F.rms_norm(h, (32,), ref.ln2.weight, 1e-5)
    want = h + ref.down(F.silu(ref.gate(n2, True)) * ref.up(n2, True), True)
    assert torch.equal(y, want)


# ------------------------------------------------------------------------------------------ config
def test_default_family_is_gpt_and_the_llama_config_loads() -> None:
    assert load_config().model.family == "gpt" and load_config().model.kv_heads == 0
    cfg = load_config(LLAMA_TINY)
    assert cfg.model.family == "llama" and cfg.model.num_kv_heads == 2
    for name, kv in (("llama-h2048", 4), ("llama-h4096", 8)):
        big = load_config(ROOT / f"examples/configs/{name}.toml")
        gpt = load_config(ROOT / f"examples/configs/{name.removeprefix('llama-')}.toml")
        assert big.model.family == "llama" and big.model.kv_heads == kv
        assert big.pipeline == gpt.pipeline and big.fp8 == gpt.fp8 and big.train == gpt.train


@pytest.mark.parametrize(("sets", "message"), [
    ({"model.family": "llama", "model.kv_heads": 3}, "kv_heads (3) must divide heads (4)"),
    ({"model.family": "llama", "model.hidden": 60, "model.heads": 4, "model.kv_heads": 0},
     "even head dimension; hidden / heads = 15"),
    ({"model.kv_heads": 2}, "kv_heads (2) is a llama field"),
    ({"model.family": "mamba"}, "model.family"),
    ({"model.family": "llama", "model.norm_eps": 0.0}, "model.norm_eps"),
    ({"model.family": "llama", "model.rope_theta": 1.0}, "model.rope_theta"),
])
def test_bad_llama_fields_are_one_line_errors(sets: dict, message: str) -> None:
    with pytest.raises(UserError) as err:
        load_config().with_overrides(**sets)
    text = str(err.value)
    assert message in text and "\n" not in text


def test_llama_fields_change_the_bits() -> None:
    from qeffect.config import bit_changing_fields

    llama = {"model.family", "model.kv_heads", "model.norm_eps", "model.rope_theta"}
    assert llama <= set(bit_changing_fields())


# ------------------------------------------------------------------------------------------ chunks
def _llama_shape(**kw) -> GPTShape:
    base = dict(vocab_size=96, hidden=32, ffn=48, heads=4, layers_per_chunk=1, seq_len=8, microbatch_size=2,
                num_stages=3, family="llama", kv_heads=2)
    return GPTShape(**{**base, **kw})


def test_llama_chunks_layout_and_state() -> None:
    first, mid, last = build_chunks(_llama_shape(), _backend(), seed=3)
    assert not hasattr(first, "pos_emb") and hasattr(first, "tok_emb")
    assert isinstance(last.ln_f, torch.nn.RMSNorm)
    assert set(last.matrix_linears()) == {"blocks.0.qkv", "blocks.0.proj", "blocks.0.gate", "blocks.0.up",
                                          "blocks.0.down", "head"}
    assert set(mid.nonmatrix_params()) == {"blocks.0.ln1.weight", "blocks.0.ln2.weight"}  # no biases
    for chunk in (first, mid, last):
        assert not set(ROPE_BUFFERS) & set(chunk.state_dict())  # constants, rebuilt: never checkpointed
        assert chunk.rope_cos.shape == (8, 8)
    # untied: the head is its own parameter, not the token table
    assert last.head.weight.data_ptr() != first.tok_emb.weight.data_ptr()
    # deterministic from the seed; residual projections get the smaller std
    again = build_chunks(_llama_shape(), _backend(), seed=3, stages=[1])[0]
    assert all(torch.equal(a, b) for a, b in zip(mid.parameters(), again.parameters(), strict=True))
    assert mid.blocks[0].down.weight.std() < mid.blocks[0].up.weight.std()
    assert torch.equal(mid.blocks[0].ln1.weight, torch.ones(32))


def test_llama_chunks_learn_end_to_end_on_the_cpu() -> None:
    chunks = build_chunks(_llama_shape(num_stages=2), _backend(), seed=0)
    params = [p for c in chunks for p in c.parameters()]
    opt = torch.optim.AdamW(params, lr=1e-2)
    g = _gen(8)
    tokens = torch.randint(0, 96, (2, 8), generator=g)
    targets = torch.roll(tokens, -1, 1)
    losses = []
    for step in range(12):
        x = chunks[0](tokens, is_first_microbatch=True)
        loss = chunks[1](x, is_first_microbatch=True, targets=targets)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
        assert all(c.caches_valid for c in chunks), step
    assert losses[-1] < 0.8 * losses[0]


def test_llama_flops_count_the_three_ffn_matrices_and_the_narrow_qkv() -> None:
    cfg = load_config(ROOT / "examples/configs/llama-h2048.toml")
    shapes = {name: (fin, fout, n) for name, fin, fout, n in linear_shapes(cfg)}
    assert shapes == {"qkv": (2048, (16 + 8) * 128, 4), "proj": (2048, 2048, 4), "gate": (2048, 5632, 4),
                      "up": (2048, 5632, 4), "down": (5632, 2048, 4), "head": (2048, 32768, 1)}
    flops = count_matrix_flops(cfg)
    n = 256 * 4  # tokens per microbatch x microbatches
    per_layer = 2048 * 3072 + 2048 * 2048 + 3 * 2048 * 5632
    assert flops.layers_only == 6 * n * per_layer * 4
    # every backend linear of the built model is counted, with its shape
    chunks = build_chunks(GPTShape.from_config(cfg), _backend(), seed=0, device="meta")
    built = sorted(tuple(m.weight.shape) for c in chunks for m in c.matrix_linears().values())
    counted = sorted((fout, fin) for fin, fout, n in shapes.values() for _ in range(n))
    assert built == counted
