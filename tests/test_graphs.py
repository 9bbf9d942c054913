"""Graph manager bookkeeping and handshake order on CPU, driven through a fake CUDA backend."""

from __future__ import annotations

import time
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from qeffect.graphs import GraphManager, GraphStats
from qeffect.graphs import handshake as hs


# ------------------------------------------------------------------------------------------ fakes
class FakeStream:
    def __init__(self, name: str, log: list) -> None:
        self.name, self.log = name, log

    def wait_stream(self, other: FakeStream) -> None:
        self.log.append(("wait_stream", self.name, other.name))

    def wait_event(self, event: FakeEvent) -> None:
        self.log.append(("wait_event", self.name, event.name))


class FakeEvent:
    def __init__(self, backend: FakeBackend, name: str) -> None:
        self.backend, self.name = backend, name

    def record(self) -> None:
        self.backend.log.append(("record", self.backend.current.name, self.name))


class FakeGraph:
    def __init__(self, backend: FakeBackend, name: str) -> None:
        self.backend, self.name = backend, name

    def replay(self) -> None:
        self.backend.log.append(("replay", self.backend.current.name, self.name))


class FakeBackend:
    """Records every operation with the stream it was issued on."""

    def __init__(self) -> None:
        self.log: list[tuple] = []
        self.caller = FakeStream("caller", self.log)
        self.current = self.caller
        self.streams = 0
        self.graphs = 0
        self.allocated = 1000
        self.reserved = 4096

    def new_stream(self) -> FakeStream:
        self.streams += 1
        return FakeStream("graph", self.log)

    def current_stream(self) -> FakeStream:
        return self.current

    @contextmanager
    def use_stream(self, stream: FakeStream):
        prev, self.current = self.current, stream
        try:
            yield
        finally:
            self.current = prev

    def graph_pool_handle(self) -> str:
        return "pool"

    def new_graph(self) -> FakeGraph:
        self.graphs += 1
        return FakeGraph(self, f"g{self.graphs}")

    @contextmanager
    def capture(self, graph: FakeGraph, pool: str, stream: FakeStream):
        self.log.append(("capture_begin", stream.name, graph.name, pool))
        prev, self.current = self.current, stream
        try:
            yield
        finally:
            self.current = prev
            self.allocated += 256  # a capture takes pool memory
            self.reserved += 2048
            self.log.append(("capture_end", stream.name, graph.name))

    def new_external_event(self) -> FakeEvent:
        return FakeEvent(self, f"tail{self.graphs}")

    def copy_(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)
        self.log.append(("copy", self.current.name, float(src.flatten()[0])))

    def record_stream(self, tensor: torch.Tensor, stream: FakeStream) -> None:
        self.log.append(("record_stream", stream.name, float(tensor.flatten()[0])))

    def add_to_capture(self, graph: FakeGraph) -> None:
        self.log.append(("child", self.current.name, graph.name))

    def memory_allocated(self) -> int:
        return self.allocated

    def memory_reserved(self) -> int:
        return self.reserved


def _manager(protocol: str = "two-way") -> tuple[GraphManager, FakeBackend]:
    be = FakeBackend()
    return GraphManager("cuda", protocol=protocol, backend=be), be  # type: ignore[arg-type]


def _capture_add(mgr: GraphManager, name: str = "add", warmup: int = 2):
    a, b = torch.zeros(3), torch.zeros(3)
    calls: list[str] = []

    def fn() -> torch.Tensor:
        calls.append(mgr.backend.current_stream().name)
        return a + b

    return mgr.capture(name, fn, static_inputs={"a": a, "b": b}, warmup=warmup), calls


# ---------------------------------------------------------------------------------- handshake order
def test_two_way_replay_order_edge_copies_replay_wait() -> None:
    mgr, be = _manager("two-way")
    action, _ = _capture_add(mgr)
    for step in range(2):
        be.log.clear()
        out = mgr.replay(action, {"a": torch.full((3,), 1.0 + step), "b": torch.full((3,), 10.0 + step)})
        assert be.log == [
            ("wait_stream", "graph", "caller"),  # (1) caller -> graph edge first
            ("copy", "graph", 1.0 + step), ("record_stream", "graph", 1.0 + step),  # (2) on the graph stream
            ("copy", "graph", 10.0 + step), ("record_stream", "graph", 10.0 + step),
            ("replay", "graph", "g1"),  # (3)
            ("wait_event", "caller", "tail1"),  # (4) graph tail -> caller
        ]
        assert out is action.outputs
        assert torch.equal(action.static_inputs["a"], torch.full((3,), 1.0 + step))
        assert torch.equal(action.static_inputs["b"], torch.full((3,), 10.0 + step))
    assert be.current is be.caller  # the caller's stream is current again after replay


