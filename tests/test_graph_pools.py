"""`runtime.graph_pools = "shared"` on a CPU: which graphs share a memory pool, that every schedule replays
each shared pool in its capture order over several steps (the rule that makes the sharing safe, checked at
every replay), native eager's bits, and the refusal of an out-of-order replay before it issues anything.

A CPU cannot show the memory a pool reuses; what it can show is the order. `PoolExecManager` adds the real
`PoolCycle` to `ExecManager`'s fake graphs the way `GraphManager` uses it (members in capture order, every
replay advanced before the body runs); the pool rule of `GraphManager` itself is tested with the fake CUDA
backend of `test_graphs.py`."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from qeffect.config import load_config
from qeffect.graphs.manager import PoolCycle, PoolOrderViolation
from qeffect.runtime import build as build_mod
from qeffect.runtime.adamw import TritonAdamW
from qeffect.verify import state as state_mod
from qeffect.verify.state import run_verify_state, synthetic_batches
from test_graph_binding_bitwise import BASE, ExecManager, _fake_captured_build
from test_graphs import _manager


@dataclass
class PoolExecManager(ExecManager):
    """`ExecManager` with shared pools: a capture joins its cycle, a replay advances it first."""

    def pool_cycle(self, name: str) -> PoolCycle:
        return PoolCycle(name, handle=object())

    def capture(self, name, fn, *, static_inputs, warmup: int = 0, private_pool: bool = False, cycle=None):
        assert not (private_pool and cycle is not None)
        action = super().capture(name, fn, static_inputs=static_inputs, warmup=warmup)
        action.cycle = None
        if cycle is not None:
            cycle.join(action)
        return action

    def replay(self, action, dynamic=None):
        if action.cycle is not None:
            action.cycle.advance(action)
        return super().replay(action, dynamic)


def _shared(monkeypatch: pytest.MonkeyPatch, *, bounded: bool) -> list:
    """Captured paths through `PoolExecManager`; `bounded`: chains bounded by liveness (else one chain per
    microbatch, as with offload). Returns the list the built pipelines are appended to."""
    built: list = []
    fake = _fake_captured_build(build_mod.build_single_process, manager=PoolExecManager)

    def build(cfg, **kw):
        pipe = fake(cfg, **{**kw, "bounded_slots": bounded})
        built.append(pipe)
        return pipe

    monkeypatch.setattr(state_mod, "build_single_process", build)
    monkeypatch.setattr(TritonAdamW, "use_graph", lambda self, enabled=True: None)
    return built


def _cfg(schedule: str, microbatches: int = 8):
    return load_config().with_overrides(**{**BASE, "pipeline.schedule": schedule, "pipeline.microbatches":
                                           microbatches, "runtime.graph_pools": "shared"})


def _cycles(pipe) -> dict[str, list[str]]:
    return {c.name: c.members for a in pipe.manager.actions.values() if (c := a.cycle) is not None}


@pytest.mark.parametrize("schedule", ["interleaved", "zbv"])
def test_one_chain_per_microbatch_shares_a_pool_per_kind(monkeypatch: pytest.MonkeyPatch, schedule: str) -> None:
    """Each stage's F graphs share one pool and its dI graphs another, members in microbatch order; dW
    graphs keep their own. Three steps replay every pool in its capture order, with native eager's bits."""
    built = _shared(monkeypatch, bounded=False)
    cfg = _cfg(schedule)
    report = run_verify_state(cfg, steps=3, path="captured-direct")
    assert report.passed, report.first_divergence
    pipe = built[-1]
    m = cfg.pipeline.microbatches
    stages = range(cfg.pipeline.pp * cfg.pipeline.chunks_per_rank)
    want = {f"s{s}.{kind}": [f"s{s}.{kind}{i}" for i in range(m)] for s in stages for kind in ("F", "dI")}
    assert _cycles(pipe) == want
    assert all(a.cycle is None for name, a in pipe.manager.actions.items() if ".dW" in name)
    assert all(a.replays == 3 for a in pipe.manager.actions.values())


@pytest.mark.parametrize("schedule", ["interleaved", "zbv"])
def test_bounded_chains_share_a_pool_per_chain(monkeypatch: pytest.MonkeyPatch, schedule: str) -> None:
    """Chains bounded by liveness serve several microbatches: each chain's F and dI share a pool, whose
    cycle (F, dI) every microbatch of the chain follows."""
    built = _shared(monkeypatch, bounded=True)
    cfg = _cfg(schedule)
    report = run_verify_state(cfg, steps=3, path="captured-direct")
    assert report.passed, report.first_divergence
    cycles = _cycles(built[-1])
    assert cycles and all(name.split(".")[1].startswith("chain") for name in cycles)
    for name, members in cycles.items():
        stage, chain = name.split(".")
        assert members == [f"{stage}.F{chain[5:]}", f"{stage}.dI{chain[5:]}"]
    assert len(cycles) < cfg.pipeline.microbatches * cfg.pipeline.pp * cfg.pipeline.chunks_per_rank


