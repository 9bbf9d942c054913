"""The fused FP8 quantization (`fp8.fused_quantize`) against the torch sequence it replaces, bit for bit.

GPU only (the fused path needs CUDA and Triton). Every FP8 byte and the transpose must be identical;
the amax must have the same bits (for a NaN input: both NaN, payloads may differ -- see the module).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]


def _fused():
    from qeffect.fp8 import fused_quantize

    if fused_quantize._kernel() is None:
        pytest.skip("needs Triton")
    return fused_quantize


def _special(shape: tuple[int, int], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random values over many magnitudes, with zeros, -0, subnormals, huge values and infinities."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(shape, device="cuda", generator=g) * torch.exp2(torch.randint(-30, 30, shape, device="cuda",
                                                                                  generator=g).float())
    flat = x.view(-1)
    k = max(1, flat.numel() // 16)
    picks = torch.randint(0, flat.numel(), (6, k), device="cuda", generator=g)
    flat[picks[0]] = 0.0
    flat[picks[1]] = -0.0
    flat[picks[2]] = 1e-40  # a subnormal (in bf16 too, about 9.2e-41)
    flat[picks[3]] = -3e38
    flat[picks[4]] = float("inf")
    flat[picks[5]] = -float("inf")
    return x.to(dtype)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def torch_transition(st, x: torch.Tensor, transpose: bool) -> tuple:  # noqa: ANN001 - a ScalingState
    """What a `ScalingState` runs without the fused passes (the CPU's path), in torch: `1 / scale`, the
    quantization with its amax recorded (`quantize_sequence`), then `update_scale`."""
    from qeffect.fp8.fused_quantize import quantize_sequence
    from qeffect.fp8.scaling import update_scale

    inv = st.scale.reciprocal()
    q, qt = quantize_sequence(x, st.scale, st.amax_history[0], st.fp8_dtype, transpose)
    update_scale(st.amax_history, st.scale, st.fmax, st.margin, st.amax_compute_algo)
    return (q, qt, inv) if transpose else (q, inv)


@pytest.mark.parametrize("fp8", FP8)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(1, 1), (3, 5), (64, 64), (255, 1000), (256, 4096), (4096, 1), (1000, 257)])
@pytest.mark.parametrize("scale", [1.0, 0.37, 1e-3, 3.5e4])
def test_fused_quantize_is_bitwise_the_sequence(fp8, dtype, shape, scale) -> None:
    """The kernel's transpose for 16-bit inputs, `transpose_bytes` after it for fp32 ones: torch's bytes."""
    fq = _fused()
    for seed, special in ((0, False), (1, True)):
        x = _special(shape, dtype, seed) if special else (torch.randn(shape, device="cuda") * 3).to(dtype)
        s = torch.tensor(scale, device="cuda")
        assert fq.fused_available(x)
        a_ref, a_got = torch.full((), 7.0, device="cuda"), torch.full((), 7.0, device="cuda")
        q_ref, qt_ref = fq.quantize_sequence(x, s, a_ref, fp8, transpose=True)
        q, qt = fq.quantize_amax(x, s, a_got, fp8, transpose=True)
        assert q.is_contiguous() and qt.is_contiguous() and qt.shape == (shape[1], shape[0])
        assert _same_bits(q, q_ref), (fp8, dtype, shape, scale, special)
        assert _same_bits(qt, qt_ref)
        assert torch.equal(a_got.view(torch.int32), a_ref.view(torch.int32)), (a_got, a_ref)
        q2, none = fq.quantize_amax(x, s, a_got, fp8, transpose=False)
        assert none is None and _same_bits(q2, q_ref)


@pytest.mark.parametrize("fp8", FP8)
def test_nan_input_gives_nan_amax_and_the_sequence_bytes_elsewhere(fp8) -> None:
    fq = _fused()
    x = torch.randn(128, 96, device="cuda", dtype=torch.bfloat16)
    x[5, 7] = float("nan")
    s = torch.tensor(2.0, device="cuda")
    a_ref, a_got = torch.zeros((), device="cuda"), torch.zeros((), device="cuda")
    q_ref, _ = fq.quantize_sequence(x, s, a_ref, fp8, transpose=False)
    q, _ = fq.quantize_amax(x, s, a_got, fp8, transpose=False)
    assert torch.isnan(a_ref) and torch.isnan(a_got)
    keep = torch.ones_like(x, dtype=torch.bool)
    keep[5, 7] = False
    assert torch.equal(q.view(torch.uint8)[keep], q_ref.view(torch.uint8)[keep])
    assert torch.isnan(q[5, 7].float()) and torch.isnan(q_ref[5, 7].float())
    print(f"NaN byte: fused {q.view(torch.uint8)[5, 7].item():#x}, torch {q_ref.view(torch.uint8)[5, 7].item():#x}")


def test_reversing_the_scale_changes_the_bytes() -> None:
    """The comparison above can fail: a different scale gives different bytes."""
    fq = _fused()
    x = torch.randn(64, 64, device="cuda")
    a = torch.zeros((), device="cuda")
    q1, _ = fq.quantize_amax(x, torch.tensor(1.0, device="cuda"), a, torch.float8_e4m3fn)
    q2, _ = fq.quantize_amax(x, torch.tensor(1.5, device="cuda"), a, torch.float8_e4m3fn)
    assert not _same_bits(q1, q2)


def test_fused_quantize_captures_into_a_graph() -> None:
    fq = _fused()
    x = torch.randn(256, 512, device="cuda", dtype=torch.bfloat16)
    s = torch.tensor(0.5, device="cuda")
    hist = torch.zeros(4, device="cuda")
    fq.quantize_amax(x, s, hist[0], torch.float8_e4m3fn, transpose=True)  # compile outside the capture
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        q, qt = fq.quantize_amax(x, s, hist[0], torch.float8_e4m3fn, transpose=True)
    x.copy_(torch.randn_like(x) * 4)
    hist.zero_()
    g.replay()
    ref_a = torch.zeros((), device="cuda")
    q_ref, qt_ref = fq.quantize_sequence(x, s, ref_a, torch.float8_e4m3fn, transpose=True)
    torch.cuda.synchronize()
    assert _same_bits(q, q_ref) and _same_bits(qt, qt_ref) and torch.equal(hist[0], ref_a)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])  # fp32: master weights
def test_scaling_state_pair_equals_quantize_then_transpose(dtype) -> None:
    """`ScalingState.quantize_pair` on a GPU (fused) against the torch path (`torch_transition`)."""
    from qeffect.fp8.recipe import DelayedScalingRecipe
    from qeffect.fp8.scaling import ScalingState

    _fused()
    x = torch.randn(320, 704, device="cuda", dtype=dtype) * 10
    out = []
    for fused in (True, False):
        st = ScalingState.new(DelayedScalingRecipe(), torch.float8_e4m3fn, device="cuda")
        # three transitions: scales move
        res = [st.quantize_pair(x * (k + 1)) if fused else torch_transition(st, x * (k + 1), True) for k in range(3)]
        out.append((res, st.amax_history.clone(), st.scale.clone()))
    (ra, ha, sa), (rb, hb, sb) = out
    assert torch.equal(ha, hb) and torch.equal(sa, sb)
    for (qa, qta, ia), (qb, qtb, ib) in zip(ra, rb, strict=True):
        assert _same_bits(qa, qb) and _same_bits(qta, qtb) and torch.equal(ia, ib)


@pytest.mark.parametrize("shape", [(1, 1), (3, 5), (64, 64), (255, 1000), (256, 4096), (4096, 1), (1000, 257)])
def test_transpose_bytes_is_torch_transpose(shape) -> None:
    fq = _fused()
    q = torch.randint(0, 256, shape, dtype=torch.uint8, device="cuda").view(torch.float8_e4m3fn)
    assert _same_bits(fq.transpose_bytes(q), q.t().contiguous())


@pytest.mark.parametrize("shape", [(256, 4096), (100, 130), (1, 64), (257, 16384)])
def test_column_sums_from_the_quantize_pass(shape) -> None:
    """`quantize_amax_colsum`: the FP8 bytes, transpose and amax are `quantize_amax`'s bit for bit; the fp32
    column sums (a bias gradient) are the same bits on every call (fixed order: each tile's sums, added
    in row order), within fp32 rounding of the exact sums; the bf16 sums are torch's rounding of the fp32
    ones."""
    fq = _fused()
    g = torch.Generator(device="cuda").manual_seed(shape[0])
    x = (torch.randn(shape, device="cuda", generator=g) * 3).to(torch.bfloat16)
    scale = torch.tensor(0.7, device="cuda")
    a1, a2, a3 = (torch.zeros((), device="cuda") for _ in range(3))
    q, qt, sums = fq.quantize_amax_colsum(x, scale, a1, torch.float8_e5m2, torch.float32)
    q_ref, qt_ref = fq.quantize_amax(x, scale, a2, torch.float8_e5m2, transpose=True)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8)) and torch.equal(qt.view(torch.uint8),
                                                                                      qt_ref.view(torch.uint8))
    assert torch.equal(a1, a2) and sums.dtype == torch.float32 and sums.shape == (shape[1],)
    _, _, again = fq.quantize_amax_colsum(x, scale, a3, torch.float8_e5m2, torch.float32)
    assert torch.equal(sums, again)
    _, _, sums16 = fq.quantize_amax_colsum(x, scale, a3, torch.float8_e5m2, torch.bfloat16)
    assert sums16.dtype == torch.bfloat16 and _same_bits(sums16, sums.to(torch.bfloat16))
    exact = x.double().sum(0)
    bound = 2 * shape[0] * torch.finfo(torch.float32).eps * x.double().abs().sum(0)  # any summation order
    assert bool(((sums.double() - exact).abs() <= bound).all())


def _states(fp8: torch.dtype, algo: str, margin: int, history: list[float], scale: float):
    """Two equal states, one with a `scratch` (the transition in the quantize pass), one without (the pass,
    then `fused_update`'s kernel: two launches)."""
    from qeffect.fp8.scaling import ScalingState

    def make(scratch: bool) -> ScalingState:
        return ScalingState(torch.tensor(history, device="cuda"), torch.tensor(scale, device="cuda"), fp8, margin,
                            algo, torch.zeros(2, dtype=torch.int32, device="cuda") if scratch else None)

    return make(True), make(False)


def _run(state, kind: str, x: torch.Tensor) -> tuple:
    if kind == "quantize":
        return state.quantize(x)
    if kind == "pair":
        return state.quantize_pair(x)
    return state.quantize_pair_colsum(x, torch.bfloat16 if kind == "colsum-bf16" else torch.float32)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", [(1, 1), (3, 5), (255, 1000), (256, 4096), (1000, 257), (257, 16384)])
@pytest.mark.parametrize("algo", ["max", "most_recent"])
@pytest.mark.parametrize("kind", ["quantize", "pair", "colsum-fp32", "colsum-bf16"])
def test_transition_in_the_pass_is_bitwise_the_two_launches(dtype, shape, algo, kind) -> None:
    """`ScalingState` with a scratch (`quantize_transition`: one launch) against the same state without
    (the pass, then the update kernel): six transitions in a row, inputs over many magnitudes, with
    infinities, a NaN and an all-zero input; every output (bytes, transpose, 1 / scale, column sums) and
    the history and scale after each have the same bits; the scratch is zero after every launch."""
    _fused()
    fp8 = torch.float8_e5m2 if kind.startswith("colsum") else torch.float8_e4m3fn
    a, b = _states(fp8, algo, 1, [0.0, 3.0, 1e-40, 0.5], 0.37)
    for k in range(6):
        x = (torch.randn(shape, device="cuda", generator=torch.Generator(device="cuda").manual_seed(k)) * 10.0 ** (k - 2))
        x = _special(shape, dtype, k) if k == 2 else torch.zeros(shape, device="cuda") if k == 4 else x
        x = x.to(dtype)
        if k == 5:
            x.view(-1)[x.numel() // 2] = float("nan")
        got, want = _run(a, kind, x), _run(b, kind, x)
        assert len(got) == len(want)
        for t, u in zip(got, want, strict=True):
            assert t.dtype == u.dtype and t.shape == u.shape and _same_bits(t, u), (k, t, u)
        assert _same_bits(a.amax_history, b.amax_history) and _same_bits(a.scale, b.scale), (k, a, b)
        assert not a.scratch.any()


def test_transition_in_the_pass_captures_into_a_graph() -> None:
    """Captured once, replayed on new inputs: each replay is one eager two-launch transition, bit for bit."""
    _fused()
    a, b = _states(torch.float8_e5m2, "max", 0, [0.0, 2.0, 0.25, 7.0], 1.0)
    x = torch.randn(256, 4096, device="cuda", dtype=torch.bfloat16)
    _run(a, "colsum-bf16", x.clone())  # compile outside the capture, and one transition on each
    _run(b, "colsum-bf16", x.clone())
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        outs = _run(a, "colsum-bf16", x)
    for k in range(3):
        x.copy_(torch.randn(256, 4096, device="cuda", dtype=torch.bfloat16) * 10.0 ** k)
        g.replay()
        want = _run(b, "colsum-bf16", x)
        for t, u in zip(outs, want, strict=True):
            assert _same_bits(t, u), k
        assert _same_bits(a.amax_history, b.amax_history) and _same_bits(a.scale, b.scale), k
        assert not a.scratch.any()
