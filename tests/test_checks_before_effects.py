"""Checks land before effects, through the real stage actions (eager, and the captured protocol with faked
replays): every F, dI and dW consumes its chunk's effect token; a duplicate, out-of-order or aliased dW is
refused before any GEMM (or replay) writes, leaving the arena's bytes, the FP8 state, the tape pool and the
token ledger as they were; a rank presents the token it was handed; a reference from an aborted and purged
step never reaches the tape that reuses its slot (ABA)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from qeffect.config import load_config
from qeffect.contracts import (
    ArenaViolation,
    CommitBarrier,
    EffectTokenViolation,
    EpochClock,
    GradientArena,
    TapePool,
    TapeViolation,
)
from qeffect.graphs.captured import CapturedStageActions, SlotGraphs
from qeffect.runtime.build import build_chunks_for, build_single_process
from qeffect.stage.actions import StageActions, arena_name
from qeffect.verify.state import bitwise_equal, synthetic_batches

CFG = load_config().with_overrides(**{"model.vocab_size": 256, "pipeline.pp": 1, "pipeline.chunks_per_rank": 1,
                                      "pipeline.microbatches": 2})
LAYOUTS = {"views": {}, "region": {"accumulate": True}, "staged": {"accumulate": True, "staging": 2}}


def _eager(layout: str = "views", direct: bool = True, microbatches: int = 2) -> StageActions:
    chunk = build_chunks_for(CFG, "cpu")[0]
    specs = {arena_name(0, p): (tuple(w.shape), w.dtype) for p, w in chunk.matrix_params().items()}
    arena = GradientArena(specs, microbatches, name="test", **LAYOUTS[layout])
    return StageActions(chunk, TapePool(microbatches), EpochClock(), arena, direct=direct)


def _state(acts: StageActions) -> tuple:
    """Everything a refused dW must leave alone: the arena's bytes and bookkeeping, the FP8 state, the
    pool, the ledger (host pictures), and the matrix gradients' retained work in the tapes."""
    arena_bytes = [b.clone() for b in acts.arena._buffers.values()]
    fp8 = {k: v.clone() for k, v in acts.chunk.fp8_state().items()}
    return arena_bytes, fp8, acts.arena.snapshot(), acts.pool.snapshot(), acts.ledger.snapshot()


def _assert_same(before: tuple, after: tuple) -> None:
    (bytes0, fp80, *host0), (bytes1, fp81, *host1) = before, after
    assert len(bytes0) == len(bytes1) and all(bitwise_equal(a, b) for a, b in zip(bytes0, bytes1, strict=True))
    assert fp80.keys() == fp81.keys() and all(bitwise_equal(fp80[k], fp81[k]) for k in fp80)
    assert host0 == host1


def _batch(m: int) -> tuple[torch.Tensor, torch.Tensor]:
    return synthetic_batches(CFG, 7, "cpu")[m]


def _f_di(acts: StageActions, m: int, token, batch: int | None = None):
    x, y = _batch(m if batch is None else batch)
    f = acts.forward(m, x, token, y)
    di = acts.input_grad(m, f.ref, torch.tensor(0.5), f.token)
    return f.ref, di.token


# ------------------------------------------------------------------------------------------ eager dW
@pytest.mark.parametrize("direct", [True, False], ids=["direct", "copy"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_a_duplicate_dw_is_refused_before_its_gemm(layout: str, direct: bool) -> None:
    acts = _eager(layout, direct)
    ref0, tok = _f_di(acts, 0, acts.ledger.current)
    dw = acts.weight_grad(0, ref0, tok)
    if not direct:
        acts.place_copies(0, dw.grads)
    # the same microbatch again in this epoch (other data, so its GEMM would write other bytes)
    again, tok = _f_di(acts, 0, dw.token, batch=1)
    before = _state(acts)
    with pytest.raises(ArenaViolation, match=r"duplicate write for arena 'test' view s0\..*\[m=0\]: expected "
                                             r"exactly one write in epoch 0, found a second write"):
        acts.weight_grad(0, again, tok)
    _assert_same(before, _state(acts))  # the token did not move, the tape is still dI-consumed, no byte written


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "copy"])
@pytest.mark.parametrize("layout", ["region", "staged"])
def test_an_out_of_order_dw_is_refused_before_its_gemm(layout: str, direct: bool) -> None:
    acts = _eager(layout, direct)
    ref0, tok = _f_di(acts, 0, acts.ledger.current)
    ref1, tok = _f_di(acts, 1, tok)
    before = _state(acts)
    with pytest.raises(ArenaViolation, match=r"out-of-order accumulation for arena 'test' view s0\..*\[m=1\]: "
                                             r"expected microbatch 0 next .*found 1"):
        acts.weight_grad(1, ref1, tok)
    _assert_same(before, _state(acts))
    for m, ref in ((0, ref0), (1, ref1)):  # the ascending order then goes through
        dw = acts.weight_grad(m, ref, tok)
        tok = dw.token
        if not direct:
            acts.place_copies(m, dw.grads)
    acts.arena.finalize()
    assert acts.pool.live_count == 0 and acts.ledger.seq == 6


