"""The checked split actions: contract violations surface at the action that breaks them, and the
copied-gradient path is bitwise equal to direct placement."""

from __future__ import annotations

import pytest
import torch

from qeffect.config import load_config
from qeffect.contracts import (
    CacheEpochViolation,
    ConsumerOrderViolation,
    EffectTokenViolation,
    TapeViolation,
)
from qeffect.runtime.build import build_single_process
from qeffect.verify.state import bitwise_equal, synthetic_batches

CFG = load_config().with_overrides(**{"model.vocab_size": 256, "pipeline.pp": 1, "pipeline.chunks_per_rank": 1,
                                      "pipeline.microbatches": 2})


def _single_stage():
    pipe = build_single_process(CFG, native=False)
    rank = pipe.ranks[0]
    return pipe, rank, rank.actions[0]


def test_dw_before_di_is_rejected_and_tape_kept() -> None:
    _, rank, act = _single_stage()
    (x, y) = synthetic_batches(CFG, 0, "cpu")[0]
    f = act.forward(0, x, act.ledger.current, y)
    before = rank.pool.snapshot()
    with pytest.raises(ConsumerOrderViolation,
                       match=r"dW before dI for K\(e=0,s=0,m=0,u=0,i=0\): expected completed consumers dI,"
                             r" found completed consumers none"):
        act.weight_grad(0, f.ref, f.token)
    assert rank.pool.snapshot() == before
    di = act.input_grad(0, f.ref, torch.tensor(0.5), f.token)
    act.weight_grad(0, f.ref, di.token)
    assert rank.pool.live_count == 0


def test_stale_token_and_stale_reference_are_rejected() -> None:
    _, rank, act = _single_stage()
    (x, y) = synthetic_batches(CFG, 0, "cpu")[0]
    t0 = act.ledger.current
    f = act.forward(0, x, t0, y)
    with pytest.raises(EffectTokenViolation,
                       match=r"stale token for stage0: expected seq 1, found 0; action dI0"):
        act.input_grad(0, f.ref, torch.tensor(0.5), t0)  # the token F already consumed
    di = act.input_grad(0, f.ref, torch.tensor(0.5), f.token)
    dw = act.weight_grad(0, f.ref, di.token)
    f1 = act.forward(1, x, dw.token, y)  # reuses the released slot with a new generation
    assert f1.ref.slot == f.ref.slot and f1.ref.generation != f.ref.generation
    with pytest.raises(TapeViolation,
                       match=r"foreign reference for K\(e=0,s=0,m=1,u=0,i=0\): expected key K\(e=0,s=0,m=1"
                             r",u=0,i=0\), found reference for K\(e=0,s=0,m=0"):
        act.input_grad(1, f.ref, torch.tensor(0.5), f1.token)  # the old reference (ABA)
    assert rank.pool.live_count == 1


def test_stale_weight_cache_after_commit_is_rejected() -> None:
    pipe, rank, act = _single_stage()
    pipe.step(synthetic_batches(CFG, 0, "cpu"))
    (x, y) = synthetic_batches(CFG, 1, "cpu")[1]
    with pytest.raises(CacheEpochViolation,
                       match=r"stale weight cache for cache 'stage0': expected e_C == e_W = 1, found e_C ="
                             r" 0"):
        act.forward(1, x, act.ledger.current, y)  # microbatch 1 first after the commit: no refresh


def test_copied_gradients_equal_direct_placement() -> None:
    cfg = load_config()
    direct = build_single_process(cfg, native=False, direct=True)
    copied = build_single_process(cfg, native=False, direct=False)
    for step in range(2):
        batches = synthetic_batches(cfg, step, "cpu")
        assert bitwise_equal(direct.step(batches), copied.step(batches))
    for rd, rc in zip(direct.ranks, copied.ranks, strict=True):
        for s in rd.chunks:
            for (n, a), (_, b) in zip(rd.chunks[s].named_parameters(), rc.chunks[s].named_parameters(), strict=True):
                assert bitwise_equal(a.detach(), b.detach()), (s, n)


