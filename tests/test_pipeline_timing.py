"""The per-rank step breakdown (`runtime.step_timing`) and benchmarks/pipeline_timing.py's `--breakdown`,
`--one-gpu` and `--compare`: the lap arithmetic against a fake clock, then a CPU torchrun run (gloo)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from launch import ENV, SMALL, torchrun
from launch import run as _run
from qeffect.runtime.step_timing import (
    CATEGORIES,
    StepLaps,
    TimedTransport,
    breakdown_step,
    summarize,
    within_tolerance,
)

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "pipeline_timing.py"


class FakeClock:
    """Time moves only when a test says so; every read is logged with the syncs before it."""

    def __init__(self) -> None:
        self.now = 0.0
        self.syncs = 0
        self.reads: list[int] = []  # syncs seen at each read

    def __call__(self) -> float:
        self.reads.append(self.syncs)
        return self.now

    def sync(self) -> None:
        self.syncs += 1


def test_laps_charge_the_time_since_the_last_lap_after_syncing() -> None:
    c = FakeClock()
    laps = StepLaps(c.sync, c)
    laps.start()
    c.now = 0.5
    laps.lap("compute")
    c.now = 0.75
    laps.lap("recv_wait")
    c.now = 1.0
    laps.lap("compute")
    out = laps.finish()
    assert out["compute"] == 0.75 and out["recv_wait"] == 0.25 and out["send"] == 0.0
    assert out["laps_seconds"] == 1.0 == sum(out[k] for k in CATEGORIES)
    assert c.reads == [0, 1, 2, 3]  # each lap's clock read comes after its sync; start() does not sync
    laps.start()  # a new step starts from zero
    c.now = 3.0
    laps.lap("barrier")
    assert laps.finish() == {**dict.fromkeys(CATEGORIES, 0.0), "barrier": 2.0, "laps_seconds": 2.0}


def test_laps_refuse_unknown_categories_and_use_before_start() -> None:
    c = FakeClock()
    laps = StepLaps(c.sync, c)
    with pytest.raises(RuntimeError, match="before start"):
        laps.lap("compute")
    with pytest.raises(RuntimeError, match="before start"):
        laps.finish()
    laps.start()
    with pytest.raises(ValueError, match="unknown step category 'bubble'"):
        laps.lap("bubble")


class FakeTransport:
    def __init__(self, clock: FakeClock) -> None:
        self.clock, self.calls = clock, []

    def put(self, kind: str, stage: int, m: int, tensor: Any) -> None:
        self.calls.append(("put", kind, stage, m))
        self.clock.now += 0.125  # posting the send

    def get(self, kind: str, stage: int, m: int) -> Any:
        self.calls.append(("get", kind, stage, m))
        self.clock.now += 2.0  # waiting for the peer
        return "tensor"

    def finish(self) -> None:
        self.calls.append(("finish",))
        self.clock.now += 0.25


class FakePipeline:
    """An executor with the `TimedPipeline` surface: one action receives, computes for 1 s and sends."""

    def __init__(self, clock: FakeClock, *, fail: bool = False) -> None:
        self.clock, self.fail = clock, fail
        self.transport = FakeTransport(clock)
        self.step_laps: StepLaps | None = None
        self.seen: list[Any] = []

    def run_actions(self, batches: Any, observer: Any = None) -> float:
        self.seen.append((type(self.transport).__name__, self.step_laps))
        assert self.transport.get("act", 0, 0) == "tensor"
        self.clock.now += 1.0
        if self.fail:
            raise RuntimeError("action failed")
        self.transport.put("act", 1, 0, None)
        observer("F", None)
        self.transport.finish()
        self.clock.now += 0.5  # the loss all-reduce
        return 2.5

    def commit(self) -> None:
        self.clock.now += 0.0625  # reduction (a replica's hook laps here)
        self.step_laps.lap("reduction")
        self.clock.now += 0.375


def test_breakdown_step_charges_each_region_and_restores_the_transport() -> None:
    c = FakeClock()
    pipe = FakePipeline(c)
    inner = pipe.transport

    def sync_all() -> None:
        c.now += 0.03125  # the step-end wait for the slowest rank (and the start's, before the timer)

    out = breakdown_step(pipe, [], StepLaps(c.sync, c), sync_all, clock=c)
    assert pipe.seen == [("TimedTransport", pipe.seen[0][1])] and pipe.seen[0][1] is not None
    assert pipe.transport is inner and pipe.step_laps is None
    assert inner.calls == [("get", "act", 0, 0), ("put", "act", 1, 0), ("finish",)]
    assert {k: out[k] for k in CATEGORIES} == {"compute": 1.0, "recv_wait": 2.0, "send": 0.375, "loss_reduce": 0.5,
                                               "reduction": 0.0625, "optimizer": 0.375, "barrier": 0.03125}
    assert out["wall_seconds"] == 4.34375 and out["unattributed_seconds"] == 0.0 and out["loss"] == 2.5
    assert within_tolerance(out)
    failing = FakePipeline(c, fail=True)
    inner = failing.transport
    with pytest.raises(RuntimeError, match="action failed"):
        breakdown_step(failing, [], StepLaps(c.sync, c), sync_all, clock=c)
    assert failing.transport is inner and failing.step_laps is None


def test_timed_transport_delegates_and_charges_compute_before_each_call() -> None:
    c = FakeClock()
    laps = StepLaps(c.sync, c)
    t = TimedTransport(FakeTransport(c), laps)
    laps.start()
    c.now = 0.5  # compute before the receive
    assert t.get("grad", 3, 1) == "tensor"
    out = laps.finish()
    assert out["compute"] == 0.5 and out["recv_wait"] == 2.0 and t.inner.calls == [("get", "grad", 3, 1)]


def test_summarize_takes_medians_and_idle_and_tolerance_is_stated() -> None:
    def step(compute: float, recv: float, barrier: float) -> dict[str, float]:
        s = {**dict.fromkeys(CATEGORIES, 0.0), "compute": compute, "recv_wait": recv, "barrier": barrier}
        s["wall_seconds"] = compute + recv + barrier
        s["unattributed_seconds"] = 0.0
        return s

    m = summarize([step(1.0, 4.0, 0.0), step(3.0, 0.0, 1.0), step(2.0, 2.0, 8.0)])
    assert m["compute"] == 2.0 and m["recv_wait"] == 2.0 and m["barrier"] == 1.0
    assert m["idle"] == 4.0 and m["wall"] == 5.0  # medians of the sums, not sums of the medians
    with pytest.raises(ValueError, match="no breakdown steps"):
        summarize([])
    s = step(1.0, 0.0, 0.0)
    assert within_tolerance({**s, "unattributed_seconds": 0.0549}) and not within_tolerance(
        {**s, "unattributed_seconds": 0.0551})
    assert not within_tolerance({**s, "unattributed_seconds": -0.056})


def _script() -> Any:
    spec = importlib.util.spec_from_file_location("pipeline_timing", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_compare_prints_breakdowns_and_one_gpu_ratios(tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    def report(world: int, median: float, **extra: Any) -> Path:
        p = tmp_path / f"w{world}.json"
        p.write_text(json.dumps({"layers": 4, "world_size": world, "median_step_seconds": median, **extra}))
        return p

    row = {"rank": 1, "pp_rank": 1, "dp_rank": 0, "median": {"compute": 0.002, "idle": 0.001}}
    a = report(2, 0.5, one_gpu_step_seconds=1.0, multi_over_one_gpu=0.5,
               breakdown={"overhead": 1.25, "by_rank": [row]})
    b = report(4, 0.3125)  # exact binary fractions: the ratios below are the nearest floats
    assert _script().compare(str(a), str(b)) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["speedup"] == 1.6 and out["strong_scaling_efficiency"] == 0.8
    assert out["a_one_gpu_ms"] == 1000.0 and out["a_multi_over_one_gpu"] == 0.5 and out["a_breakdown_overhead"] == 1.25
    assert out["a_breakdown_by_rank"] == [{"rank": 1, "pp_rank": 1, "dp_rank": 0, "compute_ms": 2.0, "idle_ms": 1.0}]
    assert not any(k.startswith("b_") and k not in ("b", "b_median_ms") for k in out)


def test_one_gpu_refuses_data_parallel_before_starting() -> None:
    proc = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--one-gpu", "--set", "pipeline.dp=2"],
                          env=ENV, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--one-gpu: pipeline.dp = 2; one process runs one replica" in proc.stderr


@pytest.mark.slow
def test_breakdown_by_rank_and_one_process_under_torchrun(tmp_path: Path) -> None:
    """PP=2 (gloo): every rank's breakdown sums to its step; the one-process run is the same work."""
    out = tmp_path / "t.json"
    proc = _run(torchrun(2, str(SCRIPT), "--device", "cpu", "--steps", "2", "--warmup", "1", "--breakdown", "2",
                         "--one-gpu", *SMALL, "--out", str(out)), tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(out.read_text())
    b = r["breakdown"]
    assert b["steps"] == 2 and b["categories"] == list(CATEGORIES) and "5 ms + 5%" in b["tolerance"]
    assert [x["rank"] for x in b["by_rank"]] == [0, 1] and [x["pp_rank"] for x in b["by_rank"]] == [0, 1]
    for x in b["by_rank"]:
        assert len(x["steps"]) == 2
        for s in x["steps"]:
            assert within_tolerance(s), s
            assert all(s[k] >= 0 for k in CATEGORIES) and s["compute"] > 0 and s["optimizer"] > 0
            assert s["recv_wait"] > 0 and s["send"] > 0  # each rank receives and sends (2 chunks per rank)
            assert s["reduction"] == 0.0  # no replicas
        assert set(x["median"]) == {*CATEGORIES, "idle", "wall"}
    assert b["overhead"] == b["median_wall_seconds"] / r["median_step_seconds"]
    # the same config in one process, on this machine: the same losses bit for bit, and the ratio
    assert r["one_gpu_same_losses"] is True and len(r["one_gpu"]["step_seconds"]) == 2
    assert r["multi_over_one_gpu"] == r["median_step_seconds"] / r["one_gpu_step_seconds"]
    assert "multi / one" in proc.stdout and "rank 1: compute" in proc.stdout
    assert "median_step_seconds" in r and len(r["step_seconds"]) == 2  # the unperturbed timing, apart


@pytest.mark.slow
def test_breakdown_charges_the_data_parallel_reduction(tmp_path: Path) -> None:
    """PP=1 x DP=2 (gloo): the replicas' gradient all-reduce is its own category."""
    out = tmp_path / "d.json"
    proc = _run(torchrun(2, str(SCRIPT), "--device", "cpu", "--steps", "1", "--warmup", "1", "--breakdown", "1",
                         "--set", "pipeline.pp=1", "--set", "pipeline.dp=2", *SMALL, "--out", str(out)), tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert [x["dp_rank"] for x in r["breakdown"]["by_rank"]] == [0, 1] and "one_gpu_step_seconds" not in r
    for x in r["breakdown"]["by_rank"]:
        (s,) = x["steps"]
        assert within_tolerance(s) and s["reduction"] > 0 and s["optimizer"] > 0, s


@pytest.mark.gpu
@pytest.mark.slow
@pytest.mark.skipif(not __import__("torch").cuda.is_available() or __import__("torch").cuda.device_count() < 2,
                    reason="needs two CUDA devices (NCCL)")
def test_breakdown_and_one_gpu_captured_under_nccl(tmp_path: Path) -> None:
    """Two GPUs, captured-direct: the synchronised laps add up on the device too (no deadlock on the NCCL
    sends), and one GPU running both pipeline ranks computes the same losses."""
    out = tmp_path / "g.json"
    proc = _run(torchrun(2, str(SCRIPT), "--device", "cuda", "--path", "captured-direct", "--steps", "3",
                         "--warmup", "2", "--breakdown", "3", "--one-gpu", "--out", str(out)), tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["path"] == "captured-direct" and r["one_gpu_same_losses"] is True and r["multi_over_one_gpu"] > 0
    for x in r["breakdown"]["by_rank"]:
        for s in x["steps"]:
            assert within_tolerance(s) and s["compute"] > 0 and s["recv_wait"] > 0, s
