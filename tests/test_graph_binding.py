"""Graphs and tape slots bounded by the schedule's liveness (graphs/binding.py), on CPU with faked replays:
the chain layout, the slot count per stage for M = 2..16 (both schedules), the generation check that
rejects a premature reuse at its first invalid operation, and the arena's write signatures."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from qeffect.config import load_config
from qeffect.contracts import GradientArena, TapePool, TapeViolation
from qeffect.contracts.arena import FoldMode
from qeffect.contracts.epochs import EpochClock
from qeffect.graphs.binding import chain_count, chain_of, graph_plan
from qeffect.graphs.captured import CapturedStageActions, SlotGraphs
from qeffect.runtime.build import build_chunks_for, build_rank, schedule_of
from qeffect.schedule import Action, ActionKind, Schedule, build_schedule, validate
from qeffect.schedule.liveness import slot_conflict, slots_for
from qeffect.stage.actions import arena_name
from qeffect.stage.embedding_grad import TokenEmbeddingGrad
from qeffect.verify.state import bitwise_equal

F, DI, DW = ActionKind.F, ActionKind.DI, ActionKind.DW
PP, CHUNKS = 2, 2


class FakeManager:
    """Records replays by graph name; `outputs` are whatever the faked graph holds."""

    def __init__(self) -> None:
        self.replays: list[str] = []

    def replay(self, action, dynamic=None):
        self.replays.append(action.name)
        return action.outputs

    def step_tensor(self, key, make):  # ordinary steps only (`GraphManager.step_tensor`)
        return make()


def accepted(name: str) -> dict[int, Schedule]:
    out = {}
    for m in range(2, 17):
        try:
            out[m] = build_schedule(name, PP, CHUNKS, m)
        except ValueError:  # torch refuses some M for interleaved
            continue
    return out


# ------------------------------------------------------------------------------------------- the layout
@pytest.mark.parametrize(("k", "m", "chains"), [(1, 5, [0, 1, 1, 1, 1]), (2, 6, [0, 1, 2, 1, 2, 1]),
                                                (3, 7, [0, 1, 2, 3, 1, 2, 3]), (4, 3, [0, 1, 2])])
def test_chain_of_gives_microbatch_zero_its_own_chain(k: int, m: int, chains: list[int]) -> None:
    assert [chain_of(i, k) for i in range(m)] == chains
    assert chain_count(m, k) == len(set(chains))


def test_one_chain_per_microbatch_when_k_is_m() -> None:
    plan = graph_plan(6, 6)
    assert [g.chain for g in plan.per_microbatch] == list(range(6))
    assert plan.graph_count == 3 * 6 and not any(plan.shared(m) for m in range(6))


@pytest.mark.parametrize("k", [1, 2, 3, 4, 5])
def test_chains_are_subsets_of_the_m_mod_k_classes(k: int) -> None:
    """What makes the liveness proof for m % K carry over to the chains."""
    for m in range(40):
        for n in range(m):
            if chain_of(m, k) == chain_of(n, k):
                assert m % k == n % k, (k, m, n)


@pytest.mark.parametrize("name", ["interleaved", "zbv"])
def test_rank_slot_count_follows_liveness_for_every_m(name: str) -> None:
    """Captured ranks bind K = `slots_for` per stage, for M = 2..16 (each chunk its own range of pool
    slots); the K are conflict-free, and without the bound every microbatch has its own chain."""
    schedules = accepted(name)
    assert 2 in schedules and 16 in schedules
    base = load_config().with_overrides(**{"model.vocab_size": 64, "model.hidden": 16, "model.ffn": 32,
                                           "model.heads": 2, "model.seq_len": 8, "pipeline.pp": PP,
                                           "pipeline.chunks_per_rank": CHUNKS, "pipeline.schedule": name})
    chunks = build_chunks_for(base, "cpu")
    for m, sch in schedules.items():
        cfg = base.with_overrides(**{"pipeline.microbatches": m})
        k = slots_for(sch)
        assert slot_conflict(sch, k) is None
        for rank in range(PP):
            r = build_rank(cfg, schedule_of(cfg), rank, chunks, native=False, manager=FakeManager())
            for i, (s, act) in enumerate(r.actions.items()):
                assert act.graph_slots == k[s] and act.slot_base == i * m, (name, m, s)
                plan = act.plan_for(m)
                assert chain_count(m, k[s]) <= len(plan.chains) <= m  # classes, split by the arena's writes
            unbounded = build_rank(cfg, schedule_of(cfg), rank, chunks, native=False, manager=FakeManager(),
                                   bounded_slots=False)
            assert all(a.graph_slots is None for a in unbounded.actions.values())
            assert unbounded.pool.capacity == len(unbounded.actions) * m


def rank_graphs(sch: Schedule, rank: int, arena_of=None) -> int:
    """Graphs one rank captures: each of its chunks' `graph_plan` (dW variants from `arena_of(M)`)."""
    k = slots_for(sch)
    total = 0
    for s in sch.stages_of(rank):
        variant = arena_of(sch.microbatches).write_signature if arena_of is not None else None
        total += graph_plan(sch.microbatches, k[s], dw_variant=variant).graph_count
    return total


