"""A step's actions as one graph (`graphs.step_graph`, `runtime.step_graph`) on a CPU, with fake graphs.

`test_graph_binding_bitwise.ExecManager` replays an action by re-running its body. `StepExecManager` adds
the step graph's two modes as a CUDA capture would see them: while recording, every replay, input copy and
step tensor (`GraphManager.step_tensor`) is deferred into the recorded step's list and runs only when that
step is replayed; while dry, nothing runs at all. So a device operation of a step that does not go
through the manager would run at the wrong time here (while recording, on stale values; while dry, not at
all) and change the numbers: the bitwise comparison with ordinary steps catches it. The runtime, the
contracts and the checks of what a dry step issues are the real code."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch
from torch.autograd.graph import increment_version

from qeffect.config import load_config
from qeffect.errors import UserError
from qeffect.graphs.manager import GraphManager
from qeffect.graphs.step_graph import RecordedStep, check_issued, load_batches, recording
from qeffect.runtime import build as build_mod
from qeffect.runtime import single as single_mod
from qeffect.runtime.adamw import TritonAdamW
from qeffect.runtime.build import path_runtime
from qeffect.verify.state import synthetic_batches
from script_modules import script_module
from test_graph_binding_bitwise import BASE, ExecManager, _Action, _copy_into, _fake_captured_build


@dataclass
class StepExecManager(ExecManager):
    issued: list = field(default_factory=list)
    _step_tensors: dict = field(default_factory=dict)
    deferred: list[Callable[[], None]] = field(default_factory=list)

    def replay(self, action: _Action, dynamic: dict[str, torch.Tensor] | None = None) -> Any:
        if self.mode == "launch":
            return super().replay(action, dynamic)
        keys = []
        for k, v in (dynamic or {}).items():
            dst = action.static_inputs[k]
            constant = self.held.is_constant(v)
            if constant and self.held.holds(dst, v):
                continue
            keys.append((k, v.data_ptr()))
            if self.mode == "record":
                with torch.no_grad():
                    dst.copy_(v)  # moves the version as the captured copy does (its value is rewritten below)
                self.deferred.append(lambda dst=dst, v=v: dst.data.copy_(v))  # `.data`: no version moves
            else:
                increment_version(dst)  # dry: the copy the step graph makes, counted as the manager does
            if constant:
                self.held.copied(dst, v)
        if self.mode == "record":
            self.deferred.append(lambda: _copy_into(action.outputs, action.fn()))
        self.issued.append((action.name, tuple(keys)))
        return action.outputs

    set_step_mode = GraphManager.set_step_mode

    def step_tensor(self, key, make):
        if self.mode == "launch":
            return make()
        if self.mode == "record":
            t = self._step_tensors[key] = make()  # stale values now; the replay writes the right ones
            self.deferred.append(lambda: t.data.copy_(make()))
            return t
        return self._step_tensors[key]


class _Replay:
    def __init__(self, work: list[Callable[[], None]]) -> None:
        self.work = work

    def replay(self) -> None:
        for fn in self.work:  # in order, as a replay of the bodies does (autograd on: dI reads F's graph)
            fn()


def fake_record_step(manager: StepExecManager, device, batches, run) -> RecordedStep:
    """`graphs.step_graph.record_step` without CUDA: the deferred work is the outer graph."""
    manager.deferred = []
    with recording(manager):
        loss = run(batches)
    return RecordedStep(_Replay(manager.deferred), list(batches), loss, list(manager.issued))


@pytest.fixture
def step_graphs(monkeypatch: pytest.MonkeyPatch) -> Callable[..., Any]:
    monkeypatch.setattr(single_mod, "record_step", fake_record_step)
    monkeypatch.setattr(TritonAdamW, "use_graph", lambda self, enabled=True: None)
    return _fake_captured_build(build_mod.build_single_process, manager=StepExecManager)


def _parameters(pipe) -> list[torch.Tensor]:
    pipe.settle()
    return [p.detach() for r in pipe.ranks for c in r.chunks.values() for p in c.parameters()]


@pytest.mark.parametrize(("schedule", "staging", "by_liveness"),
                         [("interleaved", 8, False), ("zbv", 8, False), ("interleaved", 3, False),
                          ("zbv", 8, True)])
def test_steps_launched_as_one_recorded_graph_keep_the_bits(step_graphs, schedule: str, staging: int,
                                                             by_liveness: bool) -> None:
    """Two ordinary steps, one recorded, five replayed with dry bookkeeping: the same losses and parameters
    as a pipeline of ordinary steps, bit for bit (bounded chains, whose clones go through `step_tensor`;
    staging by liveness, whose dW graphs of a stage share one fold mode word)."""
    cfg = load_config().with_overrides(**{**BASE, "pipeline.schedule": schedule, "pipeline.microbatches": 8,
                                          "pipeline.wgrad_staging": staging,
                                          "pipeline.wgrad_staging_by_liveness": by_liveness})
    ordinary = step_graphs(cfg, native=False, path="captured-direct")
    graphed = step_graphs(cfg, native=False, path="captured-direct")
    graphed.step_graph_after = 2
    for i in range(8):
        batches = synthetic_batches(cfg, i, "cpu")
        want, got = ordinary.step(batches), graphed.step(batches)
        assert torch.equal(got, want), (i, got, want)
    assert graphed.recorded is not None and graphed.recorded.replays == 6
    assert len(graphed.recorded.issued) == 3 * 8 * 4  # F, dI, dW of 8 microbatches on 4 stages
    for a, b in zip(_parameters(ordinary), _parameters(graphed), strict=True):
        assert torch.equal(a, b)


def test_a_dry_step_that_issues_other_work_is_refused(step_graphs) -> None:
    cfg = load_config().with_overrides(**{**BASE, "pipeline.microbatches": 4})
    pipe = step_graphs(cfg, native=False, path="captured-direct")
    pipe.step_graph_after = 1
    for i in range(2):
        pipe.step(synthetic_batches(cfg, i, "cpu"))
    name, keys = pipe.recorded.issued[5]
    pipe.recorded.issued[5] = (name, (*keys, ("x", 0)))
    before = [p.clone() for p in _parameters(pipe)]
    steps, replays = [r.step_index for r in pipe.ranks], pipe.recorded.replays
    with pytest.raises(RuntimeError, match="issues other work than the recorded step, from replay 5 on"):
        pipe.step(synthetic_batches(cfg, 2, "cpu"))
    # launched before the check, which still gates the commit: no parameter took the step
    assert pipe.recorded.replays == replays + 1
    assert [r.step_index for r in pipe.ranks] == steps
    assert all(torch.equal(a, b) for a, b in zip(before, _parameters(pipe), strict=True))


def test_a_replayed_step_launches_before_its_bookkeeping_and_commits_after(step_graphs, monkeypatch) -> None:
    """Stale FP8 weight caches cast, the one launch, then the dry bookkeeping while the device runs, then
    the commit: the device never waits for the host's checks, which still come before the commit."""
    cfg = load_config().with_overrides(**{**BASE, "pipeline.microbatches": 4})
    pipe = step_graphs(cfg, native=False, path="captured-direct")
    pipe.step_graph_after = 1
    for i in range(2):
        pipe.step(synthetic_batches(cfg, i, "cpu"))
    events: list[str] = []
    rec = pipe.recorded
    replay = rec.graph.replay
    monkeypatch.setattr(rec.graph, "replay", lambda: (events.append("launch"), replay())[1])
    for r in pipe.ranks:
        monkeypatch.setattr(r, "cast_stale_weights", lambda r=r: events.append(f"cast {r.rank}"))
        run, commit = r.run, r.commit
        monkeypatch.setattr(r, "run", lambda *a, run=run, **k: (events.append("bookkeeping"), run(*a, **k))[1])
        monkeypatch.setattr(r, "commit", lambda *a, commit=commit, **k: (events.append("commit"), commit(*a, **k))[1])
    pipe.step(synthetic_batches(cfg, 2, "cpu"))
    first = events.index("bookkeeping")
    assert events[:first] == ["cast 0", "cast 1", "launch"]
    assert set(events[first:-2]) == {"bookkeeping"} and events[-2:] == ["commit", "commit"]


