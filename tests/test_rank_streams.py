"""Which one-process pipelines put each rank on its own stream, and the transport without events (CPU)."""

from __future__ import annotations

import pytest
import torch

from qeffect.config import load_config
from qeffect.runtime.build import build_single_process, rank_streams
from qeffect.runtime.transport import LocalTransport


def test_rank_streams_are_for_pipelines_without_offload() -> None:
    """Both backends (Transformer Engine's captures get a workspace per rank), not with offload, not when
    switched off."""
    cfg = load_config()
    assert cfg.fp8.backend == "reference" and rank_streams(cfg)
    assert rank_streams(cfg.with_overrides(**{"fp8.backend": "te"}))
    assert not rank_streams(cfg.with_overrides(**{"offload.mode": "release"}))
    assert not rank_streams(cfg.with_overrides(**{"offload.mode": "resident"}))
    assert not rank_streams(cfg.with_overrides(**{"runtime.rank_streams": False}))


def test_pipelines_without_graphs_keep_one_stream() -> None:
    """Eager qeffect and native eager have no rank streams (and a CPU cannot have any)."""
    cfg = load_config()
    for native in (True, False):
        assert build_single_process(cfg, native=native, device="cpu").rank_streams is None


def test_the_transport_without_events_hands_over_once() -> None:
    t = LocalTransport()
    x = torch.ones(3)
    t.put("act", 0, 1, x)
    with pytest.raises(RuntimeError, match="published twice"):
        t.put("act", 0, 1, x)
    assert t.get("act", 0, 1) is x and t.empty()
    with pytest.raises(RuntimeError, match="not available yet"):
        t.get("act", 0, 1)


# ------------------------------------------------------------------------- host cost: the stream cut
def test_rank_runs_group_consecutive_actions_of_one_rank() -> None:
    from qeffect.runtime.single import rank_runs

    assert rank_runs([]) == []
    assert rank_runs([(0, "a"), (0, "b"), (1, "c"), (0, "d"), (0, "e"), (1, "f")]) == [
        (0, ["a", "b"]), (1, ["c"]), (0, ["d", "e"]), (1, ["f"])]


def test_a_step_switches_streams_only_where_the_rank_changes(monkeypatch) -> None:
    """Every action runs on its own rank's stream, in the global order; the step sets a stream once per run of
    one rank's actions (straight from one rank's to the next), then the caller's again, then the step loss's
    on the last rank's and back: not once per action, and never back to the caller between two runs."""
    from qeffect.runtime.single import rank_runs
    from qeffect.verify.state import synthetic_batches

    class FakeStream:
        device = torch.device("cpu")

        def __init__(self, name: str) -> None:
            self.name = name

        def wait_stream(self, other: object) -> None:
            pass

    cfg = load_config()
    pipe = build_single_process(cfg, native=False, device="cpu")
    caller = FakeStream("caller")
    pipe.rank_streams = [FakeStream(f"rank{k}") for k in range(len(pipe.ranks))]
    current = [caller]
    set_to: list[str] = []

    def set_stream(stream: FakeStream) -> None:
        set_to.append(stream.name)
        current[0] = stream

    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current[0])
    monkeypatch.setattr(torch.cuda, "set_stream", set_stream)
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, stream: None)
    monkeypatch.setattr(pipe, "_step_transport", LocalTransport)  # no CUDA events on a CPU
    ran: list[tuple[int, object]] = []
    for k, r in enumerate(pipe.ranks):
        def run(action, batches, transport, _run=r.run, k=k):
            assert current[0] is pipe.rank_streams[k]  # on its own rank's stream
            ran.append((k, action))
            _run(action, batches, transport)
        monkeypatch.setattr(r, "run", run)
    pipe.run_actions(synthetic_batches(cfg, 0, "cpu"))
    runs = rank_runs(pipe.order)
    last = pipe.schedule.stage_to_rank[pipe.schedule.num_stages - 1]
    assert ran == list(pipe.order)
    assert set_to == [f"rank{rank}" for rank, _ in runs] + ["caller", f"rank{last}", "caller"]
    assert current[0] is caller
    assert len(runs) < len(pipe.order)  # the cut is real on this schedule

    def fail(*args: object) -> None:
        raise RuntimeError("refused")

    monkeypatch.setattr(pipe.ranks[1], "run", fail)
    with pytest.raises(RuntimeError, match="refused"):
        pipe.run_actions(synthetic_batches(cfg, 1, "cpu"))
    assert current[0] is caller  # an action that raises leaves the caller's stream current


