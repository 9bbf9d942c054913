"""The checked protocol of captured stage actions, on CPU: the replays are faked (no CUDA), the tape,
token, cache-epoch and arena bookkeeping around them is the real code."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from qeffect.config import load_config
from qeffect.contracts import ArenaViolation, ConsumerOrderViolation, GradientArena, TapePool
from qeffect.contracts.epochs import EpochClock
from qeffect.graphs.captured import CapturedStageActions, SlotGraphs
from qeffect.runtime.build import build_chunks_for
from qeffect.stage.actions import arena_name

CFG = load_config().with_overrides(**{"model.vocab_size": 256, "pipeline.pp": 1, "pipeline.chunks_per_rank": 1,
                                      "pipeline.microbatches": 2})


class FakeManager:
    """Records replays; `fail` makes the next replay raise (a device error)."""

    def __init__(self) -> None:
        self.replays: list[tuple[str, tuple[str, ...]]] = []
        self.fail = False

    def replay(self, action, dynamic=None):
        if self.fail:
            raise RuntimeError("replay failed")
        self.replays.append((action.name, tuple(sorted(dynamic or {}))))
        return action.outputs


def _actions(direct: bool = True, foreign_dest: bool = False):
    chunk = build_chunks_for(CFG, "cpu")[0]
    specs = {arena_name(0, p): (tuple(w.shape), w.dtype) for p, w in chunk.matrix_params().items()}
    arena = GradientArena(specs, 2)
    acts = CapturedStageActions(chunk, TapePool(2), EpochClock(), arena, direct=direct, manager=FakeManager())
    for m in range(2):
        tok = lambda: torch.zeros((), dtype=torch.int64)  # noqa: E731
        grads = {p: (torch.zeros_like(w) if foreign_dest else arena.view(arena_name(0, p), m))
                 for p, w in chunk.matrix_params().items()}
        nonmatrix = {n: torch.ones_like(p) for n, p in chunk.nonmatrix_params().items()}
        acts.slots[m] = SlotGraphs(
            F=SimpleNamespace(name=f"F{m}", outputs=(torch.zeros(()), tok())),
            dI=SimpleNamespace(name=f"dI{m}", outputs=(None, nonmatrix, tok())),
            dW=SimpleNamespace(name=f"dW{m}", outputs=(grads, tok())))
    acts._ngrad = {n: torch.ones_like(p) for n, p in chunk.nonmatrix_params().items()}  # what dI graphs fill
    return acts


def _tokens(mb: int = 2):
    return torch.zeros((mb, 8), dtype=torch.int64), torch.zeros((mb, 8), dtype=torch.int64)


def test_replays_are_checked_and_recorded() -> None:
    acts = _actions()
    x, y = _tokens()
    f = acts.forward(0, x, acts.ledger.current, y)
    with pytest.raises(ConsumerOrderViolation,
                       match=r"dW before dI for K\(e=0,s=0,m=0,u=0,i=0\): expected completed consumers dI,"
                             r" found completed consumers none"):
        acts.weight_grad(0, f.ref, f.token)
    di = acts.input_grad(0, f.ref, torch.tensor(0.5), f.token)
    dw = acts.weight_grad(0, f.ref, di.token)
    assert acts.pool.live_count == 0 and acts.ledger.seq == 3 and dw.token is acts.ledger.current
    assert [r[0] for r in acts.manager.replays] == ["F0", "dI0", "dW0"]
    # the replays' copied-in inputs: no token (every graph increments the chunk's token buffer in place)
    assert [r[1] for r in acts.manager.replays] == [("targets", "x"), ("grad",), ()]
    assert len(acts.arena.written) == len(acts.chunk.matrix_params())
    assert all(torch.equal(p.grad, torch.ones_like(p)) for p in acts.chunk.nonmatrix_params().values())


def test_failed_replay_aborts_the_tape() -> None:
    acts = _actions()
    x, y = _tokens()
    f = acts.forward(0, x, acts.ledger.current, y)
    acts.manager.fail = True
    with pytest.raises(RuntimeError, match="replay failed"):
        acts.input_grad(0, f.ref, torch.tensor(0.5), f.token)
    assert acts.pool.live_count == 0  # aborted, slot free


def test_captured_destination_must_be_the_arena_view() -> None:
    acts = _actions(foreign_dest=True)
    x, y = _tokens()
    f = acts.forward(0, x, acts.ledger.current, y)
    di = acts.input_grad(0, f.ref, torch.tensor(0.5), f.token)
    with pytest.raises(ArenaViolation,
                       match=r"wrong binding for arena 'arena' view s0\.blocks\.0\.qkv\.weight\[m=0\] in c"
                             r"heck_write: expected data_ptr"):
        acts.weight_grad(0, f.ref, di.token)
    assert acts.manager.replays[-1][0] == "dI0"  # refused before the dW replay


def test_offload_hooks_bracket_the_replays() -> None:
    """F replays between before/after_forward; dI opens the group's backward and dW (the last reader of
    the saved tensors: the retained dW work references them) closes it. An 'off' manager checks order."""
    from qeffect.config import OffloadConfig
    from qeffect.offload.group import OffloadManager

    acts = _actions()
    mgr = OffloadManager(OffloadConfig(), device="cpu")  # mode "off"
    acts.groups = {m: mgr.group(f"s0.m{m}") for m in range(2)}
    mgr.allocate([acts.groups[0], acts.groups[1]])
    g0 = acts.groups[0]
    x, y = _tokens()
    f = acts.forward(0, x, acts.ledger.current, y)
    assert g0.live and g0.phase is None
    d = acts.input_grad(0, f.ref, torch.zeros(()), f.token)
    assert g0.phase == "backward"
    acts.weight_grad(0, f.ref, d.token)
    assert not g0.live and g0.phase is None
    assert not acts.groups[1].live  # untouched


def test_rank_hands_its_offload_manager_to_every_captured_action() -> None:
    from qeffect.config import OffloadConfig
    from qeffect.offload.group import OffloadManager
    from qeffect.runtime.build import build_rank, schedule_of

    cfg = load_config()
    mgr = OffloadManager(OffloadConfig(), device="cpu")  # mode "off"
    chunks = build_chunks_for(cfg, "cpu")
    r = build_rank(cfg, schedule_of(cfg), 0, chunks, native=False, manager=FakeManager(), offload=mgr)
    assert r.actions and all(a.offload is mgr for a in r.actions.values())


def test_captured_di_binds_the_fixed_gradient_buffers_and_refuses_another_order() -> None:
    """The dI graphs accumulate the non-matrix gradients into fixed buffers (copy at m = 0, add after),
    so `.grad` is those buffers after every dI, and a dI out of microbatch order is refused before it
    replays (its graph would copy or add at the wrong point)."""
    acts = _actions()
    x, y = _tokens()
    f0 = acts.forward(0, x, acts.ledger.current, y)
    f1 = acts.forward(1, x, f0.token, y)
    with pytest.raises(RuntimeError, match=r"expected dI\(0\), got dI\(1\)"):
        acts.input_grad(1, f1.ref, torch.tensor(0.5), f1.token)
    assert "dI1" not in [r[0] for r in acts.manager.replays]
    di = acts.input_grad(0, f0.ref, torch.tensor(0.5), f1.token)
    params = acts.chunk.nonmatrix_params()
    assert all(params[n].grad is buf for n, buf in acts._ngrad.items())
    assert set(di.nonmatrix_grads) == set(acts._ngrad)
    acts.input_grad(1, f1.ref, torch.tensor(0.5), di.token)
    assert acts._di_next == 0  # the next step starts at dI(0) again


@pytest.mark.parametrize("fail_at", ["F", "dI"])
def test_a_slot_with_offload_runs_again_after_an_aborted_step(fail_at: str) -> None:
    """A replay that fails between its offload hooks aborts the tape; the slot's next forward (a new
    step) abandons the group's leftovers instead of refusing the hook order forever."""
    from qeffect.config import OffloadConfig
    from qeffect.offload.group import OffloadManager

    acts = _actions()
    mgr = OffloadManager(OffloadConfig(), device="cpu")  # mode "off"
    acts.groups = {m: mgr.group(f"s0.m{m}") for m in range(2)}
    mgr.allocate([acts.groups[0], acts.groups[1]])
    x, y = _tokens()
    if fail_at == "F":
        acts.manager.fail = True
        with pytest.raises(RuntimeError, match="replay failed"):
            acts.forward(0, x, acts.ledger.current, y)
    else:
        f = acts.forward(0, x, acts.ledger.current, y)
        acts.manager.fail = True
        with pytest.raises(RuntimeError, match="replay failed"):
            acts.input_grad(0, f.ref, torch.zeros(()), f.token)
    assert acts.pool.live_count == 0 and (acts.groups[0].phase is not None or acts.groups[0].live)
    acts.manager.fail = False
    f = acts.forward(0, x, acts.ledger.current, y)
    d = acts.input_grad(0, f.ref, torch.zeros(()), f.token)
    acts.weight_grad(0, f.ref, d.token)
    assert not acts.groups[0].live and acts.groups[0].phase is None
