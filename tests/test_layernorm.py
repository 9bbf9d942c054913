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
def test_the_model_uses_them_on_cuda_16_bit_unless_disabled(monkeypatch):
    calls = []
    real = gpt.triton_layer_norm
    monkeypatch.setattr(gpt, "triton_layer_norm", lambda ln, x: calls.append(1) or real(ln, x))
    ln, x, _ = _ln_case(tokens=8, hidden=64)
    gpt.layer_norm(ln, x)
    assert calls == [1]
    gpt.layer_norm(ln, x.float())
    monkeypatch.setenv("QEFFECT_FUSED_LAYERNORM", "0")
    gpt.layer_norm(ln, x)
    assert calls == [1]
