"""`runtime.adamw.TritonAdamW`: torch's fused AdamW bits and state, with the update as Triton passes.

CPU: everything the Triton pass does not cover falls back to torch's own step (same bits, same state),
the runtimes pick the right optimizer, and (where Triton is installed) the kernel computes AdamW under
Triton's interpreter. GPU: the Triton pass against torch's fused kernel, bit for
bit, over several steps, with and without weight decay, on sizes that do and do not fill a block.
"""

from __future__ import annotations

import copy
import math
import subprocess
import sys
import textwrap
from fractions import Fraction
from pathlib import Path

import pytest
import torch

from adamw_reference import adamw_step, fma32, folded_gradient
from qeffect.config import OptimConfig
from qeffect.runtime import adamw
from qeffect.runtime.adamw import TritonAdamW
from qeffect.runtime.rank import make_optimizer

HYPER = dict(lr=3e-4, betas=(0.9, 0.95), eps=1e-8)


def _run(opt_cls, shapes, steps, device, wd, seed=0, **kw):
    gen = torch.Generator(device=device).manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(s, device=device, generator=gen) * 0.02) for s in shapes]
    opt = opt_cls(params, weight_decay=wd, **HYPER, **kw)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, device=device, generator=gen) * 1e-3
        opt.step()
    return params, opt


def _state(params, opt):
    return [t for p in params for t in (p.detach(), *(opt.state[p][k] for k in ("exp_avg", "exp_avg_sq", "step")))]


def _assert_same_bits(a, b):
    for x, y in zip(a, b, strict=True):
        assert x.dtype == y.dtype and x.device == y.device and x.shape == y.shape
        assert torch.equal(x, y)


def test_cpu_falls_back_to_torch_with_the_same_bits_and_state():
    shapes = [(7, 5), (33,)]
    ref = _run(torch.optim.AdamW, shapes, 3, "cpu", 0.1, fused=True)
    got = _run(TritonAdamW, shapes, 3, "cpu", 0.1)
    _assert_same_bits(_state(*ref), _state(*got))
    assert got[1].state_dict()["param_groups"][0]["fused"] is True


def test_the_pass_covers_only_what_it_computes(monkeypatch):
    opt = TritonAdamW([torch.nn.Parameter(torch.zeros(3))], **HYPER)
    group = opt.param_groups[0]
    p = torch.zeros(4)
    monkeypatch.setattr(adamw, "_kernel", lambda: object())
    monkeypatch.setattr(adamw, "_fp32_contiguous_cuda", lambda t: t.dtype == torch.float32 and t.is_contiguous())
    assert opt._covered(group, [p], [p])
    assert not opt._covered(group, [p], [p.to(torch.bfloat16)])
    assert not opt._covered(group, [torch.zeros(4, 4).t()], [torch.zeros(4, 4)])
    for key, value in (("amsgrad", True), ("maximize", True), ("capturable", True), ("differentiable", True),
                       ("lr", torch.tensor(1e-3))):
        assert not opt._covered({**group, key: value}, [p], [p])
    monkeypatch.setattr(adamw, "_kernel", lambda: None)
    assert not opt._covered(group, [p], [p])


def test_large_tensors_take_the_pass_and_small_ones_torchs_kernel(monkeypatch):
    launches = []

    class FakeKernel:  # records each launch; the update itself is checked on the GPU
        def __getitem__(self, grid):
            return lambda p, g, s, stride, m, v, b1, b2, n, *hyper, **meta: launches.append(
                (p.data_ptr(), n, b1.item(), meta["COUNT"]))

    monkeypatch.setattr(adamw, "_kernel", lambda: FakeKernel())
    monkeypatch.setattr(TritonAdamW, "_covered", lambda self, group, params, grads: True)
    shapes = [(adamw.MIN_NUMEL,), (5, 3), (adamw.MIN_NUMEL + 1,), (7,)]
    params, opt = _run(TritonAdamW, shapes, 1, "cpu", 0.0)
    ref, _ = _run(torch.optim.AdamW, shapes, 1, "cpu", 0.0, fused=True)
    assert [(ptr, n) for ptr, n, *_ in launches] == [(params[0].data_ptr(), adamw.MIN_NUMEL),
                                                     (params[2].data_ptr(), adamw.MIN_NUMEL + 1)]
    assert all(b1 == pytest.approx(0.1) for _, _, b1, _ in launches)  # 1 - beta1**1: the step was counted first
    assert all(count == 0 for *_, count in launches)  # no fold handed over: the plain gradient
    assert all(opt.state[p]["step"].item() == 1.0 for p in params)
    for i in (1, 3):  # torch's fused kernel: the same bits as torch's optimizer alone
        assert torch.equal(params[i], ref[i])
    for i in (0, 2):  # the fake pass left them alone
        assert not torch.equal(params[i], ref[i])


