"""`fp8.weight_cast`: when a cache the optimizer cast is fresh, and what the optimizer accepts (CPU).

The casts themselves are GPU-tested against Transformer Engine's (`test_weight_cast_gpu.py`)."""

from __future__ import annotations

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
    assert not t.fresh and not t.use_cache()  # never cast: a first forward casts itself
    t.mark_cast()
    assert t.fresh and t.use_cache()
    t.mark_consumed()
    assert not t.fresh
    t.mark_cast()
    with torch.no_grad():
        w.add_(1.0)  # written outside the optimizer's pass: the cached cast is of the old weight
    assert not t.fresh
    t.captured = True  # a captured slot-0 graph takes the cache whatever it holds: its caller casts first
    assert t.use_cache()


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
