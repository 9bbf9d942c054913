"""Reference FP8 backend: TE delayed-scaling semantics, the one GEMM, the weight cache, and the key
property that delaying `dW` changes nothing but its timing (bitwise)."""

from __future__ import annotations

import copy

import pytest
import torch

from qeffect.errors import UserError
from qeffect.fp8 import (
    STATE_NAMES,
    DelayedScalingRecipe,
    ReferenceBackend,
    RefFP8Linear,
    ScalingState,
    fp8_mm,
    get_backend,
    is_backend_linear,
)
from qeffect.fp8.base import TE_MISSING_MSG
from qeffect.model import GPTShape, build_chunks

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


# -- recipe -----------------------------------------------------------------------------------------
def test_recipe_defaults_dtypes_and_roundtrip():
    r = DelayedScalingRecipe()
    assert (r.margin, r.amax_history_len, r.amax_compute_algo, r.fp8_format) == (0, 4, "max", "HYBRID")
    assert r.fwd_dtype == E4M3 and r.bwd_dtype == E5M2
    assert r.fp8_max(E4M3) == 448.0 and r.fp8_max(E5M2) == 57344.0
    r2 = DelayedScalingRecipe(margin=2, amax_history_len=7, amax_compute_algo="most_recent")
    assert DelayedScalingRecipe.from_dict(r2.to_dict()) == r2
    with pytest.raises(ValueError):
        DelayedScalingRecipe.from_dict({**r2.to_dict(), "extra": 1})
    for bad in (
        {"margin": -1},
        {"amax_history_len": 0},
        {"amax_compute_algo": "mean"},
        {"fp8_format": "E4M3"},
    ):
        with pytest.raises(ValueError):
            DelayedScalingRecipe(**bad)


# -- scaling -----------------------------------------------------------------------------------------
def _state(algo="max", margin=0, length=4, dtype=E4M3):
    r = DelayedScalingRecipe(margin=margin, amax_history_len=length, amax_compute_algo=algo)
    return ScalingState.new(r, dtype)


def _feed(st: ScalingState, amax: float):
    return st.quantize(torch.tensor([amax, -amax / 4]))


def test_max_algo_hand_computed_with_rollover():
    st = _state("max")
    assert torch.equal(st.amax_history, torch.zeros(4)) and torch.equal(st.scale, torch.tensor(1.0))
    # (amax fed, expected history after the update, expected scale after the update)
    steps = [
        (2.0, [0, 0, 0, 2], 224.0),  # 448 / 2
        (8.0, [0, 0, 2, 8], 56.0),  # max(8, 2) = 8
        (1.0, [0, 2, 8, 1], 56.0),
        (0.5, [0, 8, 1, 0.5], 56.0),  # window [0.5, 2, 8, 1]: 2 leaves after this update
        (0.25, [0, 1, 0.5, 0.25], 56.0),  # window [0.25, 8, 1, 0.5]: 8 is still in (its 4th update)
        (0.25, [0, 0.5, 0.25, 0.25], 448.0),  # 8 rolled out after L = 4 updates: max(0.25, 1, 0.5, .25)
    ]
    for amax, hist, scale in steps:
        _feed(st, amax)
        assert torch.equal(st.amax_history, torch.tensor(hist)), (amax, st.amax_history)
        assert torch.equal(st.scale, torch.tensor(scale)), (amax, st.scale)


def test_most_recent_and_margin():
    st = _state("most_recent", margin=1)
    for amax, scale in [(2.0, 112.0), (8.0, 28.0), (1.0, 224.0)]:  # (448 / amax) / 2
        _feed(st, amax)
        assert torch.equal(st.scale, torch.tensor(scale))
    assert torch.equal(st.amax_history, torch.tensor([0.0, 2.0, 8.0, 1.0]))
    st = _state("max", margin=3, dtype=E5M2)
    _feed(st, 4.0)
    assert torch.equal(st.scale, torch.tensor(57344.0 / 4.0 / 8.0))


def test_history_length_one():
    st = _state("max", length=1)
    _feed(st, 8.0)
    _feed(st, 2.0)
    assert torch.equal(st.scale, torch.tensor(224.0)) and torch.equal(st.amax_history, torch.zeros(1))