INTERPRETED = textwrap.dedent("""
    import os
    import sys
    os.environ["TRITON_INTERPRET"] = "1"
    sys.path.insert(0, sys.argv[1])  # tests/: the fp32 reference
    import torch
    from adamw_reference import adamw_step, folded_gradient
    from qeffect.runtime import adamw

    def same_bits(a, b):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.int32), b.view(torch.int32))

    n = adamw.BLOCK + 17
    torch.manual_seed(0)
    p0 = torch.randn(n) * 0.02
    for wd, count in ((0.0, 0), (0.1, 0), (0.1, 3)):  # count: staged bf16 slots folded in the pass
        p, m, v, step = p0.clone(), torch.zeros(n), torch.zeros(n), torch.zeros(())
        ref = p0.clone().requires_grad_(True)
        opt = torch.optim.AdamW([ref], lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=wd)
        for _ in range(3):
            g = torch.randn(n) * 1e-3
            slots = (torch.randn(max(count, 1), n + 5) * 1e-3).to(torch.bfloat16)
            nan = torch.full_like(g, float("nan"))  # with INIT the pass must not read g
            g_in = nan if count else g
            g_used = folded_gradient(g_in, slots, count, init=count > 0)
            ref.grad = g_used
            opt.step()
            step += 1
            bc1, bc2_sqrt = adamw.bias_corrections([step], 0.9, 0.95)
            want = adamw_step(p.clone(), g_used, m.clone(), v.clone(), lr=3e-4, beta1=0.9, beta2=0.95,
                              weight_decay=wd, eps=1e-8, bc1=bc1[0], bc2_sqrt=bc2_sqrt[0], interpreted=True)
            block = adamw.FOLD_BLOCK if count else adamw.BLOCK
            adamw._kernel()[(-(-n // block),)](p, g_in, slots, slots.stride(0), m, v, bc1[0], bc2_sqrt[0], n, 3e-4,
                                               0.9, 0.95, wd, 1e-8, p, p, p, p, 0.0, COUNT=count, INIT=count > 0,
                                               DECAY=wd != 0, UPDATE=True, CAST=False, BLOCK=block,
                                               num_warps=adamw.NUM_WARPS)
            for name, got, exp in (("p", p, want[0]), ("m", m, want[1]), ("v", v, want[2])):
                assert same_bits(got, exp), (wd, count, name, (got != exp).sum().item())
        # the algebra is torch's AdamW: its CPU step orders the operations otherwise (no fma, decay after
        # the moments' lerp, ...), so only close to it; the bits are the reference's above
        st = opt.state[ref]
        torch.testing.assert_close(p, ref.detach(), rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(m, st["exp_avg"], rtol=1e-5, atol=1e-9)
        torch.testing.assert_close(v, st["exp_avg_sq"], rtol=1e-5, atol=1e-12)
        assert not torch.equal(p, p0)
    print("ok")
""")


