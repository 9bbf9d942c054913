"""Fault injection: every family rejects its first invalid operation and preserves state."""

from __future__ import annotations

import json

import pytest
import torch

from qeffect.contracts import FAMILIES, TapePool, TapeViolation
from qeffect.verify.faults import FaultReport, Injection, build_injections, run_faults, run_injection


@pytest.fixture(scope="module")
def report() -> FaultReport:
    return run_faults()


def test_report_passes(report):
    assert report.passed, [r for r in report.injections if not r.passed]
    assert report.kind == "faults" and report.schema_version == 1
    assert len(report.injections) >= 8 and len(report.families) == 7
    assert set(report.families) == set(FAMILIES) == {"tape-reference", "consumer-order", "effect-token",
                                                     "cache-epoch", "arena", "commit", "device-completion"}
    assert report.cuda_initialized is False and torch.cuda.is_initialized() is False


def test_every_injection_first_invalid_and_preserved(report):
    for r in report.injections:
        assert r.passed and r.first_invalid and r.state_preserved and r.later_ops_ok, r
        assert r.rejected_operation == r.expected_operation
        assert r.found_family == r.family and r.message.startswith(f"[{r.family}]")
        assert r.checks
    by_name = {r.injection: r for r in report.injections}
    assert by_name["stale tape reference after slot reuse (ABA)"].error_type == "TapeViolation"
    assert "stale generation" in by_name["stale tape reference after slot reuse (ABA)"].message
    assert by_name["premature commit with a live tape"].aftermath_ok is True
    assert by_name["premature commit with a pending reduction"].aftermath_ok is True
    handoff = by_name["hand-off read on a rank stream that did not wait"]
    assert handoff.error_type == "DeviceCompletionViolation"
    assert handoff.rejected_operation == "F(1,1) reads act(0,1) on rank1 without a wait"
    assert ("use without wait for ('act', 0, 1): expected consumer stream 'rank1' to wait on the record on "
            "producer stream 'rank0'") in handoff.message
    one_way = by_name["graph outputs read after a replay the caller did not wait for (one-way)"]
    assert one_way.error_type == "DeviceCompletionViolation" and "stale wait for stage0.F0" in one_way.message


def test_report_round_trips_as_json(report):
    again = FaultReport.model_validate(json.loads(report.model_dump_json()))
    assert again == report


def _pool_script(ops, invalid_index, family="tape-reference"):
    pool = TapePool(1)
    return pool, Injection(family=family, name="custom", ops=ops(pool), invalid_index=invalid_index,
                           observe=pool.snapshot, checks="pool snapshot")


def test_runner_fails_when_invalid_op_is_accepted():
    from qeffect.contracts import InvocationKey

    k = InvocationKey(0, 0, 0)
    _, inj = _pool_script(lambda p: [("allocate", lambda: p.allocate(k)), ("harmless", p.live_keys)], 1)
    r = run_injection(inj)
    assert not r.passed and not r.first_invalid and r.rejected_operation is None
    assert "was accepted" in r.message
    rep = run_faults([inj] + build_injections())
    assert not rep.passed


def test_runner_fails_when_rejected_too_early():
    from qeffect.contracts import InvocationKey, TapeRef

    k = InvocationKey(0, 0, 0)
    bad = TapeRef(0, 9, k)
    _, inj = _pool_script(lambda p: [("stale abort", lambda: p.abort(bad)), ("allocate", lambda: p.allocate(k)),
                                     ("stale abort again", lambda: p.abort(bad))], 2)
    r = run_injection(inj)
    assert not r.passed and not r.first_invalid and r.rejected_operation == "stale abort"


def test_runner_fails_on_wrong_family_or_changed_state():
    from qeffect.contracts import InvocationKey

    k = InvocationKey(0, 0, 0)
    _, inj = _pool_script(lambda p: [("allocate", lambda: p.allocate(k)), ("dup", lambda: p.allocate(k))], 1,
                          family="arena")
    r = run_injection(inj)
    assert r.first_invalid and r.state_preserved and not r.passed and r.found_family == "tape-reference"

    def mutate_then_raise(p):
        def op():
            p.allocate(InvocationKey(0, 0, 1))
            raise TapeViolation("late check", relation="x")

        return [("mutating op", op)]

    _, inj = _pool_script(mutate_then_raise, 0)
    r = run_injection(inj)
    assert r.first_invalid and not r.state_preserved and not r.passed

    _, inj = _pool_script(lambda p: [("plain error", lambda: 1 / 0)], 0)
    r = run_injection(inj)
    assert not r.first_invalid and r.error_type == "ZeroDivisionError" and not r.passed


def test_runner_fails_when_later_ops_break():
    from qeffect.contracts import InvocationKey

    k = InvocationKey(0, 0, 0)
    _, inj = _pool_script(lambda p: [("allocate", lambda: p.allocate(k)), ("dup", lambda: p.allocate(k)),
                                     ("dup again", lambda: p.allocate(k))], 1)
    r = run_injection(inj)
    assert r.first_invalid and r.state_preserved and not r.later_ops_ok and not r.passed


def test_too_few_injections_or_families_fail():
    # injections hold state: build fresh ones for every run
    def firsts():
        by_family: dict[str, Injection] = {}
        for inj in build_injections():
            by_family.setdefault(inj.family, inj)
        return list(by_family.values())

    seven = run_faults(firsts())
    assert len(seven.injections) == 7 and len(seven.families) == 7 and all(r.passed for r in seven.injections)
    assert not seven.passed
    eight = run_faults(firsts() + [build_injections()[1]])
    assert len(eight.injections) == 8 and eight.passed  # eight injections, every family: the minimum
    for family in ("effect-token", "device-completion"):
        missing = run_faults([i for i in build_injections() if i.family != family])
        assert all(r.passed for r in missing.injections) and not missing.passed