def test_one_way_replay_has_neither_edge() -> None:
    mgr, be = _manager("one-way")
    action, _ = _capture_add(mgr)
    be.log.clear()
    mgr.replay(action, {"a": torch.ones(3)})
    assert be.log == [("copy", "graph", 1.0), ("record_stream", "graph", 1.0), ("replay", "graph", "g1")]
    assert not any(op[0] in ("wait_stream", "wait_event") for op in be.log)


def test_stream_ordered_replay_copies_and_launches_on_the_caller_stream() -> None:
    mgr, be = _manager("stream-ordered")
    action, _ = _capture_add(mgr)
    for step in range(2):
        be.log.clear()
        out = mgr.replay(action, {"a": torch.full((3,), 1.0 + step), "b": torch.full((3,), 10.0 + step)})
        # no edge and no record_stream: the copies and the graph are on the caller's stream, in order
        assert be.log == [("copy", "caller", 1.0 + step), ("copy", "caller", 10.0 + step), ("replay", "caller", "g1")]
        assert out is action.outputs
        assert torch.equal(action.static_inputs["b"], torch.full((3,), 10.0 + step))
    assert be.current is be.caller and mgr.stats.handoffs == 0 and mgr.stats.replay_count == 2
    with pytest.raises(ValueError, match="dynamic input 'a'"):
        mgr.replay(action, {"a": torch.zeros(4)})  # the same checks as the other protocols


def test_replay_without_dynamic_inputs_still_handshakes() -> None:
    mgr, be = _manager("two-way")
    action, _ = _capture_add(mgr)
    be.log.clear()
    mgr.replay(action)
    assert be.log == [("wait_stream", "graph", "caller"), ("replay", "graph", "g1"), ("wait_event", "caller", "tail1")]


def test_capture_warms_up_on_graph_stream_and_records_tail_inside_capture() -> None:
    mgr, be = _manager()
    action, calls = _capture_add(mgr, warmup=2)
    assert calls == ["graph", "graph", "graph"]  # 2 warm-ups + 1 capture, all on the graph stream
    assert be.log == [
        ("wait_stream", "graph", "caller"),  # warm-up starts after the caller's prior work
        ("wait_stream", "caller", "graph"),  # and the caller sees its results
        ("capture_begin", "graph", "g1", "pool"),
        ("record", "graph", "tail1"),  # the tail event is a node at the end of the graph
        ("capture_end", "graph", "g1"),
    ]
    assert torch.equal(action.outputs, torch.zeros(3))
    assert be.streams == 1  # ONE graph stream for the manager


def test_capture_without_warmup_runs_body_once() -> None:
    mgr, be = _manager()
    _, calls = _capture_add(mgr, warmup=0)
    assert calls == ["graph"]
    assert be.log[0][0] == "capture_begin"


def test_all_graphs_share_one_stream_and_pool() -> None:
    mgr, be = _manager()
    _capture_add(mgr, "x")
    _capture_add(mgr, "y")
    begins = [op for op in be.log if op[0] == "capture_begin"]
    assert begins == [("capture_begin", "graph", "g1", "pool"), ("capture_begin", "graph", "g2", "pool")]
    assert be.streams == 1


def test_replay_rejects_unknown_or_mismatched_inputs_and_duplicate_names() -> None:
    mgr, _ = _manager()
    action, _ = _capture_add(mgr)
    with pytest.raises(KeyError, match="no static input 'c'"):
        mgr.replay(action, {"c": torch.zeros(3)})
    with pytest.raises(ValueError, match="dynamic input 'a'"):
        mgr.replay(action, {"a": torch.zeros(4)})
    with pytest.raises(ValueError, match="dynamic input 'a'"):
        mgr.replay(action, {"a": torch.zeros(3, dtype=torch.float64)})
    with pytest.raises(ValueError, match="already captured"):
        _capture_add(mgr)
    assert mgr.stats.replay_count == 0  # rejected replays are not counted
    with pytest.raises(ValueError, match="protocol"):
        GraphManager("cuda", protocol="three-way", backend=FakeBackend())  # type: ignore[arg-type]


