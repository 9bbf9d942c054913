"""`qeffect profile` under torchrun (gloo on CPU, 2 processes): one pipeline rank per process, rank 0
writes one report with memory, resources and trace summaries by rank; the resource analysis over M is
single-process and refused."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from launch import run as _run
from launch import torchrun
from qeffect.profile.distributed import merge_ranks, pipeline_floor
from qeffect.profile.flops import Floor
from qeffect.profile.report import SCHEMA_VERSION, ConfigResult, TraceSummary

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_profile_under_torchrun_writes_one_report_with_every_rank_traced(tmp_path: Path) -> None:
    out = tmp_path / "p.json"
    proc = _run(torchrun(2, "-m", "qeffect", "profile", "--steps", "2", "--warmup", "1", "--trace", "1",
                         "--configs", "native-eager,qeffect-eager,captured-direct,te-graphed,te-graphed-model,te-graphed-mcore,"
                         "megatron-graphs", "--targets", str(ROOT / "examples/targets/h200.toml"), "--json", str(out)),
                tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["schema_version"] == SCHEMA_VERSION and r["world_size"] == 2
    assert r["init_draw_seconds"] > 0  # every process drew the initial weights once, before any timer
    assert r["command"].startswith("torchrun --nproc-per-node 2")
    # the file's targets for a reference report at h64: losses-bitwise alone, not measured on CPU (no capture)
    assert [t["name"] for t in r["targets"]] == ["losses-bitwise"] and r["targets"][0]["met"] is None
    assert r["targets_source"].endswith("h200.toml") and r["rounds"] == 1
    by = {c["name"]: c for c in r["configs"]}
    for name in ("native-eager", "qeffect-eager"):
        assert by[name]["status"] == "ok" and len(by[name]["step_seconds"]) == 2
        assert len(by[name]["losses"]) == 3  # 1 warm-up + 2 timed, the all-reduced loss of the pipeline
    # same model, same data: qeffect eager's losses are native's bit for bit (floats from the same tensor)
    assert by["qeffect-eager"]["losses"] == by["native-eager"]["losses"]
    assert by["captured-direct"]["status"] == "not run" and "CUDA" in by["captured-direct"]["reason"]
    for name in ("te-graphed", "te-graphed-model", "te-graphed-mcore", "megatron-graphs"):
        assert by[name]["status"] == "not run" and "single-process" in by[name]["reason"]
    assert by["qeffect-eager"]["arena_bytes"] > 0
    for name in ("native-eager", "qeffect-eager"):  # the slowest rank's build, by phase
        phases = by[name]["setup_phases"]
        assert list(phases) == ["modules", "values", "ranks"] and sum(phases.values()) <= by[name]["build_seconds"]
    assert "2 x" in proc.stdout and proc.stdout.count("native-eager") >= 1  # rank 0 rendered, once
    assert proc.stdout.count("profile: h64") == 1
    # --trace: every rank traces its half of each configuration that ran
    assert r["trace_steps"] == 1 and "--trace 1" in r["command"]
    for c in (by["native-eager"], by["qeffect-eager"]):
        ranks = c["trace_by_rank"]
        assert len(ranks) == 2 and all(t["steps"] == 1 and t["wall_seconds_per_step"] > 0
                                       and t["cpu_ops_per_step"] > 0 for t in ranks), c["name"]
        assert c["trace"] == ranks[0] and c["trace_error"] is None
        # one pipeline, two halves: the ranks run different ops, so their summaries differ
        assert ranks[0]["cpu_ops_per_step"] != ranks[1]["cpu_ops_per_step"]
        assert f"{c['name']} rank 1: trace: wall" in proc.stdout


@pytest.mark.slow
def test_profile_under_torchrun_refuses_microbatches(tmp_path: Path) -> None:
    proc = _run(torchrun(2, "-m", "qeffect", "profile", "--steps", "1", "--microbatches", "2,4"), tmp_path)
    assert proc.returncode != 0
    assert "--microbatches" in proc.stderr + proc.stdout and "without torchrun" in proc.stderr + proc.stdout


def test_merge_ranks_sums_resources_and_maxes_memory() -> None:
    def res(peak: int, arena: int, growth: float) -> dict:
        return ConfigResult(name="captured-direct", description="d", status="ok", step_seconds=[0.1, 0.2],
                            warmup_seconds=[1.0], first_step_seconds=1.0, build_seconds=2.0 + peak,
                            peak_allocated_bytes=peak, peak_reserved_bytes=peak + 1, graph_count=24,
                            graphs_per_rank=24, arena_bytes=arena, replays_per_step=24.0, handoffs_per_step=48.0,
                            persistent_growth_bytes_per_step=growth, capture_host_seconds=0.1 * peak,
                            setup_phases={"modules": float(peak)}).model_dump()

    m = merge_ranks([res(5, 100, 0.0), res(7, 50, 3.0)])
    assert m.step_seconds == [0.1, 0.2]  # rank 0's (every step ends with a barrier)
    assert (m.peak_allocated_bytes, m.peak_reserved_bytes) == (7, 8)
    assert m.peak_allocated_bytes_by_rank == [5, 7]
    assert m.persistent_growth_bytes_per_step == 3.0 and m.persistent_growth_bytes_per_step_by_rank == [0.0, 3.0]
    assert (m.graph_count, m.graphs_per_rank, m.arena_bytes) == (48, 24, 150)
    assert (m.replays_per_step, m.handoffs_per_step) == (48.0, 96.0)
    assert m.build_seconds == 9.0 and m.setup_seconds == 10.0
    assert m.setup_phases == {"modules": 7.0}  # the phases of the rank whose build took 9.0 s
    assert m.trace is None and m.trace_by_rank is None and m.trace_error is None


def test_merge_ranks_keeps_every_rank_trace_and_names_failed_ones() -> None:
    def res(trace: TraceSummary | None, error: str | None) -> dict:
        return ConfigResult(name="captured-direct", description="d", status="ok", step_seconds=[0.1],
                            trace=trace, trace_error=error).model_dump()

    def summary(wall: float) -> TraceSummary:
        return TraceSummary(steps=1, wall_seconds_per_step=wall, cpu_op_seconds_per_step=wall / 2,
                            cpu_ops_per_step=10, top_kernels=[], categories={"gemm": wall / 4})

    m = merge_ranks([res(summary(0.2), None), res(summary(0.3), None), res(None, "RuntimeError: no CUPTI")])
    assert m.trace == summary(0.2)
    assert m.trace_by_rank == [summary(0.2), summary(0.3), None]
    assert m.trace_error == "rank 2: RuntimeError: no CUPTI"


def test_pipeline_floor_splits_over_stages() -> None:
    f = pipeline_floor(Floor(seconds=8.0, seconds_layers_only=6.0, effective_tflops=1.0, peak_tflops=2.0), 4)
    assert (f.seconds, f.seconds_layers_only, f.effective_tflops) == (2.0, 1.5, 1.0)
    assert f.limit_seconds is None  # an older floor: nothing else to split
    g = pipeline_floor(Floor(seconds=8.0, seconds_layers_only=6.0, effective_tflops=1.0, peak_tflops=2.0,
                             peak_rate_seconds=4.0, optimizer_seconds=2.0, limit_seconds=6.0,
                             limit_seconds_layers_only=3.0, peak_rate_tflops=9.0), 2)
    assert (g.peak_rate_seconds, g.optimizer_seconds, g.limit_seconds, g.limit_seconds_layers_only) == (2.0, 1.0, 3.0, 1.5)
    assert g.peak_rate_tflops == 9.0  # a rate, not a time: unchanged
