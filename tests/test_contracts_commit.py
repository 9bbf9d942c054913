"""Commit barrier and reduction tracker: quiescence, refusal reasons, abort, epochs advancing together."""

from __future__ import annotations

import pytest
import torch

from qeffect.contracts import (
    CommitBarrier,
    CommitViolation,
    Consumer,
    EpochClock,
    GradientArena,
    InvocationKey,
    ReductionTracker,
    TapePool,
    TapeViolation,
    WeightCacheVersion,
)


def setup(M=2):
    clock = EpochClock()
    pools = [TapePool(3, "p0"), TapePool(3, "p1")]
    arenas = [GradientArena({"w": ((2,), torch.float32)}, M, name="a0"),
              GradientArena({"v": ((3,), torch.float32)}, M, name="a1")]
    red = ReductionTracker("dp")
    return clock, pools, arenas, red, CommitBarrier(clock, pools, arenas, red)


def fill(arenas):
    for a in arenas:
        for k in a.keys():
            a.record_write(*k, a.view(*k))


def test_reduction_tracker():
    r = ReductionTracker()
    h1, h2 = r.start("a"), r.start("b")
    assert h1 != h2 and r.pending() == ["a", "b"]
    with pytest.raises(CommitViolation, match="pending reduction"):
        r.advance_epoch()
    r.finish(h1)
    assert r.pending() == ["b"]
    with pytest.raises(CommitViolation, match="unknown reduction"):
        r.finish(h1)
    r.finish(h2)
    assert r.advance_epoch() == 1 and r.epoch == 1


def test_commit_advances_all_epochs_together():
    clock, pools, arenas, red, barrier = setup()
    param = torch.ones(2)
    for step_no in range(3):
        e = clock.e_W
        refs = [p.allocate(InvocationKey(e, s, 0)) for s, p in enumerate(pools)]
        for p, r in zip(pools, refs, strict=True):
            p.mark_consumed(r, Consumer.DI)
            p.mark_consumed(r, Consumer.DW)
        h = red.start("grads")
        fill(arenas)
        red.finish(h)
        for a in arenas:
            a.view("w" if a.name == "a0" else "v", 0).fill_(1.0)
        seen: list[torch.Tensor] = []

        def step(seen=seen):
            seen.append(arenas[0].sum_microbatches("w"))
            param.sub_(seen[-1])

        barrier.commit(step)
        assert len(seen) == 1 and torch.equal(seen[0], torch.ones(2))
        assert clock.e_W == step_no + 1
        assert [a.epoch for a in arenas] == [step_no + 1] * 2 and red.epoch == step_no + 1
        assert all(a.written == frozenset() and a.usable for a in arenas)
    assert torch.equal(param, torch.full((2,), -2.0))


def test_commit_refusal_lists_every_reason_then_aborts():
    clock, pools, arenas, red, barrier = setup()
    live = pools[1].allocate(InvocationKey(0, 1, 1))
    pools[0].allocate(InvocationKey(0, 0, 0))
    arenas[0].record_write("w", 0, arenas[0].view("w", 0))
    red.start("all-reduce w")
    calls = []
    before = barrier.reasons("commit")
    assert len(before) == 5
    with pytest.raises(CommitViolation,
                       match=r"premature commit at e_W=0: expected quiescence, found: pool 'p0' has 1 live"
                             r" tape") as ei:
        barrier.check_quiescent()
    msg = str(ei.value)
    for part in ("premature commit", "K(e=0,s=1,m=1,u=0,i=0)", "K(e=0,s=0,m=0,u=0,i=0)", "w[m=1]", "v[m=0]",
                 "v[m=1]", "all-reduce w", "'p0'", "'p1'", "'a0'", "'a1'"):
        assert part in msg, part
    assert pools[1].live_count == 1 and all(a.usable for a in arenas)  # check_quiescent mutates nothing
    with pytest.raises(CommitViolation,
                       match=r"premature commit at e_W=0: expected quiescence, found: pool 'p0' has 1 live"
                             r" tape"):
        barrier.commit(lambda: calls.append(1))
    assert calls == [] and clock.e_W == 0 and [a.epoch for a in arenas] == [0, 0] and red.epoch == 0
    assert pools[0].live_count == 0 and pools[1].live_count == 0 and not any(a.usable for a in arenas)
    assert red.pending() == ["all-reduce w"]
    with pytest.raises(TapeViolation, match=r"free slot for K\(e=0,s=1,m=1,u=0,i=0\): expected live generation 1, "
                                            r"found slot 0 free \(current generation 1\); pool 'p1'"):
        pools[1].resolve(live, InvocationKey(0, 1, 1))  # the abort purged it