def test_the_transport_and_its_events_live_across_steps() -> None:
    """One transport per pipeline (its hand-off events reused per slot); a fresh one after a step that left
    hand-offs behind (an aborted step) or when the settings change."""
    pipe = build_single_process(load_config(), native=False, device="cpu")
    t = pipe._step_transport()
    assert pipe._step_transport() is t and not t.events
    t.put("act", 0, 0, torch.ones(1))  # an aborted step's leftover
    fresh = pipe._step_transport()
    assert fresh is not t and fresh.empty()
    pipe.checked_completion = True
    assert pipe._step_transport() is not fresh


def test_hand_off_events_are_made_once_per_slot_and_still_order_every_step() -> None:
    """Two steps of the same hand-off through one transport: one event for the slot, recorded and waited on in
    each step, and the consumer sees each step's write in every interleaving (a wait snapshots its record)."""
    from qeffect.offload.fake import FakeDevice

    for checked in (False, True):
        for seed in range(30):
            dev = FakeDevice(seed, progress=1)
            made: list[str] = []
            new_event = dev.new_event
            dev.new_event = lambda name, timing=False, made=made, new=new_event: made.append(name) or new(name, timing)
            transport = LocalTransport(events=True, ops=dev, checked=checked)
            prod, cons = dev.new_stream("rank0"), dev.new_stream("rank1")
            x = torch.zeros(4)
            for step in (1.0, 2.0):
                seen = torch.full((4,), -1.0)
                with dev.use(prod):
                    for _ in range(3):
                        dev.launch(prod, lambda: None, "other work")
                    dev.launch(prod, lambda v=step, x=x: x.fill_(v), "write x")
                    transport.put("act", 0, 0, x)
                with dev.use(cons):
                    got = transport.get("act", 0, 0)
                    dev.launch(cons, lambda got=got, seen=seen: seen.copy_(got), "read x")
                dev.synchronize()
                assert float(seen[0]) == step, (checked, seed, step)
            assert made == ["transport"], (checked, seed)
            assert [t[0] for t in dev.trace if t[0] in ("record", "wait")] == ["record", "wait"] * 2


