"""`scripts/offload_cap_check.py`'s cap placement on the CPU: a cap bounds reserved memory, so it must lie
above what release reserved and mapped and below what no offload reserved (its graph pools)."""

from __future__ import annotations

import pytest

from script_modules import script_module

GIB = 2**30


@pytest.fixture(scope="module")
def cap_check():
    with script_module("scripts/offload_cap_check.py") as mod:
        yield mod


def test_the_configs_own_cap_is_kept_where_it_separates_the_runs(cap_check) -> None:
    fraction, why = cap_check.place_cap(100 * GIB, release_reserved=40 * GIB, off_reserved=60 * GIB, own=0.5)
    assert fraction == 0.5 and "own" in why


def test_otherwise_the_cap_lies_halfway_between_the_reserved_peaks(cap_check) -> None:
    fraction, why = cap_check.place_cap(100 * GIB, release_reserved=40 * GIB, off_reserved=60 * GIB, own=0.3)
    assert fraction == 0.5 and "halfway" in why
    fraction, _ = cap_check.place_cap(100 * GIB, release_reserved=41 * GIB, off_reserved=47 * GIB, own=0.0)
    assert fraction == 0.44


def test_no_cap_where_release_needs_more_than_no_offload_reserves(cap_check) -> None:
    """Release needs what it reserved plus what its slots mapped; where that is above what no offload
    reserved, no cap lets release fit and refuses no offload."""
    verdict = cap_check.place_cap(79 * GIB, release_reserved=int(53.0 * GIB), off_reserved=int(52.8 * GIB),
                                  own=0.3)
    assert verdict == ("no cap separates the two runs: release reserved and mapped 53.0 GiB, no offload reserved "
                       "52.8 GiB")