@pytest.mark.parametrize("bad", [0.0, float("inf"), float("nan")])
def test_zero_or_nonfinite_amax_keeps_scale(bad):
    st = _state("most_recent")
    _feed(st, 2.0)
    assert torch.equal(st.scale, torch.tensor(224.0))
    st.quantize(torch.tensor([bad, 0.0]))
    assert torch.equal(st.scale, torch.tensor(224.0))
    fresh = _state("max")
    fresh.quantize(torch.full((3,), bad))
    assert torch.equal(fresh.scale, torch.tensor(1.0))


def test_tiny_amax_gives_fp32_max_scale():
    st = _state("most_recent")
    st.quantize(torch.tensor([1e-38, 0.0]))  # 448 / 1e-38 overflows fp32
    assert torch.equal(st.scale, torch.tensor(torch.finfo(torch.float32).max))


def test_quantize_uses_current_scale_and_returns_own_scale_inv():
    st = _state("max")
    x = torch.tensor([1.0, -3.0, 0.5, 2.0])
    q, sinv = st.quantize(x)
    assert q.dtype == E4M3 and torch.equal(q.float(), x) and torch.equal(sinv, torch.tensor(1.0))
    scale1 = torch.tensor(448.0) / torch.tensor(3.0)  # fp32 division, as in the update
    assert torch.equal(st.scale, scale1)
    assert torch.equal(sinv, torch.tensor(1.0)), "scale_inv must not alias the updated scale"
    q2, sinv2 = st.quantize(x)
    assert torch.equal(sinv2, scale1.reciprocal())
    assert torch.equal(q2.float(), (x * scale1).to(E4M3).float())


def test_quantization_saturates():
    st = _state("max")
    q, _ = st.quantize(torch.tensor([1000.0, -1000.0, 3.0]))
    assert torch.equal(q.float(), torch.tensor([448.0, -448.0, 3.0]))
    st = _state("max", dtype=E5M2)
    q, _ = st.quantize(torch.tensor([1e6, -1e6, 4.0]))
    assert torch.equal(q.float(), torch.tensor([57344.0, -57344.0, 4.0]))


# -- GEMM -----------------------------------------------------------------------------------------
def test_fp8_mm_layout_and_scales_exact():
    a = torch.tensor([[1.0, 2.0], [3.0, 4.0]]).to(E4M3)
    b = torch.tensor([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]]).to(E5M2)
    y = fp8_mm(a, torch.tensor(0.5), b.to(E4M3), torch.tensor(0.25), torch.float32)
    assert torch.equal(y, torch.tensor([[1.0, 2.0, 3.0], [3.0, 4.0, 7.0]]) / 8)
    y = fp8_mm(b, torch.tensor(2.0), a, torch.tensor(1.0), torch.bfloat16)  # e5m2 x e4m3 is allowed
    assert y.dtype == torch.bfloat16 and torch.equal(y.float(), 2 * torch.tensor([[1.0, 3], [2, 4], [3, 7]]))
    with pytest.raises(ValueError, match="E5M2 x E5M2"):
        fp8_mm(b, torch.tensor(1.0), b, torch.tensor(1.0), torch.float32)
    with pytest.raises(ValueError, match="inner"):
        fp8_mm(a, torch.tensor(1.0), torch.zeros(2, 3).to(E4M3), torch.tensor(1.0), torch.float32)


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_fp8_mm_out_is_bitwise_equal(out_dtype):
    g = torch.Generator().manual_seed(0)
    a = (torch.randn(24, 40, generator=g) * 30).to(E5M2)
    b = (torch.randn(16, 40, generator=g) * 30).to(E4M3)
    sa, sb = torch.tensor(0.013), torch.tensor(0.37)
    ref = fp8_mm(a, sa, b, sb, out_dtype)
    arena = torch.full((3 * 24 * 16,), float("nan"), dtype=out_dtype)
    view = arena[24 * 16 : 2 * 24 * 16].view(24, 16)
    got = fp8_mm(a, sa, b, sb, out_dtype, out=view)
    assert got is view and torch.equal(view, ref)
    assert arena[: 24 * 16].isnan().all() and arena[2 * 24 * 16 :].isnan().all()
    with pytest.raises(ValueError, match="out="):
        fp8_mm(a, sa, b, sb, out_dtype, out=torch.empty(16, 24, dtype=out_dtype))
    with pytest.raises(ValueError, match="contiguous"):
        fp8_mm(a, sa, b, sb, out_dtype, out=torch.empty(16, 24, dtype=out_dtype).t())