@pytest.mark.parametrize(("schedule", "microbatches", "extra"), [
    ("interleaved", 4, {}),
    ("zbv", 6, {"pipeline.wgrad_staging": 3}),
    ("interleaved", 6, {"pipeline.wgrad_staging": 1, "optim.clip_grad_norm": 1.0}),
    ("interleaved", 4, {"pipeline.wgrad_staging_by_liveness": True}),
    ("zbv", 6, {"pipeline.wgrad_staging_by_liveness": True}),
    ("interleaved", 16, {"pipeline.wgrad_staging_by_liveness": True, "runtime.graph_pools": "shared"}),
    ("zbv", 4, {"pipeline.wgrad_accumulation": "fused"}),
    ("interleaved", 4, {"model.family": "llama", "model.kv_heads": 1, "pipeline.wgrad_staging_by_liveness": True}),
])
def test_every_dry_step_of_the_real_manager_issues_what_the_recorded_step_did(monkeypatch, schedule: str,
                                                                               microbatches: int, extra: dict) -> None:
    """The real `GraphManager` and pipeline (on host_overhead.py's backend, which issues nothing): two
    ordinary steps, one recorded, five dry; each dry step must issue the recorded step's graphs and copies
    (`check_issued`), across schedules, staging depths that do and do not divide M, staging by liveness
    (one fold mode word per stage for all its dW graphs), clipping, fused accumulation and Llama."""
    with script_module("benchmarks/host_overhead.py") as bench:
        monkeypatch.setattr(single_mod, "record_step", bench.null_record_step)
        cfg = load_config().with_overrides(**{**bench.SHRINK, "train.device": "cpu", "fp8.backend": "reference",
                                              "pipeline.schedule": schedule, "pipeline.microbatches": microbatches,
                                              **extra})
        pipe = bench.build(cfg, step_graph=True)
    for i in range(8):
        pipe.step(synthetic_batches(cfg, i, "cpu"))
    assert pipe.recorded is not None and pipe.recorded.replays == 6  # the recorded step's own launch too


