"""The fused delayed-scaling transition on CPU: the torch path runs here, and, where Triton is installed,
its interpreter checks the kernel's arithmetic (numpy's IEEE floats, not the GPU's: the GPU bits are
tests/test_fused_update_gpu.py's)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from importlib.util import find_spec

import pytest
import torch

from qeffect.fp8.fused_update import fused_update_available
from qeffect.fp8.recipe import DelayedScalingRecipe
from qeffect.fp8.scaling import ScalingState

CASES = textwrap.dedent("""
    import random, sys, torch
    from qeffect.fp8 import fused_update as fu
    from qeffect.fp8.scaling import update_scale
    most_recent_for_max = sys.argv[1] == "wrong"   # the check must be able to fail
    k, rng, bad, n = fu._kernel(), random.Random(0), 0, 0
    specials = [0.0, float("nan"), float("inf"), 1e-45, 1e-40, 1e-38, 3.0, 448.0, 57344.0, 1e30]
    for L in (1, 2, 4, 17):
        for algo in ("max", "most_recent"):
            for margin in (0, 2):
                for trial in range(6):
                    h = torch.tensor([rng.choice(specials) if rng.random() < 0.3 else
                                      rng.uniform(0, 100) * 10 ** rng.randint(-30, 10) for _ in range(L)])
                    s0 = torch.tensor(rng.choice([1.0, 0.37, 3e38]))
                    h1, s1 = h.clone(), s0.clone()
                    update_scale(h1, s1, 448.0, margin, algo)
                    h2, s2, inv = h.clone(), s0.clone(), torch.empty(())
                    mr = algo == "most_recent" or most_recent_for_max
                    k[(1,)](h2, s2, inv, L, 448.0, 2.0 ** -margin, torch.finfo(torch.float32).max,
                            MOST_RECENT=mr, WRITE_INV=True, BLOCK=max(16, 1 << (L - 1).bit_length()))
                    same = (torch.equal(h1.view(torch.int32), h2.view(torch.int32))
                            and torch.equal(s1.view(torch.int32), s2.view(torch.int32))
                            and torch.equal(inv.view(torch.int32), s0.reciprocal().view(torch.int32)))
                    n, bad = n + 1, bad + (not same)
                    if bad and most_recent_for_max:  # caught: the rest would only be caught again
                        print(n, bad)
                        sys.exit(0)
    print(n, bad)
""")


def test_cpu_scales_take_the_torch_path() -> None:
    st = ScalingState.new(DelayedScalingRecipe(), torch.float8_e4m3fn)
    assert not fused_update_available(st.scale)
    st.amax_history[0] = 3.0
    st.update()
    want = torch.tensor(448.0) / torch.tensor(3.0)  # an fp32 division
    assert torch.equal(st.scale, want) and st.amax_history[0].item() == 0.0 and st.amax_history[-1].item() == 3.0


@pytest.mark.skipif(find_spec("triton") is None, reason="needs Triton (its interpreter runs on CPU)")
@pytest.mark.parametrize("variant", ["right", "wrong"])
def test_kernel_arithmetic_under_the_interpreter(variant: str) -> None:
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-c", CASES, variant], capture_output=True, text=True, env=env,
                         timeout=300, check=True).stdout.split()
    n, bad = int(out[-2]), int(out[-1])
    assert (n, bad) == (96, 0) if variant == "right" else (0 < bad <= n <= 96)
