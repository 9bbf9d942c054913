"""`runtime.phases.SetupClock`: the build phases `qeffect profile` reports (CPU; no device to synchronize)."""

from __future__ import annotations

import time

import pytest

from qeffect.config import load_config
from qeffect.runtime.build import build_single_process
from qeffect.runtime.phases import SetupClock, no_phase, phase_of


def test_a_phase_entered_again_adds_to_its_total() -> None:
    clock = SetupClock("cpu")
    for _ in range(2):
        with clock.phase("a"):
            time.sleep(0.01)
    with clock.phase("b"):
        pass
    assert list(clock.seconds) == ["a", "b"]
    assert clock.seconds["a"] >= 0.02 and 0 <= clock.seconds["b"] < clock.seconds["a"]


def test_a_phase_that_raises_is_still_timed() -> None:
    clock = SetupClock("cpu")
    with pytest.raises(ValueError), clock.phase("a"):
        raise ValueError
    assert "a" in clock.seconds


def test_no_clock_times_nothing() -> None:
    assert phase_of(None) is no_phase
    with no_phase("a"):
        pass
    clock = SetupClock("cpu")
    assert phase_of(clock) == clock.phase


@pytest.mark.parametrize("native", [True, False])
def test_a_build_reports_its_phases_in_order(native: bool) -> None:
    clock = SetupClock("cpu")
    t0 = time.perf_counter()
    pipe = build_single_process(load_config(), native=native, device="cpu", clock=clock)
    total = time.perf_counter() - t0
    assert list(clock.seconds) == ["modules", "values", "ranks"]  # eager: no capture phase
    assert sum(clock.seconds.values()) <= total
    assert len(pipe.ranks) == load_config().pipeline.pp