def test_check_issued_names_the_first_difference() -> None:
    rec = RecordedStep(None, [], torch.zeros(()), [("a", ()), ("b", (("x", 1),))])
    check_issued(rec, [("a", ()), ("b", (("x", 1),))])
    with pytest.raises(RuntimeError, match=r"from replay 1 on: \('b', \(\)\) instead of \('b', \(\('x', 1\),\)\)"):
        check_issued(rec, [("a", ()), ("b", ())])
    with pytest.raises(RuntimeError, match="from replay 2 on: nothing instead of"):
        check_issued(RecordedStep(None, [], torch.zeros(()), [("a", ()), ("b", ()), ("c", ())]),
                     [("a", ()), ("b", ())])


def test_load_batches_copies_into_the_recorded_inputs_and_refuses_other_shapes() -> None:
    old = [(torch.zeros(2, 3, dtype=torch.int64), torch.zeros(2, 3, dtype=torch.int64))]
    rec = RecordedStep(None, old, torch.zeros(()), [])
    new = [(torch.ones(2, 3, dtype=torch.int64), torch.full((2, 3), 2))]
    load_batches(rec, new)
    assert torch.equal(old[0][0], new[0][0]) and torch.equal(old[0][1], new[0][1])
    with pytest.raises(ValueError, match=r"microbatch 0's input ids are torch.int64\(2, 4\); the step graph reads"):
        load_batches(rec, [(torch.zeros(2, 4, dtype=torch.int64), torch.zeros(2, 3, dtype=torch.int64))])
    with pytest.raises(ValueError, match="reads 1 microbatches, got 2"):
        load_batches(rec, new * 2)


@pytest.mark.parametrize(("path", "offload"), [("captured-copy", "off"), ("captured-direct", "release")])
def test_a_step_graph_needs_captured_direct_without_offload(path: str, offload: str) -> None:
    cfg = load_config().with_overrides(**{"runtime.step_graph": True, "offload.mode": offload})
    with pytest.raises(UserError, match="runtime.step_graph records captured-direct steps without offload"):
        path_runtime(cfg, path, "cuda", native=False, direct=True)


@pytest.mark.parametrize(("path", "offload", "device", "one_process", "applies"), [
    ("captured-direct", "off", "cuda", True, True),
    ("captured-direct", "off", "cpu", True, False),
    ("captured-copy", "off", "cuda", True, False),
    ("captured-direct", "release", "cuda", True, False),
    ("captured-direct", "off", "cuda", False, False),
])
def test_step_graph_auto_applies_to_one_process_captured_direct_on_cuda(path, offload, device, one_process,
                                                                         applies) -> None:
    from qeffect.runtime.build import step_graph_applies

    cfg = load_config()
    assert cfg.runtime.step_graph == "auto"
    assert step_graph_applies(cfg, path, device, offload=offload, one_process=one_process) is applies
    off = cfg.with_overrides(**{"runtime.step_graph": False})
    assert step_graph_applies(off, path, device, offload=offload, one_process=one_process) is False
    on = cfg.with_overrides(**{"runtime.step_graph": True})
    if applies:
        assert step_graph_applies(on, path, device, offload=offload, one_process=one_process) is True
    elif device == "cuda":  # required where it cannot apply: a clear error
        with pytest.raises(UserError, match="runtime.step_graph records"):
            step_graph_applies(on, path, device, offload=offload, one_process=one_process)


