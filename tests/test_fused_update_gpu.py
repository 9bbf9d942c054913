"""The fused delayed-scaling transition (`fp8.fused_update`) against `scaling.update_scale`, bit for bit.

GPU only (CUDA and Triton). History, scale and `scale_inv` must have the same bits as the torch
sequence, for histories with zeros, NaNs, infinities and amaxes so small that the scale overflows.
"""

from __future__ import annotations

import random

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

SPECIALS = [0.0, float("nan"), float("inf"), 1e-45, 1e-40, 1e-38, 3.0, 448.0, 57344.0, 3e38]


def _fused():
    from qeffect.fp8 import fused_update

    if fused_update._kernel() is None:
        pytest.skip("needs Triton")
    return fused_update


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.int32)


@pytest.mark.parametrize("length", [1, 2, 4, 16, 1024])
@pytest.mark.parametrize("algo", ["max", "most_recent"])
@pytest.mark.parametrize("margin", [0, 1, 3])
@pytest.mark.parametrize("fmax", [448.0, 57344.0])
def test_fused_update_is_bitwise_update_scale(length: int, algo: str, margin: int, fmax: float) -> None:
    from qeffect.fp8.scaling import update_scale

    fu = _fused()
    rng = random.Random(length * 1000 + margin)
    for _ in range(20):
        h = torch.tensor([rng.choice(SPECIALS) if rng.random() < 0.3 else
                          rng.uniform(0, 100) * 10 ** rng.randint(-30, 10) for _ in range(length)], device="cuda")
        s0 = torch.tensor(rng.choice([1.0, 0.37, 3e38, 2.5]), device="cuda")
        h_ref, s_ref = h.clone(), s0.clone()
        update_scale(h_ref, s_ref, fmax, margin, algo)
        h_got, s_got, inv = h.clone(), s0.clone(), torch.empty((), device="cuda")
        fu.update_scale_fused(h_got, s_got, fmax, margin, algo, scale_inv_out=inv)
        assert torch.equal(_bits(h_got), _bits(h_ref)), (h, h_got, h_ref)
        assert torch.equal(_bits(s_got), _bits(s_ref)), (h, s0, s_got, s_ref)
        assert torch.equal(_bits(inv), _bits(s0.reciprocal())), (s0, inv)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_scaling_state_transitions_fused_equal_torch(dtype: torch.dtype) -> None:
    """Eight `quantize_pair` / `quantize` transitions: fused quantize + fused update against the torch path
    (what a state runs without the fused passes: `1 / scale`, `quantize_sequence`, `update_scale`)."""
    from qeffect.fp8.fused_quantize import quantize_sequence
    from qeffect.fp8.recipe import DelayedScalingRecipe
    from qeffect.fp8.scaling import ScalingState, update_scale

    def torch_transition(st: ScalingState, x: torch.Tensor, transpose: bool) -> tuple:
        inv = st.scale.reciprocal()
        q, qt = quantize_sequence(x, st.scale, st.amax_history[0], st.fp8_dtype, transpose)
        update_scale(st.amax_history, st.scale, st.fmax, st.margin, st.amax_compute_algo)
        return (q, qt, inv) if transpose else (q, inv, None)

    _fused()
    xs = [torch.randn(192, 320, device="cuda", dtype=dtype) * 10 ** (k % 5 - 2) for k in range(8)]
    runs = []
    for fused in (True, False):
        st = ScalingState.new(DelayedScalingRecipe(), torch.float8_e4m3fn, device="cuda")
        if fused:
            out = [st.quantize_pair(x) if k % 2 else (*st.quantize(x), None) for k, x in enumerate(xs)]
        else:
            out = [torch_transition(st, x, transpose=bool(k % 2)) for k, x in enumerate(xs)]
        runs.append((out, st.amax_history.clone(), st.scale.clone()))
    (oa, ha, sa), (ob, hb, sb) = runs
    assert torch.equal(_bits(ha), _bits(hb)) and torch.equal(_bits(sa), _bits(sb))
    for a, b in zip(oa, ob, strict=True):
        for ta, tb in zip(a, b, strict=True):
            assert (ta is None) == (tb is None)
            if ta is not None:
                assert torch.equal(ta.reshape(-1).view(torch.uint8), tb.reshape(-1).view(torch.uint8))  # 0-dim scale_inv too


def test_fused_update_captures_into_a_graph() -> None:
    fu = _fused()
    h = torch.tensor([3.0, 7.0, 1.0, 0.5], device="cuda")
    s, inv = torch.ones((), device="cuda"), torch.empty((), device="cuda")
    fu.update_scale_fused(h.clone(), s.clone(), 448.0, 0, "max", scale_inv_out=inv.clone())  # compile first
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fu.update_scale_fused(h, s, 448.0, 0, "max", scale_inv_out=inv)
    start = torch.tensor([2.0, 9.0, 0.25, 4.0], device="cuda")
    h.copy_(start)
    s.fill_(0.5)
    g.replay()
    from qeffect.fp8.scaling import update_scale

    h_ref, s_ref = start.clone(), torch.full((), 0.5, device="cuda")
    update_scale(h_ref, s_ref, 448.0, 0, "max")
    torch.cuda.synchronize()
    assert torch.equal(h, h_ref) and torch.equal(s, s_ref) and inv.item() == 2.0