def test_an_aliased_dw_is_refused_before_its_gemm(monkeypatch) -> None:
    """dW(0) handed microbatch 1's storage as its destination (a wrong view lookup): refused as an alias
    of that view before the GEMM writes into it. (In a staged layout another slot of the same parameter
    is that parameter's own storage: a wrong binding, `test_a_misbound_dw_is_refused_before_its_gemm`.)"""
    acts = _eager("views")
    ref0, tok = _f_di(acts, 0, acts.ledger.current)
    view = acts.arena.view
    monkeypatch.setattr(acts.arena, "view", lambda name, m: view(name, 1))
    before = _state(acts)
    with pytest.raises(ArenaViolation, match=r"aliased write for arena 'test' view s0\..*\[m=0\]: expected a "
                                             r"write confined to .*\[m=0\], found a destination overlapping "
                                             r"view\(s\) .*\[m=1\]"):
        acts.weight_grad(0, ref0, tok)
    _assert_same(before, _state(acts))
    monkeypatch.setattr(acts.arena, "view", view)
    acts.weight_grad(0, ref0, tok)
    assert acts.pool.live_count == 0


@pytest.mark.parametrize("into", ["fresh", "own slot"])
def test_a_misbound_dw_is_refused_before_its_gemm(into: str, monkeypatch) -> None:
    acts = _eager("staged")
    ref0, tok = _f_di(acts, 0, acts.ledger.current)
    view = acts.arena.view
    monkeypatch.setattr(acts.arena, "view", (lambda name, m: torch.zeros(acts.arena.specs[name][0])) if into == "fresh"
                        else (lambda name, m: view(name, 1)))
    before = _state(acts)
    with pytest.raises(ArenaViolation, match=r"wrong binding for arena 'test' view s0\..*\[m=0\] in check_write: "
                                             r"expected data_ptr"):
        acts.weight_grad(0, ref0, tok)
    _assert_same(before, _state(acts))


def test_a_stale_token_at_dw_is_refused_before_its_gemm() -> None:
    acts = _eager()
    t0 = acts.ledger.current
    ref0, tok = _f_di(acts, 0, t0)
    before = _state(acts)
    with pytest.raises(EffectTokenViolation, match=r"stale token for stage0: expected seq 2, found 0; action dW0"):
        acts.weight_grad(0, ref0, t0)
    _assert_same(before, _state(acts))


def test_a_stale_token_at_the_first_forward_leaves_the_cache_version_alone() -> None:
    """A refused F(0) must not refresh the cache version: a later F(1) would then pass its epoch check
    with the weight cache never rebuilt."""
    acts = _eager()
    stale = acts.ledger.current
    _f_di(acts, 0, stale)
    acts.cache.e_C = None  # as after a resume: the next first forward must refresh
    x, y = _batch(0)
    with pytest.raises(EffectTokenViolation, match=r"stale token for stage0: expected seq 2, found 0; action F0"):
        acts.forward(0, x, stale, y)
    assert acts.cache.e_C is None and acts.ledger.seq == 2


def test_a_stale_token_at_a_captured_first_forward_leaves_the_cache_version_alone() -> None:
    acts = _captured()
    stale = acts.ledger.current
    _captured_f_di(acts, 0, stale)
    acts.cache.e_C = None  # as after a resume: the next first forward must refresh
    x, y = torch.zeros((2, 8), dtype=torch.int64), torch.zeros((2, 8), dtype=torch.int64)
    with pytest.raises(EffectTokenViolation, match=r"stale token for stage0: expected seq 2, found 0; action F0"):
        acts.forward(0, x, stale, y)
    assert acts.cache.e_C is None and acts.manager.replays == ["F0", "dI0"]


