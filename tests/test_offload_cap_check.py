"""`scripts/offload_cap_check.py`'s cap placement on the CPU: a cap bounds reserved memory, so it must lie
above what release reserved and below what no offload allocated."""

from __future__ import annotations

import pytest

from script_modules import script_module

GIB = 2**30


@pytest.fixture(scope="module")
def cap_check():
    with script_module("scripts/offload_cap_check.py") as mod:
        yield mod


def test_the_configs_own_cap_is_kept_where_it_separates_the_runs(cap_check) -> None:
    fraction, why = cap_check.place_cap(100 * GIB, release_reserved=40 * GIB, off_allocated=60 * GIB, own=0.5)
    assert fraction == 0.5 and "own" in why


def test_otherwise_the_cap_lies_halfway_between_reserved_and_allocated(cap_check) -> None:
    fraction, why = cap_check.place_cap(100 * GIB, release_reserved=40 * GIB, off_allocated=60 * GIB, own=0.3)
    assert fraction == 0.5 and "halfway" in why
    fraction, _ = cap_check.place_cap(100 * GIB, release_reserved=41 * GIB, off_allocated=47 * GIB, own=0.0)
    assert fraction == 0.44


def test_no_cap_where_release_reserves_more_than_no_offload_allocates(cap_check) -> None:
    """As on the H100 at h4096-long with microbatch size 2: release allocated less (38.3 GiB) but reserved
    68.5 GiB, above no offload's 43.4 GiB allocated; a cap between the allocated peaks refused both."""
    verdict = cap_check.place_cap(79 * GIB, release_reserved=int(68.5 * GIB), off_allocated=int(43.4 * GIB),
                                  own=0.3)
    assert verdict == ("no cap separates the two runs: release reserved and mapped 68.5 GiB, no offload allocated "
                       "43.4 GiB")
