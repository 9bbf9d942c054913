"""Captured actions bound to chains (graphs/binding.py) against native eager, bitwise, on a CPU.

A CUDA graph replays the work its capture recorded on the same addresses. `ExecManager` fakes exactly
that on a CPU: a capture runs the body once and keeps it with its static inputs and outputs; a replay
copies the dynamic inputs into the static buffers, runs the body again and copies its results into the
captured outputs in place. Whatever one chain's graphs share between microbatches (static inputs, the
saved forward, the retained dW work, the outputs) is therefore shared here too, so a chain reused too
early, a chain that captured another microbatch's writes or a result read after its buffer was rewritten
changes the numbers, and `verify-state`'s oracle (every action, every step) sees it. The contracts, the
plan and the runtime around the replays are the real code."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from qeffect.config import load_config
from qeffect.contracts import GradientArena
from qeffect.contracts.arena import FoldMode
from qeffect.graphs.binding import GraphPlan
from qeffect.graphs.manager import HeldInputs
from qeffect.graphs.stats import GraphStats
from qeffect.runtime import build as build_mod
from qeffect.runtime.adamw import TritonAdamW
from qeffect.runtime.build import build_chunks_for, build_rank, capture_ranks, link_stages, schedule_of
from qeffect.runtime.single import SingleProcessPipeline
from qeffect.stage.embedding_grad import needs_signed_zeros
from qeffect.verify import state as state_mod
from qeffect.verify.state import run_verify_state


class _Stream:
    def wait_stream(self, other: Any) -> None:
        pass


class _Backend:
    def current_stream(self) -> _Stream:
        return _Stream()

    def use_stream(self, stream: Any):
        return nullcontext()

    def synchronize(self) -> None:
        pass


@dataclass
class _Action:
    name: str
    fn: Callable[[], Any]
    static_inputs: dict[str, torch.Tensor]
    outputs: Any
    replays: int = 0


def _copy_into(dst: Any, src: Any) -> None:
    """A replay rewrites the captured outputs in place (same objects, same addresses)."""
    if isinstance(dst, torch.Tensor):
        with torch.no_grad():
            dst.copy_(src)
    elif isinstance(dst, dict):
        if set(dst) != set(src):
            raise AssertionError(f"a replay produced other outputs: {sorted(src)} vs {sorted(dst)}")
        for k in dst:
            _copy_into(dst[k], src[k])
    elif isinstance(dst, tuple | list):
        for d, s in zip(dst, src, strict=True):
            _copy_into(d, s)
    elif dst is not None or src is not None:
        raise AssertionError(f"unexpected output {type(dst).__name__}")


@dataclass
class ExecManager:
    """The `GraphManager` surface captured actions use, replaying by re-running the captured body."""

    stream: _Stream = field(default_factory=_Stream)
    backend: _Backend = field(default_factory=_Backend)
    actions: dict[str, _Action] = field(default_factory=dict)
    stats: GraphStats = field(default_factory=lambda: GraphStats(protocol="stream-ordered"))
    held: HeldInputs = field(default_factory=HeldInputs)  # the real manager's rule for constant inputs
    copied: list[tuple[str, list[str]]] = field(default_factory=list)  # per replay: graph, dynamic inputs
    mode: str = "launch"  # ordinary steps only (`GraphManager.mode`)

    def mark_constant(self, *tensors: torch.Tensor) -> None:
        self.held.mark(*tensors)

    def capture(self, name: str, fn, *, static_inputs, warmup: int = 0, private_pool: bool = False) -> _Action:
        assert name not in self.actions, name
        action = _Action(name, fn, dict(static_inputs), fn())
        self.actions[name] = action
        self.stats.record_capture(name, 0.0, 0, 0, 0, 0)
        return action

    def dry_capture(self, fn):
        return fn()

    def step_tensor(self, key, make):  # ordinary steps only (`GraphManager.step_tensor`)
        return make()

    def replay(self, action: _Action, dynamic: dict[str, torch.Tensor] | None = None) -> Any:
        self.copied.append((action.name, sorted(dynamic or {})))
        with torch.no_grad():
            for k, v in (dynamic or {}).items():
                dst = action.static_inputs[k]
                constant = self.held.is_constant(v)  # a body run eagerly moves the version of what it writes
                if constant and self.held.holds(dst, v):
                    self.stats.input_copies_skipped += 1
                    continue
                dst.copy_(v)
                if constant:
                    self.held.copied(dst, v)
        _copy_into(action.outputs, action.fn())
        action.replays += 1
        self.stats.record_replay(0)
        return action.outputs

    @contextmanager
    def capturing_on(self, stream: Any):
        yield

    def mark_step(self) -> int:
        self.stats.mark_step(0)
        return 0

    def persistent_growth_per_step(self) -> float:
        return 0.0


def _fake_captured_build(real, *, link: bool = True, manager=ExecManager, offload=None):
    """`build_single_process` whose captured paths run on `manager()`; `offload(cfg, manager)`: the offload
    manager their stage actions get (tests/test_offload_chains.py), or None."""
    def build(cfg, *, native, direct=True, fixed_order_sum=True, device=None, path="eager", capture=True,
              accumulate=None, clock=None, bounded_slots=True):
        if native or path == "eager":
            return real(cfg, native=native, direct=direct, fixed_order_sum=fixed_order_sum, device=device,
                        path=path, capture=capture, accumulate=accumulate, clock=clock, bounded_slots=bounded_slots)
        mgr = manager()
        off = offload(cfg, mgr) if offload is not None else None
        schedule = schedule_of(cfg)
        chunks = build_chunks_for(cfg, "cpu")
        ranks = [build_rank(cfg, schedule, r, chunks, native=False, direct=direct, fixed_order_sum=fixed_order_sum,
                            manager=mgr, offload=off, accumulate=accumulate, bounded_slots=bounded_slots)
                 for r in range(schedule.pp)]
        for r in ranks:  # the optimizer's FP8 weight cast is a CUDA pass: slot 0's F refreshes the cache itself
            for act in r.actions.values():
                act.weight_cast = False
        pipe = SingleProcessPipeline(ranks, schedule)
        pipe.manager, pipe.offload = mgr, off
        if link:  # as `capture_graphs` does before the ranks capture
            link_stages(ranks)
        capture_ranks(ranks, pipe.order, off, cfg.model.microbatch_size, cfg.model.seq_len)
        return pipe
    return build


@pytest.fixture
def fake_graphs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Captured paths on a CPU through `ExecManager`; the optimizer step stays eager (its own graph is
    CUDA's, and it is not what this file checks)."""
    monkeypatch.setattr(state_mod, "build_single_process", _fake_captured_build(build_mod.build_single_process))
    monkeypatch.setattr(TritonAdamW, "use_graph", lambda self, enabled=True: None)