def test_fp8_mm_bias_on_the_cpu_is_the_rounded_product_plus_the_bias():
    """No epilogue on the CPU: the product rounded to the output dtype, then the bias (in it) added."""
    g = torch.Generator().manual_seed(0)
    a, b = (torch.randn(24, 40, generator=g) * 30).to(E5M2), (torch.randn(16, 40, generator=g) * 30).to(E4M3)
    sa, sb, bias = torch.tensor(0.013), torch.tensor(0.37), torch.randn(16, generator=g)
    for out_dtype in (torch.float32, torch.bfloat16):
        got = fp8_mm(a, sa, b, sb, out_dtype, bias=bias)
        assert got.dtype == out_dtype and torch.equal(got, fp8_mm(a, sa, b, sb, out_dtype) + bias.to(out_dtype))
    with pytest.raises(ValueError, match="bias= and out="):
        fp8_mm(a, sa, b, sb, torch.float32, out=torch.empty(24, 16), bias=bias)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fp8_mm_cuda_adds_a_16_bit_bias_in_the_epilogue():
    """bf16 output: the bias is added to the fp32 result inside the GEMM and rounded once, so the result
    is not the rounded product plus the bias (a separate add) and is no farther from the exact sum, summed
    over the elements; fp32 outputs add it after."""
    g = torch.Generator().manual_seed(0)
    a = (torch.randn(256, 512, generator=g) * 30).to(E4M3).cuda()
    b = (torch.randn(384, 512, generator=g) * 30).to(E4M3).cuda()
    sa, sb = torch.tensor(0.013, device="cuda"), torch.tensor(0.037, device="cuda")
    bias = (torch.randn(384, generator=g) * 3).cuda()
    fused = fp8_mm(a, sa, b, sb, torch.bfloat16, bias=bias)
    apart = fp8_mm(a, sa, b, sb, torch.bfloat16) + bias.to(torch.bfloat16)
    exact = fp8_mm(a, sa, b, sb, torch.float32).double() + bias.to(torch.bfloat16).double()
    assert not torch.equal(fused, apart)
    assert (fused.double() - exact).abs().sum() <= (apart.double() - exact).abs().sum()
    assert torch.equal(fp8_mm(a, sa, b, sb, torch.float32, bias=bias), fp8_mm(a, sa, b, sb, torch.float32) + bias)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fp8_mm_cuda_out_is_bitwise_equal():
    g = torch.Generator().manual_seed(0)
    for out_dtype in (torch.float32, torch.bfloat16):
        a = (torch.randn(64, 128, generator=g) * 30).to(E5M2).cuda()
        b = (torch.randn(48, 128, generator=g) * 30).to(E4M3).cuda()
        sa, sb = torch.tensor(0.013, device="cuda"), torch.tensor(0.37, device="cuda")
        ref = fp8_mm(a, sa, b, sb, out_dtype)
        cpu = fp8_mm(a.cpu(), sa.cpu(), b.cpu(), sb.cpu(), out_dtype)
        # CPU vs GPU are not bitwise (FP8 tensor cores accumulate with limited precision): a sanity check.
        assert (ref.cpu().float() - cpu.float()).abs().max() < 1e-2 * cpu.float().abs().max()
        arena = torch.zeros(4 * 64 * 48 + 8, dtype=out_dtype, device="cuda")
        for off in (0, 64 * 48, 3 * 64 * 48 + 8):
            view = arena[off : off + 64 * 48].view(64, 48)
            assert torch.equal(fp8_mm(a, sa, b, sb, out_dtype, out=view), ref)


# -- the linear layer ---------------------------------------------------------------------------------
def _linear(in_f=32, out_f=16, bias=True, seed=0, recipe=None):
    lin = RefFP8Linear(in_f, out_f, bias, recipe or DelayedScalingRecipe())
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(out_f, in_f, generator=g) * 0.1)
        if bias:
            lin.bias.copy_(torch.randn(out_f, generator=g) * 0.1)
    return lin