@pytest.mark.parametrize("name", ["interleaved", "zbv"])
def test_graphs_per_rank_follow_liveness_not_m(name: str) -> None:
    """Copied gradients (no arena variant), or an accumulating arena without staging (both schedules run
    dW in microbatch order on every stage): from M = 2 to 16 the graphs per rank at most double (the
    issue's target) and stop growing once K does. Every layout stays at or below one graph per action and
    microbatch (staging splits classes by slot; one view per microbatch: one chain per microbatch)."""
    specs = {"w": ((4, 4), torch.float32)}
    schedules = accepted(name)
    for rank in range(PP):
        copy = {m: rank_graphs(sch, rank) for m, sch in schedules.items()}
        assert copy[16] <= 2 * copy[2], (name, rank, copy)
        assert copy[16] == copy[8], (name, rank, copy)
        for m, sch in schedules.items():
            for acc, staging in ((True, 0), (True, 4), (False, 0)):
                arena = lambda n, a=acc, g=staging: GradientArena(specs, n, device="meta", accumulate=a,  # noqa: E731
                                                                 staging=g, defer_last_fold=True)
                assert rank_graphs(sch, rank, arena) <= 3 * m * CHUNKS
        plain = lambda n: GradientArena(specs, n, device="meta", accumulate=True)  # noqa: E731
        assert rank_graphs(schedules[16], rank, plain) <= 2 * rank_graphs(schedules[2], rank, plain)


# --------------------------------------------------------------------------------- the generation check
def one_stage(text: str, microbatches: int) -> Schedule:
    prog = []
    for tok in text.split():
        kind = next(k for k in (DI, DW, F) if tok.startswith(k.value))
        stage, micro = tok[len(kind.value):].split(".")
        prog.append(Action(kind, int(stage), int(micro)))
    sch = Schedule(name="hand", pp=1, stages_per_rank=1, microbatches=microbatches, stage_to_rank=(0,),
                   programs=(tuple(prog),))
    validate(sch)
    return sch


CFG1 = load_config().with_overrides(**{"model.vocab_size": 256, "pipeline.pp": 1, "pipeline.chunks_per_rank": 1,
                                       "pipeline.microbatches": 4})


def bounded_actions(microbatches: int, slots: int) -> CapturedStageActions:
    """A captured chunk whose graphs are faked per chain (shared objects, as capture shares them)."""
    chunk = build_chunks_for(CFG1, "cpu")[0]
    specs = {arena_name(0, p): (tuple(w.shape), w.dtype) for p, w in chunk.matrix_params().items()}
    arena = GradientArena(specs, microbatches)
    plan = graph_plan(microbatches, slots)
    acts = CapturedStageActions(chunk, TapePool(microbatches), EpochClock(), arena,
                                direct=False, manager=FakeManager(), graph_slots=slots, plan=plan)
    tok = torch.zeros((), dtype=torch.int64)
    nonmatrix = {n: torch.ones_like(p) for n, p in chunk.nonmatrix_params().items()}
    grads = {p: torch.zeros_like(w) for p, w in chunk.matrix_params().items()}
    f = {c: SimpleNamespace(name=f"F{c}", outputs=(torch.zeros(()), tok)) for c in plan.chains}
    di = {c: SimpleNamespace(name=f"dI{c}", outputs=(None, nonmatrix, tok)) for c in plan.chains}
    dw = {c: SimpleNamespace(name=f"dW{c}", outputs=(grads, tok)) for c in plan.chains}
    for m, g in enumerate(plan.per_microbatch):
        acts.slots[m] = SlotGraphs(F=f[g.chain], dI=di[g.chain], dW=dw[g.chain])
    acts._ngrad = dict(nonmatrix)
    return acts