@pytest.mark.parametrize("keep", [False, True])
def test_the_manager_says_whether_its_graphs_are_kept_for_a_step_graph(keep: bool) -> None:
    # `build_single_process` reads this to decide whether a step graph records (`path_runtime` sets it)
    mgr = GraphManager("cuda", backend=FakeBackend(), keep_graphs=keep)  # type: ignore[arg-type]
    assert mgr.keep_graphs is keep


def _copies(be: FakeBackend) -> list[float]:
    return [op[2] for op in be.log if op[0] == "copy"]


def test_a_constant_input_is_copied_once_while_its_buffer_holds_it() -> None:
    mgr, be = _manager("stream-ordered")
    action, _ = _capture_add(mgr)
    seed, data = torch.full((3,), 2.0), torch.full((3,), 5.0)
    mgr.mark_constant(seed)
    be.log.clear()
    for _ in range(3):
        mgr.replay(action, {"a": seed, "b": data})
    assert _copies(be) == [2.0, 5.0, 5.0, 5.0]  # the seed once, the unmarked source every replay
    assert mgr.stats.input_copies_skipped == 2
    assert torch.equal(action.static_inputs["a"], seed)


@pytest.mark.parametrize("change", ["dst-written", "src-written", "other-source", "other-constant"])
def test_a_held_constant_is_copied_again_once_anything_may_have_changed_the_buffer(change: str) -> None:
    mgr, be = _manager("stream-ordered")
    action, _ = _capture_add(mgr)
    seed, other = torch.full((3,), 2.0), torch.full((3,), 7.0)
    mgr.mark_constant(seed, other)
    mgr.replay(action, {"a": seed})
    if change == "dst-written":
        action.static_inputs["a"].fill_(0.0)  # an in-place write through the buffer moves its version
    elif change == "src-written":
        seed.add_(1.0)  # a "constant" written after all: its version moved
    elif change == "other-source":
        mgr.replay(action, {"a": torch.full((3,), 9.0)})  # an unmarked source into the same buffer
    else:
        mgr.replay(action, {"a": other})  # another constant into the same buffer
    be.log.clear()
    mgr.replay(action, {"a": seed})
    assert _copies(be) == [float(seed[0])]
    assert torch.equal(action.static_inputs["a"], seed)


def test_dry_steps_issue_the_recorded_copies_into_a_buffer_two_graphs_share() -> None:
    """A stage's fold mode word is one buffer that each of its dW graphs reads: a step copies `first` into
    it for one graph and `later` for the other. A dry step copies nothing, but counts each copy the step
    graph makes as a write to the buffer (its version), as the recorded step's copies did: else the next
    dry step takes the buffer for still holding `first` and leaves out the copy the recorded step made."""
    mgr, be = _manager("stream-ordered")
    buf = torch.zeros(3)
    x = mgr.capture("x", lambda: buf * 2, static_inputs={"a": buf}, warmup=0)
    y = mgr.capture("y", lambda: buf * 3, static_inputs={"a": buf.detach()}, warmup=0)  # one version counter
    first, later = torch.full((3,), 1.0), torch.full((3,), 2.0)
    mgr.mark_constant(first, later)

    def step(mode: str) -> list:
        mgr.set_step_mode(mode)
        try:
            for action, src in ((x, first), (y, later), (y, later)):
                mgr.replay(action, {"a": src})
        finally:
            mgr.set_step_mode("launch")
        return list(mgr.issued)

    mgr.replay(x, {"a": first})
    mgr.replay(y, {"a": later})
    recorded = step("record")
    assert recorded == [("x", (("a", first.data_ptr()),)), ("y", (("a", later.data_ptr()),)), ("y", ())]
    be.log.clear()
    for _ in range(3):
        assert step("dry") == recorded
    assert _copies(be) == []  # a dry step issues nothing


def test_a_buffer_the_graph_writes_is_never_taken_as_holding_a_constant() -> None:
    mgr, be = _manager("stream-ordered")
    a = torch.zeros(3)
    action = mgr.capture("acc", lambda: a.add_(1.0), static_inputs={"a": a}, warmup=0)  # writes its input
    assert action.written_inputs == frozenset({"a"})
    seed = torch.full((3,), 2.0)
    mgr.mark_constant(seed)
    be.log.clear()
    mgr.replay(action, {"a": seed})
    mgr.replay(action, {"a": seed})
    assert _copies(be) == [2.0, 2.0] and mgr.stats.input_copies_skipped == 0