def test_fp8_state_names_and_state_dict():
    lin = _linear()
    assert tuple(lin.fp8_state()) == STATE_NAMES
    sd = lin.state_dict()
    for name in STATE_NAMES:
        assert sd[name] is lin.fp8_state()[name] or torch.equal(sd[name], lin.fp8_state()[name])
    assert set(sd) == {"weight", "bias", *STATE_NAMES}
    assert is_backend_linear(lin) and not is_backend_linear(torch.nn.Linear(2, 2))


def test_weight_cache_refresh_reuse_and_empty():
    lin = _linear()
    x = torch.randn(2, 3, 32)
    assert not lin.cache_valid
    with pytest.raises(RuntimeError, match="weight cache is empty"):
        lin(x, is_first_microbatch=False)
    y0 = lin(x, is_first_microbatch=True)
    assert lin.cache_valid and y0.shape == (2, 3, 16)
    cache = lin.weight_cache
    assert torch.equal(lin.weight_amax_history[-1], lin.weight.abs().amax())
    assert torch.equal(lin.weight_scale, 448.0 / lin.weight.abs().amax())
    assert torch.equal(cache.w_q_t, cache.w_q.t()) and cache.w_q_t.is_contiguous()
    w_state = {k: v.clone() for k, v in lin.fp8_state().items() if k.startswith("weight")}
    with torch.no_grad():
        lin.weight.mul_(3.0)  # a stale weight must not be seen until the next refresh
    y1 = lin(x, is_first_microbatch=False)
    assert lin.weight_cache is cache
    assert all(torch.equal(lin.fp8_state()[k], v) for k, v in w_state.items())
    # Same cached weight and bias; the input scale moved on, so compare with a fresh clone path.
    y2 = lin(x, is_first_microbatch=True)
    assert lin.weight_cache is not cache and not torch.equal(y1, y2)
    lin.invalidate_cache()
    assert not lin.cache_valid
    with pytest.raises(RuntimeError, match="first microbatch after a commit or resume"):
        lin(x, is_first_microbatch=False)


def test_forward_backward_exact_on_representable_values():
    """Small integers are exact in E4M3/E5M2 at scale 1 (the first use): checks the layouts."""
    lin = RefFP8Linear(3, 2, True, DelayedScalingRecipe())
    with torch.no_grad():
        lin.weight.copy_(torch.tensor([[1.0, 2.0, -1.0], [0.0, 3.0, 4.0]]))
        lin.bias.copy_(torch.tensor([0.5, -0.25]))
    x = torch.tensor([[[1.0, 0.0, 2.0], [2.0, -1.0, 1.0]]], requires_grad=True)
    dy = torch.tensor([[[1.0, -2.0], [3.0, 1.0]]])
    y = lin(x, is_first_microbatch=True)
    w, b = lin.weight.detach(), lin.bias.detach()
    assert torch.equal(y, x.detach() @ w.t() + b)
    y.backward(dy)
    assert torch.equal(x.grad, dy @ w)
    assert torch.equal(lin.weight.grad, dy.reshape(-1, 2).t() @ x.detach().reshape(-1, 3))
    assert torch.equal(lin.bias.grad, dy.reshape(-1, 2).sum(0))


def test_backward_updates_grad_state_exactly_once_and_dw_none():
    lin = _linear()
    lin.delay_wgrad = True
    x = torch.randn(4, 32, requires_grad=True)
    dy = torch.randn(4, 16) * 1e-3
    before = {k: v.clone() for k, v in lin.fp8_state().items()}
    y = lin(x, is_first_microbatch=True)
    after_f = {k: v.clone() for k, v in lin.fp8_state().items()}
    for k in STATE_NAMES:  # F: input and weight transitions, no grad transition
        assert torch.equal(before[k], after_f[k]) == k.startswith("grad"), k
    expect = ScalingState.new(lin.recipe, E5M2)
    expect.quantize(dy)
    y.backward(dy)
    assert torch.equal(lin.grad_amax_history, expect.amax_history)
    assert torch.equal(lin.grad_scale, expect.scale)
    assert lin.weight.grad is None and lin.bias.grad is not None and len(lin.wgrad_store) == 1
    after_di = {k: v.clone() for k, v in lin.fp8_state().items()}
    work = lin.pop_wgrad_work()
    assert len(work) == 1 and lin.wgrad_store == []
    lin.compute_wgrad(work[0])
    assert all(torch.equal(after_di[k], v) for k, v in lin.fp8_state().items()), "dW must not touch state"
    with pytest.raises(ValueError):
        lin.compute_wgrad(work[0], out=torch.empty(32, 16))