def test_copied_gradients_into_staged_slots_with_a_partial_group() -> None:
    """The copy path (`place_copies`) stages in the parameter's dtype and folds groups of 2 over M = 3:
    the region ends with copy(g0); add(g1); add(g2), bit for bit, and the fold ran at m = 1 and m = 2."""
    from qeffect.contracts import EpochClock, GradientArena, TapePool
    from qeffect.runtime.build import build_chunks_for
    from qeffect.stage.actions import StageActions, arena_name

    chunk = build_chunks_for(CFG, "cpu")[0]
    specs = {arena_name(0, p): (tuple(w.shape), w.dtype) for p, w in chunk.matrix_params().items()}
    calls = []

    def spy(region, block, count, init):
        from qeffect.contracts.arena import sequential_reduce

        calls.append((count, init))
        sequential_reduce(region, block, count, init)

    arena = GradientArena(specs, 3, accumulate=True, staging=2, reduce=spy)
    acts = StageActions(chunk, TapePool(3), EpochClock(), arena, direct=False)
    gen = torch.Generator().manual_seed(0)
    grads = [{p: torch.randn(w.shape, generator=gen) * 10.0 ** torch.randint(-3, 4, (), generator=gen)
              for p, w in chunk.matrix_params().items()} for _ in range(3)]
    for m in range(3):
        acts.place_copies(m, grads[m])
    arena.finalize()
    for p in chunk.matrix_params():
        expect = grads[0][p].clone()
        expect += grads[1][p]
        expect += grads[2][p]
        assert torch.equal(arena.sum_microbatches(arena_name(0, p)), expect)
    n = len(specs)
    assert calls == [(2, True)] * n + [(1, False)] * n


def test_a_gradient_in_another_dtype_accumulates_with_the_bits_of_casting_first() -> None:
    """A bias TE took in bf16 sends bf16 gradients: accumulated into the fp32 `.grad` they give what the
    reference's engine cast (exact) and AccumulateGrad's fp32 copy and adds give."""
    from qeffect.stage.actions import accumulate_grads

    torch.manual_seed(0)
    grads = [torch.randn(257).to(torch.bfloat16) for _ in range(4)]
    p = torch.nn.Parameter(torch.zeros(257))
    for g in grads:
        accumulate_grads({"b": p}, {"b": g})
    expect = grads[0].float().clone()
    for g in grads[1:]:
        expect += g.float()
    assert p.grad.dtype == torch.float32 and torch.equal(p.grad, expect)
    assert p.grad.data_ptr() != grads[0].data_ptr()


def test_a_key_is_made_once_per_epoch_and_microbatch() -> None:
    """`key(m)` hands out the same immutable key within an epoch (the host asks for it every action) and
    a key of the new epoch after a commit: an invocation of the next step is never named by the last one's."""
    pipe, rank, act = _single_stage()
    k0 = act.key(0)
    assert act.key(0) is k0 and (k0.e, k0.s, k0.m) == (0, 0, 0) and act.key(1).m == 1
    pipe.step(synthetic_batches(CFG, 0, "cpu"))  # the commit advances the epoch
    k1 = act.key(0)
    assert k1 is not k0 and (k1.e, k1.s, k1.m) == (act.clock.e_W, 0, 0) and k1.e == k0.e + 1


class _FoldSpy:
    """A `FoldingOptimizer` that records what `load_matrix_grads` hands it."""

    def __init__(self, in_pass: bool) -> None:
        self.in_pass, self.without, self.into = in_pass, [], []

    def folds_in_pass(self, param, block) -> bool:
        return self.in_pass

    def fold_without_region(self, param, block, count) -> None:
        self.without.append((param, count))

    def fold_into_step(self, param, block, count, init) -> None:
        self.into.append((param, count, init, param.grad))


@pytest.mark.parametrize("in_pass", [True, False])
def test_lazy_regions_reach_an_optimizer_that_folds_in_its_pass_without_a_region(in_pass: bool) -> None:
    """One staging group a step (depth M): the deferred fold goes to an optimizer whose pass folds it with no
    region made; one that would fold into `.grad` first gets the region, made then."""
    pipe, rank, act = _single_stage()
    assert rank.arena.lazy_regions and not rank.arena.regions_made
    pipe.run_actions(synthetic_batches(CFG, 0, "cpu"))
    rank.arena.finalize()
    spy = _FoldSpy(in_pass)
    act.load_matrix_grads(spy)
    weights = [lin.weight for lin in act.chunk.matrix_linears().values()]
    M = CFG.pipeline.microbatches
    if in_pass:
        assert [(id(p), c) for p, c in spy.without] == [(id(w), M) for w in weights] and not spy.into
        assert not rank.arena.regions_made
    else:
        assert [(id(p), c, i) for p, c, i, _ in spy.into] == [(id(w), M, True) for w in weights] and not spy.without
        assert rank.arena.regions_made
        assert all(g.data_ptr() == rank.arena.region(n).data_ptr()
                   for (_, _, _, g), n in zip(spy.into, rank.arena.specs, strict=True))


def test_a_destination_for_no_matrix_weight_is_the_arenas_unknown_view() -> None:
    from qeffect.contracts import ArenaViolation

    _, rank, act = _single_stage()
    before = rank.arena.snapshot()
    with pytest.raises(ArenaViolation, match=r"unknown view for arena 'rank0.arena'.*'s0.nope.weight'"):
        act.checked_destinations(0, {"nope.weight": torch.zeros(2)})
    assert rank.arena.snapshot() == before
