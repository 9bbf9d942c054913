"""`ScalingState.quantize_pair` and the fused-quantize entry point on CPU (the torch sequence runs):
the pair is exactly `quantize` plus the contiguous transpose, with the same state transitions.
The fused GPU kernel itself: tests/test_fused_quantize_gpu.py."""

from __future__ import annotations

from importlib.util import find_spec

import pytest
import torch

from qeffect.fp8 import fused_quantize as fq
from qeffect.fp8.fused_quantize import fused_available, quantize_amax, quantize_amax_colsum, quantize_sequence
from qeffect.fp8.recipe import DelayedScalingRecipe
from qeffect.fp8.scaling import ScalingState


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("fp8", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_quantize_pair_is_quantize_plus_transpose_with_the_same_transitions(fp8) -> None:
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(37, 53, generator=g) * 10 ** k for k in range(-2, 3)]
    a = ScalingState.new(DelayedScalingRecipe(), fp8)
    b = ScalingState.new(DelayedScalingRecipe(), fp8)
    for x in xs:
        q, q_t, inv = a.quantize_pair(x)
        q_ref, inv_ref = b.quantize(x)
        assert _same_bits(q, q_ref) and _same_bits(q_t, q_ref.t().contiguous()) and q_t.is_contiguous()
        assert torch.equal(inv, inv_ref)
        assert torch.equal(a.amax_history, b.amax_history) and torch.equal(a.scale, b.scale)
    assert not torch.equal(a.scale, torch.ones(()))  # the scales really moved


def test_quantize_pair_wants_2d() -> None:
    st = ScalingState.new(DelayedScalingRecipe(), torch.float8_e4m3fn)
    with pytest.raises(ValueError, match="2-D"):
        st.quantize_pair(torch.ones(2, 3, 4))


def test_cpu_takes_the_sequence() -> None:
    x = torch.randn(8, 16)
    assert not fused_available(x)
    s = torch.tensor(3.0)
    a1, a2 = torch.zeros(()), torch.zeros(())
    q, qt = quantize_amax(x, s, a1, torch.float8_e4m3fn, transpose=True)
    q_ref, qt_ref = quantize_sequence(x, s, a2, torch.float8_e4m3fn, transpose=True)
    assert _same_bits(q, q_ref) and _same_bits(qt, qt_ref) and torch.equal(a1, a2) and a1 == x.abs().max()


def test_the_kernel_transposes_16_bit_inputs_only() -> None:
    """fp32 tiles got wrong bytes from Triton's in-kernel transpose on the H200: `transpose_bytes` takes them."""
    bf16, fp16, fp32 = (torch.zeros(2, 2, dtype=d) for d in (torch.bfloat16, torch.float16, torch.float32))
    assert fq._transpose_in_kernel(bf16) and fq._transpose_in_kernel(fp16) and not fq._transpose_in_kernel(fp32)


TRANSPOSE_CASES = """
import sys, torch
from qeffect.fp8 import fused_quantize as fq
k, bad = fq._transpose_kernel(), 0
for m, n in [(1, 1), (3, 5), (64, 64), (255, 1000), (100, 1), (1, 130)]:
    q = torch.randint(0, 256, (m, n), dtype=torch.uint8, generator=torch.Generator().manual_seed(m * n))
    qt = torch.zeros((n, m), dtype=torch.uint8)
    k[(-(-m // 64), -(-n // 64))](q, qt, m, n, BLOCK_M=64, BLOCK_N=64)
    want = q.t().contiguous() if sys.argv[1] == "right" else q.reshape(n, m)  # the check must be able to fail
    bad += not torch.equal(qt, want)
print(bad)
"""


@pytest.mark.skipif(find_spec("triton") is None,
                    reason="needs Triton (its interpreter runs on CPU)")
@pytest.mark.parametrize("variant", ["right", "wrong"])
def test_byte_transpose_kernel_under_the_interpreter(variant: str) -> None:
    import os
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", TRANSPOSE_CASES, variant], capture_output=True, text=True,
                         env={**os.environ, "TRITON_INTERPRET": "1"}, timeout=300, check=True).stdout.split()
    assert (int(out[-1]) == 0) if variant == "right" else (int(out[-1]) > 0)