# -- bitwise: native full backward == delayed dW ------------------------------------------------------
class Trace:
    """Named tensors recorded in order; two traces must match name for name, bit for bit."""

    def __init__(self) -> None:
        self.items: list[tuple[str, torch.Tensor]] = []

    def add(self, name: str, t: torch.Tensor | None) -> None:
        assert t is not None, name
        self.items.append((name, t.detach().clone()))

    def add_dict(self, prefix: str, d: dict[str, torch.Tensor]) -> None:
        for k, v in d.items():
            self.add(f"{prefix}{k}", v)

    def assert_equal(self, other: Trace) -> None:
        assert [n for n, _ in self.items] == [n for n, _ in other.items]
        for (name, a), (_, b) in zip(self.items, other.items, strict=True):
            assert a.dtype == b.dtype and a.shape == b.shape, name
            assert torch.equal(a, b), f"mismatch at {name}"


def _drain_delayed(modules: dict[str, RefFP8Linear], n_micro: int) -> None:
    """Run retained dW out of order into per-microbatch "arena" views, then sum in microbatch order
    (the order autograd accumulates in the native path) into `.grad`."""
    for name, mod in modules.items():
        work = mod.pop_wgrad_work()
        assert len(work) == n_micro, name
        arena = torch.empty(n_micro, *mod.weight.shape, dtype=mod.weight.dtype, device=mod.weight.device)
        for m in reversed(range(n_micro)):  # non-LIFO / arbitrary dW order
            got = mod.compute_wgrad(work[m], out=arena[m])
            assert got.data_ptr() == arena[m].data_ptr()
        acc = arena[0].clone()
        for m in range(1, n_micro):
            acc += arena[m]
        mod.weight.grad = acc


def _sgd(params, lr=0.5):
    with torch.no_grad():
        for p in params:
            p -= lr * p.grad
            p.grad = None


def _run_linear(lin: RefFP8Linear, delay: bool, steps=2, micro=3) -> Trace:
    lin.delay_wgrad = delay
    tr = Trace()
    g = torch.Generator().manual_seed(1)
    for step in range(steps):
        for m in range(micro):
            x = (torch.randn(2, 5, 32, generator=g) * (1 + 3 * m)).requires_grad_()
            dy = torch.randn(2, 5, 16, generator=g) * 10.0 ** (-m)
            y = lin(x, is_first_microbatch=m == 0)
            y.backward(dy)
            tr.add(f"{step}.{m}.y", y)
            tr.add(f"{step}.{m}.dx", x.grad)
            tr.add(f"{step}.{m}.dbias", lin.bias.grad)
            tr.add_dict(f"{step}.{m}.", lin.fp8_state())
        if delay:
            assert lin.weight.grad is None
            _drain_delayed({"lin": lin}, micro)
        tr.add(f"{step}.dw", lin.weight.grad)
        _sgd(lin.parameters())
    return tr


@pytest.mark.parametrize("algo", ["max", "most_recent"])
def test_linear_delayed_wgrad_is_bitwise_native(algo):
    lin = _linear(recipe=DelayedScalingRecipe(margin=1, amax_history_len=2, amax_compute_algo=algo))
    native = _run_linear(copy.deepcopy(lin), delay=False)
    delayed = _run_linear(copy.deepcopy(lin), delay=True)
    native.assert_equal(delayed)
    # The oracle can fail: a different data order changes the trace.
    other = _run_linear(copy.deepcopy(lin), delay=False, micro=2)
    with pytest.raises(AssertionError):
        native.assert_equal(other)