def test_the_pass_computes_the_fp32_reference_bit_for_bit_under_the_interpreter():
    """The kernel under Triton's interpreter against `adamw_reference.adamw_step` (the kernel's operation
    order in plain torch, each operation and fma rounded once): the same bits for p, exp_avg and exp_avg_sq,
    every step, with and without decay and fold. One operation differs from the compiled kernel, and the
    reference follows the interpreter there: it passes float arguments as Python floats, so ``lr *
    weight_decay`` is a double product (`adamw_reference`'s docstring); the compiled form's bits against
    torch's CUDA kernel are the GPU tests'. (Against torch's CPU AdamW only close: it orders the operations
    otherwise.)"""
    pytest.importorskip("triton")
    tests = str(Path(__file__).parent)
    out = subprocess.run([sys.executable, "-c", INTERPRETED, tests], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


def _exact_fma32(a: float, b: float, c: float) -> float:
    """``a * b + c`` rounded once to fp32 (ties to even), from the exact rational value."""
    exact = Fraction(a) * Fraction(b) + Fraction(c)
    near = torch.tensor(float(exact), dtype=torch.float32)
    cands = [torch.nextafter(near, torch.tensor(-math.inf)), near, torch.nextafter(near, torch.tensor(math.inf))]
    best = min(abs(Fraction(x.item()) - exact) for x in cands)
    ties = [x for x in cands if abs(Fraction(x.item()) - exact) == best]
    return min(ties, key=lambda x: x.view(torch.int32).item() & 1).item()  # ties: the even one


def test_fma32_rounds_once() -> None:
    """`adamw_reference.fma32` against exact rational arithmetic: random operands of mixed magnitudes and
    the cases where rounding in fp64 first would round twice (a tiny addend just past an fp32 midpoint)."""
    one = 1 + 2.0**-12  # one * one = 1 + 2^-11 + 2^-24: exactly an fp32 midpoint
    hard = [(one, one, 2.0**-80), (one, one, -(2.0**-80)), (-one, one, 2.0**-80), (one, one, 0.0),
            (0.9, 0.123, -0.1107), (3.0, 1.0 / 3.0, -1.0)]
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(400, generator=gen) * 10.0 ** torch.randint(-6, 6, (400,), generator=gen)
    b = torch.randn(400, generator=gen)
    c = -a * b * (1 + torch.randn(400, generator=gen) * 2.0**-20)  # near-cancellations
    cases = [tuple(torch.tensor(x, dtype=torch.float32).item() for x in h) for h in hard]
    cases += list(zip(a.tolist(), b.tolist(), c.tolist(), strict=True))
    ta, tb, tc = (torch.tensor([x[i] for x in cases], dtype=torch.float32) for i in range(3))
    got = fma32(ta, tb, tc)
    want = torch.tensor([_exact_fma32(*x) for x in cases], dtype=torch.float32)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    naive = (ta.double() * tb.double() + tc.double()).float()  # what rounding twice gives
    assert naive[0].item() != got[0].item()  # the first hard case tells them apart


def test_reference_step_is_torchs_adamw_algebra() -> None:
    """The reference is AdamW (close to torch's CPU step; the operation order, not the algebra, differs)."""
    torch.manual_seed(1)
    p0, g = torch.randn(300) * 0.02, torch.randn(300) * 1e-3
    ref = p0.clone().requires_grad_(True)
    opt = torch.optim.AdamW([ref], lr=3e-4, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    ref.grad = g
    opt.step()
    bc1, bc2 = torch.tensor(1 - 0.9), torch.tensor(1 - 0.95).sqrt()
    p, m, v = adamw_step(p0, g, torch.zeros(300), torch.zeros(300), lr=3e-4, beta1=0.9, beta2=0.95,
                         weight_decay=0.1, eps=1e-8, bc1=bc1, bc2_sqrt=bc2)
    torch.testing.assert_close(p, ref.detach(), rtol=1e-6, atol=1e-8)
    torch.testing.assert_close(m, opt.state[ref]["exp_avg"], rtol=1e-6, atol=0.0)
    slots = torch.randn(3, 310).to(torch.bfloat16)
    assert torch.equal(folded_gradient(g, slots, 3, init=True),
                       slots[0, :300].float() + slots[1, :300].float() + slots[2, :300].float())
    assert torch.equal(folded_gradient(g, slots, 2, init=False), g + slots[0, :300].float() + slots[1, :300].float())
    assert folded_gradient(g, slots, 0, init=False) is g


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("wd", [0.0])
def test_fp32_reference_is_bitwise_torch_fused_on_cuda(wd):
    """Without weight decay the reference's bits are torch's fused CUDA AdamW's (so the CPU test above pins
    the kernel to the same bits as this GPU test pins torch's kernel), over several steps. With decay the
    reference does not model the GPU's rounding of the decay line (on an H100 it differed at wd 0.1: torch
    takes lr and wd as doubles, and the compiler may fuse the line's multiply and subtract); there the
    kernel is compared with torch's directly (`test_triton_pass_is_bitwise_torch_fused_on_cuda`)."""
    shapes = [(adamw.MIN_NUMEL + 5,), (33, 7)]
    params, opt = _run(torch.optim.AdamW, shapes, 1, "cuda", wd, fused=True)
    gen = torch.Generator(device="cuda").manual_seed(7)
    for _ in range(4):
        grads = [torch.randn(p.shape, device="cuda", generator=gen) * 1e-3 for p in params]
        want = []
        for p, g in zip(params, grads, strict=True):
            st = opt.state[p]
            step = st["step"] + 1
            bc1, bc2 = adamw.bias_corrections([step], *HYPER["betas"])
            want.append(adamw_step(p.detach().clone(), g, st["exp_avg"].clone(), st["exp_avg_sq"].clone(),
                                   lr=HYPER["lr"], beta1=HYPER["betas"][0], beta2=HYPER["betas"][1],
                                   weight_decay=wd, eps=HYPER["eps"], bc1=bc1[0], bc2_sqrt=bc2[0]))
            p.grad = g
        opt.step()
        for p, (wp, wm, wv) in zip(params, want, strict=True):
            st = opt.state[p]
            for got, exp in ((p.detach(), wp), (st["exp_avg"], wm), (st["exp_avg_sq"], wv)):
                assert torch.equal(got.view(torch.int32), exp.view(torch.int32))


def test_zero_grad_drops_or_zeroes_every_gradient_as_torchs_does():
    params = [torch.nn.Parameter(torch.ones(3)), torch.nn.Parameter(torch.ones(2)), torch.nn.Parameter(torch.ones(1))]
    opt = TritonAdamW([{"params": params[:2]}, {"params": params[2:]}], lr=0.1)
    for p in params[:2]:
        p.grad = torch.full_like(p, 2.0)
    opt.zero_grad(set_to_none=False)  # torch's own path: zeroed in place, the unset one left unset
    assert [p.grad.tolist() if p.grad is not None else None for p in params] == [[0.0] * 3, [0.0] * 2, None]
    params[2].grad = torch.ones(1)
    opt.zero_grad()  # the commit's call
    assert all(p.grad is None for p in params)


def test_the_step_runs_without_autograd(monkeypatch):
    """The update writes leaves that require grad in place: it runs under `no_grad`, whatever the caller's mode."""
    opt = TritonAdamW([torch.nn.Parameter(torch.ones(3))], lr=0.1)
    seen = []
    monkeypatch.setattr(opt, "_step_once", lambda closure: seen.append(torch.is_grad_enabled()))
    with torch.enable_grad():
        opt.step()
    assert seen == [False]


def test_runtimes_pick_their_optimizer():
    params = [torch.nn.Parameter(torch.zeros(2))]
    cfg = OptimConfig()
    assert type(make_optimizer(params, cfg)) is torch.optim.AdamW
    assert type(make_optimizer(params, cfg, triton=True)) is TritonAdamW


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_triton_pass_is_bitwise_torch_fused_on_cuda(wd):
    if adamw._kernel() is None:
        pytest.skip("needs Triton")
    shapes = [(4096, 3), (adamw.MIN_NUMEL,), (adamw.MIN_NUMEL + adamw.BLOCK * 3 + 17,), (1,), (257, 129), (1024, 1031)]
    ref = _run(torch.optim.AdamW, shapes, 5, "cuda", wd, fused=True)
    got = _run(TritonAdamW, shapes, 5, "cuda", wd)
    _assert_same_bits(_state(*ref), _state(*got))
    # a resumed optimizer continues with the same bits
    fresh = TritonAdamW(got[0], weight_decay=wd, **HYPER)
    fresh.load_state_dict(copy.deepcopy(ref[1].state_dict()))  # load shares same-device tensors
    for p, q in zip(got[0], ref[0], strict=True):
        g = torch.full_like(p, 1e-3)
        p.grad, q.grad = g, g.clone()
    fresh.step()
    ref[1].step()
    _assert_same_bits(_state(got[0], fresh), _state(*ref))


def _run_folded(shapes, steps, device, wd, slots_n, *, defer: bool, dtype=torch.bfloat16, init_each=True, seed=0,
                no_region=False):
    """AdamW over gradients given as staged slots: folded first (`fold_staged`) then torch's fused AdamW,
    or handed to `TritonAdamW.fold_into_step` (`defer`). A non-`init_each` fold adds onto a region already
    holding an earlier group's sum, as a second staging group does. `no_region`: a parameter the pass
    folds gets no region (`fold_without_region`), as with the arena's lazy regions."""
    from qeffect.stage.accumulate import fold_staged

    gen = torch.Generator(device=device).manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(s, device=device, generator=gen) * 0.02) for s in shapes]
    opt = (TritonAdamW if defer else torch.optim.AdamW)(params, weight_decay=wd, **HYPER,
                                                       **({} if defer else {"fused": True}))
    regions = [torch.empty_like(p) for p in params]
    for _ in range(steps):
        for p, r in zip(params, regions, strict=True):
            n = p.numel()
            block = (torch.randn(slots_n, n + 5, device=device, generator=gen) * 1e-3).to(dtype)
            if init_each:
                r.fill_(float("nan"))  # init: the region's old contents must not be read
            else:
                r.copy_(torch.randn(p.shape, device=device, generator=gen) * 1e-3)
            p.grad = r
            if defer and no_region and init_each and opt.folds_in_pass(p, block):
                opt.fold_without_region(p, block, slots_n)
            elif defer:
                opt.fold_into_step(p, block, slots_n, init_each)
            else:
                fold_staged(r, block, slots_n, init_each)
        opt.step()
        assert not defer or opt.pending_folds() == 0
    return params, opt


