"""The model's LayerNorm on 16-bit CUDA activations: the Triton kernels of `model/layernorm.py`.

Not the oracle (native eager and every qeffect path share this code, so the bitwise verification tests
cover it on the GPU); these check that the kernels compute a LayerNorm, in the promised dtypes,
deterministically, the same captured as eager, and that the model picks them exactly where it should.
On CPU the kernels run under Triton's interpreter where Triton is installed.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

from qeffect.model import gpt, layernorm

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_cpu_and_fp32_take_the_torch_form(monkeypatch):
    calls = []
    monkeypatch.setattr(gpt, "_layer_norm", lambda ln, x: calls.append(x.dtype) or x)
    ln = nn.LayerNorm(8)
    gpt.layer_norm(ln, torch.zeros(2, 8, dtype=torch.bfloat16))  # CPU
    gpt.layer_norm(ln, torch.zeros(2, 8))
    assert calls == [torch.bfloat16, torch.float32]
    assert not layernorm.available(torch.zeros(2, 8, dtype=torch.bfloat16), ln.weight)


INTERPRETED = textwrap.dedent("""
    import os
    os.environ["TRITON_INTERPRET"] = "1"
    import torch
    from qeffect.model import layernorm as L
    torch.manual_seed(0)
    for rows, n in ((6, 64), (9, 100), (8, 256)):
        ln = torch.nn.LayerNorm(n)
        with torch.no_grad():
            ln.weight.copy_(1 + 0.1 * torch.randn(n))
            ln.bias.copy_(0.1 * torch.randn(n))
        x, dy = torch.randn(1, rows, n).half(), torch.randn(1, rows, n).half()
        runs = []
        for _ in range(2):
            ln.zero_grad(set_to_none=True)
            xa = x.clone().requires_grad_(True)
            y = L._TritonLayerNorm.apply(xa, ln.weight, ln.bias, ln.eps)
            y.backward(dy)
            runs.append((y, xa.grad, ln.weight.grad, ln.bias.grad))
        for a, b in zip(*runs):
            assert torch.equal(a, b), "not deterministic"
        y, dx, dw, db = runs[0]
        assert (y.dtype, dx.dtype, dw.dtype, db.dtype) == (torch.float16,) * 2 + (torch.float32,) * 2
        ln.zero_grad(set_to_none=True)
        xr = x.float().requires_grad_(True)
        torch.nn.functional.layer_norm(xr, (n,), ln.weight, ln.bias, ln.eps).backward(dy.float())
        torch.testing.assert_close(y.float(), torch.nn.functional.layer_norm(x.float(), (n,), ln.weight,
                                   ln.bias, ln.eps), rtol=0, atol=2e-3)
        torch.testing.assert_close(dx.float(), xr.grad, rtol=0, atol=2e-3)
        torch.testing.assert_close(dw, ln.weight.grad, rtol=0, atol=1e-5)
        torch.testing.assert_close(db, ln.bias.grad, rtol=0, atol=1e-5)
    print("ok")