BASE = {"model.vocab_size": 64, "model.hidden": 16, "model.ffn": 32, "model.heads": 2, "model.seq_len": 8,
        "model.microbatch_size": 1, "pipeline.pp": 2, "pipeline.chunks_per_rank": 2, "fp8.amax_history_len": 2,
        "pipeline.wgrad_staging_by_liveness": True}


@pytest.mark.parametrize(("schedule", "microbatches", "path", "staging"), [
    ("interleaved", 8, "captured-direct", 3),
    ("interleaved", 8, "captured-direct", 0),
    ("interleaved", 6, "captured-copy", 8),
    ("zbv", 8, "captured-direct", 0),
    ("zbv", 8, "captured-direct", 3),
    ("zbv", 6, "captured-copy", 0),
    ("interleaved", 8, "captured-direct", 8),
    ("zbv", 8, "captured-direct", 8),
    ("interleaved", 6, "captured-direct", 8),  # depth 4 on the first stage: a partial last group
])
def test_bounded_chains_keep_native_eager_bits(fake_graphs, schedule: str, microbatches: int, path: str,
                                              staging: int) -> None:
    cfg = load_config().with_overrides(**{**BASE, "pipeline.schedule": schedule,
                                          "pipeline.microbatches": microbatches,
                                          "pipeline.wgrad_staging": staging})
    report = run_verify_state(cfg, steps=3, path=path)
    bad = [c for c in report.categories if c.mismatches or (c.compared == 0 and c.category != "cache_contents")]
    assert report.passed, (report.first_divergence, bad)
    graphs = report.graphs
    assert graphs is not None and graphs["graph_count"] < 3 * microbatches * 4  # shared, not one per action
    assert graphs["replays"] == 3 * 3 * microbatches * 4  # every action replayed, every step
    assert graphs["input_copies_skipped"] > 0  # the bits above hold with constant inputs copied once


@pytest.mark.parametrize("by_liveness", [False, True])
def test_microbatches_of_many_tokens_keep_native_eager_bits(fake_graphs, by_liveness: bool) -> None:
    """More tokens per microbatch than torch's zero-filled embedding backward takes (`needs_signed_zeros`:
    the +0.0 pass, one first-stage dI graph per microbatch), as at h4096-long."""
    cfg = load_config().with_overrides(**{**BASE, "model.seq_len": 64, "model.microbatch_size": 49,
                                          "pipeline.microbatches": 4,
                                          "pipeline.wgrad_staging_by_liveness": by_liveness})
    assert needs_signed_zeros(cfg.model.seq_len * cfg.model.microbatch_size)
    report = run_verify_state(cfg, steps=2, path="captured-direct")
    assert report.passed, report.first_divergence