@pytest.mark.parametrize("applies", [True, False])
def test_the_real_build_records_a_step_graph_exactly_where_path_runtime_decided(monkeypatch, applies: bool) -> None:
    # The other tests here replace `build_single_process`; this one runs it and `path_runtime` for real,
    # with only the CUDA parts swapped: the path check, the device test and the graph backend.
    with script_module("benchmarks/host_overhead.py") as bench:
        monkeypatch.setattr(build_mod, "check_path", lambda *a, **k: None)
        monkeypatch.setattr(build_mod, "step_graph_applies", lambda *a, **k: applies)
        monkeypatch.setattr(build_mod, "GraphManager",
                            lambda device, **kw: GraphManager("cpu", backend=bench.NullGraphBackend(), **kw))
        cfg = load_config().with_overrides(**{"runtime.rank_streams": False})  # streams are CUDA's
        pipe = build_mod.build_single_process(cfg, native=False, device="cpu", path="captured-direct",
                                              capture=False)
    assert pipe.manager is not None and pipe.manager.keep_graphs is applies
    assert pipe.step_graph_after == (build_mod.STEP_GRAPH_AFTER if applies else None)


def test_the_step_graph_setting_takes_auto_true_and_false_only() -> None:
    from qeffect.config import apply_sets

    assert apply_sets(load_config(), ["runtime.step_graph=auto"]).runtime.step_graph == "auto"
    assert apply_sets(load_config(), ["runtime.step_graph=false"]).runtime.step_graph is False
    with pytest.raises(UserError, match="runtime.step_graph"):
        apply_sets(load_config(), ["runtime.step_graph=sometimes"])


def _verify_with_step_graphs(monkeypatch, record=fake_record_step):
    """`run_verify_state` on fake graphs whose captured-direct pipelines record their third step (as
    `runtime.step_graph = "auto"` does on CUDA)."""
    from qeffect.verify import state as state_mod

    monkeypatch.setattr(single_mod, "record_step", record)
    monkeypatch.setattr(TritonAdamW, "use_graph", lambda self, enabled=True: None)
    fake = _fake_captured_build(build_mod.build_single_process, manager=StepExecManager)

    def build(cfg, **kw):
        pipe = fake(cfg, **kw)
        if not kw.get("native") and kw.get("path") == "captured-direct":
            pipe.step_graph_after = build_mod.STEP_GRAPH_AFTER
        return pipe

    monkeypatch.setattr(state_mod, "build_single_process", build)
    return state_mod.run_verify_state


def test_verify_state_trains_a_step_graph_pipeline_and_compares_it_with_native_eager(monkeypatch) -> None:
    run = _verify_with_step_graphs(monkeypatch)
    cfg = load_config().with_overrides(**{**BASE, "pipeline.microbatches": 4})
    report = run(cfg, steps=5, path="captured-direct")
    check = report.step_graph
    assert check is not None and report.passed, (report.first_divergence, check)
    assert check.recorded_at_step == 2 and check.replays == 3  # steps 2, 3 and 4 launched as one graph
    assert check.mismatches == 0 and check.compared > 5  # five losses, then every state tensor
    # not where the step graph does not apply, nor with an injection
    assert run(cfg, steps=3, path="captured-copy").step_graph is None


def test_verify_state_fails_a_step_graph_that_replays_other_work(monkeypatch) -> None:
    def drop_last(manager, device, batches, run):  # the recorded graph misses its last device operation
        rec = fake_record_step(manager, device, batches, run)
        rec.graph.work = rec.graph.work[:-1]
        return rec

    run = _verify_with_step_graphs(monkeypatch, record=drop_last)
    cfg = load_config().with_overrides(**{**BASE, "pipeline.microbatches": 4})
    report = run(cfg, steps=5, path="captured-direct")
    assert report.step_graph is not None and not report.step_graph.passed and not report.passed
    assert report.step_graph.first_divergence.startswith("loss at step 2")
    assert all(c.mismatches == 0 for c in report.categories)  # the action-by-action comparison passed


def test_verify_state_prints_the_step_graph_check_in_one_line() -> None:
    from rich.console import Console

    from qeffect.cli.verify_state import _print_step_graph
    from qeffect.verify.state import StepGraphCheck

    console = Console(record=True, width=300)
    _print_step_graph(StepGraphCheck(recorded_at_step=2, replays=18, compared=500, mismatches=1,
                                     first_divergence="parameters at step 19: s0.fc1.weight", passed=False), console)
    _print_step_graph(StepGraphCheck(recorded_at_step=None, replays=0, compared=8, mismatches=0, passed=True), console)
    _print_step_graph(None, console)
    lines = console.export_text().splitlines()
    assert lines == ["step graph: recorded at step 2, 18 steps launched as one graph; losses and final state: 500 "
                     "tensors compared, 1 mismatches",
                     "step graph: first divergence: parameters at step 19: s0.fc1.weight",
                     "step graph: not recorded (a step graph records the third step: run more steps); 8 tensors "
                     "compared, 0 mismatches"]
