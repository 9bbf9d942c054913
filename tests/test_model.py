"""GPT stage chunks: shapes, deterministic init, parameter classification, a CPU training smoke test."""

from __future__ import annotations

import pytest
import torch

from qeffect.config import RunConfig
from qeffect.fp8 import STATE_NAMES, DelayedScalingRecipe, ReferenceBackend, is_backend_linear
from qeffect.model import GPTShape, StageChunk, build_chunks

BACKEND = ReferenceBackend(DelayedScalingRecipe())


def _shape(num_stages=2, layers_per_chunk=1, **kw) -> GPTShape:
    base = dict(vocab_size=64, hidden=32, ffn=64, heads=4, seq_len=8, microbatch_size=2)
    base.update(kw)
    return GPTShape(layers_per_chunk=layers_per_chunk, num_stages=num_stages, **base)


def test_shape_from_config_and_validation():
    cfg = RunConfig().with_overrides(**{"model.hidden": 48, "model.heads": 6, "pipeline.pp": 3})
    s = GPTShape.from_config(cfg)
    assert (s.hidden, s.heads, s.num_stages) == (48, 6, 3 * cfg.pipeline.chunks_per_rank)
    assert s.vocab_size == cfg.model.vocab_size and s.seq_len == cfg.model.seq_len
    assert s.num_layers == s.layers_per_chunk * s.num_stages
    with pytest.raises(ValueError, match="divide"):
        _shape(heads=5)
    with pytest.raises(ValueError):
        _shape(num_stages=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_forward_shapes(dtype):
    s = _shape(num_stages=3, layers_per_chunk=2)
    chunks = build_chunks(s, BACKEND, seed=0, dtype=dtype)
    assert [c.stage for c in chunks] == [0, 1, 2]
    assert [(c.is_first, c.is_last) for c in chunks] == [(True, False), (False, False), (False, True)]
    ids = torch.randint(0, 64, (2, 8))
    h = chunks[0](ids, is_first_microbatch=True)
    assert h.shape == (2, 8, 32) and h.dtype == dtype
    h = chunks[1](h, is_first_microbatch=True)
    assert h.shape == (2, 8, 32) and h.dtype == dtype
    logits = chunks[2](h, is_first_microbatch=True)
    assert logits.shape == (2, 8, 64) and logits.dtype == dtype
    loss = chunks[2](h, is_first_microbatch=False, targets=ids)
    assert loss.shape == () and loss.dtype == torch.float32 and torch.isfinite(loss)
    assert all(p.dtype == torch.float32 for c in chunks for p in c.parameters())
    with pytest.raises(ValueError, match="token ids"):
        chunks[0](h, is_first_microbatch=False)
    with pytest.raises(ValueError, match="hidden"):
        chunks[1](ids, is_first_microbatch=False)


def test_single_stage_is_first_and_last():
    (chunk,) = build_chunks(_shape(num_stages=1), BACKEND, seed=0)
    assert chunk.is_first and chunk.is_last
    ids = torch.randint(0, 64, (2, 8))
    assert chunk(ids, is_first_microbatch=True, targets=ids).shape == ()
    assert chunk(ids, is_first_microbatch=False).shape == (2, 8, 64)


def _params(chunks):
    return {f"{c.stage}.{k}": v for c in chunks for k, v in c.state_dict().items()}


def test_build_chunks_deterministic_per_seed():
    s = _shape(num_stages=3)
    rng_before = torch.random.get_rng_state()
    a, b, c = (_params(build_chunks(s, BACKEND, seed=seed)) for seed in (7, 7, 8))
    assert torch.equal(torch.random.get_rng_state(), rng_before), "build_chunks must not touch the global RNG"
    assert a.keys() == b.keys() == c.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    differ = [k for k in a if not torch.equal(a[k], c[k])]
    assert differ and all(k.endswith("weight") for k in differ)
    # Building a subset of stages (a rank's chunks) gives the same tensors as the full build.
    (mid,) = build_chunks(s, BACKEND, seed=7, stages=[1])
    assert mid.stage == 1 and all(torch.equal(v, a[f"1.{k}"]) for k, v in mid.state_dict().items())
    with pytest.raises(ValueError):
        build_chunks(s, BACKEND, seed=7, stages=[3])


def test_a_stage_the_build_does_not_keep_is_built_on_the_meta_device(monkeypatch):
    """Its draws need only names and shapes; with the draws shared it is not built at all."""
    import qeffect.model.gpt as gpt

    built = []
    real = gpt.StageChunk

    def spy(shape, backend, stage, *, device=None, **kw):
        built.append((stage, torch.device(device).type))
        return real(shape, backend, stage, device=device, **kw)

    monkeypatch.setattr(gpt, "StageChunk", spy)
    s = _shape(num_stages=3)
    (mid,) = build_chunks(s, BACKEND, seed=7, stages=[1])
    assert built == [(0, "meta"), (1, "cpu"), (2, "meta")]
    assert all(p.device.type == "cpu" for p in mid.parameters())
    built.clear()
    with gpt.shared_init_draws():
        build_chunks(s, BACKEND, seed=7)
        built.clear()
        build_chunks(s, BACKEND, seed=7, stages=[2])
    assert built == [(2, "cpu")]


def test_init_values():
    s = _shape(num_stages=2, layers_per_chunk=2)
    first, last = build_chunks(s, BACKEND, seed=0)
    blk = first.blocks[0]
    assert torch.equal(blk.ln1.weight, torch.ones(32)) and torch.equal(blk.ln1.bias, torch.zeros(32))
    assert torch.equal(blk.qkv.bias, torch.zeros(96))
    assert 0.015 < blk.fc1.weight.std().item() < 0.025
    assert 0.015 < first.tok_emb.weight.std().item() < 0.025
    resid = 0.02 / (2 * s.num_layers) ** 0.5
    assert 0.7 * resid < blk.fc2.weight.std().item() < 1.3 * resid
    assert torch.equal(last.ln_f.weight, torch.ones(32)) and last.head.bias is None
    assert all(torch.equal(t, torch.ones(())) for n, t in last.fp8_state().items() if n.endswith("scale"))


def test_parameter_classification_and_fp8_state():
    for chunk in build_chunks(_shape(num_stages=2, layers_per_chunk=2), BACKEND, seed=0):
        named = dict(chunk.named_parameters())
        linears = chunk.matrix_linears()
        expect = {f"blocks.{i}.{n}" for i in range(2) for n in ("qkv", "proj", "fc1", "fc2")}
        if chunk.is_last:
            expect.add("head")
        assert set(linears) == expect and all(is_backend_linear(m) for m in linears.values())
        assert sum(is_backend_linear(m) for m in chunk.modules()) == len(expect)
        matrix, nonmatrix = chunk.matrix_params(), chunk.nonmatrix_params()
        assert set(matrix) == {f"{n}.weight" for n in expect}
        assert all(named[k] is p for k, p in {**matrix, **nonmatrix}.items())
        assert set(matrix).isdisjoint(nonmatrix) and set(matrix) | set(nonmatrix) == set(named)
        assert any(k.endswith("qkv.bias") for k in nonmatrix) and any("ln1" in k for k in nonmatrix)
        assert ("tok_emb.weight" in nonmatrix) == chunk.is_first
        state = chunk.fp8_state()
        assert set(state) == {f"{n}.{s}" for n in expect for s in STATE_NAMES}
        sd = chunk.state_dict()
        assert all(torch.equal(sd[k], v) for k, v in state.items())


def test_biases_taken_in_the_activation_dtype_replace_theirs_in_the_grad_inputs():
    """The reference backend keeps its fp32 biases (no stand-in: its dbias is an fp32 sum); a linear that
    takes one (TE's, faked here) has it differentiated in place of its bias."""
    (chunk,) = build_chunks(_shape(num_stages=1), BACKEND, seed=0, dtype=torch.bfloat16)
    chunk.use_activation_biases()
    assert chunk.nonmatrix_grad_inputs() == chunk.nonmatrix_params()
    calls = []
    lin = chunk.matrix_linears()["blocks.0.fc1"]
    stand_in = torch.zeros(lin.bias.shape, dtype=torch.bfloat16, requires_grad=True)
    lin.use_activation_bias = calls.append
    lin.bias_grad_input = stand_in
    chunk.use_activation_biases()
    assert calls == [torch.bfloat16]
    inputs, params = chunk.nonmatrix_grad_inputs(), chunk.nonmatrix_params()
    assert list(inputs) == list(params) and inputs["blocks.0.fc1.bias"] is stand_in
    assert all(inputs[k] is p for k, p in params.items() if k != "blocks.0.fc1.bias")


def test_delay_wgrad_and_cache_toggles():
    (chunk,) = build_chunks(_shape(num_stages=1), BACKEND, seed=0)
    ids = torch.randint(0, 64, (2, 8))
    assert not chunk.caches_valid
    chunk.set_delay_wgrad(True)
    chunk(ids, is_first_microbatch=True, targets=ids).backward()
    assert chunk.caches_valid
    assert all(p.grad is None for p in chunk.matrix_params().values())
    assert all(p.grad is not None for p in chunk.nonmatrix_params().values())
    work = chunk.pop_wgrad_work()
    assert set(work) == set(chunk.matrix_linears()) and all(len(w) == 1 for w in work.values())
    assert all(m.wgrad_store == [] for m in chunk.matrix_linears().values())
    chunk.invalidate_caches()
    assert not chunk.caches_valid
    with pytest.raises(RuntimeError, match="weight cache is empty"):
        chunk(ids, is_first_microbatch=False)
    chunk.set_delay_wgrad(False)
    chunk(ids, is_first_microbatch=True, targets=ids).backward()
    assert all(p.grad is not None for p in chunk.matrix_params().values())


def test_training_smoke_loss_decreases():
    torch.manual_seed(0)
    s = _shape(num_stages=2, layers_per_chunk=1, seq_len=16)
    chunks: list[StageChunk] = build_chunks(s, BACKEND, seed=0)
    params = [p for c in chunks for p in c.parameters()]
    opt = torch.optim.AdamW(params, lr=3e-3)
    g = torch.Generator().manual_seed(0)
    batch = torch.randint(0, 64, (2, 17), generator=g)
    ids, targets = batch[:, :-1], batch[:, 1:]
    losses = []
    for _ in range(40):
        opt.zero_grad()
        h = chunks[0](ids, is_first_microbatch=True)
        loss = chunks[1](h, is_first_microbatch=True, targets=targets)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(map(torch.isfinite, map(torch.tensor, losses)))
    assert losses[-1] < 0.5 * losses[0], losses


def test_shared_init_draws_reuses_the_same_numbers(monkeypatch) -> None:
    """Inside the scope the second build of a model copies the first one's draws (no generator call) and
    gets the same parameters as a build outside it; another seed or shape draws afresh; the cache ends
    with the scope."""
    import qeffect.model.gpt as gpt

    s = _shape()
    plain = _params(build_chunks(s, BACKEND, seed=7))
    draws = []
    real = gpt._init_value
    monkeypatch.setattr(gpt, "_init_value", lambda *a: draws.append(a[0]) or real(*a))
    with gpt.shared_init_draws():
        first = _params(build_chunks(s, BACKEND, seed=7))
        n = len(draws)
        assert n == sum(1 for c in build_chunks(s, BACKEND, seed=9) for _ in c.parameters())
        draws.clear()
        again = _params(build_chunks(s, BACKEND, seed=7, stages=[1]))
        assert draws == []  # copied, not drawn
        other = _params(build_chunks(s, BACKEND, seed=8))
        assert len(draws) == n
    assert gpt._DRAWS is None
    assert plain.keys() == first.keys() and all(torch.equal(plain[k], first[k]) for k in plain)
    assert again and all(torch.equal(v, first[k]) for k, v in again.items())
    assert any(not torch.equal(plain[k], other[k]) for k in plain)
    build_chunks(s, BACKEND, seed=7)
    assert len(draws) == 2 * n  # outside the scope every build draws


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_split_heads_has_autograds_values_and_gradient_bits(dtype):
    """`split_heads` (one copy in its backward) against autograd's view/permute/unbind route: the same
    views forward and, through attention, the same bits in the fused projection's gradient."""
    import torch.nn.functional as F

    from qeffect.model.gpt import split_heads

    torch.manual_seed(0)
    b, t, heads, d = 2, 8, 4, 16
    qkv = torch.randn(b, t, 3 * heads * d, dtype=dtype)
    dy = torch.randn(b, heads, t, d, dtype=dtype)
    grads, outs = [], []

    def autograd_route(x: torch.Tensor, heads: int) -> tuple[torch.Tensor, ...]:
        return x.view(b, t, 3, heads, d).permute(2, 0, 3, 1, 4).unbind(0)

    for route in (autograd_route, split_heads):
        x = qkv.clone().requires_grad_(True)
        q, k, v = route(x, heads)
        assert q.shape == (b, heads, t, d) and q.data_ptr() == x.data_ptr()  # views, no copy forward
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        out.backward(dy)
        outs.append(out)
        grads.append(x.grad)
    assert torch.equal(outs[0], outs[1]) and torch.equal(grads[0], grads[1])
    assert grads[1].is_contiguous() and grads[1].shape == qkv.shape
    # a gradient that reaches only some of q, k, v (materialized as zeros) still lands in its place
    x = qkv.clone().requires_grad_(True)
    q, k, v = split_heads(x, heads)
    (k * 2).sum().backward()
    expect = torch.zeros(b, t, 3, heads, d, dtype=dtype)
    expect[:, :, 1] = 2
    assert torch.equal(x.grad, expect.view_as(x))