def _run_pipeline(chunks, delay: bool, steps=2, micro=3, seq=8, bsz=2, vocab=64, device="cpu") -> Trace:
    """GPipe order per step (all F, then all backward in microbatch order) across the chunks."""
    for c in chunks:
        c.set_delay_wgrad(delay)
    tr = Trace()
    g = torch.Generator().manual_seed(2)
    for step in range(steps):
        tapes = []
        for m in range(micro):
            ids = torch.randint(0, vocab, (bsz, seq), generator=g).to(device)
            x, boundary = ids, []
            for s, c in enumerate(chunks):
                if s:
                    x = x.detach().requires_grad_()
                    boundary.append(x)
                x = c(x, is_first_microbatch=m == 0, targets=ids if c.is_last else None)
                tr.add(f"{step}.{m}.F{s}", x)
                boundary.append(x)
            tapes.append(boundary)
        for m, boundary in enumerate(tapes):  # dI for every stage, last to first
            grad = None
            for s in reversed(range(len(chunks))):
                out = boundary[2 * s]
                out.backward(grad)
                if s:
                    grad = boundary[2 * s - 1].grad
                    tr.add(f"{step}.{m}.dI{s}", grad)
                for c in chunks:
                    tr.add_dict(f"{step}.{m}.dI{s}.s{c.stage}.", c.fp8_state())
                tr.add_dict(
                    f"{step}.{m}.dI{s}.grad.", {k: p.grad for k, p in chunks[s].nonmatrix_params().items()}
                )
        for c in chunks:
            if delay:
                assert all(p.grad is None for p in c.matrix_params().values())
                _drain_delayed(c.matrix_linears(), micro)
            tr.add_dict(f"{step}.dW.s{c.stage}.", {k: p.grad for k, p in c.matrix_params().items()})
            _sgd(c.parameters(), lr=0.1)
    return tr


def _build(num_stages, device="cpu", dtype=torch.float32):
    shape = GPTShape(
        vocab_size=64,
        hidden=32,
        ffn=64,
        heads=4,
        layers_per_chunk=1,
        seq_len=8,
        microbatch_size=2,
        num_stages=num_stages,
    )
    backend = ReferenceBackend(DelayedScalingRecipe(amax_history_len=2))
    return build_chunks(shape, backend, seed=3, device=device, dtype=dtype)


@pytest.mark.parametrize(
    ("num_stages", "dtype"), [(1, torch.float32), (2, torch.float32), (2, torch.bfloat16)]
)
def test_chunks_delayed_wgrad_is_bitwise_native(num_stages, dtype):
    chunks = _build(num_stages, dtype=dtype)
    native = _run_pipeline(copy.deepcopy(chunks), delay=False)
    delayed = _run_pipeline(copy.deepcopy(chunks), delay=True)
    assert len(native.items) > 100
    native.assert_equal(delayed)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_chunks_delayed_wgrad_is_bitwise_native_cuda(dtype):
    chunks = _build(2, device="cuda", dtype=dtype)
    native = _run_pipeline(copy.deepcopy(chunks), delay=False, device="cuda")
    delayed = _run_pipeline(copy.deepcopy(chunks), delay=True, device="cuda")
    native.assert_equal(delayed)


# -- registry -------------------------------------------------------------------------------------
def test_get_backend():
    r = DelayedScalingRecipe()
    b = get_backend("reference", r)
    assert b.name == "reference" and b.recipe is r
    assert b.state_transitions["dW"] == () and set(b.state_transitions) == {"F", "dI", "dW"}
    assert set(b.state_transitions["dI"]) == {"grad_amax_history", "grad_scale"}
    assert isinstance(b.linear(4, 8, True, device="cpu", dtype=torch.float32), RefFP8Linear)
    with pytest.raises(UserError, match="unknown FP8 backend"):
        get_backend("nope", r)
    try:
        import transformer_engine.pytorch  # noqa: F401
    except Exception:
        with pytest.raises(UserError) as err:
            get_backend("te", r)
        assert str(err.value) == TE_MISSING_MSG
    else:
        assert get_backend("te", r).name == "te"


# -- the weight-gradient GEMM's dtype ------------------------------------------------------------------
def _wgrad_works(lin: RefFP8Linear, micro: int = 3) -> list:
    """`micro` retained dW works of bf16 activations through an fp32-weight linear (fp32 masters)."""
    lin.delay_wgrad = True
    g = torch.Generator().manual_seed(1)
    for m in range(micro):
        x = torch.randn(8, lin.in_features, generator=g).to(torch.bfloat16).requires_grad_()
        lin(x, is_first_microbatch=m == 0).backward(torch.randn(8, lin.out_features, generator=g).to(torch.bfloat16))
    return lin.pop_wgrad_work()