def drive(acts: CapturedStageActions, sch: Schedule) -> list[int]:
    """Run the stage's program through the checked actions; returns the positions run."""
    x = torch.zeros((1, 8), dtype=torch.int64)
    token, refs, done = acts.ledger.current, {}, []
    for pos, a in enumerate(sch.programs[0]):
        m = a.microbatch
        if a.kind is F:
            out = acts.forward(m, x, token, x)
            refs[m] = out.ref
        elif a.kind is DI:
            out = acts.input_grad(m, refs[m], torch.tensor(0.5), token)
        else:
            out = acts.weight_grad(m, refs[m], token)
            acts.place_copies(m, out.grads)
        token = out.token
        done.append(pos)
    return done


PREMATURE = "F0.0 dI0.0 dW0.0 F0.1 F0.2 F0.3 dI0.1 dW0.1 dI0.2 dW0.2 dI0.3 dW0.3"


def test_k_from_liveness_runs_the_whole_program_with_shared_graphs() -> None:
    sch = one_stage(PREMATURE, 4)
    k = slots_for(sch)[0]
    acts = bounded_actions(4, k)
    assert drive(acts, sch) == list(range(12))
    assert acts.pool.live_count == 0
    names = acts.manager.replays
    assert names[:3] == ["F0", "dI0", "dW0"] and len(names) == 12
    assert len(set(names)) == acts.plan.graph_count


def test_premature_reuse_is_rejected_at_its_first_invalid_operation() -> None:
    """With K = 2, F(3) wants chain 1 while microbatch 1's tape (dI and dW pending) still holds it: the
    forward is refused before any effect (no replay, no token move, pool and arena unchanged); everything
    before it ran."""
    sch = one_stage(PREMATURE, 4)
    assert slot_conflict(sch, 2) is not None and slot_conflict(sch, 2).position == 5
    acts = bounded_actions(4, 2)
    x = torch.zeros((1, 8), dtype=torch.int64)
    with pytest.raises(TapeViolation) as err:
        drive(acts, sch)
    assert str(err.value) == ("[tape-reference] premature slot reuse for K(e=0,s=0,m=3,u=0,i=0): "
                              "expected slot 1 fully consumed, "
                              "found K(e=0,s=0,m=1,u=0,i=0) generation 1 still live (completed consumers none); "
                              "pool 'tapes'")
    assert acts.manager.replays == ["F0", "dI0", "dW0", "F1", "F2"]
    before = (acts.pool.snapshot(), acts.ledger.seq, acts.arena.snapshot(), acts.cache.e_C)
    with pytest.raises(TapeViolation, match="premature slot reuse"):
        acts.forward(3, x, acts.ledger.current, x)
    assert (acts.pool.snapshot(), acts.ledger.seq, acts.arena.snapshot(), acts.cache.e_C) == before
    assert acts.manager.replays == ["F0", "dI0", "dW0", "F1", "F2"]


def test_a_stale_reference_to_a_reused_chain_is_rejected() -> None:
    """Microbatch 1 finished, microbatch 3 took chain 1 (a new generation): microbatch 1's old reference
    reaches nothing, and microbatch 3's reference presented for another microbatch is foreign."""
    sch = one_stage("F0.0 dI0.0 dW0.0 F0.1 dI0.1 dW0.1 F0.2 F0.3 dI0.2 dW0.2 dI0.3 dW0.3", 4)
    acts = bounded_actions(4, 2)
    x = torch.zeros((1, 8), dtype=torch.int64)
    tok = acts.ledger.current
    refs = {}
    for a in sch.programs[0][:8]:
        m = a.microbatch
        if a.kind is F:
            out = acts.forward(m, x, tok, x)
            refs.setdefault(m, []).append(out.ref)
        elif a.kind is DI:
            out = acts.input_grad(m, refs[m][-1], torch.tensor(0.5), tok)
        else:
            out = acts.weight_grad(m, refs[m][-1], tok)
            acts.place_copies(m, out.grads)
        tok = out.token
    old, new = refs[1][0], refs[3][0]
    assert old.slot == new.slot == 1 and new.generation == old.generation + 1
    replays = list(acts.manager.replays)
    with pytest.raises(TapeViolation, match="stale generation|free slot|foreign"):
        acts.input_grad(1, old, torch.tensor(0.5), tok)
    with pytest.raises(TapeViolation, match="foreign reference"):
        acts.input_grad(1, new, torch.tensor(0.5), tok)
    assert acts.manager.replays == replays


def test_a_reference_outside_its_chain_is_rejected() -> None:
    acts = bounded_actions(4, 2)
    x = torch.zeros((1, 8), dtype=torch.int64)
    f0 = acts.forward(0, x, acts.ledger.current, x)
    forged = type(f0.ref)(1, f0.ref.generation, f0.ref.key)
    acts.pool._slots[1], acts.pool._slots[0] = acts.pool._slots[0], None  # a pool that lost track
    acts.pool._slots[1].slot = 1
    acts.pool._live[f0.ref.key] = 1
    acts.pool._generations[1] = f0.ref.generation
    with pytest.raises(TapeViolation, match="tape outside its chain"):
        acts.input_grad(0, forged, torch.tensor(0.5), f0.token)


