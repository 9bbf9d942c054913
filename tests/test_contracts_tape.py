"""Tape pool: generations, injective live mapping, consumer order, release, abort, purge."""

from __future__ import annotations

import pytest

from qeffect.contracts import (
    Consumer,
    ConsumerOrderViolation,
    InvocationKey,
    PoolCapacityError,
    TapePool,
    TapeRef,
    TapeViolation,
)

K = InvocationKey
K1, K2, K3 = K(0, 0, 0), K(0, 0, 1), K(0, 1, 0)


def consume_both(pool, ref):
    pool.check_consumer(ref, ref.key, Consumer.DI)
    assert pool.mark_consumed(ref, Consumer.DI) is False
    pool.check_consumer(ref, ref.key, Consumer.DW)
    assert pool.mark_consumed(ref, Consumer.DW) is True


def test_consumer_labels():
    assert Consumer.DI.label == "dI" and Consumer.DW.label == "dW" and str(Consumer.DW) == "dW"
    assert (Consumer.DI | Consumer.DW).label == "dI|dW" and Consumer(0).label == "none"


def test_allocate_lowest_free_slot_and_generation_bump():
    pool = TapePool(3)
    r1, r2 = pool.allocate(K1), pool.allocate(K2)
    assert (r1.slot, r1.generation, r2.slot, r2.generation) == (0, 1, 1, 1)
    consume_both(pool, r1)
    assert pool.generation_of(0) == 1  # release does not bump; the next allocate does
    r3 = pool.allocate(K3)
    assert (r3.slot, r3.generation, r3.key) == (0, 2, K3)
    assert pool.generation_of(0) == 2 and pool.generation_of(2) == 0
    assert pool.live_keys() == [K3, K2] and pool.live_count == 2 and pool.peak_live == 2


def test_release_only_after_both_consumers():
    pool = TapePool(1)
    payload = {"x": object()}
    ref = pool.allocate(K1, payload)
    tape = pool.resolve(ref, K1)
    assert tape.payload is payload and tape.consumers == Consumer(0)
    assert pool.mark_consumed(ref, Consumer.DI) is False
    assert pool.live_keys() == [K1] and tape.consumers == Consumer.DI and tape.payload is payload
    assert pool.mark_consumed(ref, Consumer.DW) is True
    assert pool.live_keys() == [] and tape.payload == {} and not tape.live
    with pytest.raises(TapeViolation, match="free slot"):
        pool.resolve(ref, K1)


def test_duplicate_live_key_rejected():
    pool = TapePool(2)
    pool.allocate(K1)
    before = pool.snapshot()
    with pytest.raises(TapeViolation, match="duplicate live key") as ei:
        pool.allocate(K1)
    assert not isinstance(ei.value, PoolCapacityError)
    assert pool.snapshot() == before


def test_capacity_never_preempts():
    pool = TapePool(2, name="p")
    pool.allocate(K1)
    pool.allocate(K2)
    before = pool.snapshot()
    with pytest.raises(PoolCapacityError,
                       match=r"pool 'p' is full for K\(e=0,s=1,m=0,u=0,i=0\): capacity 2") as ei:
        pool.allocate(K3)
    msg = str(ei.value)
    assert str(K1) in msg and str(K2) in msg and "capacity 2" in msg
    assert ei.value.family == "tape-reference" and ei.value.found == [K1, K2]
    assert pool.snapshot() == before


def test_stale_reference_after_reuse_preserves_live_tape():
    pool = TapePool(1)
    old = pool.allocate(K1)
    consume_both(pool, old)
    payload = {"act": [1, 2]}
    new = pool.allocate(K2, payload)
    pool.mark_consumed(new, Consumer.DI)
    live = pool.resolve(new, K2)
    before = pool.snapshot()
    for call in (lambda: pool.resolve(old, K1), lambda: pool.check_consumer(old, K1, Consumer.DW),
                 lambda: pool.mark_consumed(old, Consumer.DW), lambda: pool.abort(old)):
        with pytest.raises(TapeViolation, match="stale generation") as ei:
            call()
        assert ei.value.expected == 2 and ei.value.found == 1
    assert pool.snapshot() == before
    assert pool.resolve(new, K2) is live and live.payload is payload and live.consumers == Consumer.DI


def test_stale_ref_with_context_manager_does_not_abort_live_tape():
    pool = TapePool(1)
    old = pool.allocate(K1)
    consume_both(pool, old)
    new = pool.allocate(K2)
    before = pool.snapshot()
    ran = []
    with pytest.raises(TapeViolation,
                       match=r"stale generation for K\(e=0,s=0,m=0,u=0,i=0\): expected generation 2, found"
                             r" 1"):
        with pool.consume(old, K1, Consumer.DI):
            ran.append(1)
    assert ran == [] and pool.snapshot() == before and pool.live_keys() == [K2]
    assert pool.resolve(new, K2).generation == 2