def test_the_wgrad_gemm_writes_the_activation_dtype_and_sums_as_autograd() -> None:
    """bf16 activations: the GEMM writes bf16 (a staging slot is its own output), and every destination
    gets the bits of autograd's cast to fp32 and AccumulateGrad's sum; fp32 activations: fp32."""
    lin = _linear()
    works = _wgrad_works(lin)
    assert lin.wgrad_dtype(torch.bfloat16) == torch.bfloat16 and works[0].activation_dtype == torch.bfloat16
    full = [lin.compute_wgrad(w) for w in works]  # the native path's values: fp32 casts of the GEMM's bf16
    assert all(d.dtype == torch.float32 and torch.equal(d, d.bfloat16().float()) for d in full)
    slots = torch.empty(len(works), *lin.weight.shape, dtype=torch.bfloat16)
    for m in reversed(range(len(works))):  # any order into its slot: the GEMM's own output
        assert lin.compute_wgrad(works[m], out=slots[m]).data_ptr() == slots[m].data_ptr()
    assert all(torch.equal(s.float(), d) for s, d in zip(slots, full, strict=True))
    acc = torch.empty_like(lin.weight)  # the accumulating arena: copy, then mixed-dtype adds
    lin.compute_wgrad(works[0], out=acc)
    for w in works[1:]:
        lin.compute_wgrad(w, out=acc, accumulate=True)
    native = full[0].clone()
    for d in full[1:]:
        native += d
    assert torch.equal(acc, native)
    with pytest.raises(ValueError, match="dW destination"):  # a bf16 slot cannot be added into
        lin.compute_wgrad(works[0], out=slots[0], accumulate=True)
    assert lin.wgrad_dtype(torch.float32) == torch.float32


# -- the weight cast in the optimizer's pass ----------------------------------------------------------
def _optimizer_cast(t) -> None:
    """What `TritonAdamW`'s cast writes (GPU-tested there), in torch: the weight quantized with the forward
    weight scale, its transpose, `1 / scale`, the amax pending; marked as the cast of the weight as it is."""
    from qeffect.fp8.scaling import cast_fp8

    q = cast_fp8(t.weight.detach(), t.scale, torch.float8_e4m3fn)
    t.data.copy_(q)
    t.transpose.copy_(q.t())
    t.scale_inv.view(1).copy_(t.scale.reciprocal())  # the kernel stores one element
    t.pending_amax.copy_(t.weight.detach().abs().amax())
    t.mark_cast()


def test_a_first_forward_takes_the_optimizers_cast_with_the_bits_of_quantizing_itself() -> None:
    """Over steps with weight updates, a linear whose optimizer casts its weight gives the outputs, cached
    bytes, `1 / scale` and FP8 state of one that quantizes in its first forward; a stale cast (the weight
    changed after it, or the cache was invalidated) is not taken."""
    cast_lin, plain = _linear(), _linear()
    target = cast_lin.weight_cast_target("lin")
    assert cast_lin.weight_cast_target("lin") is target
    g = torch.Generator().manual_seed(3)
    for step in range(4):
        if step != 2:  # step 2: no cast since the update (stale): the forward quantizes itself
            _optimizer_cast(target)
        x = torch.randn(6, 32, generator=g) * (step + 1)
        y_cast, y_plain = cast_lin(x, is_first_microbatch=True), plain(x, is_first_microbatch=True)
        assert torch.equal(y_cast, y_plain), step
        a, b = cast_lin.weight_cache, plain.weight_cache
        assert (a.w_q.data_ptr() == target.data.data_ptr()) == (step != 2), step
        for u, v in ((a.w_q, b.w_q), (a.w_q_t, b.w_q_t), (a.scale_inv, b.scale_inv)):
            # the tapes save these: offload's groups check shape, stride and dtype against discovery's
            assert (u.shape, u.stride(), u.dtype) == (v.shape, v.stride(), v.dtype), step
            assert torch.equal(u.reshape(-1).view(torch.uint8), v.reshape(-1).view(torch.uint8)), step
        for k, v in plain.fp8_state().items():
            assert torch.equal(cast_lin.fp8_state()[k], v), (step, k)
        assert not target.fresh and float(target.pending_amax) == 0.0  # consumed (or never cast)
        with torch.no_grad():  # the optimizer's update
            for lin in (cast_lin, plain):
                lin.weight.mul_(1.5).add_(0.01)
    _optimizer_cast(target)
    cast_lin.invalidate_cache()  # e.g. a resume: the cast may be of another scale
    assert not target.fresh
    assert not torch.equal(plain.weight_scale, torch.ones(()))  # the scales really moved


