"""`fp8.weight_cast`: when a cache the optimizer cast is fresh, and what the optimizer accepts (CPU).

The casts themselves are GPU-tested against Transformer Engine's (`test_weight_cast_gpu.py`)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from qeffect.fp8.weight_cast import WeightCastTarget
from qeffect.runtime.adamw import TritonAdamW


def _target(weight: torch.Tensor, transpose: bool = True) -> WeightCastTarget:
    rows, cols = weight.shape
    fp8 = torch.float8_e4m3fn
    return WeightCastTarget("lin", weight, torch.zeros(rows, cols, dtype=fp8),
                            torch.zeros(cols, rows, dtype=fp8) if transpose else None, torch.ones(1),
                            torch.ones(1), torch.zeros(1))


def test_fresh_until_consumed_or_the_weight_changes() -> None:
    w = torch.nn.Parameter(torch.randn(3, 2))
    t = _target(w)
    assert not t.fresh and not t.use_cache(False)  # never cast: a first forward casts itself
    t.mark_cast()
    assert t.fresh and t.use_cache(False)
    t.mark_consumed()
    assert not t.fresh
    t.mark_cast()
    with torch.no_grad():
        w.add_(1.0)  # written outside the optimizer's pass: the cached cast is of the old weight
    assert not t.fresh
    t.captured = True  # a slot-0 graph being captured takes the cache whatever it holds: its caller casts
    assert t.use_cache(True) and not t.use_cache(False)  # before each replay; an eager forward casts itself


def test_pending_amax_folds_as_an_atomic_max_onto_the_row() -> None:
    t = _target(torch.zeros(2, 2))
    t.amax_row.fill_(3.0)
    t.pending_amax.fill_(2.0)
    t.fold_pending_amax()
    assert t.amax_row.item() == 3.0 and t.pending_amax.item() == 0.0
    t.pending_amax.fill_(5.0)
    t.fold_pending_amax()
    assert t.amax_row.item() == 5.0 and t.pending_amax.item() == 0.0


def test_target_shapes_are_checked() -> None:
    fp8 = torch.float8_e4m3fn
    with pytest.raises(ValueError, match="contiguous fp32"):
        _target(torch.zeros(2, 3, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="transpose"):
        WeightCastTarget("lin", torch.zeros(2, 3), torch.zeros(2, 3, dtype=fp8), torch.zeros(2, 3, dtype=fp8),
                         torch.ones(1), torch.ones(1), torch.zeros(1))


def test_the_optimizer_casts_only_its_own_weights() -> None:
    w, other = torch.nn.Parameter(torch.randn(4, 2)), torch.nn.Parameter(torch.randn(4, 2))
    opt = TritonAdamW([w], lr=1e-3)
    with pytest.raises(ValueError, match="not in this optimizer's groups"):
        opt.cast_after_step(_target(other))
    with pytest.raises(ValueError, match="needs CUDA and Triton"):
        opt.cast_after_step(_target(w))  # on the CPU: nothing to cast with
    assert opt.cast_now([]) == 0


INTERPRETED = textwrap.dedent("""
    import os
    os.environ["TRITON_INTERPRET"] = "1"
    import torch
    from qeffect.runtime import adamw
    from qeffect.fp8.fused_quantize import transpose_bytes
    rows, cols = 70, 150  # not a whole block
    w = torch.randn(rows, cols) * 40
    w[0, :4] = torch.tensor([1e4, -1e4, 0.0, 448.0])
    scale, scale_inv, amax = torch.tensor([3.7]), torch.zeros(1), torch.zeros(1)
    q = torch.zeros(rows, cols, dtype=torch.float8_e4m3fn)
    n = w.numel()
    adamw._kernel()[(-(-n // adamw.BLOCK),)](w, w, w, 0, w, w, w, w, n, 0.0, 0.0, 0.0, 0.0, 0.0, q.view(torch.uint8),
                                             scale, scale_inv, amax.view(torch.int32), 448.0, COUNT=0, INIT=False,
                                             DECAY=False, UPDATE=False, CAST=True, BLOCK=adamw.BLOCK)
    # the interpreter's own FP8 conversion is not the GPU's (127.4 became 64 here, not 128): the bytes'
    # bits are the GPU test's; here only that every one was written with the weight's sign
    assert ((q.view(torch.uint8) & 0x80) == (w < 0).to(torch.uint8) * 0x80).all()
    assert amax.item() == w.abs().max().item() and scale_inv.item() == (1 / torch.tensor(3.7)).item()
    print("ok")
""")


def test_the_cast_under_the_interpreter() -> None:
    """The cast on CPU (Triton's interpreter): amax and 1 / scale exactly, every byte written
    with the weight's sign (the interpreter converts to FP8 its own way); the bytes' bits against Transformer Engine's are the GPU test's."""
    pytest.importorskip("triton")
    out = subprocess.run([sys.executable, "-c", INTERPRETED], capture_output=True, text=True, timeout=600)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]