def test_foreign_reference_and_bad_refs():
    pool = TapePool(2)
    r1, r2 = pool.allocate(K1), pool.allocate(K2)
    before = pool.snapshot()
    with pytest.raises(TapeViolation, match="foreign reference"):
        pool.resolve(r1, K2)
    # a forged ref naming K2's slot and generation but K1's key
    with pytest.raises(TapeViolation, match="foreign reference"):
        pool.resolve(TapeRef(r2.slot, r2.generation, K1), K1)
    with pytest.raises(TapeViolation, match="slot out of range"):
        pool.resolve(TapeRef(5, 1, K1), K1)
    with pytest.raises(TapeViolation, match="not a tape reference"):
        pool.resolve((0, 1, K1), K1)  # type: ignore[arg-type]
    assert pool.snapshot() == before


def test_consumer_rules():
    pool = TapePool(2)
    ref = pool.allocate(K1)
    before = pool.snapshot()
    with pytest.raises(ConsumerOrderViolation, match="dW before dI"):
        pool.check_consumer(ref, K1, Consumer.DW)
    with pytest.raises(ConsumerOrderViolation, match="dW before dI"):
        pool.mark_consumed(ref, Consumer.DW)
    assert pool.snapshot() == before
    pool.check_consumer(ref, K1, Consumer.DI)
    assert pool.snapshot() == before  # a check mutates nothing
    pool.mark_consumed(ref, Consumer.DI)
    mid = pool.snapshot()
    with pytest.raises(ConsumerOrderViolation, match="duplicate dI"):
        pool.check_consumer(ref, K1, Consumer.DI)
    with pytest.raises(ConsumerOrderViolation, match="duplicate dI"):
        pool.mark_consumed(ref, Consumer.DI)
    assert pool.snapshot() == mid
    with pytest.raises(ValueError, match=r"consumer must be Consumer\.DI or Consumer\.DW"):
        pool.check_consumer(ref, K1, Consumer.DI | Consumer.DW)


def test_consume_context_manager_success_and_failure():
    pool = TapePool(2)
    ref = pool.allocate(K1, {"a": 1})
    with pool.consume(ref, K1, Consumer.DI) as tape:
        assert tape.payload == {"a": 1} and tape.consumers == Consumer(0)  # recorded only after the block
    assert pool.resolve(ref, K1).consumers == Consumer.DI
    with pool.consume(ref, K1, Consumer.DW):
        pass
    assert pool.live_count == 0

    ref2 = pool.allocate(K2, {"a": 2})
    with pytest.raises(RuntimeError, match="kernel failed"):
        with pool.consume(ref2, K2, Consumer.DI):
            raise RuntimeError("kernel failed")
    assert pool.live_count == 0  # aborted
    with pytest.raises(TapeViolation,
                       match=r"free slot for K\(e=0,s=0,m=1,u=0,i=0\): expected live generation 2, found s"
                             r"lot 0 free"):
        pool.resolve(ref2, K2)
    again = pool.allocate(K2)
    assert (again.slot, again.generation) == (0, 3)  # K1 used gen 1, the aborted K2 gen 2


def test_abort_and_purge():
    pool = TapePool(4)
    a, b = pool.allocate(K(0, 0, 0)), pool.allocate(K(1, 0, 0))
    c = pool.allocate(K(0, 1, 1))
    pool.abort(a)
    with pytest.raises(TapeViolation,
                       match=r"free slot for K\(e=0,s=0,m=0,u=0,i=0\): expected live generation 1, found s"
                             r"lot 0 free"):
        pool.abort(a)
    assert pool.live_keys() == [K(1, 0, 0), K(0, 1, 1)]
    assert pool.purge(0) == [K(0, 1, 1)]
    assert pool.live_keys() == [K(1, 0, 0)]
    assert pool.purge(0) == []
    with pytest.raises(TapeViolation,
                       match=r"free slot for K\(e=0,s=1,m=1,u=0,i=0\): expected live generation 1, found s"
                             r"lot 2 free"):
        pool.resolve(c, K(0, 1, 1))
    assert pool.resolve(b, K(1, 0, 0)).key == K(1, 0, 0)
    assert pool.peak_live == 3
    # aborted slots come back with bumped generations
    r = pool.allocate(K(0, 0, 0))
    assert (r.slot, r.generation) == (0, 2)


def test_snapshot_detects_changes():
    pool = TapePool(2)
    ref = pool.allocate(K1, {"x": 1})
    s0 = pool.snapshot()
    hash(s0)
    pool.resolve(ref, K1).payload["y"] = 2
    s1 = pool.snapshot()
    assert s1 != s0
    pool.mark_consumed(ref, Consumer.DI)
    assert pool.snapshot() != s1


def test_constructor_validation():
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ValueError, match=r"TapePool capacity must be an int >= 1"):
            TapePool(bad)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"allocate needs an InvocationKey, got tuple"):
        TapePool(1).allocate((0, 0, 0))  # type: ignore[arg-type]