def test_a_static_input_that_requires_grad_is_copied_into_without_a_grad_mode_switch() -> None:
    """A stage's input buffer is a leaf that requires grad; the replay copies into its detached alias (same
    storage, same version counter), so the backend's copy needs no `no_grad` and the leaf keeps its flag."""
    mgr, be = _manager("stream-ordered")
    x = torch.zeros(3, requires_grad=True)
    action = mgr.capture("f", lambda: x * 2, static_inputs={"x": x}, warmup=0)
    version = x._version
    mgr.replay(action, {"x": torch.full((3,), 4.0)})
    assert torch.equal(x.detach(), torch.full((3,), 4.0)) and x.requires_grad and x.is_leaf
    assert x._version == version + 1  # the held-constant rule reads this counter
    assert action.copy_targets["x"].data_ptr() == x.data_ptr() and not action.copy_targets["x"].requires_grad


def test_real_backend_refuses_a_cpu_device() -> None:
    with pytest.raises(ValueError, match="CUDA device"):
        GraphManager("cpu")


def test_importing_graphs_touches_no_cuda() -> None:
    import qeffect.cli.capture  # noqa: F401
    import qeffect.graphs.handshake  # noqa: F401

    assert not torch.cuda.is_initialized()


# ------------------------------------------------------------------------------------------ stats
@pytest.mark.parametrize(("protocol", "per_replay"), [("two-way", 2), ("one-way", 0), ("stream-ordered", 0)])
def test_stats_count_graphs_replays_handoffs_and_capture_cost(protocol: str, per_replay: int) -> None:
    mgr, be = _manager(protocol)

    def slow() -> torch.Tensor:
        time.sleep(0.002)
        return torch.zeros(1)

    a = mgr.capture("a", slow, static_inputs={}, warmup=1)
    b, _ = _capture_add(mgr, "b")
    for _ in range(3):
        mgr.replay(a)
    for _ in range(2):
        mgr.replay(b, {"a": torch.ones(3)})
    s = mgr.stats
    assert (s.graph_count, s.replay_count, s.handoffs) == (2, 5, 5 * per_replay)
    assert (a.replays, b.replays) == (3, 2)
    assert set(s.capture_host_seconds_per_graph) == {"a", "b"}
    assert s.capture_host_seconds_per_graph["a"] >= 0.004  # warm-up + capture, both timed
    assert s.capture_host_seconds == pytest.approx(sum(s.capture_host_seconds_per_graph.values()))
    assert a.capture_seconds == s.capture_host_seconds_per_graph["a"]
    assert (s.memory_allocated_before_capture, s.memory_allocated_after_capture) == (1000, 1512)
    assert (s.memory_reserved_before_capture, s.memory_reserved_after_capture) == (4096, 8192)
    assert s.capture_memory_allocated == 512
    assert (b.memory_allocated_before, b.memory_allocated_after) == (1256, 1512)
    assert s.protocol == protocol
    assert GraphStats.model_validate_json(s.model_dump_json()) == s


@pytest.mark.parametrize("protocol", ["two-way", "stream-ordered"])
def test_host_phases_time_copies_and_launches_only_while_on(protocol: str, monkeypatch) -> None:
    """Off (the default) nothing is read; on, each replay's input copies (the copies made: a held constant is
    none) and its launch are added to their phases, and the operations and their order stay the same."""
    from qeffect.graphs.stats import COPY, HANDOFF, LAUNCH, OPTIMIZER

    def logged(on: bool) -> tuple[list, GraphManager]:
        mgr, be = _manager(protocol)
        action, _ = _capture_add(mgr)
        seed = torch.full((3,), 2.0)
        mgr.mark_constant(seed)
        mgr.host.on = on
        be.log.clear()
        for _ in range(3):
            mgr.replay(action, {"a": seed, "b": torch.full((3,), 5.0)})
        mgr.replay(action)  # no dynamic inputs: a launch, no copy phase
        return list(be.log), mgr

    off_log, off = logged(False)
    assert off.host.seconds == dict.fromkeys(off.host.seconds, 0.0) and not any(off.host.calls.values())
    slow_copy, slow_replay = FakeBackend.copy_, FakeGraph.replay
    monkeypatch.setattr(FakeBackend, "copy_", lambda self, d, s: (time.sleep(0.002), slow_copy(self, d, s)))
    monkeypatch.setattr(FakeGraph, "replay", lambda self: (time.sleep(0.003), slow_replay(self)))
    on_log, on = logged(True)
    assert on_log == off_log
    h = on.host
    assert h.calls == {LAUNCH: 4, COPY: 4, HANDOFF: 0, OPTIMIZER: 0}  # the seed once, "b" three times
    assert h.seconds[COPY] >= 4 * 0.002 and h.seconds[LAUNCH] >= 4 * 0.003
    assert h.seconds[COPY] < 4 * 0.002 + 0.5 and h.seconds[HANDOFF] == h.seconds[OPTIMIZER] == 0.0