def test_quantize_pair_colsum_is_the_pair_and_the_column_sums_on_the_cpu() -> None:
    """The CPU takes torch's sums, `x.sum(0, dtype)`, beside the pair, with the pair's state transitions."""
    g = torch.Generator().manual_seed(1)
    a = ScalingState.new(DelayedScalingRecipe(), torch.float8_e5m2)
    b = ScalingState.new(DelayedScalingRecipe(), torch.float8_e5m2)
    for k in range(3):
        x = (torch.randn(37, 53, generator=g) * 10 ** k).to(torch.bfloat16)
        q, q_t, inv, sums = a.quantize_pair_colsum(x, torch.float32)
        q_ref, q_t_ref, inv_ref = b.quantize_pair(x)
        assert _same_bits(q, q_ref) and _same_bits(q_t, q_t_ref) and torch.equal(inv, inv_ref)
        assert torch.equal(sums, x.sum(0, dtype=torch.float32)) and sums.dtype == torch.float32
        assert torch.equal(a.amax_history, b.amax_history) and torch.equal(a.scale, b.scale)
    with pytest.raises(ValueError, match="2-D"):
        a.quantize_pair_colsum(torch.ones(2, 3, 4), torch.float32)
    with pytest.raises(ValueError, match="2-D"):
        quantize_amax_colsum(torch.ones(2, 3, 4), torch.ones(()), torch.zeros(()), torch.float8_e5m2, torch.float32)


@pytest.mark.parametrize("scratch", [torch.zeros(2, dtype=torch.int64), torch.zeros(3, dtype=torch.int32),
                                     torch.zeros(2, 2, dtype=torch.int32)[:, 0]])
def test_a_state_refuses_a_scratch_the_kernel_cannot_use(scratch: torch.Tensor) -> None:
    """The transition's scratch is checked where a state gets it (the kernel takes it unchecked): two
    contiguous int32 words, or none."""
    with pytest.raises(ValueError, match="two contiguous int32 words"):
        ScalingState(torch.zeros(4), torch.ones(()), torch.float8_e4m3fn, scratch=scratch)
    ScalingState(torch.zeros(4), torch.ones(()), torch.float8_e4m3fn, scratch=torch.zeros(2, dtype=torch.int32))


COLSUM_CASES = """
import itertools, sys, torch
from qeffect.fp8 import fused_quantize as fq
k, bad = fq._kernel(), 0
for (m, n), block_n in itertools.product([(1, 1), (3, 5), (64, 64), (100, 130), (130, 70)],
                                         (fq.COLSUM_BLOCK_N, fq.COLSUM_WIDE_BLOCK_N)):  # narrow and wide strips
    # small integers: every partial sum is exact, so any summation order gives these bits
    x = torch.randint(-8, 8, (m, n), generator=torch.Generator().manual_seed(m * n)).to(torch.bfloat16)
    q, amax, sums = torch.empty((m, n), dtype=torch.float8_e4m3fn), torch.zeros(1), torch.full((n,), float("nan"))
    k[(1, -(-n // block_n))](x, torch.ones(1), q, q.view(torch.uint8), amax.view(torch.int32), m, n, 448.0,
                             sums, q, q, 1, 1.0, 0.0, TRANSPOSE=False, COLSUM=True, BLOCK_M=16,
                             BLOCK_N=block_n)  # 16-row tiles: several per strip here
    # the check must be able to fail: the last row left out
    want = (x[:-1] if sys.argv[1] == "wrong" else x).float().sum(0)
    bad += not torch.equal(sums, want) or not torch.equal(q.float(), x.float()) or amax.item() != x.float().abs().max().item()
    if bad and sys.argv[1] == "wrong":  # caught: the rest would only be caught again
        break
print(bad)
"""


def test_wide_tensors_take_the_narrow_one_warp_strips() -> None:
    """The column-sum pass's strip follows the width: the default strip below `COLSUM_WIDE_FROM` columns,
    the wide one from there on."""
    narrow = (fq.COLSUM_BLOCK_N, fq.COLSUM_WARPS)
    wide = (fq.COLSUM_WIDE_BLOCK_N, fq.COLSUM_WIDE_WARPS)
    assert narrow != wide
    assert [fq.colsum_strip(n) for n in (1, 4096, fq.COLSUM_WIDE_FROM - 1)] == [narrow] * 3
    assert [fq.colsum_strip(n) for n in (fq.COLSUM_WIDE_FROM, 11008, 12288)] == [wide] * 3


@pytest.mark.skipif(find_spec("triton") is None,
                    reason="needs Triton (its interpreter runs on CPU)")
@pytest.mark.parametrize("variant", ["right", "wrong"])
def test_column_sums_under_the_interpreter(variant: str) -> None:
    """The pass with the column sums (one program per column strip, over several row blocks): the sums,
    the padded rows and columns contributing nothing, the bytes and the amax (the kernel, run by Triton's
    interpreter on the CPU)."""
    import os
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", COLSUM_CASES, variant], capture_output=True, text=True,
                         env={**os.environ, "TRITON_INTERPRET": "1"}, timeout=300, check=True).stdout.split()
    assert (int(out[-1]) == 0) if variant == "right" else (int(out[-1]) > 0)


