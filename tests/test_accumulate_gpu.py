"""The fused staged fold on the H200: bitwise equal to the copy_/add_ sequence it replaces."""

from __future__ import annotations

import pytest
import torch

from qeffect.contracts.arena import FoldMode, sequential_reduce
from qeffect.stage.accumulate import BLOCK, _gated_kernel, fold_staged, fold_staged_gated, fused_available

pytestmark = pytest.mark.gpu
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _block(G: int, n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator(device="cuda").manual_seed(seed)
    # wide exponents: any other association or a fused multiply-add would change bits
    vals = torch.randn(G, n + 40, device="cuda", generator=g)
    vals *= 10.0 ** torch.randint(-6, 7, (G, n + 40), device="cuda", generator=g)
    return vals.to(dtype)


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("init", [True, False])
def test_fused_fold_is_bitwise_the_sequence(dtype: torch.dtype, init: bool) -> None:
    region0 = torch.randn(3 * BLOCK + 17, device="cuda") * 1e3
    assert fused_available(region0), "the fused fold needs Triton on the GPU machine"
    for count in (1, 2, 3, 5, 8):
        block = _block(8, region0.numel(), dtype, seed=count)
        fused, seq = region0.clone(), region0.clone()
        fold_staged(fused, block, count, init)
        sequential_reduce(seq, block, count, init)
        assert torch.equal(fused, seq), (dtype, init, count)
        if count >= 3 and not init:  # the oracle can fail: the same slots in reverse give other bits
            rev = region0.clone()
            for j in reversed(range(count)):
                rev.add_(block[j, : rev.numel()])
            assert not torch.equal(rev, seq)


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gated_fold_is_the_fold_its_mode_names(dtype: torch.dtype) -> None:
    """The gated kernel (its mode read on the device) against the sequence with that mode's init; SKIP
    leaves the region's bits; special values compared as bit patterns; one captured graph, three modes."""
    assert _gated_kernel() is not None, "the gated fold needs Triton on the GPU machine"
    tiny = torch.finfo(torch.float32).tiny
    specials = torch.tensor([0.0, -0.0, tiny / 4, float("inf"), float("nan"), -1e-39, 3.0], device="cuda")
    region0 = torch.randn(3 * BLOCK + 17, device="cuda") * 1e3
    region0[: specials.numel()] = specials
    mode = torch.zeros((), dtype=torch.int32, device="cuda")
    for count in (1, 3, 8):
        block = _block(8, region0.numel(), dtype, seed=count)
        block[:, : specials.numel()] = specials.to(dtype)
        for value, init in ((FoldMode.INIT, True), (FoldMode.ADD, False), (FoldMode.SKIP, None)):
            mode.fill_(value)
            gated, seq = region0.clone(), region0.clone()
            fold_staged_gated(gated, block, count, mode)
            if init is not None:
                sequential_reduce(seq, block, count, init)
            assert torch.equal(gated.view(torch.int32), seq.view(torch.int32)), (dtype, count, value)
    region, block = region0.clone(), _block(4, region0.numel(), dtype, seed=11)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fold_staged_gated(region, block, 4, mode)
    for value, init in ((FoldMode.INIT, True), (FoldMode.ADD, False), (FoldMode.SKIP, None)):
        start = region.clone()
        mode.fill_(value)
        graph.replay()
        expect = start.clone()
        if init is not None:
            sequential_reduce(expect, block, 4, init)
        torch.cuda.synchronize()
        assert torch.equal(region.view(torch.int32), expect.view(torch.int32)), value


@requires_cuda
def test_fused_fold_captures_into_a_graph() -> None:
    region = torch.zeros(BLOCK * 2, device="cuda")
    block = _block(3, region.numel(), torch.bfloat16, seed=9)
    fold_staged(region, block, 3, True)  # compile and load outside the capture
    expect = region.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fold_staged(region, block, 3, True)
    region.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(region, expect)


@requires_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_fused_fold_keeps_special_values_bit_for_bit(dtype: torch.dtype) -> None:
    """Subnormals (no flush to zero), signed zeros, infinities and NaNs: compared as bit patterns."""
    tiny = torch.finfo(torch.float32).tiny
    specials = torch.tensor([0.0, -0.0, tiny / 4, -tiny / 8, float("inf"), -float("inf"), float("nan"), 1e-40,
                             -1e-39, 3.0], device="cuda")
    n = BLOCK + 7
    region0 = specials.repeat(n // specials.numel() + 1)[:n].contiguous()
    g = torch.Generator(device="cuda").manual_seed(5)
    block = specials[torch.randint(0, specials.numel(), (6, n + 8), device="cuda", generator=g)].to(dtype)
    for init in (True, False):
        fused, seq = region0.clone(), region0.clone()
        fold_staged(fused, block, 6, init)
        sequential_reduce(seq, block, 6, init)
        assert torch.equal(fused.view(torch.int32), seq.view(torch.int32)), init


@requires_cuda
def test_batched_accumulation_is_copy_and_add_also_replayed_in_a_graph() -> None:
    """`accumulate_into` on the GPU (fp32 and bf16 sources, more pairs than one launch, an unaligned pair
    that goes one by one) against copy_/add_, eagerly and as a CUDA graph captured after one eager call."""
    from qeffect.stage.accumulate import _multi_kernel, accumulate_into

    assert _multi_kernel() is not None, "the batched accumulation needs Triton on the GPU machine"
    sizes = [4096, 1, 1023, 1025, 3000, 17, 2048, 5, 12288, 7, 100]
    g = torch.Generator(device="cuda").manual_seed(0)
    src = [(torch.randn(n, device="cuda", generator=g) * 10.0 ** torch.randint(-4, 5, (n,), device="cuda",
                                                                                 generator=g)).to(dt)
           for n in sizes for dt in (torch.float32, torch.bfloat16)]
    src.append(torch.randn(65, device="cuda", generator=g)[1:])  # 4 bytes past alignment: one by one
    dst = [torch.zeros(s.numel(), device="cuda") for s in src]
    ref = [d.clone() for d in dst]
    for m in range(3):
        for d, s in zip(ref, src, strict=True):
            d.copy_(s) if m == 0 else d.add_(s)
        accumulate_into(dst, src, init=m == 0)
    assert all(torch.equal(a, b) for a, b in zip(dst, ref, strict=True))
    graphs = []
    for init in (True, False):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            accumulate_into(dst, src, init=init)
        graphs.append(graph)
    for m in range(3):
        for d, s in zip(ref, src, strict=True):
            d.copy_(s) if m == 0 else d.add_(s)
        graphs[m > 0].replay()
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(dst, ref, strict=True))
