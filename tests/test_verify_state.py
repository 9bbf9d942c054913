"""Bitwise verify-state on CPU: passes for both schedules, and the oracle can fail."""

from __future__ import annotations

import pytest

from qeffect.config import bit_changing_fields, load_config
from qeffect.graphs.handshake import run_settings
from qeffect.verify.state import CATEGORIES, run_verify_state


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["interleaved", "zbv"])
def test_twenty_steps_bitwise_equal(schedule: str) -> None:
    cfg = load_config().with_overrides(**{"pipeline.schedule": schedule})
    report = run_verify_state(cfg, steps=20)
    by = {c.category: c for c in report.categories}
    assert set(by) == set(CATEGORIES)
    assert all(c.mismatches == 0 for c in report.categories), report.first_divergence
    assert all(c.compared > 0 for c in report.categories)  # nothing vacuous
    assert report.first_divergence is None
    assert report.amax_rollover.rolled_over
    assert report.amax_rollover.forward_updates_per_module > cfg.fp8.amax_history_len
    assert report.passed
    assert report.losses[-1] < report.losses[0]


def test_perturbed_scale_is_caught() -> None:
    report = run_verify_state(load_config(), steps=3, injection="perturb-scale")
    assert not report.passed
    by = {c.category: c.mismatches for c in report.categories}
    assert by["fp8_state"] > 0
    d = report.first_divergence
    assert d is not None and d.step == 1 and d.action == "F"


def test_swapped_dw_without_fixed_order_sum_is_caught() -> None:
    report = run_verify_state(load_config(), steps=2, injection="swap-dw")
    assert not report.passed
    by = {c.category: c.mismatches for c in report.categories}
    assert by["parameter_gradients"] > 0
    assert report.first_divergence is not None
    assert report.first_divergence.category == "parameter_gradients"


def test_swapped_dw_with_fixed_order_sum_is_equal() -> None:
    report = run_verify_state(load_config(), steps=2, injection="swap-dw-fixed")
    assert report.passed, report.first_divergence


@pytest.mark.parametrize("schedule", ["interleaved", "zbv"])
def test_staged_accumulation_with_a_partial_group_is_bitwise_equal(schedule: str, monkeypatch) -> None:
    """M = 6 in groups of at most 4 (each stage at the divisor of its K: `staging_depth`): verify compares
    every dW's prefix (staged slots not yet folded included) and every commit against native, and the
    staged folds really ran: every whole group's by the dW that closes it, the last group's (deferred, a
    partial one where the depth does not divide 6) by the commit's AdamW."""
    from qeffect.contracts.arena import GradientArena
    from qeffect.graphs.binding import staging_depth
    from qeffect.runtime.adamw import TritonAdamW
    from qeffect.runtime.build import schedule_of
    from qeffect.schedule.liveness import slots_for

    folds: list[tuple[int, int]] = []
    deferred: list[tuple[int, bool]] = []
    flush, fold_into = GradientArena.flush, TritonAdamW.fold_into_step
    monkeypatch.setattr(GradientArena, "flush",
                        lambda self, name, m: (folds.append((self.depth(name), m)), flush(self, name, m)))
    monkeypatch.setattr(TritonAdamW, "fold_into_step",
                        lambda self, p, block, count, init: (deferred.append((count, init)),
                                                             fold_into(self, p, block, count, init)))
    cfg = load_config().with_overrides(**{"pipeline.schedule": schedule, "pipeline.microbatches": 6,
                                          "pipeline.wgrad_staging": 4, "pipeline.wgrad_staging_by_liveness": True})
    report = run_verify_state(cfg, steps=3)
    assert report.passed, report.first_divergence
    assert all(c.mismatches == 0 and c.compared > 0 for c in report.categories)
    depths = {staging_depth(4, k, 6) for k in slots_for(schedule_of(cfg)).values()}
    assert 4 in depths and len(depths) > 1  # a partial group (4 into 6) and several depths
    assert {g for g, _ in folds} == depths
    for g, m in folds:  # a dW folds exactly where it closes a whole group of its depth, never the last
        assert m % g == g - 1 and m < 5
    assert {c for c, _ in deferred} == {5 % g + 1 for g in depths}
    assert not any(init for _, init in deferred)  # every last group adds to the groups before it


def test_a_run_that_diverged_on_both_sides_fails() -> None:
    """Two runs that both went to NaN agree bit for bit; the report must still fail."""
    cfg = load_config().with_overrides(**{"optim.lr": 1e30})
    report = run_verify_state(cfg, steps=3)
    assert all(c.mismatches == 0 for c in report.categories), report.first_divergence
    assert report.non_finite_losses > 0, report.losses
    assert not report.passed
    assert type(report).model_validate_json(report.model_dump_json()).non_finite_losses == report.non_finite_losses


def test_bf16_activations_stage_the_weight_gradients_in_bf16_bitwise_equal(monkeypatch) -> None:
    """bf16 activations through fp32 masters (the GPU configs' setup): the reference wgrad GEMM writes
    bf16, the arena stages bf16 slots and folds them, and every fingerprint equals native's."""
    from qeffect.contracts.arena import GradientArena

    staged: list[set] = []
    init = GradientArena.__init__

    def record(self, *args, **kwargs) -> None:
        staged.append(set((kwargs.get("staging_dtypes") or {}).values()))
        init(self, *args, **kwargs)

    monkeypatch.setattr(GradientArena, "__init__", record)
    cfg = load_config().with_overrides(**{"train.dtype": "bfloat16"})
    report = run_verify_state(cfg, steps=3)
    assert report.passed, report.first_divergence
    assert all(c.mismatches == 0 and c.compared > 0 for c in report.categories)
    assert {str(d) for s in staged for d in s} == {"torch.bfloat16"}
    # the report records the settings it ran under: every bit-changing one and the [runtime] section
    assert report.settings == run_settings(cfg) and report.settings["train.dtype"] == "bfloat16"
    assert set(bit_changing_fields()) < set(report.settings) and "runtime.rank_streams" in report.settings
    assert type(report).model_validate_json(report.model_dump_json()).settings == report.settings