# ------------------------------------------------------------------------------- arena write signatures
def test_write_signature_names_what_dw_does_differently() -> None:
    specs = {"w": ((3, 5), torch.float32)}
    views = GradientArena(specs, 6)
    assert [views.write_signature(m) for m in range(6)] == [("view", m) for m in range(6)]
    acc = GradientArena(specs, 6, accumulate=True)
    assert [acc.write_signature(m) for m in range(6)] == [("region", True)] + [("region", False)] * 5
    staged = GradientArena(specs, 7, accumulate=True, staging=3, defer_last_fold=True)
    sig = [staged.write_signature(m) for m in range(7)]
    # per depth: (G, slot, slots the captured fold reads); whether that fold overwrites, adds or is skipped is
    # the mode, read at replay
    assert sig == [("staging", (3, 0, 0)), ("staging", (3, 1, 0)), ("staging", (3, 2, 3)),
                   ("staging", (3, 0, 0)), ("staging", (3, 1, 0)), ("staging", (3, 2, 3)),
                   ("staging", (3, 0, 0))]  # m = 6 opens the deferred last group: the commit folds it
    assert [staged.fold_mode(m, "w") for m in range(7)] == [FoldMode.SKIP, FoldMode.SKIP, FoldMode.INIT,
                                                            FoldMode.SKIP, FoldMode.SKIP, FoldMode.ADD,
                                                            FoldMode.SKIP]
    # equal signatures: the same destination and the same captured fold
    for a in range(7):
        for b in range(7):
            if sig[a] == sig[b]:
                assert staged.view("w", a).data_ptr() == staged.view("w", b).data_ptr()
                assert staged.fold_count(a, "w") == staged.fold_count(b, "w")
    # not deferred: the last, partial group is folded by dW(6) itself, one slot
    eager = GradientArena(specs, 7, accumulate=True, staging=3)
    assert eager.write_signature(6) == ("staging", (3, 0, 1)) and eager.fold_mode(6, "w") == FoldMode.ADD
    # a depth per parameter: the signature over some names speaks of their depths only
    two = GradientArena({"a": ((3, 5), torch.float32), "b": ((2, 2), torch.float32)}, 8, accumulate=True,
                        staging={"a": 4, "b": 2}, defer_last_fold=True)
    assert two.write_signature(3, ["a"]) == ("staging", (4, 3, 4))
    assert two.write_signature(3, ["b"]) == ("staging", (2, 1, 2))
    assert two.write_signature(3) == ("staging", (2, 1, 2), (4, 3, 4))
    with pytest.raises(ValueError, match="needs a parameter name"):
        two.flushes(3)
    with pytest.raises(ValueError, match="outside"):
        staged.write_signature(7)


# ----------------------------------------------------------------------- the token rows' device index
@pytest.mark.parametrize("microbatches", [2, 3, 5])
def test_token_rows_with_a_device_index_have_the_same_bits(microbatches: int) -> None:
    """One dI graph records any microbatch's rows through a device index: the accumulator and the
    recorded rows equal the per-microbatch writes bitwise."""
    g = torch.Generator().manual_seed(microbatches)
    weight = torch.randn(40, 8, generator=g)
    toks = [torch.randint(0, 40, (1, 12), generator=g) for _ in range(microbatches)]
    grads = [torch.randn(1, 12, 8, generator=g) for _ in range(microbatches)]
    plain = TokenEmbeddingGrad(weight, 12, microbatches)
    indexed = TokenEmbeddingGrad(weight, 12, microbatches)
    assert not indexed.signed_zeros
    index = torch.zeros(1, dtype=torch.int64)
    for m in range(microbatches):
        a = plain.accumulate(m, toks[m], grads[m])
        index.fill_(m)
        b = indexed.accumulate(m, toks[m], grads[m], index=index)
    assert bitwise_equal(a, b) and torch.equal(plain.rows_all, indexed.rows_all)


def test_token_rows_index_refused_with_the_signed_zero_pass() -> None:
    acc = TokenEmbeddingGrad(torch.zeros(10, 4), 4, 2)
    with pytest.raises(ValueError, match="no \\+0.0 pass"):
        acc.add_rows(1, torch.arange(4), torch.zeros(4, 4), signed_zeros=True, index=torch.ones(1, dtype=torch.int64))