def test_one_chain_too_few_is_caught(fake_graphs, monkeypatch: pytest.MonkeyPatch) -> None:
    """K one below the liveness bound on every stage (copied gradients: one chain per class): the pool
    refuses the first premature reuse (the generation check), before any replay could overwrite a live
    chain."""
    from qeffect.contracts import TapeViolation

    real = build_mod.slots_for
    monkeypatch.setattr(build_mod, "slots_for", lambda sch: {s: max(1, k - 1) for s, k in real(sch).items()})
    cfg = load_config().with_overrides(**{**BASE, "pipeline.microbatches": 8})
    with pytest.raises(TapeViolation, match="premature slot reuse"):
        run_verify_state(cfg, steps=1, path="captured-copy")  # no arena variants: chains = classes


@pytest.mark.parametrize("schedule", ["interleaved", "zbv"])
def test_staged_direct_chains_are_the_liveness_classes(fake_graphs, schedule: str) -> None:
    """With the default staging depth a direct dW's slot and fold follow its chain (`staging_depth`) and
    the fold's overwrite/add/skip is a device word: the chunk captures as many graphs as without staging."""
    counts = {}
    for staging, by_liveness in ((0, True), (8, True), (8, False)):
        cfg = load_config().with_overrides(**{**BASE, "pipeline.schedule": schedule, "pipeline.microbatches": 8,
                                              "pipeline.wgrad_staging": staging,
                                              "pipeline.wgrad_staging_by_liveness": by_liveness})
        report = run_verify_state(cfg, steps=2, path="captured-direct")
        assert report.passed, report.first_divergence
        counts[staging, by_liveness] = report.graphs["graph_count"]
    assert counts[8, True] == counts[0, True]
    assert counts[8, False] > counts[0, True]  # every stage at depth 8: slots and folds split the classes


@pytest.mark.parametrize("mode", [FoldMode.ADD, FoldMode.SKIP])
def test_a_fold_with_the_wrong_mode_is_caught(fake_graphs, monkeypatch: pytest.MonkeyPatch, mode: int) -> None:
    """The mode a dW replay copies in decides the bits: every fold adding (the first group onto the last
    step's sum) or every fold skipped (groups never reach the region) fails the oracle."""
    monkeypatch.setattr(GradientArena, "fold_mode", lambda self, m, name: mode)
    cfg = load_config().with_overrides(**{**BASE, "pipeline.microbatches": 8, "pipeline.wgrad_staging": 8})
    report = run_verify_state(cfg, steps=2, path="captured-direct")
    assert not report.passed


def test_each_rank_captures_the_graphs_its_plan_counts() -> None:
    """`QEffectRank.captured_graphs` (distinct graphs its actions replay) is its plan's count on every rank,
    and the ranks' counts add up to the manager's captures."""
    cfg = load_config().with_overrides(**{**BASE, "pipeline.microbatches": 8})
    pipe = _fake_captured_build(None)(cfg, native=False, path="captured-direct")
    counts = [r.captured_graphs() for r in pipe.ranks]
    assert counts == [r.planned_graphs() for r in pipe.ranks] and sum(counts) == len(pipe.manager.actions)
    assert len(set(counts)) > 1  # the ranks differ (K per stage), so a per-rank average would not do


@pytest.mark.parametrize("staging", [4, 8])
def test_a_fold_every_replay_would_skip_is_not_captured(fake_graphs, staging: int) -> None:
    """Fixed staging depth: the last microbatch's group is folded by the optimizer (deferred), so a dW graph
    that serves only microbatches whose fold is skipped holds no gated fold (no kernel launched every step to
    do nothing); a graph that also serves a microbatch closing an earlier group keeps it, gated. Depth 8 at
    M = 8: no dW graph folds at all. The bits stay native eager's."""
    cfg = load_config().with_overrides(**{**BASE, "pipeline.microbatches": 8, "pipeline.wgrad_staging": staging,
                                          "pipeline.wgrad_staging_by_liveness": False})
    pipe = _fake_captured_build(build_mod.build_single_process)(cfg, native=False, path="captured-direct")
    dropped = 0
    for r in pipe.ranks:
        for act in r.actions.values():
            for m in range(8):
                members = [k for k in range(8) if act.chain(k) == act.chain(m)]
                runs = any(act._dw_modes[k] and FoldMode.SKIP not in [int(v) for v in act._dw_modes[k].values()]
                           for k in members)
                has = any(k.startswith("fold") for k in act.slots[m].dW.static_inputs)
                assert has is runs and has is bool(act._dw_modes[m]), (act.stage, m)
                dropped += m % staging == staging - 1 and not has
            if staging == 8:
                assert not any(act._dw_modes)
    assert dropped > 0
    report = run_verify_state(cfg, steps=2, path="captured-direct")
    assert report.passed, report.first_divergence