def test_the_rank_streams_ab_benchmark_interleaves_both_variants(tmp_path, capsys) -> None:
    """A CPU dry run of benchmarks/rank_streams_ab.py (no rank streams on a CPU: both variants run eager): the
    JSON has both variants over every round, the median of per-round ratios and equal losses."""
    import importlib.util
    import json
    import statistics
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    spec = importlib.util.spec_from_file_location("rank_streams_ab", root / "benchmarks" / "rank_streams_ab.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    toml = root / "src" / "qeffect" / "configs" / "tiny.toml"
    rc = bench.main(["--tomls", str(toml), "--backend", "reference", "--device", "cpu", "--path", "eager",
                     "--steps", "2", "--warmup", "1", "--rounds", "2", "--trace", "0", "--out", str(tmp_path)])
    assert rc == 0
    report = json.loads((tmp_path / "rank-streams-ab-tiny-reference-cpu.json").read_text())
    streams, one = report["results"]
    assert (streams["name"], one["name"]) == ("rank-streams", "one-stream") and report["losses_equal"] is True
    assert len(streams["round_medians"]) == len(one["round_medians"]) == 2 and len(streams["step_seconds"]) == 4
    ratios = [b / a for a, b in zip(streams["round_medians"], one["round_medians"], strict=True)]
    assert report["off_over_on_by_round"] == ratios and report["field"] == "runtime.rank_streams"
    assert report["off_over_on"] == statistics.median(ratios)
    assert "one-stream / rank-streams" in capsys.readouterr().out


def test_the_loss_seed_is_made_once_per_dtype_and_device_and_keeps_its_value() -> None:
    """The last stage's incoming gradient (1/M) is one tensor per dtype and device: the same object each
    microbatch and step, with the value a fresh one would have, and a step still gives native eager's bits."""
    from qeffect.verify.state import synthetic_batches

    cfg = load_config()
    pipe = build_single_process(cfg, native=False, device="cpu")
    r = pipe.ranks[pipe.schedule.stage_to_rank[pipe.schedule.num_stages - 1]]
    like = torch.zeros((), dtype=torch.float32)
    seed = r.loss_seed(like)
    assert r.loss_seed(like) is seed and torch.equal(seed, torch.full((), 1.0 / cfg.pipeline.microbatches))
    half = r.loss_seed(like.to(torch.bfloat16))
    assert half is not seed and half.dtype == torch.bfloat16 and r.loss_seed(like.to(torch.bfloat16)) is half
    native = build_single_process(cfg, native=True, device="cpu")
    for step in range(2):
        batches = synthetic_batches(cfg, step, "cpu")
        assert torch.equal(pipe.step(batches), native.step(batches))  # actions and commit
    assert r.loss_seed(like) is seed and float(seed) == 1.0 / cfg.pipeline.microbatches


def test_the_host_profile_benchmark_writes_both_variants_and_their_profiles(tmp_path, monkeypatch) -> None:
    """A CPU dry run of benchmarks/host_profile.py: per variant the unprofiled host time of every step,
    the top functions per step, and the whole profile beside the report (readable by `pstats`)."""
    import json
    import pstats

    from script_modules import ROOT, script_module

    with script_module("benchmarks/host_profile.py") as bench:  # it imports rank_streams_ab.py beside it
        monkeypatch.setattr(bench, "git_revision", lambda: "abc1234")
        toml = ROOT / "src" / "qeffect" / "configs" / "tiny.toml"
        assert bench.main(["--tomls", str(toml), "--backend", "reference", "--device", "cpu", "--path", "eager",
                           "--steps", "2", "--warmup", "1", "--top", "5", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "host-profile-tiny-reference-abc1234-cpu.json").read_text())
    assert report["git_revision"] == "abc1234" and set(report["variants"]) == {"rank-streams", "one-stream"}
    for name, v in report["variants"].items():
        assert len(v["host_seconds"]) == len(v["step_seconds"]) == 2 and len(v["top"]) == 5
        assert v["top"][0]["own_us_per_step"] >= v["top"][-1]["own_us_per_step"] > 0
        pstats.Stats(str(tmp_path / f"host-profile-tiny-{name}.prof"))  # a whole profile, loadable


def test_the_host_overhead_benchmark_times_the_captured_runtime_and_its_phases(tmp_path) -> None:
    """benchmarks/host_overhead.py on the tiny config: the captured-direct pipeline on a backend that replays
    nothing; its report has every timed step and, with --phases, a graph launch per action and one commit a
    step over the phased steps."""
    import importlib.util
    import json
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    spec = importlib.util.spec_from_file_location("host_overhead", root / "benchmarks" / "host_overhead.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    out = tmp_path / "host.json"
    assert bench.main(["--steps", "3", "--warmup", "1", "--phases", "2", "--out", str(out)]) == 0
    report = json.loads(out.read_text())
    assert len(report["step_seconds"]) == 3 and report["median_step_seconds"] > 0
    phases = report["host_phases"]
    assert phases["calls_per_step"]["graph launches"] == report["actions_per_step"]
    assert phases["calls_per_step"]["optimizer"] == 1
    assert all(len(v) == 2 and min(v) >= 0 for v in phases["seconds"].values()) and "runtime" in phases["seconds"]
    # --step-graph: from the fourth step on, a step graph's replay: one launch, no input copies, dry bookkeeping
    from qeffect.runtime import single

    recorder = single.record_step
    assert bench.main(["--steps", "3", "--warmup", "3", "--phases", "2", "--step-graph", "--out", str(out)]) == 0
    assert single.record_step is recorder  # the library's recording is back
    report = json.loads(out.read_text())
    calls = report["host_phases"]["calls_per_step"]
    assert report["step_graph"] and calls["graph launches"] == 1 and calls["input copies"] == 0


def test_the_stream_switch_sets_a_stream_only_where_it_changes_and_restores_it(monkeypatch) -> None:
    """Inside a step the pipeline knows the current stream: one query at `begin`, a `set_stream` per change
    (none for a run on the stream already current), the previous stream back on exit (also on an error),
    and the transport's hand-offs read the known stream; outside a step it is torch's context."""
    from qeffect.runtime.single import StreamSwitch, _SwitchEvents

    caller, a, b = object(), object(), object()
    calls: list[object] = []
    queries: list[object] = []
    monkeypatch.setattr(torch.cuda, "set_stream", calls.append)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: queries.append(device) or caller)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: ("torch", s))
    sw = StreamSwitch()
    events = _SwitchEvents(sw)
    assert sw.use(a) == ("torch", a)  # outside a step
    assert sw.begin("dev") is caller and queries == ["dev"]
    with sw.use(a):
        assert sw.current is a and events.current_stream("dev") is a
        with sw.use(a):  # already current: nothing to set
            pass
        assert calls == [a]
    assert sw.current is caller and calls == [a, caller]
    with pytest.raises(ValueError), sw.use(b):
        raise ValueError
    assert sw.current is caller and calls == [a, caller, b, caller]
    assert events.current_stream("dev") is caller and queries == ["dev"]  # no query inside the step
    sw.end()
    assert sw.current is None and events.current_stream("dev") is caller and queries == ["dev", "dev"]