def test_private_pools_share_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    built = _shared(monkeypatch, bounded=False)
    cfg = _cfg("interleaved").with_overrides(**{"runtime.graph_pools": "private"})
    assert run_verify_state(cfg, steps=1, path="captured-direct").passed
    assert _cycles(built[-1]) == {}


def test_a_replay_out_of_capture_order_is_refused_before_it_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    """After a step, replaying a stage's F of microbatch 1 where its pool's cycle expects microbatch 0:
    refused, naming the pool's order, and the graph's body does not run."""
    built = _shared(monkeypatch, bounded=False)
    cfg = _cfg("interleaved", microbatches=4)
    pipe = state_mod.build_single_process(cfg, native=False, path="captured-direct")
    pipe.step(synthetic_batches(cfg, 0, "cpu"))
    f1 = built[-1].manager.actions["s0.F1"]
    ran = []
    body = f1.fn
    f1.fn = lambda: (ran.append(1), body())[1]
    with pytest.raises(PoolOrderViolation, match=r"graph s0\.F1 replayed out of .*\(pool s0\.F: s0\.F0 -> s0\.F1 "
                                                 r"-> s0\.F2 -> s0\.F3\); expected s0\.F0"):
        pipe.manager.replay(f1, {})
    assert ran == [] and f1.replays == 1


def test_an_aborted_step_restarts_the_pools_at_the_next_steps_first_forward(monkeypatch: pytest.MonkeyPatch) -> None:
    """A step that stopped after its first forward leaves a pool mid-cycle; the next step's F of microbatch
    0 begins every cycle of its stage anew (what the aborted step left is dead), and the step runs."""
    built = _shared(monkeypatch, bounded=False)
    cfg = _cfg("interleaved", microbatches=4)
    pipe = state_mod.build_single_process(cfg, native=False, path="captured-direct")
    pipe.step(synthetic_batches(cfg, 0, "cpu"))
    f0 = built[-1].manager.actions["s0.F0"]
    f_pool = f0.cycle
    f_pool.advance(f0)  # as an aborted step's first forward did
    assert f_pool.next == 1
    pipe.step(synthetic_batches(cfg, 1, "cpu"))
    assert f_pool.next == 0  # F0..F3 of the new step, from the start


# ------------------------------------------------------------------------------- GraphManager's rule
def test_the_manager_captures_a_cycle_into_one_pool_and_checks_each_replay() -> None:
    mgr, be = _manager("stream-ordered")
    handles = iter(range(100))
    be.graph_pool_handle = lambda: f"pool{next(handles)}"
    cycle = mgr.pool_cycle("p")
    x = mgr.capture("x", lambda: torch.zeros(1), static_inputs={}, warmup=0, cycle=cycle)
    other = mgr.capture("other", lambda: torch.zeros(1), static_inputs={}, warmup=0, private_pool=True)
    y = mgr.capture("y", lambda: torch.zeros(1), static_inputs={}, warmup=0, cycle=cycle)
    assert cycle.members == ["x", "y"] and x.pool == y.pool == cycle.handle != other.pool
    assert [e[3] for e in be.log if e[0] == "capture_begin"] == [cycle.handle, other.pool, cycle.handle]
    for _ in range(2):  # two cycles, in capture order; a graph outside the cycle replays any time
        mgr.replay(x)
        mgr.replay(other)
        mgr.replay(y)
    mgr.replay(x)
    replays = sum(1 for e in be.log if e[0] == "replay")
    with pytest.raises(PoolOrderViolation, match=r"graph x replayed out of .*pool p: x -> y\); expected y"):
        mgr.replay(x)
    assert sum(1 for e in be.log if e[0] == "replay") == replays  # refused before the launch
    cycle.restart()
    mgr.replay(x)
    with pytest.raises(ValueError, match="a private pool or a shared pool cycle, not both"):
        mgr.capture("z", lambda: torch.zeros(1), static_inputs={}, warmup=0, private_pool=True, cycle=cycle)


def test_the_config_refuses_an_unknown_pool_choice() -> None:
    from qeffect.errors import UserError

    with pytest.raises(UserError, match="runtime.graph_pools"):
        load_config().with_overrides(**{"runtime.graph_pools": "global"})
