"""Non-matrix gradient accumulation, several tensors per launch (`stage.accumulate.accumulate_into`).

CPU: the one-by-one route (what CPU tensors take) is copy_/add_; the batched kernel computes the same bits
under Triton's interpreter (mixed sizes, more pairs than one launch holds, each source dtype, both modes);
only aligned, contiguous, same-size fp32 destinations are batched. GPU: `test_accumulate_gpu.py`.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from qeffect.stage import accumulate as acc


def _pairs(dtype, seed=0, sizes=(4096, 1, 1023, 1025, 3000, 17, 2048, 5, 12288, 7, 100)):
    gen = torch.Generator().manual_seed(seed)
    dst = [torch.randn(n, generator=gen) for n in sizes]
    # wide exponents: a different association or rounding would change bits
    src = [(torch.randn(n, generator=gen) * 10.0 ** torch.randint(-4, 5, (n,), generator=gen)).to(dtype)
           for n in sizes]
    return dst, src


@pytest.mark.parametrize("init", [True, False])
def test_cpu_tensors_take_copy_and_add_one_by_one(init):
    dst, src = _pairs(torch.bfloat16)
    ref = [d.clone() for d in dst]
    for d, s in zip(ref, src, strict=True):
        d.copy_(s) if init else d.add_(s)
    acc.accumulate_into(dst, src, init=init)
    assert all(torch.equal(a, b) for a, b in zip(dst, ref, strict=True))


INTERPRETED = textwrap.dedent("""
    import os
    os.environ["TRITON_INTERPRET"] = "1"
    import torch
    import test_accumulate as t
    from qeffect.stage import accumulate as acc
    for init in (True, False):
        for dtype in acc.FUSED_SOURCES:
            dst, src = t._pairs(dtype, seed=1)
            ref = [d.clone() for d in dst]
            for d, s in zip(ref, src):
                d.copy_(s) if init else d.add_(s)
            acc.launch_multi(dst, src, init)
            bad = [i for i, (a, b) in enumerate(zip(dst, ref)) if not torch.equal(a, b)]
            assert not bad, (init, dtype, bad)
    print("ok")
""")


def test_the_batched_kernel_is_copy_and_add_under_the_interpreter():
    pytest.importorskip("triton")
    out = subprocess.run([sys.executable, "-c", INTERPRETED], capture_output=True, text=True, timeout=600,
                         cwd=__file__.rsplit("/", 1)[0])
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


def test_only_what_the_kernel_covers_is_batched(monkeypatch):
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    d, s = torch.zeros(64), torch.zeros(64, dtype=torch.bfloat16)
    assert acc._batchable(d, s)
    assert not acc._batchable(d.to(torch.float64), s.double())  # fp32 destinations only
    assert not acc._batchable(d, s.to(torch.int32))
    assert not acc._batchable(d, s[:32])  # sizes differ
    assert not acc._batchable(torch.zeros(8, 8).t(), torch.zeros(8, 8))  # not contiguous
    assert not acc._batchable(torch.zeros(65)[1:], s)  # 4 bytes past an aligned start


def test_pairs_go_to_one_launch_per_source_dtype_and_eight_pairs(monkeypatch):
    """Batchable pairs are grouped by source dtype, `SLOTS` per launch (unused slots repeat the first with
    n = 0); the others are copied or added one by one, with torch's bits."""
    launches = []

    class FakeKernel:
        def __getitem__(self, grid):
            def launch(*args, INIT, BLOCK):
                pairs = [args[i:i + 3] for i in range(0, 3 * acc.SLOTS, 3)]
                launches.append((grid[0], INIT, [(d.data_ptr(), s.dtype, n) for d, s, n in pairs],
                                 list(args[3 * acc.SLOTS:])))
            return launch

    monkeypatch.setattr(acc, "_multi_kernel", lambda: FakeKernel())
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    dst32, src32 = _pairs(torch.float32)  # 11 pairs: one launch of 8, one of 3
    dst16, src16 = _pairs(torch.bfloat16, sizes=(5000,))
    odd_d, odd_s = torch.zeros(9), torch.arange(9, dtype=torch.int64)  # not batchable: torch's add_
    acc.accumulate_into([*dst32, odd_d, *dst16], [*src32, odd_s, *src16], init=False)
    assert torch.equal(odd_d, torch.arange(9, dtype=torch.float32))
    assert [(grid, init) for grid, init, *_ in launches] == [
        (sum(-(-d.numel() // acc.ACC_BLOCK) for d in dst32[:8]), False),
        (sum(-(-d.numel() // acc.ACC_BLOCK) for d in dst32[8:]), False),
        (-(-5000 // acc.ACC_BLOCK), False)]
    assert [p[0] for p in launches[0][2]] == [d.data_ptr() for d in dst32[:8]]
    assert launches[1][2][3:] == [(dst32[8].data_ptr(), torch.float32, 0)] * (acc.SLOTS - 3)
    ends = launches[0][3]
    assert ends == [sum(-(-d.numel() // acc.ACC_BLOCK) for d in dst32[:i]) for i in range(1, acc.SLOTS)]
    assert launches[2][2][0] == (dst16[0].data_ptr(), torch.bfloat16, 5000)
    launches.clear()
    acc.accumulate_into([torch.zeros(0)], [torch.zeros(0)], init=True)
    assert launches == []  # empty tensors: no launch of 0 programs
    monkeypatch.setattr(acc, "_multi_kernel", lambda: None)  # no Triton: each pair by torch
    acc.accumulate_into(dst32, src32, init=True)
    assert launches == [] and all(torch.equal(d, s) for d, s in zip(dst32, src32, strict=True))


@pytest.mark.parametrize("region_dtype", [torch.float32, torch.bfloat16])
def test_gated_sequence_is_the_sequence_its_mode_names(region_dtype: torch.dtype) -> None:
    """`gated_sequential_reduce` (no host read of the mode) gives the bits of `sequential_reduce` with the
    mode's init, signed zeros included; SKIP leaves the region as it was."""
    from qeffect.contracts.arena import FoldMode, gated_sequential_reduce, sequential_reduce

    g = torch.Generator().manual_seed(3)
    n = 64
    region0 = (torch.randn(n, generator=g) * 1e3).to(region_dtype)
    region0[:3] = torch.tensor([0.0, -0.0, -0.0])
    block = torch.randn(5, n + 6, generator=g) * 10.0 ** torch.randint(-6, 7, (5, n + 6), generator=g)
    block = block.to(torch.bfloat16)
    block[:, :3] = -0.0
    mode = torch.zeros((), dtype=torch.int32)
    for count in (1, 2, 5):
        for value, init in ((FoldMode.INIT, True), (FoldMode.ADD, False), (FoldMode.SKIP, None)):
            mode.fill_(value)
            gated, seq = region0.clone(), region0.clone()
            gated_sequential_reduce(gated, block, count, mode)
            if init is not None:
                sequential_reduce(seq, block, count, init)
            assert torch.equal(gated.view(torch.int16 if region_dtype == torch.bfloat16 else torch.int32),
                               seq.view(torch.int16 if region_dtype == torch.bfloat16 else torch.int32))