def test_the_weight_cast_target_needs_e4m3_from_fp32() -> None:
    lin = RefFP8Linear(4, 2, False, DelayedScalingRecipe(), dtype=torch.bfloat16)
    with pytest.raises(RuntimeError, match="E4M3 from an fp32 weight"):
        lin.weight_cast_target("lin")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_captured_reference_verifies_with_the_weight_cast_in_the_optimizer() -> None:
    """Captured reference training (bf16 activations, fp32 masters) with the weights cast in the optimizer's
    pass verifies against native eager, cached bytes and FP8 state included; after a step every target is
    cast for the next."""
    from qeffect.config import load_config
    from qeffect.runtime.build import build_single_process
    from qeffect.verify.state import run_verify_state, synthetic_batches

    cfg = load_config().with_overrides(**{"train.device": "cuda", "train.dtype": "bfloat16"})
    report = run_verify_state(cfg, steps=3, path="captured-direct")
    assert report.passed, report.first_divergence
    assert {c.category: c for c in report.categories}["cache_contents"].compared > 0
    pipe = build_single_process(cfg, native=False, device="cuda", path="captured-direct")
    targets = [t for r in pipe.ranks for a in r.actions.values() for t in a.weight_casts]
    for s in range(2):
        pipe.step(synthetic_batches(cfg, s, "cuda"))
    assert targets and all(t.captured and t.fresh for t in targets)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_bias_is_cast_once_per_epoch_for_the_gemm_epilogue() -> None:
    """On CUDA with bf16 activations the first microbatch casts the fp32 bias into the module's buffer and
    every forward of the epoch reads it: the outputs and the fp32 bias gradients are those of the per-call
    cast, bit for bit (a module built alike with ``bias_cast`` switched off), and a bias changed within the epoch is not
    seen until the next first microbatch (the buffer is the epoch's, as the weight cache)."""
    torch.manual_seed(0)
    a = RefFP8Linear(64, 32, True, DelayedScalingRecipe(), device="cuda")
    with torch.no_grad():
        a.weight.normal_()
        a.bias.normal_()
    b = copy.deepcopy(a)
    b.bias_cast = lambda dtype: None  # the per-call cast
    xs = [torch.randn(16, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3)]
    for k, x in enumerate(xs):
        ya, yb = a(x, is_first_microbatch=k == 0), b(x, is_first_microbatch=k == 0)
        assert torch.equal(ya.view(torch.int16), yb.view(torch.int16))
        g = torch.randn_like(ya)
        ya.backward(g)
        yb.backward(g)
        # the bias gradient stays fp32 (summed from the output gradient in fp32), as without the cast
        assert a.bias.grad.dtype == torch.float32 and torch.equal(a.bias.grad.view(torch.int32),
                                                                 b.bias.grad.view(torch.int32))
    buf = a._bias_buffer
    assert buf is not None and buf.dtype == torch.bfloat16 and torch.equal(buf, a.bias.to(torch.bfloat16))
    old = a.bias.detach().clone()
    with torch.no_grad():
        a.bias.add_(1.0)
        b.bias.copy_(a.bias)
    stale = a(xs[0], is_first_microbatch=False)  # within the epoch: the epoch's cast
    assert torch.equal(buf, old.to(torch.bfloat16)) and not torch.equal(stale, b(xs[0], is_first_microbatch=True))
    fresh = a(xs[0], is_first_microbatch=True)  # the next epoch: cast again, into the same buffer
    assert a._bias_buffer is buf and torch.equal(buf, a.bias.to(torch.bfloat16))
    assert torch.equal(fresh.view(torch.int16), b(xs[0], is_first_microbatch=False).view(torch.int16))