@pytest.mark.parametrize("init_each", [True, False])
def test_deferred_folds_run_before_torchs_step_off_the_pass(init_each):
    """CPU (no Triton pass): the deferred fold runs as its own pass first, so the bits are the fold's then AdamW's."""
    shapes = [(7, 5), (33,)]
    ref = _run_folded(shapes, 3, "cpu", 0.1, 3, defer=False, init_each=init_each)
    got = _run_folded(shapes, 3, "cpu", 0.1, 3, defer=True, init_each=init_each)
    _assert_same_bits(_state(*ref), _state(*got))


def test_a_fold_without_region_needs_the_pass_and_never_takes_torchs_route():
    """CPU (no Triton pass): `fold_without_region` is refused; a placeholder `.grad` (all strides 0) that
    reached the unfused route is refused before anything writes into it."""
    p = torch.nn.Parameter(torch.zeros(6))
    opt = TritonAdamW([p], **HYPER)
    block = torch.ones(2, 6)
    assert not opt.folds_in_pass(p, block)
    with pytest.raises(ValueError, match="does not fold this parameter"):
        opt.fold_without_region(p, block, 2)
    p.grad = torch.zeros(1).expand(6)
    assert adamw._placeholder(p.grad) and not adamw._placeholder(torch.zeros(6)) and not adamw._placeholder(torch.zeros(1))
    opt.fold_into_step(p, block, 2, True)
    with pytest.raises(RuntimeError, match="no region to fold into"):
        opt.step()
    assert torch.equal(p.detach(), torch.zeros(6))