@pytest.mark.parametrize(("samples", "per_step", "total"), [
    ([], 0.0, 0),
    ([500], 0.0, 0),
    ([500, 500, 500, 500], 0.0, 0),
    ([500, 400, 450], 0.0, 0),  # shrinking or below the baseline is no growth
    ([500, 520, 540, 560], 20.0, 60),  # a steady leak of 20 bytes per step
    ([500, 800, 500, 500], 300.0, 300),  # one spike counts as the worst rate
    ([500, 500, 500, 530], 10.0, 30),
])
def test_persistent_growth_per_step(samples: list[int], per_step: float, total: int) -> None:
    s = GraphStats()
    for x in samples:
        s.mark_step(x)
    assert s.persistent_growth_per_step() == per_step
    assert s.persistent_growth_bytes() == total


def test_manager_mark_step_samples_allocated_memory() -> None:
    mgr, be = _manager()
    for extra in (0, 0, 64, 128):
        be.allocated = 2000 + extra
        mgr.mark_step()
    assert mgr.stats.step_allocated == [2000, 2000, 2064, 2128]
    assert mgr.persistent_growth_per_step() == 128 / 3


# ------------------------------------------------------------------------------- handshake suite
def _fake_child(stale: dict[str, int]):
    def run(protocol: str, checks: int, json_path: Path, device: str) -> hs.HandshakeResult:
        return hs.HandshakeResult(protocol=protocol, checks=checks, stale_reads=min(checks, stale[protocol]),
                                  seconds=0.1, device_name="Fake GPU", torch_version="0.0")
    return run


def test_suite_sums_fresh_processes_per_protocol(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hs, "_run_child", _fake_child({"one-way": 200, "two-way": 0, "stream-ordered": 0}))
    monkeypatch.setenv("QEFFECT_GIT_REVISION", "abc123")
    seen: list[tuple[str, int]] = []
    report = hs.run_handshake_suite(3, 200, command="qeffect capture --handshake-check",
                                    progress=lambda p, i: seen.append((p, i)))
    by = {s.protocol: s for s in report.protocols}
    assert (by["one-way"].processes, by["one-way"].checks, by["one-way"].stale_reads) == (3, 600, 600)
    assert (by["two-way"].processes, by["two-way"].checks, by["two-way"].stale_reads) == (3, 600, 0)
    assert by["stream-ordered"].stale_reads == 0 and len(by["stream-ordered"].runs) == 3
    assert len(seen) == 9 and len(by["two-way"].runs) == 3
    assert report.passed
    assert (report.git_revision, report.device_name, report.torch_version) == ("abc123", "Fake GPU", "0.0")
    assert report.command == "qeffect capture --handshake-check"
    assert hs.HandshakeReport.model_validate_json(report.model_dump_json()) == report