def test_a_timed_step_splits_the_hosts_time_into_switches_hand_offs_and_the_commit(monkeypatch) -> None:
    """With the host's phases on, a step on rank streams adds its fork and join, its stream switches and its
    hand-off events to "streams and hand-offs" and its commit to "optimizer" (once per step); off, nothing is
    read."""
    import time

    from qeffect.graphs.stats import COPY, HANDOFF, LAUNCH, OPTIMIZER
    from qeffect.runtime.single import rank_runs
    from qeffect.verify.state import synthetic_batches

    class FakeStream:
        device = torch.device("cpu")

        def wait_stream(self, other: object) -> None:
            pass

    records: list[int] = []

    class Ops:  # the transport's event calls; a record is slowed so that it shows
        def current_stream(self, device: torch.device) -> str:
            return "stream"

        def new_event(self, name: str) -> object:
            return object()

        def record(self, event: object, stream: object) -> None:
            records.append(1)
            time.sleep(0.0005)

        def wait(self, stream: object, event: object) -> None:
            pass

        def record_stream(self, tensor: torch.Tensor, stream: object) -> None:
            pass

    cfg = load_config()
    pipe = build_single_process(cfg, native=False, device="cpu")
    caller = FakeStream()
    pipe.rank_streams = [FakeStream() for _ in pipe.ranks]
    current = [caller]
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: current[0])
    monkeypatch.setattr(torch.cuda, "set_stream", lambda s: current.__setitem__(0, s))
    monkeypatch.setattr(torch.Tensor, "record_stream", lambda self, stream: None)
    monkeypatch.setattr(pipe, "_step_transport", lambda: LocalTransport(events=True, ops=Ops(), host=pipe.host))
    pipe.step(synthetic_batches(cfg, 0, "cpu"))
    assert not pipe.host.on and not any(pipe.host.calls.values())  # off: nothing read
    clock = pipe.time_host_phases()
    assert clock is pipe.host and clock.on
    records.clear()
    steps = 2
    for i in range(steps):
        pipe.step(synthetic_batches(cfg, 1 + i, "cpu"))
    hand_offs = len(records) // steps
    calls = clock.calls
    assert hand_offs > 0 and calls[OPTIMIZER] == steps and calls[LAUNCH] == calls[COPY] == 0  # eager: no graphs
    # per step: the fork and the join, one switch per run of one rank's actions, a put and a get per hand-off
    assert calls[HANDOFF] == steps * (2 + len(rank_runs(pipe.order)) + 2 * hand_offs)
    assert clock.seconds[HANDOFF] >= steps * hand_offs * 0.0005 and clock.seconds[OPTIMIZER] > 0


def _graph_launch_bench():
    import importlib.util
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    spec = importlib.util.spec_from_file_location("graph_launch", root / "benchmarks" / "graph_launch.py")
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench


