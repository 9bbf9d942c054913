"""verify-state under torchrun (gloo, 2 processes): native eager and qeffect with the same rank mapping,
compared bitwise after every step on every rank; and an injected fault is caught. On CPU the tiny default
with launch.SMALL_VOCAB rows."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from launch import ROOT, SMALL, SMALL_VOCAB, torchrun
from launch import run as _run

pytestmark = pytest.mark.slow
VOCAB = ["--vocab-size", str(SMALL_VOCAB)]


@pytest.mark.parametrize("schedule", ["interleaved", "zbv"])
def test_cli_under_torchrun_is_bitwise_equal(tmp_path: Path, schedule: str) -> None:
    out = tmp_path / "report.json"
    proc = _run(torchrun(2, "-m", "qeffect", "verify-state", "--schedule", schedule, "--steps", "3", *SMALL,
                         "--json", str(out)), tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["kind"] == "verify-state-distributed" and r["world_size"] == 2 and r["passed"]
    by = {c["category"]: c for c in r["categories"]}
    assert set(by) == {"loss", "parameter_gradients", "parameters", "optimizer_state", "fp8_state"} | (
        {"loss_vs_interleaved"} if schedule == "zbv" else set())
    assert all(c["compared"] > 0 and c["mismatches"] == 0 for c in by.values())
    assert by["loss"]["compared"] == 2 * 3  # every rank, every step
    assert "PASS" in proc.stdout


def test_pp4_zbv_under_torchrun_is_bitwise_equal(tmp_path: Path) -> None:
    """PP=4 with ZB-V (4 processes, 2 chunks each: 8 stages), against native eager with the same placement
    and, for the loss, native Interleaved on its own placement."""
    out = tmp_path / "report.json"
    proc = _run(torchrun(4, "-m", "qeffect", "verify-state", "--pp", "4", "--schedule", "zbv", "--steps", "3", *SMALL,
                         "--json", str(out)), tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["passed"] and (r["pp"], r["world_size"], r["chunks_per_rank"], r["schedule"]) == (4, 4, 2, "zbv")
    by = {c["category"]: c for c in r["categories"]}
    assert set(by) == {"loss", "parameter_gradients", "parameters", "optimizer_state", "fp8_state",
                       "loss_vs_interleaved"}
    assert all(c["compared"] > 0 and c["mismatches"] == 0 for c in by.values())
    assert by["loss"]["compared"] == 4 * 3 and "PASS" in proc.stdout


def test_injected_scale_is_caught(tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    proc = _run(torchrun(2, str(ROOT / "tests/dist/run_verify.py"), "--steps", "3", "--inject", "perturb-scale",
                         *VOCAB, "--out", str(out)), tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert not r["passed"]
    by = {c["category"]: c["mismatches"] for c in r["categories"]}
    assert by["fp8_state"] > 0
    d = r["first_divergence"]
    assert d["step"] == 1 and d["rank"] == 0  # stage 0 lives on rank 0; the scale was doubled at step 1


@pytest.mark.parametrize("schedule", ["interleaved", "zbv"])
def test_pp2_dp2_is_bitwise_equal_with_replicas_identical(tmp_path: Path, schedule: str) -> None:
    """Issue 10 run 2 on CPU (gloo, 4 processes): PP=2 x DP=2 against native eager with the same mapping;
    replicas identical to data-parallel rank 0 after every step, one reduction finished per commit."""
    out = tmp_path / "report.json"
    proc = _run(torchrun(4, "-m", "qeffect", "verify-state", "--steps", "3", "--schedule", schedule,
                         "--config", str(_dp2(tmp_path)), *SMALL, "--json", str(out)), tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["passed"] and (r["pp"], r["dp"], r["world_size"]) == (2, 2, 4)
    by = {c["category"]: c for c in r["categories"]}
    assert set(by) == {"loss", "parameter_gradients", "parameters", "optimizer_state", "fp8_state",
                       "replicas", "reductions"} | ({"loss_vs_interleaved"} if schedule == "zbv" else set())
    assert all(c["compared"] > 0 and c["mismatches"] == 0 for c in by.values())
    assert by["reductions"]["compared"] == 4 * 3


def test_zbv_with_nccl_order_fault_is_caught_by_the_interleaved_loss(tmp_path: Path) -> None:
    """The transport as it was, under NCCL's matching: ZB-V's hand-offs get swapped on the native
    reference with the same placement too, so every same-placement category agrees; only the loss against
    native Interleaved (its own placement, an order that happens to match) shows it."""
    out = tmp_path / "report.json"
    proc = _run(torchrun(2, str(ROOT / "tests/dist/run_verify.py"), "--steps", "2", "--schedule", "zbv",
                         "--nccl-order-fault", *VOCAB, "--out", str(out)), tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(out.read_text())
    by = {c["category"]: c["mismatches"] for c in r["categories"]}
    assert not r["passed"] and by["loss_vs_interleaved"] > 0
    assert all(n == 0 for c, n in by.items() if c != "loss_vs_interleaved")


def test_zbv_with_a_microbatch_count_interleaved_refuses_notes_the_skipped_check(tmp_path: Path) -> None:
    """ZB-V runs M=5 at PP=2, Interleaved does not: the cross-placement loss is skipped with a note."""
    cfg = tmp_path / "m5.toml"
    cfg.write_text("[pipeline]\nmicrobatches = 5\n")
    out = tmp_path / "report.json"
    proc = _run(torchrun(2, "-m", "qeffect", "verify-state", "--schedule", "zbv", "--steps", "2",
                         "--config", str(cfg), *SMALL, "--json", str(out)), tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["passed"] and r["microbatches"] == 5
    assert "loss_vs_interleaved" not in {c["category"] for c in r["categories"]}
    assert len(r["notes"]) == 1 and "loss_vs_interleaved not checked" in r["notes"][0]
    assert "note: loss_vs_interleaved not checked" in proc.stdout


def test_desynchronized_replica_is_caught(tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    proc = _run(torchrun(4, str(ROOT / "tests/dist/run_verify.py"), "--steps", "3", "--dp", "2",
                         "--inject", "desync-replica", *VOCAB, "--out", str(out)), tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert not r["passed"]
    by = {c["category"]: c["mismatches"] for c in r["categories"]}
    assert by["replicas"] > 0 and by["parameters"] > 0
    assert r["first_divergence"]["step"] == 1


def _dp2(tmp_path: Path) -> Path:
    p = tmp_path / "dp2.toml"
    p.write_text("[pipeline]\ndp = 2\n")
    return p


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available() or __import__("torch").cuda.device_count() < 2,
                    reason="needs 2 CUDA devices")
@pytest.mark.parametrize("schedule", ["interleaved", "zbv"])
def test_captured_direct_under_torchrun_nccl(tmp_path: Path, schedule: str) -> None:
    """Issue 10, run 1 at test size: PP=2 on two GPUs (NCCL), captured with direct placement."""
    out = tmp_path / "report.json"
    proc = _run(torchrun(2, "-m", "qeffect", "verify-state", "--device", "cuda", "--path", "captured-direct",
                         "--schedule", schedule, "--steps", "3", "--json", str(out)), tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["passed"] and r["device"] == "cuda" and r["graphs_per_rank"] == [24, 24]


def test_pipeline_timing_dry_run_on_cpu(tmp_path: Path) -> None:
    """benchmarks/pipeline_timing.py (issue 10's fixed-work scaling) runs end to end under torchrun."""
    out = tmp_path / "t.json"
    proc = _run(torchrun(2, str(ROOT / "benchmarks/pipeline_timing.py"), "--device", "cpu", "--steps", "2",
                         "--warmup", "1", "--out", str(out)), tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["world_size"] == 2 and r["path"] == "eager" and len(r["step_seconds"]) == 2
    assert r["median_step_seconds"] > 0