def test_script_provenance_names_the_command_and_the_revision(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("QEFFECT_GIT_REVISION", "abc123")
    monkeypatch.setattr("sys.argv", ["scripts/x.py", "--json", "out.json"])
    assert hs.script_provenance() == {"command": "python3 scripts/x.py --json out.json", "git_revision": "abc123"}
    monkeypatch.setattr("torch.cuda.get_device_name", lambda device=None: f"Fake GPU {device}")
    assert hs.gpu_provenance(3) == {"command": "python3 scripts/x.py --json out.json", "git_revision": "abc123",
                                    "device": "Fake GPU 3", "torch": torch.__version__}


@pytest.mark.parametrize("stale", [{"one-way": 200, "two-way": 1, "stream-ordered": 0},
                                   {"one-way": 200, "two-way": 0, "stream-ordered": 1},
                                   {"one-way": 0, "two-way": 0, "stream-ordered": 0}])
def test_suite_fails_on_a_two_way_race_or_a_blind_one_way_check(monkeypatch: pytest.MonkeyPatch,
                                                                stale: dict[str, int]) -> None:
    monkeypatch.setattr(hs, "_run_child", _fake_child(stale))
    assert not hs.run_handshake_suite(2, 10).passed


def test_suite_reports_a_failing_child_process(monkeypatch: pytest.MonkeyPatch) -> None:
    # A real child on a CPU-only machine: the check cannot run, and the error names the process.
    if torch.cuda.is_available():
        pytest.skip("needs a machine without CUDA")
    with pytest.raises(hs.HandshakeError, match=r"handshake process \(one-way\) exited 2: .*no CUDA device"):
        hs.run_handshake_suite(1, 1)


# ------------------------------------------------------------------------------------------- CLI
def _main(argv: list[str]) -> int:
    from qeffect.cli.app import main

    with pytest.raises(SystemExit) as exc:
        main(argv)
    return int(exc.value.code or 0)


def test_cli_capture_without_cuda_is_one_line_exit_2(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert _main(["capture", "--handshake-check"]) == 2
    err = capsys.readouterr().err
    assert err == "qeffect: error: qeffect capture needs a CUDA device; none is available\n"


def test_cli_capture_config_errors_are_one_line(monkeypatch: pytest.MonkeyPatch, capsys, tmp_path: Path) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert _main(["capture", "--config", str(tmp_path / "x.toml")]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "x.toml: config file not found" in err
    assert _main(["capture", "--path", "eager"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--path must be captured-copy or captured-direct" in err


@pytest.mark.parametrize(("stale", "code"), [({"one-way": 5, "two-way": 0, "stream-ordered": 0}, 0),
                                             ({"one-way": 5, "two-way": 2, "stream-ordered": 0}, 1),
                                             ({"one-way": 5, "two-way": 0, "stream-ordered": 3}, 1)])
def test_cli_handshake_check_table_json_and_exit_code(monkeypatch: pytest.MonkeyPatch, capsys, tmp_path: Path,
                                                      stale: dict[str, int], code: int) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(hs, "_run_child", _fake_child(stale))
    out = tmp_path / "hs.json"
    assert _main(["capture", "--handshake-check", "--processes", "2", "--checks", "7", "--json", str(out)]) == code
    text = capsys.readouterr().out
    assert "one-way" in text and "two-way" in text and "10 / 14" in text
    report = hs.HandshakeReport.model_validate_json(out.read_text())
    assert report.passed == (code == 0)
    assert report.command == f"qeffect capture --handshake-check --processes 2 --checks 7 --json {out}"
    assert [s.checks for s in report.protocols] == [14, 14, 14]


def test_dry_capture_runs_under_capture_and_registers_nothing() -> None:
    mgr, be = _manager()
    seen = []

    def fn() -> int:
        seen.append(be.current.name)
        return 7

    assert mgr.dry_capture(fn) == 7
    assert seen == ["graph"] and be.current is be.caller
    assert [e[0] for e in be.log] == ["capture_begin", "capture_end"]
    assert mgr.actions == {} and mgr.stats.graph_count == 0


# ------------------------------------------------------------------------- the collector and captures
def test_the_collector_is_paused_inside_and_restored_after() -> None:
    """`collector_paused`: off inside, back on after (also when the body raises), and left off when it
    was off before."""
    import gc

    from qeffect.graphs.manager import collector_paused

    assert gc.isenabled()
    with collector_paused():
        assert not gc.isenabled()
    assert gc.isenabled()
    with pytest.raises(RuntimeError, match="inside"), collector_paused():
        raise RuntimeError("inside")
    assert gc.isenabled()
    gc.disable()
    try:
        with collector_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_the_real_backend_captures_with_the_collector_paused(monkeypatch: pytest.MonkeyPatch) -> None:
    """`TorchCudaBackend.capture` enters torch's capture with Python's collector off (a collection inside a
    capture can run CUDA-calling finalizers of dead cycles) and leaves it on after (torch's capture faked:
    it records the collector's state when entered and left)."""
    import gc

    from qeffect.graphs.manager import TorchCudaBackend

    seen: list[tuple[str, bool]] = []

    class FakeCapture:
        def __init__(self, graph, pool=None, stream=None) -> None:  # noqa: ANN001 - torch.cuda.graph's arguments
            self.args = (graph, pool, stream)

        def __enter__(self) -> None:
            seen.append(("enter", gc.isenabled()))

        def __exit__(self, *exc: object) -> None:
            seen.append(("exit", gc.isenabled()))

    monkeypatch.setattr(torch.cuda, "graph", FakeCapture)
    be = TorchCudaBackend("cuda:0")  # an indexed device: no CUDA call in the constructor
    with be.capture("graph", "pool", "stream"):
        seen.append(("body", gc.isenabled()))
    assert seen == [("enter", False), ("body", False), ("exit", False)] and gc.isenabled()