def test_fold_into_step_refuses_what_it_cannot_fold():
    p = torch.nn.Parameter(torch.zeros(6))
    opt = TritonAdamW([p], **HYPER)
    with pytest.raises(ValueError, match="no .grad"):
        opt.fold_into_step(p, torch.zeros(2, 6), 2, True)
    p.grad = torch.zeros(6)
    for block, count in ((torch.zeros(2, 6), 3), (torch.zeros(2, 6), 0), (torch.zeros(2, 5), 1), (torch.zeros(12), 1)):
        with pytest.raises(ValueError, match="fold of"):
            opt.fold_into_step(p, block, count, True)
    stranger = torch.nn.Parameter(torch.zeros(6))
    stranger.grad = torch.zeros(6)
    opt.fold_into_step(stranger, torch.zeros(2, 6), 2, True)
    with pytest.raises(ValueError, match="not in this optimizer"):
        opt.step()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("wd", [0.0, 0.1])
@pytest.mark.parametrize("init_each", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fold_in_the_pass_is_bitwise_fold_then_torch_fused_on_cuda(wd, init_each, dtype):
    """The fused fold+update against the fold kernel then torch's fused AdamW: same bits, for large
    tensors (the fused pass), small ones (folded first) and both slot dtypes."""
    if adamw._kernel() is None:
        pytest.skip("needs Triton")
    shapes = [(adamw.MIN_NUMEL + adamw.FOLD_BLOCK * 3 + 17,), (257, 129), (1024, 1031)]
    for slots_n in (1, 3, 8):
        ref = _run_folded(shapes, 4, "cuda", wd, slots_n, defer=False, dtype=dtype, init_each=init_each)
        got = _run_folded(shapes, 4, "cuda", wd, slots_n, defer=True, dtype=dtype, init_each=init_each)
        _assert_same_bits(_state(*ref), _state(*got))
        if init_each:  # the large tensors without a region (each .grad a placeholder the pass never reads)
            lazy = _run_folded(shapes, 4, "cuda", wd, slots_n, defer=True, dtype=dtype, no_region=True)
            large = [p.numel() >= adamw.MIN_NUMEL for p in lazy[0]]
            assert [adamw._placeholder(p.grad) for p in lazy[0]] == large and any(large) and not all(large)
            _assert_same_bits(_state(*ref), _state(*lazy))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("backend", ["te", "reference"])
def test_training_steps_with_the_fold_in_the_pass_equal_native_eager(backend, monkeypatch):
    """Plain `step`s (no verification hook) of the captured h2048 pipeline, where the staged weight
    gradients of the last group reach AdamW unfolded and the Triton pass folds them: parameters and both
    moments bitwise equal to native eager's after 3 steps, with weight decay on."""
    from qeffect.config import load_config
    from qeffect.runtime.build import build_single_process
    from qeffect.verify.state import synthetic_batches

    if adamw._kernel() is None:
        pytest.skip("needs Triton")
    if backend == "te":
        pytest.importorskip("transformer_engine")
    fused, unfused = [], []
    real_fold_into, real_first = TritonAdamW.fold_into_step, adamw._fold_first

    def spy_fold_into(self, param, block, count, init):
        (fused if param.numel() >= adamw.MIN_NUMEL and adamw._fusable(block) else unfused).append(count)
        real_fold_into(self, param, block, count, init)

    monkeypatch.setattr(TritonAdamW, "fold_into_step", spy_fold_into)
    monkeypatch.setattr(adamw, "_fold_first", lambda folds: (unfused.extend(folds), real_first(folds)))
    cfg = load_config("examples/configs/h2048.toml").with_overrides(
        **{"train.device": "cuda", "fp8.backend": backend, "optim.weight_decay": 0.1})
    dev = torch.device("cuda", torch.cuda.current_device())
    native = build_single_process(cfg, native=True, device=dev)
    qeff = build_single_process(cfg, native=False, device=dev, path="captured-direct")
    for step in range(3):
        batches = synthetic_batches(cfg, step, dev)
        assert torch.equal(native.step(batches), qeff.step(batches))
    matrix = sum(len(c.matrix_params()) for r in qeff.ranks for c in r.chunks.values())
    assert len(fused) == 3 * matrix and not unfused  # every matrix weight, every step, in the fused pass
    assert set(fused) == {cfg.pipeline.microbatches}  # one staging group of all microbatches
    # so no region was ever made: the pass folded every weight's slots with a placeholder as its .grad
    assert all(r.arena.lazy_regions and not r.arena.regions_made for r in qeff.ranks)
    qeff.settle()  # the row-lazy token table (runtime/lazy_rows.py) up to date before reading it
    for rn, rq in zip(native.ranks, qeff.ranks, strict=True):
        for cn, cq in zip(rn.chunks.values(), rq.chunks.values(), strict=True):
            for (name, pn), (_, pq) in zip(cn.named_parameters(), cq.named_parameters(), strict=True):
                assert torch.equal(pn, pq), name
                for k in ("exp_avg", "exp_avg_sq"):
                    assert torch.equal(rn.optimizer.state[pn][k], rq.optimizer.state[pq][k]), (name, k)


def test_graph_policy_captures_the_second_equal_step_and_replays_with_the_host_bookkeeping(monkeypatch):
    """CPU, with the key, capture and graph faked: eager until the same work came twice, then a capture,
    then replays (which consume the folds and stamp the casts as the eager step does); new work runs
    eagerly and is captured again once it repeats."""
    p = torch.nn.Parameter(torch.zeros(4))
    opt = TritonAdamW([p], graph=True, **HYPER)
    keys = iter([None, "a", "a", "a", "a", "b", "a", "b", "b", "b"])
    ran: list[str] = []

    class FakeGraph:
        def __init__(self, key):
            self.key = key

        def replay(self):
            ran.append(f"replay:{self.key}")

    def fake_capture(self, key):
        self._step(None)
        ran[-1] = f"capture:{key}"
        self._graph, self._graph_key = FakeGraph(key), key
        self.graph_captures += 1

    stamps = []

    class Target:
        def mark_cast(self):
            stamps.append(len(ran))

    monkeypatch.setattr(TritonAdamW, "_work_key", lambda self: next(keys))
    monkeypatch.setattr(TritonAdamW, "_step", lambda self, closure: ran.append("eager"))
    monkeypatch.setattr(TritonAdamW, "_capture", fake_capture)
    opt._casts = {p: Target()}
    for _ in range(10):
        opt._folds = {p: (torch.zeros(1, 4), 1, True)}
        opt.step()
        assert not ran[-1].startswith("replay") or opt._folds == {}  # a replay consumes the fold
    assert ran == ["eager", "eager", "capture:a", "replay:a", "replay:a", "eager", "replay:a", "eager",
                   "capture:b", "replay:b"]
    assert opt.graph_captures == 2
    assert stamps == [4, 5, 7, 10]  # every replay stamped the cast (an eager step stamps in its launches)
    opt.use_graph(False)
    opt.step()
    assert ran[-1] == "eager" and opt._graph is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_graphed_step_is_bitwise_the_eager_step_with_folds_and_casts():
    """The step replayed from its graph against the eager step: parameters, moments, step counts and the
    cast's bytes, transpose, amax and 1 / scale, after every step; a new learning rate runs eagerly, then
    is captured anew."""
    from qeffect.fp8.weight_cast import WeightCastTarget

    if adamw._kernel() is None:
        pytest.skip("needs Triton")
    fp8 = torch.float8_e4m3fn
    shapes = [(1536, 1088), (adamw.MIN_NUMEL + 17,), (257, 129), (33,)]
    gen = torch.Generator("cuda").manual_seed(0)
    init = [torch.randn(s, device="cuda", generator=gen) * 0.02 for s in shapes]
    runs = []
    for graph in (False, True):
        params = [torch.nn.Parameter(w.clone()) for w in init]
        opt = TritonAdamW(params, graph=graph, weight_decay=0.1, **HYPER)
        rows, cols = shapes[0]
        target = WeightCastTarget("w", params[0], torch.zeros(shapes[0], dtype=fp8, device="cuda"),
                                  torch.zeros((cols, rows), dtype=fp8, device="cuda"),
                                  torch.full((1,), 97.5, device="cuda"), torch.zeros(1, device="cuda"),
                                  torch.zeros(1, device="cuda"))
        opt.cast_after_step(target)
        grads = [torch.empty_like(p) for p in params]  # fixed addresses, refilled in place, as the arena's
        slots = torch.empty((2, params[0].numel()), device="cuda", dtype=torch.bfloat16)
        runs.append((params, opt, target, grads, slots))
    for step in range(8):
        if step == 6:
            for _, opt, *_ in runs:
                opt.param_groups[0]["lr"] = 1e-3
        step_gen = torch.Generator("cuda").manual_seed(100 + step)
        fresh_grads = [torch.randn(s, device="cuda", generator=step_gen) * 1e-3 for s in shapes]
        fresh_slots = torch.randn((2, init[0].numel()), device="cuda", generator=step_gen).to(torch.bfloat16)
        for params, opt, target, grads, slots in runs:
            for p, g, f in zip(params, grads, fresh_grads, strict=True):
                g.copy_(f)
                p.grad = g
            slots.copy_(fresh_slots)
            opt.fold_into_step(params[0], slots, 2, init=False)
            opt.step()
            assert opt.pending_folds() == 0 and target.fresh
        (pa, oa, ta, *_), (pb, ob, tb, *_) = runs
        torch.cuda.synchronize()
        _assert_same_bits(_state(pa, oa), _state(pb, ob))
        for name in ("data", "transpose"):
            assert torch.equal(getattr(ta, name).view(torch.uint8), getattr(tb, name).view(torch.uint8)), (step, name)
        assert torch.equal(ta.pending_amax, tb.pending_amax) and torch.equal(ta.scale_inv, tb.scale_inv), step
        for t in (ta, tb):
            t.fold_pending_amax()
            t.mark_consumed()
    eager, graphed = runs[0][1], runs[1][1]
    assert (eager.graph_captures, eager.graph_replays) == (0, 0)
    # step 0 initializes the state, 1 is the first key, 2 captures (and replays), 3-5 replay; the new lr at
    # 6 runs eagerly, 7 captures it
    assert (graphed.graph_captures, graphed.graph_replays) == (2, 5)


def test_the_graph_key_names_every_address_and_refuses_what_the_pass_does_not_cover(monkeypatch):
    """`_work_key` (built by the host every step): the addresses of each live parameter, gradient and state
    tensor, so a moved gradient gives another key; None (no graph) for a state not yet made, a tensor the
    pass does not cover, a group option it does not take, or a group without gradients."""
    monkeypatch.setattr(adamw, "_kernel", lambda: object())
    monkeypatch.setattr(adamw, "_fp32_contiguous_cuda", lambda t: t.dtype == torch.float32 and t.is_contiguous())
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    params, opt = _run(torch.optim.AdamW, [(4, 3), (5,)], 1, "cpu", 0.0)
    opt.__class__ = TritonAdamW  # the state torch's step made, read as TritonAdamW's
    opt.tensor_lr, opt._folds, opt._lazy, opt._casts = False, {}, {}, {}
    key = opt._work_key()
    st = [opt.state[p] for p in params]
    assert key == ((3e-4, (0.9, 0.95), 1e-8, 0.0),
                   *((p.data_ptr(), p.numel(), p.grad.data_ptr(), s["step"].data_ptr(), s["exp_avg"].data_ptr(),
                      s["exp_avg_sq"].data_ptr()) for p, s in zip(params, st, strict=True)))
    params[1].grad = params[1].grad.clone()
    assert opt._work_key() != key
    params[1].grad = None  # a parameter without a gradient is not part of the step
    assert len(opt._work_key()) == 2
    params[0].grad = torch.zeros(3, 4).t()  # not contiguous
    assert opt._work_key() is None
    params[0].grad = None
    assert opt._work_key() is None  # no live parameter
    params[0].grad = torch.zeros(4, 3)
    del opt.state[params[0]]["exp_avg"]
    assert opt._work_key() is None
    opt.state[params[0]]["exp_avg"] = torch.zeros(4, 3)
    assert opt._work_key() is not None
    opt.param_groups[0]["amsgrad"] = True
    assert opt._work_key() is None