def test_the_graph_launch_benchmark_fits_a_line_and_needs_cuda(capsys, monkeypatch) -> None:
    bench = _graph_launch_bench()
    fit = bench.fit_line([(1, 12.0), (4, 15.0), (16, 27.0)])
    assert fit["slope"] == pytest.approx(1.0) and fit["intercept"] == pytest.approx(11.0)
    assert bench.fit_line([(8, 1.0), (8, 2.0)]) is None  # one kernel count: no slope
    calls = iter([0.0, 0.5, 10.0, 10.2, 20.0, 20.3])  # three batches of 10 calls: 50, 20 and 30 us each
    monkeypatch.setattr(bench.time, "perf_counter", lambda: next(calls))
    assert bench.host_us_per_replay(lambda: None, lambda: None, 10, 3) == pytest.approx(3e4)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert bench.main([]) == 2 and "needs a CUDA device" in capsys.readouterr().err


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_graph_launch_benchmark_counts_each_graphs_kernels(tmp_path) -> None:
    import json

    bench = _graph_launch_bench()
    assert bench.main(["--config", "src/qeffect/configs/tiny.toml", "--backend", "reference", "--kernels", "1,4",
                       "--nested", "3,2", "--replays", "2", "--repeats", "1", "--out", str(tmp_path)]) == 0
    (path,) = tmp_path.glob("graph-launch-tiny-reference-*.json")
    report = json.loads(path.read_text())
    assert [(r["kernels"], r["device_ops"]) for r in report["synthetic"] if not r["fork"]] == [(1, 1), (4, 4)]
    assert all(r["device_ops"] > 0 and r["host_us_per_replay"] > 0 for r in report["graphs"])
    assert report["replays_per_step"] == 3 * 4 * 4  # tiny: 3 actions x 4 stages x 4 microbatches
    nest = report["nested"]
    assert nest["graphs"] == 3 and nest["kernels"] == 2
    for way in ("torch_replay", "driver_launch", "child_nodes"):
        r = nest[way]
        assert r["one_by_one_host_us"] > 0
        if r["supported"]:  # the outer graph replays every inner one: each kernel adds 1, once
            assert r["same_values"] and r["added_per_step"] == 3 * 2 and r["nested_host_us"] > 0
        else:
            assert r["error"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_step_recorded_as_one_graph_of_child_nodes_keeps_the_bits(tmp_path) -> None:
    """`benchmarks/step_graph_probe.py`: a step whose actions run as one outer graph (each action graph a
    child-graph node) leaves the same losses and parameters as ordinary steps."""
    import json

    from script_modules import script_module

    with script_module("benchmarks/step_graph_probe.py") as probe:
        rc = probe.main(["--config", "src/qeffect/configs/tiny.toml", "--backend", "reference", "--steps", "3",
                         "--record-step", "1", "--reps", "2", "--out", str(tmp_path)])
    (path,) = tmp_path.glob("step-graph-probe-tiny-reference-*.json")
    report = json.loads(path.read_text())
    assert report["error"] is None and report["bitwise"], report
    assert rc == 0 and report["as_one_graph"]["host_median_s"] > 0


def test_the_step_graph_ab_builds_each_variant_with_its_switch(monkeypatch) -> None:
    """The profile's runner takes runtime.step_graph from its spec, so the A/B must put the variant's switch
    there too (an A/B that left it in the config alone timed launched steps twice)."""
    import dataclasses

    from script_modules import ROOT, script_module

    seen: list[tuple[bool, bool]] = []
    with script_module("benchmarks/rank_streams_ab.py") as bench:
        real = bench.PipelineRunner

        def runner(c, device, spec):  # records the switch, then runs eager (a CPU has no step graph)
            seen.append((c.runtime.step_graph, spec.step_graph))
            return real(c.with_overrides(**{"runtime.step_graph": False}), device,
                        dataclasses.replace(spec, step_graph=False))

        monkeypatch.setattr(bench, "PipelineRunner", runner)
        cfg = load_config(ROOT / "src" / "qeffect" / "configs" / "tiny.toml").with_overrides(
            **{"fp8.backend": "reference", "train.device": "cpu"})
        report = bench.ab(cfg, field="runtime.step_graph", path="eager", steps=1, warmup=1, rounds=2,
                          say=lambda *_: None)
    assert seen == [(True, True), (False, False)] * 2
    assert [r["name"] for r in report["results"]] == ["step-graph", "launched"]