@pytest.mark.parametrize("reason", ["tape", "arena", "reduction", "aborted"])
def test_commit_refuses_each_reason_alone(reason):
    clock, pools, arenas, red, barrier = setup()
    fill(arenas)
    if reason == "tape":
        pools[0].allocate(InvocationKey(0, 0, 0))
    elif reason == "arena":
        arenas[1].abort()
        arenas[1].rebuild()  # writes cleared: v[m=0] and v[m=1] are missing again
    elif reason == "reduction":
        red.start("r")
    else:
        arenas[0].abort()
    assert len(barrier.reasons()) == 1
    with pytest.raises(CommitViolation, match="premature commit"):
        barrier.commit(lambda: None)
    assert clock.e_W == 0


def test_checkpoint_quiescence():
    clock, pools, arenas, red, barrier = setup()
    barrier.check_quiescent("checkpoint")  # between steps: nothing written, nothing live
    with pytest.raises(CommitViolation, match="premature commit"):
        barrier.check_quiescent("commit")  # but a commit needs every view written
    arenas[0].record_write("w", 1, arenas[0].view("w", 1))
    with pytest.raises(CommitViolation, match=r"premature checkpoint .*writes in flight \[w\[m=1\]\]"):
        barrier.check_quiescent("checkpoint")
    with pytest.raises(ValueError, match=r"purpose must be one of \('commit', 'checkpoint'\), got 'save'"):
        barrier.check_quiescent("save")


def test_failing_step_aborts_and_keeps_epoch():
    clock, pools, arenas, red, barrier = setup()
    fill(arenas)
    pools[0].allocate(InvocationKey(1, 0, 0))  # a tape of another epoch is not purged ...
    barrier.pools = [pools[1]]  # ... and not seen by this barrier
    with pytest.raises(RuntimeError, match="optimizer exploded"):
        barrier.commit(lambda: (_ for _ in ()).throw(RuntimeError("optimizer exploded")))
    assert clock.e_W == 0 and not any(a.usable for a in arenas) and [a.epoch for a in arenas] == [0, 0]
    assert pools[0].live_count == 1


def test_abort_epoch_purges_only_current_epoch():
    clock, pools, arenas, red, barrier = setup()
    clock.advance()
    pools[0].allocate(InvocationKey(1, 0, 0))
    pools[0].allocate(InvocationKey(0, 0, 1))
    pools[1].allocate(InvocationKey(1, 1, 0))
    assert barrier.abort_epoch() == [InvocationKey(1, 0, 0), InvocationKey(1, 1, 0)]
    assert pools[0].live_keys() == [InvocationKey(0, 0, 1)] and pools[1].live_count == 0


def test_weight_cache_follows_commit():
    clock, pools, arenas, red, barrier = setup(M=1)
    cache = WeightCacheVersion("q")
    assert cache.check_forward(clock, True)
    fill(arenas)
    barrier.commit(lambda: None)
    from qeffect.contracts import CacheEpochViolation

    with pytest.raises(CacheEpochViolation,
                       match=r"stale weight cache for cache 'q': expected e_C == e_W = 1, found e_C = 0"):
        cache.check_forward(clock, False)
    assert cache.check_forward(clock, True) and cache.e_C == 1