# -------------------------------------------------------------------- tokens: every action consumes one
def _stage_sequence(pipe, rank: int, stage: int) -> list[str]:
    return [f"{a.kind.value}{a.microbatch}" for a in pipe.schedule.programs[rank] if a.stage == stage]


@pytest.mark.parametrize("schedule", ["interleaved", "zbv"])
def test_after_two_steps_each_ledger_holds_its_stages_schedule(schedule: str) -> None:
    cfg = load_config().with_overrides(**{"model.vocab_size": 256, "pipeline.schedule": schedule})
    pipe = build_single_process(cfg, native=False)
    for step in range(2):
        pipe.step(synthetic_batches(cfg, step, "cpu"))
    for r in pipe.ranks:
        for s, act in r.actions.items():
            expected = _stage_sequence(pipe, r.rank, s) * 2
            assert len(expected) == 2 * 3 * cfg.pipeline.microbatches
            assert act.ledger.history == list(enumerate(expected)), (r.rank, s)
            assert r.tokens[s] is act.ledger.current and act.ledger.seq == len(expected)


def test_a_rank_presents_the_token_it_was_handed() -> None:
    """The rank threads each action's output token into the next action of the chunk; handed a stale one,
    the chunk's next action refuses it (a rank that presented `ledger.current` instead would never be)."""
    cfg = load_config().with_overrides(**{"model.vocab_size": 256, "pipeline.microbatches": 2})
    pipe = build_single_process(cfg, native=False)
    rank = pipe.ranks[1]
    stage = min(rank.actions)
    old = rank.tokens[stage]
    pipe.step(synthetic_batches(cfg, 0, "cpu"))
    seq = rank.actions[stage].ledger.seq
    rank.tokens[stage] = old
    with pytest.raises(EffectTokenViolation, match=rf"stale token for stage{stage}: expected seq {seq}, found 0; action "):
        pipe.step(synthetic_batches(cfg, 1, "cpu"))
    assert rank.actions[stage].ledger.seq == seq  # refused: no action of that chunk ran


# ----------------------------------------------------------------------------------- ABA after an abort
def test_aba_after_an_aborted_and_purged_step_is_a_stale_generation() -> None:
    """The aborted step's reference names the same key (e, s, m) as the tape that reuses its slot in the
    retried step: only the generation tells them apart."""
    acts = _eager()
    barrier = CommitBarrier(acts.clock, [acts.pool], [acts.arena])
    x, y = _batch(0)
    f = acts.forward(0, x, acts.ledger.current, y)
    assert barrier.abort_epoch() == [f.ref.key]  # the step is aborted: its tape purged
    acts.arena.rebuild()
    retry = acts.forward(0, x, f.token, y)
    assert (retry.ref.slot, retry.ref.key) == (f.ref.slot, f.ref.key) and retry.ref.generation == f.ref.generation + 1
    before = _state(acts)
    with pytest.raises(TapeViolation, match=r"stale generation for K\(e=0,s=0,m=0,u=0,i=0\): expected generation 2, "
                                            r"found 1; slot 0 of pool 'tapes' now holds K\(e=0,s=0,m=0,u=0,i=0\)"):
        acts.input_grad(0, f.ref, torch.tensor(0.5), retry.token)
    _assert_same(before, _state(acts))
    di = acts.input_grad(0, retry.ref, torch.tensor(0.5), retry.token)
    acts.weight_grad(0, retry.ref, di.token)
    assert acts.pool.live_count == 0


def test_stage_actions_ref_to_a_reused_slot_is_foreign() -> None:
    """Another microbatch's tape in the reused slot: the key check fires first ("foreign reference")."""
    acts = _eager()
    ref0, tok = _f_di(acts, 0, acts.ledger.current)
    dw = acts.weight_grad(0, ref0, tok)
    x, y = _batch(1)
    f1 = acts.forward(1, x, dw.token, y)
    assert f1.ref.slot == ref0.slot
    with pytest.raises(TapeViolation, match=r"foreign reference for K\(e=0,s=0,m=1,u=0,i=0\): expected key "
                                            r"K\(e=0,s=0,m=1,u=0,i=0\), found reference for K\(e=0,s=0,m=0"):
        acts.input_grad(1, ref0, torch.tensor(0.5), f1.token)


# ------------------------------------------------------------------- the captured protocol, faked replays
class WritingManager:
    """Fake replays that do what the graphs' kernels would: a dW replay writes its captured outputs (+1)."""

    def __init__(self) -> None:
        self.replays: list[str] = []

    def replay(self, action, dynamic=None):
        self.replays.append(action.name)
        if action.name.startswith("dW"):
            for g in action.outputs[0].values():
                g.add_(1.0)
        return action.outputs


