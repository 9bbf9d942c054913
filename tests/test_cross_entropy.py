"""The model's loss on 16-bit CUDA logits: the Triton passes of `model/cross_entropy.py`.

Not the oracle (native eager and every qeffect path share this code, so the bitwise verification tests
cover it on the GPU); these check that the passes compute torch's mean cross-entropy and its gradient
(within rounding), in the promised dtypes, deterministically, the same captured as eager, with torch's
ignore-index semantics, and that the model picks them exactly where it should. On CPU the kernels run
under Triton's interpreter where Triton is installed.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

from qeffect.model import cross_entropy as ce
from qeffect.model import gpt

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _torch_form(logits, targets):
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


def test_cpu_and_fp32_take_the_torch_form(monkeypatch):
    calls = []
    monkeypatch.setattr(ce, "triton_cross_entropy", lambda x, t: calls.append(x.dtype))
    logits, targets = torch.randn(2, 3, 11), torch.randint(0, 11, (2, 3))
    for x in (logits.bfloat16(), logits):  # CPU: never the kernels
        assert torch.equal(gpt.cross_entropy(x, targets), _torch_form(x, targets))
    assert calls == []
    assert not ce.available(logits.bfloat16(), targets)


def test_available_needs_matching_shapes_and_int64_targets():
    x = torch.zeros(2, 3, 5, dtype=torch.bfloat16)
    assert not ce.available(x, torch.zeros(2, 4, dtype=torch.int64))
    assert not ce.available(x, torch.zeros(2, 3, dtype=torch.int32))


INTERPRETED = textwrap.dedent("""
    import os
    os.environ["TRITON_INTERPRET"] = "1"
    import torch
    import torch.nn.functional as F
    from qeffect.model import cross_entropy as ce
    torch.manual_seed(0)
    for rows, v in ((5, 37), (4, 3000), (3, 4096)):
        x = (3 * torch.randn(rows, v)).half()
        t = torch.randint(0, v, (rows,))
        t[1] = -100
        runs = []
        for _ in range(2):
            xa = x.clone().requires_grad_(True)
            loss = ce._TritonCrossEntropy.apply(xa, t)
            loss.backward(torch.tensor(0.5))
            runs.append((loss, xa.grad))
        for a, b in zip(*runs):
            assert torch.equal(a, b), "not deterministic"
        loss, dx = runs[0]
        assert (loss.dtype, dx.dtype) == (torch.float32, torch.float16)
        xr = x.float().requires_grad_(True)
        ref = F.cross_entropy(xr, t)
        ref.backward(torch.tensor(0.5))
        torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(dx.float(), xr.grad, rtol=0, atol=1e-3)
    print("ok")
""")


def test_kernels_compute_a_cross_entropy_under_the_interpreter():
    # the rows' loops take their bound from a runtime argument, which an older interpreter rejects (the
    # GPU machine's: "only 0-dimensional arrays can be converted"); Triton 3.9's runs them
    pytest.importorskip("triton", minversion="3.9")
    out = subprocess.run([sys.executable, "-c", INTERPRETED], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


def _case(rows=256, vocab=32768, dtype=torch.bfloat16, seed=0, ignored=()):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    logits = (4 * torch.randn(1, rows, vocab, device="cuda", generator=gen)).to(dtype)
    targets = torch.randint(0, vocab, (1, rows), device="cuda", generator=gen)
    for i in ignored:
        targets[0, i] = ce.IGNORE_INDEX
    return logits, targets


def _fwd_bwd(fn, logits, targets, scale=1.0):
    x = logits.detach().clone().requires_grad_(True)
    loss = fn(x, targets)
    loss.backward(torch.tensor(scale, device=logits.device))
    return loss.detach(), x.grad


@pytest.mark.gpu
@cuda
@pytest.mark.parametrize("rows,vocab,dtype,ignored", [
    (256, 32768, torch.bfloat16, ()),
    (254, 1000, torch.bfloat16, (0, 7, 253)),
    (8, 50, torch.float16, (3,)),
    (3, 5000, torch.bfloat16, ()),
])
def test_kernels_are_torch_cross_entropy_in_the_promised_dtypes(rows, vocab, dtype, ignored):
    logits, targets = _case(rows, vocab, dtype, ignored=ignored)
    assert ce.available(logits, targets)
    loss, dx = _fwd_bwd(ce.triton_cross_entropy, logits, targets, scale=0.125)
    ref, rdx = _fwd_bwd(_torch_form, logits, targets, scale=0.125)
    assert (loss.dtype, loss.shape, dx.dtype) == (torch.float32, torch.Size([]), dtype)
    # a different summation order and Triton's exp/log, so not the torch form's bits
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(dx.float(), rdx.float(), rtol=0.02, atol=1e-6)
    for i in ignored:
        assert not dx[0, i].any()


@pytest.mark.gpu
@cuda
def test_kernels_are_deterministic_and_the_same_captured():
    logits, targets = _case(seed=1, ignored=(5,))
    first = _fwd_bwd(ce.triton_cross_entropy, logits, targets)
    second = _fwd_bwd(ce.triton_cross_entropy, logits, targets)
    for a, b in zip(first, second, strict=True):
        assert torch.equal(a, b)
    static_x = logits.detach().clone().requires_grad_(True)
    one = torch.ones((), device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):  # the kernels are compiled already (eager runs above)
        loss = ce.triton_cross_entropy(static_x, targets)
        loss.backward(one)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(loss, first[0]) and torch.equal(static_x.grad, first[1])


@pytest.mark.gpu
@cuda
def test_all_ignored_is_nan_as_torch_and_a_target_out_of_range_is_nan():
    logits, targets = _case(rows=4, vocab=64, ignored=range(4))
    loss, dx = _fwd_bwd(ce.triton_cross_entropy, logits, targets)
    assert torch.isnan(loss) and torch.isnan(_torch_form(logits, targets))
    assert not dx.any()  # no target counted: no gradient, as torch's (NaN-weighted nothing) gives zeros
    logits, targets = _case(rows=4, vocab=64)
    targets[0, 2] = 64
    loss, _ = _fwd_bwd(ce.triton_cross_entropy, logits, targets)
    assert torch.isnan(loss)


@pytest.mark.gpu
@cuda
def test_the_model_uses_them_on_cuda_16_bit_only(monkeypatch):
    calls = []
    real = ce.triton_cross_entropy
    monkeypatch.setattr(ce, "triton_cross_entropy", lambda x, t: calls.append(1) or real(x, t))
    logits, targets = _case(rows=8, vocab=64)
    fused = gpt.cross_entropy(logits, targets)
    assert calls == [1]
    assert torch.equal(gpt.cross_entropy(logits.float(), targets), _torch_form(logits, targets))
    assert calls == [1]  # fp32 logits: the torch form
    torch.testing.assert_close(fused, _torch_form(logits, targets), rtol=1e-5, atol=1e-5)