# ------------------------------------------------------------------------------------------ hand-offs
def _handed(pipe) -> tuple[int, int]:
    """(F and dI replays of the step that copied their activation or gradient in, those that did not)."""
    copied = linked = 0
    last = pipe.schedule.num_stages - 1
    for name, keys in pipe.manager.copied:
        stage = int(name[1:name.index(".")])
        kind = name.split(".")[1]
        if kind.startswith("F") and stage > 0:
            copied, linked = copied + ("x" in keys), linked + ("x" not in keys)
        elif kind.startswith("dI") and stage < last:
            copied, linked = copied + ("grad" in keys), linked + ("grad" not in keys)
    return copied, linked


@pytest.mark.parametrize("schedule", ["interleaved", "zbv"])
def test_hand_offs_copy_nothing_where_chains_are_their_own(schedule: str) -> None:
    """One chain per microbatch (the direct path at staging depth M): every activation and input gradient
    that crosses a stage boundary is written by the producing graph into the consumer's static input, so
    no F or dI replay copies one in; without the links every one of them is copied."""
    cfg = load_config().with_overrides(**{**BASE, "pipeline.schedule": schedule, "pipeline.microbatches": 8,
                                          "pipeline.wgrad_staging": 8, "pipeline.wgrad_staging_by_liveness": False})
    batches = [(torch.randint(0, 64, (1, 8)), torch.randint(0, 64, (1, 8))) for _ in range(8)]
    for link, expected in ((True, (0, 2 * 3 * 8)), (False, (2 * 3 * 8, 0))):
        pipe = _fake_captured_build(None, link=link)(cfg, native=False, path="captured-direct")
        pipe.manager.copied.clear()
        pipe.step(batches)
        assert _handed(pipe) == expected, link


@pytest.mark.parametrize(("schedule", "path", "staging"), [("interleaved", "captured-direct", 8),
                                                           ("zbv", "captured-direct", 8),
                                                           ("interleaved", "captured-copy", 8),
                                                           ("interleaved", "captured-direct", 3)])
def test_hand_offs_keep_native_eager_bits(fake_graphs, schedule: str, path: str, staging: int) -> None:
    """Linked hand-offs (all of them; or, with chains shared by liveness, only where both sides have a chain
    of their own) against native eager, every action of every step."""
    cfg = load_config().with_overrides(**{**BASE, "pipeline.schedule": schedule, "pipeline.microbatches": 8,
                                          "pipeline.wgrad_staging": staging,
                                          "pipeline.wgrad_staging_by_liveness": staging != 8})
    report = run_verify_state(cfg, steps=3, path=path)
    assert report.passed, report.first_divergence


def test_a_hand_off_on_a_shared_chain_is_caught(fake_graphs, monkeypatch: pytest.MonkeyPatch) -> None:
    """The rule that makes a link safe: both graphs serve that microbatch only. Links on chains that serve
    several microbatches (plans that claim no chain is shared) let a later microbatch's F rewrite the input
    an earlier microbatch's tape still holds. Replayed here by re-running the captured body, the dI of that
    earlier microbatch reads the rewritten input and autograd's version check refuses it (a CUDA graph would
    read it silently, and the oracle would see the bits)."""
    monkeypatch.setattr(GraphPlan, "shared", lambda self, m: False)
    cfg = load_config().with_overrides(**{**BASE, "pipeline.microbatches": 8})
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        run_verify_state(cfg, steps=2, path="captured-copy")  # chains shared by liveness


def test_link_stages_links_each_boundary_once_and_not_under_offload() -> None:
    """Every consecutive pair of captured stages gets one hand-off (linking again changes nothing); a stage
    with an offload manager keeps its own buffers."""
    cfg = load_config().with_overrides(**{**BASE, "pipeline.microbatches": 4})
    schedule = schedule_of(cfg)
    chunks = build_chunks_for(cfg, "cpu")
    ranks = [build_rank(cfg, schedule, r, chunks, native=False, manager=ExecManager()) for r in range(schedule.pp)]
    acts = {s: a for r in ranks for s, a in r.actions.items()}
    assert link_stages(ranks) == 3 and link_stages(ranks) == 0
    assert all(acts[s].send is acts[s + 1].recv is not None for s in range(3))
    assert acts[0].recv is None and acts[3].send is None
    ranks = [build_rank(cfg, schedule, r, chunks, native=False, manager=ExecManager()) for r in range(schedule.pp)]
    acts = {s: a for r in ranks for s, a in r.actions.items()}
    acts[2].offload = object()  # any manager: the stage plans its groups around its own buffers
    assert link_stages(ranks) == 1
    assert acts[0].send is acts[1].recv is not None and acts[1].send is None and acts[2].send is None