def _captured(direct: bool = True, layout: str = "views") -> CapturedStageActions:
    chunk = build_chunks_for(CFG, "cpu")[0]
    specs = {arena_name(0, p): (tuple(w.shape), w.dtype) for p, w in chunk.matrix_params().items()}
    arena = GradientArena(specs, 2, name="test", **LAYOUTS[layout])
    acts = CapturedStageActions(chunk, TapePool(2), EpochClock(), arena, direct=direct, manager=WritingManager())
    for m in range(2):
        tok = torch.zeros((), dtype=torch.int64)
        grads = {p: (arena.view(arena_name(0, p), m) if direct else torch.zeros_like(w))
                 for p, w in chunk.matrix_params().items()}
        nonmatrix = {n: torch.ones_like(p) for n, p in chunk.nonmatrix_params().items()}
        acts.slots[m] = SlotGraphs(F=SimpleNamespace(name=f"F{m}", outputs=(torch.zeros(()), tok)),
                                   dI=SimpleNamespace(name=f"dI{m}", outputs=(None, nonmatrix, tok)),
                                   dW=SimpleNamespace(name=f"dW{m}", outputs=(grads, tok)))
    acts._ngrad = {n: torch.ones_like(p) for n, p in chunk.nonmatrix_params().items()}
    return acts


def _captured_f_di(acts, m: int, token):
    x, y = torch.zeros((2, 8), dtype=torch.int64), torch.zeros((2, 8), dtype=torch.int64)
    f = acts.forward(m, x, token, y)
    di = acts.input_grad(m, f.ref, torch.tensor(0.5), f.token)
    return f.ref, di.token


def test_captured_actions_consume_a_token_each() -> None:
    acts = _captured()
    tok = acts.ledger.current
    refs = {}
    for m in range(2):
        refs[m], tok = _captured_f_di(acts, m, tok)
    for m in range(2):
        tok = acts.weight_grad(m, refs[m], tok).token
    assert acts.ledger.history == list(enumerate(["F0", "dI0", "F1", "dI1", "dW0", "dW1"]))
    assert tok is acts.ledger.current and acts.manager.replays == ["F0", "dI0", "F1", "dI1", "dW0", "dW1"]


@pytest.mark.parametrize("direct", [True, False], ids=["direct", "copy"])
def test_captured_duplicate_dw_is_refused_before_its_replay(direct: bool) -> None:
    acts = _captured(direct)
    ref, tok = _captured_f_di(acts, 0, acts.ledger.current)
    dw = acts.weight_grad(0, ref, tok)
    if not direct:
        acts.place_copies(0, dw.grads)
    again, tok = _captured_f_di(acts, 0, dw.token)
    before = _state(acts)
    with pytest.raises(ArenaViolation, match=r"duplicate write for arena 'test' view s0\..*\[m=0\]"):
        acts.weight_grad(0, again, tok)
    _assert_same(before, _state(acts))
    assert acts.manager.replays.count("dW0") == 1


def test_captured_out_of_order_dw_is_refused_before_its_replay() -> None:
    acts = _captured(layout="region")
    tok = acts.ledger.current
    ref0, tok = _captured_f_di(acts, 0, tok)
    ref1, tok = _captured_f_di(acts, 1, tok)
    before = _state(acts)
    with pytest.raises(ArenaViolation, match=r"out-of-order accumulation for arena 'test' view s0\..*\[m=1\]"):
        acts.weight_grad(1, ref1, tok)
    _assert_same(before, _state(acts))
    assert "dW1" not in acts.manager.replays


def test_captured_aliased_destination_is_refused_before_its_replay() -> None:
    acts = _captured()
    grads, tok_out = acts.slots[0].dW.outputs  # the graph of dW(0) captured dW(1)'s views
    acts.slots[0].dW = SimpleNamespace(name="dW0", outputs=(acts.slots[1].dW.outputs[0], tok_out))
    ref, tok = _captured_f_di(acts, 0, acts.ledger.current)
    before = _state(acts)
    with pytest.raises(ArenaViolation, match=r"aliased write for arena 'test' view s0\..*\[m=0\].*overlapping "
                                             r"view\(s\) .*\[m=1\]"):
        acts.weight_grad(0, ref, tok)
    _assert_same(before, _state(acts))
    assert "dW0" not in acts.manager.replays