""")


def test_kernels_compute_a_layer_norm_under_the_interpreter():
    pytest.importorskip("triton")
    out = subprocess.run([sys.executable, "-c", INTERPRETED], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


def _ln_case(seed=0, tokens=256, hidden=4096):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    ln = nn.LayerNorm(hidden, device="cuda")
    with torch.no_grad():
        ln.weight.copy_(1 + 0.1 * torch.randn(hidden, device="cuda", generator=gen))
        ln.bias.copy_(0.1 * torch.randn(hidden, device="cuda", generator=gen))
    x = torch.randn(1, tokens, hidden, device="cuda", generator=gen).to(torch.bfloat16)
    dy = torch.randn(1, tokens, hidden, device="cuda", generator=gen).to(torch.bfloat16)
    return ln, x, dy


def _fwd_bwd(fn, ln, x, dy):
    ln.zero_grad(set_to_none=True)
    xi = x.detach().clone().requires_grad_(True)
    y = fn(ln, xi)
    y.backward(dy)
    return y.detach(), xi.grad, ln.weight.grad, ln.bias.grad


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("tokens,hidden", [(256, 4096), (254, 2048), (8, 64), (33, 100)])
def test_kernels_are_a_layer_norm_in_the_promised_dtypes(tokens, hidden):
    ln, x, dy = _ln_case(tokens=tokens, hidden=hidden)
    assert layernorm.available(x, ln.weight)
    y, dx, dw, db = _fwd_bwd(layernorm.triton_layer_norm, ln, x, dy)
    ry, rdx, rdw, rdb = _fwd_bwd(gpt._layer_norm, ln, x, dy)
    assert (y.dtype, dx.dtype, dw.dtype, db.dtype) == (torch.bfloat16, torch.bfloat16, torch.float32, torch.float32)
    # a different summation order, so not the torch form's bits: within bf16 rounding of them
    torch.testing.assert_close(y.float(), ry.float(), rtol=0.02, atol=0.02)
    torch.testing.assert_close(dx.float(), rdx.float(), rtol=0.02, atol=0.02)
    torch.testing.assert_close(dw, rdw, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(db, rdb, rtol=1e-3, atol=1e-3)


@pytest.mark.gpu
@cuda
def test_kernels_are_deterministic_and_the_same_captured():
    ln, x, dy = _ln_case(seed=1)
    first = _fwd_bwd(layernorm.triton_layer_norm, ln, x, dy)
    second = _fwd_bwd(layernorm.triton_layer_norm, ln, x, dy)
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b)
    static_x = x.detach().clone().requires_grad_(True)
    ln.zero_grad(set_to_none=True)
    ln.weight.grad, ln.bias.grad = torch.zeros_like(ln.weight), torch.zeros_like(ln.bias)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # the kernels are compiled already (eager runs above)
        y = layernorm.triton_layer_norm(ln, static_x)
        y.backward(dy)
    ln.weight.grad.zero_(), ln.bias.grad.zero_()
    graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(first, (y, static_x.grad, ln.weight.grad, ln.bias.grad), strict=True):
        assert torch.equal(a, b)


@pytest.mark.gpu
@cuda
def test_the_model_uses_them_on_cuda_16_bit_only(monkeypatch):
    calls = []
    real = gpt.triton_layer_norm
    monkeypatch.setattr(gpt, "triton_layer_norm", lambda ln, x: calls.append(1) or real(ln, x))
    ln, x, _ = _ln_case(tokens=8, hidden=64)
    gpt.layer_norm(ln, x)
    assert calls == [1]
    gpt.layer_norm(ln, x.float())  # fp32 activations: the torch form
    assert calls == [1]


def _outputs_backward(fn, ln, x, r, grads):
    """Run `fn(ln, x, r)` (two outputs), back-propagate `grads` into them (None: that output unused)."""
    ln.zero_grad(set_to_none=True)
    xi = x.detach().clone().requires_grad_(True)
    ri = r.detach().clone().requires_grad_(True) if r is not None else None
    outs = fn(ln, xi, ri)
    used = [(o, g) for o, g in zip(outs, grads, strict=True) if g is not None]
    torch.autograd.backward([o for o, _ in used], [g for _, g in used])
    return ([o.detach().clone() for o in outs]
            + [xi.grad, ri.grad if ri is not None else None, ln.weight.grad, ln.bias.grad])


def _add_apart(ln, x, r):
    s = x + r
    return s, layernorm.triton_layer_norm(ln, s)


def _fork_apart(ln, x, r):
    return x.view_as(x), layernorm.triton_layer_norm(ln, x)  # autograd adds x's two gradients


def _equal(a, b):
    assert len(a) == len(b)
    for i, (u, v) in enumerate(zip(a, b, strict=True)):
        assert (u is None) == (v is None), i
        assert u is None or (u.dtype == v.dtype and torch.equal(u, v)), i


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("tokens,hidden", [(256, 4096), (254, 2048), (33, 100)])
def test_the_residual_adds_in_the_norm_passes_have_the_bits_of_the_add_and_the_norm_apart(tokens, hidden):
    ln, x, dy = _ln_case(seed=2, tokens=tokens, hidden=hidden)
    gen = torch.Generator(device="cuda").manual_seed(3)
    r = torch.randn(x.shape, device="cuda", generator=gen).to(x.dtype)
    ds = torch.randn(x.shape, device="cuda", generator=gen).to(x.dtype)
    for grads in ((ds, dy), (None, dy), (ds, None)):
        fused = _outputs_backward(lambda ln, x, r: layernorm.triton_add_layer_norm(ln, x, r), ln, x, r, grads)
        apart = _outputs_backward(_add_apart, ln, x, r, grads)
        _equal(fused, apart)
        fused = _outputs_backward(lambda ln, x, r: layernorm.triton_fork_layer_norm(ln, x), ln, x, None, grads)
        apart = _outputs_backward(_fork_apart, ln, x, None, grads)
        _equal(fused, apart)
    # the case is real: the add in the backward changed the norm's input gradient
    fork = lambda ln, x, r: layernorm.triton_fork_layer_norm(ln, x)  # noqa: E731
    added, plain = (_outputs_backward(fork, ln, x, None, g)[2] for g in ((ds, dy), (None, dy)))
    assert not torch.equal(added, plain)


@pytest.mark.gpu
@cuda
def test_a_block_has_the_same_bits_with_the_residual_adds_fused_or_apart(monkeypatch):
    from qeffect.fp8 import DelayedScalingRecipe, ReferenceBackend
    from qeffect.model import GPTShape, build_chunks

    shape = GPTShape(vocab_size=64, hidden=256, ffn=512, heads=4, layers_per_chunk=2, seq_len=32,
                     microbatch_size=2, num_stages=1)
    calls = []
    real = layernorm.triton_add_layer_norm
    monkeypatch.setattr(gpt, "triton_add_layer_norm", lambda *a: calls.append(1) or real(*a))
    runs = []
    fused_residual = gpt._fused_residual
    for fused in (True, False):  # apart: the add, then the norm (each still the Triton LayerNorm)
        monkeypatch.setattr(gpt, "_fused_residual", fused_residual if fused else lambda ln, x: False)
        (chunk,) = build_chunks(shape, ReferenceBackend(DelayedScalingRecipe()), seed=0, device="cuda",
                                dtype=torch.bfloat16)
        gen = torch.Generator().manual_seed(5)
        tokens = torch.randint(0, 64, (2, 32), generator=gen).cuda()
        targets = torch.randint(0, 64, (2, 32), generator=gen).cuda()
        loss = chunk(tokens, is_first_microbatch=True, targets=targets)
        loss.backward()
        runs.append([loss.detach()] + [p.grad for _, p in sorted(chunk.named_parameters())])
    assert calls == [1, 1]  # two blocks fused, none apart
    _equal(runs[0], runs[1])