TRANSITION_CASES = """
import random, sys, torch
from qeffect.fp8 import fused_quantize as fq
from qeffect.fp8.fused_update import history_block
from qeffect.fp8.recipe import fp8_max
from qeffect.fp8.scaling import update_scale
wrong = sys.argv[1] == "wrong"  # the check must be able to fail: "max" taken as "most_recent", a row block left out
k, rng, bad, n_cases = fq._kernel(), random.Random(0), 0, 0
specials = [0.0, float("nan"), float("inf"), 1e-40, 2.0 ** -30, 2.0 ** 20]  # exact scales: see below
for (m, n) in ((64, 64), (130, 70), (256, 200)):
    for L in (1, 4, 17):
        for algo in ("max", "most_recent"):
            for colsum in (None, torch.bfloat16, torch.float32):
                fp8 = torch.float8_e5m2 if colsum is not None else torch.float8_e4m3fn
                h = torch.tensor([rng.choice(specials) if rng.random() < 0.3 else 2.0 ** rng.randint(-8, 8) for _ in range(L)])
                s = torch.tensor(rng.choice([1.0, 0.5, 2.0]))
                scratch = torch.zeros(2, dtype=torch.int32)
                for rep in range(2):  # the scratch is reused: zero again after each launch
                    x = torch.randint(-1, 2, (m, n)).to(torch.bfloat16) * (rep + 1)
                    h_ref, s_ref = h.clone(), s.clone()
                    q_ref = fq.cast_fp8(x, s_ref, fp8)
                    h_ref[0] = x.float().abs().amax()
                    inv_ref = s_ref.reciprocal()
                    update_scale(h_ref, s_ref, fp8_max(fp8), 2, "most_recent" if wrong and algo == "max" else algo)
                    rows = -(-m // 64)
                    kept = x[:64 * (rows - 1)] if wrong and rows > 1 else x  # wrong: a row block left out
                    sums_ref = None if colsum is None else kept.float().sum(0).to(colsum)  # exact: small integers
                    q = torch.empty(m, n, dtype=fp8)
                    inv = torch.empty(())
                    sums = torch.empty(n, dtype=colsum or torch.float32)
                    block_n = fq.COLSUM_BLOCK_N if colsum is not None else fq.BLOCK_N
                    grid = (1 if colsum is not None else rows, -(-n // block_n))
                    k[grid](x, s, q, q.view(torch.uint8), scratch, m, n, fp8_max(fp8), sums, h, inv, L, 2.0 ** -2,
                            torch.finfo(torch.float32).max, TRANSPOSE=False, COLSUM=colsum is not None,
                            BLOCK_M=64, BLOCK_N=block_n, TRANSITION=True, MOST_RECENT=algo == "most_recent",
                            HBLOCK=history_block(L), SUM_CAST=colsum is torch.bfloat16)
                    same = (torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
                            and torch.equal(h.view(torch.int32), h_ref.view(torch.int32))
                            and torch.equal(s.view(torch.int32), s_ref.view(torch.int32))
                            and torch.equal(inv.view(torch.int32), inv_ref.view(torch.int32))
                            and not scratch.any()
                            and (colsum is None or torch.equal(sums, sums_ref)))
                    n_cases, bad = n_cases + 1, bad + (not same)
                    if not same:  # the next launch starts from the sequence's state
                        h, s = h_ref.clone(), s_ref.clone()
                        if wrong:  # caught: the rest would only be caught again
                            print(n_cases, bad)
                            sys.exit(0)
print(n_cases, bad)
"""


@pytest.mark.skipif(find_spec("triton") is None, reason="needs Triton (its interpreter runs on CPU)")
@pytest.mark.slow
@pytest.mark.parametrize("variant", ["right", "wrong"])
def test_transition_in_the_pass_under_the_interpreter(variant: str) -> None:
    """`quantize_transition`'s kernel (run by Triton's interpreter on the CPU) against the sequence it
    replaces: the bytes, the recorded and rolled history, the new scale, `1 / scale` before it, the
    column sums summed over the row blocks in order, and the scratch zero again after each launch (two
    launches share it). Histories with zeros, NaNs, infinities and tiny amaxes, both amax algorithms,
    several row blocks. Inputs of -2..2 and power-of-two amaxes keep every product and sum exact: the
    interpreter's float conversions are numpy's, the GPU's bits are `test_fused_quantize_gpu.py`'s."""
    import os
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", TRANSITION_CASES, variant], capture_output=True, text=True,
                         env={**os.environ, "TRITON_INTERPRET": "1"}, timeout=600, check=True).stdout.split()
    n, bad = int(out[-2]), int(out[-1])
    assert (n, bad) == (108, 0) if variant == "right" else (0 < bad <= n <= 108)
