"""torchrun on CPU (gloo): the distributed executor is bitwise equal to the single-process executor,
and data-parallel replicas stay bitwise identical with every reduction finished before each commit. On CPU
the tiny default with launch.SMALL_VOCAB rows."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import torch

from launch import SMALL_VOCAB, torchrun
from qeffect.config import load_config
from qeffect.runtime.build import build_single_process
from qeffect.verify.state import bitwise_equal, synthetic_batches

WORKER = Path(__file__).parent / "dist" / "run_pipeline.py"
pytestmark = pytest.mark.slow
VOCAB = ["--vocab-size", str(SMALL_VOCAB)]



def _torchrun(nproc: int, out: Path, *args: str) -> None:
    cmd = torchrun(nproc, str(WORKER), "--out", str(out), *args)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


@pytest.mark.parametrize("untagged", [False, True], ids=["tagged", "untagged"])
@pytest.mark.parametrize("schedule", ["interleaved", "zbv"])
def test_pp2_torchrun_equals_single_process(tmp_path: Path, schedule: str, untagged: bool) -> None:
    """`untagged`: NCCL's matching (a pair's messages in posting order, tags ignored). ZB-V's rank 1 wants a
    gradient before an activation rank 0 sent earlier; receiving in its own order swapped them silently."""
    steps = 3
    _torchrun(2, tmp_path, "--schedule", schedule, "--pp", "2", "--steps", str(steps), *VOCAB,
              *(["--untagged"] if untagged else []))
    cfg = load_config().with_overrides(**{"pipeline.schedule": schedule, "model.vocab_size": SMALL_VOCAB})
    # CPU kernels split reductions by thread count (embedding backward, bias sums): the workers run with
    # OMP_NUM_THREADS=1, so the single-process reference must too, or the bits legitimately differ.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        single = build_single_process(cfg, native=False)
        losses = [single.step(synthetic_batches(cfg, step, "cpu")) for step in range(steps)]
    finally:
        torch.set_num_threads(threads)
    expected = {}
    for r in single.ranks:
        for s, chunk in r.chunks.items():
            expected.update({f"s{s}.{n}": p for n, p in chunk.named_parameters()})
            expected.update({f"s{s}.{k}": v for k, v in chunk.fp8_state().items()})
    found: dict[str, torch.Tensor] = {}
    for rank in range(2):
        res = torch.load(tmp_path / f"rank{rank}.pt")
        assert all(bitwise_equal(a, b) for a, b in zip(res["losses"], losses, strict=True))
        assert res["e_W"] == steps
        found.update(res["state"])
    assert sorted(found) == sorted(expected)
    different = [k for k in expected if not bitwise_equal(expected[k].detach(), found[k])]
    assert different == [], different


def test_pp2_dp2_replicas_identical(tmp_path: Path) -> None:
    steps = 3
    _torchrun(4, tmp_path, "--pp", "2", "--dp", "2", "--steps", str(steps), *VOCAB)
    states = [torch.load(tmp_path / f"rank{r}.pt") for r in range(4)]
    for res in states:
        assert res["replicas_equal"] == [True] * steps
        assert res["reductions_done"] == [True] * steps
        assert res["reductions_run"] == steps  # one tracked reduction finished before each commit
    # Replica 1 (ranks 2, 3) saw other data than replica 0, so equality proves the all-reduce happened:
    # without it the replicas would differ. And the run did move away from the initial parameters.
    cfg = load_config().with_overrides(**{"model.vocab_size": SMALL_VOCAB})
    init = build_single_process(cfg, native=False)
    p0 = dict(init.ranks[0].chunks[0].named_parameters())["blocks.0.qkv.weight"]
    assert not bitwise_equal(p0.detach(), states[0]["state"]["s0.blocks.0.qkv.weight"])


def _gpu_dp_replicas(tmp_path: Path, pp: int, dp: int, path: str) -> None:
    """Issue 10 run 2 shape: NCCL, one GPU per process, h2048, captured; replicas equal after every step."""
    steps = 5
    env_root = Path(__file__).resolve().parent.parent
    _torchrun(pp * dp, tmp_path, "--pp", str(pp), "--dp", str(dp), "--steps", str(steps), "--device", "cuda",
              "--path", path, "--config", str(env_root / "examples/configs/h2048.toml"))
    states = [torch.load(tmp_path / f"rank{r}.pt") for r in range(pp * dp)]
    for res in states:
        assert res["replicas_equal"] == [True] * steps
        assert res["reductions_done"] == [True] * steps
        assert res["reductions_run"] == steps


def _gpus() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.gpu
@pytest.mark.skipif(_gpus() < 2, reason="needs 2 CUDA devices")
def test_pp1_dp2_replicas_identical_nccl_captured(tmp_path: Path) -> None:
    _gpu_dp_replicas(tmp_path, 1, 2, "captured-direct")


@pytest.mark.gpu
@pytest.mark.skipif(_gpus() < 4, reason="needs 4 CUDA devices (issue 10 run 2: PP=2 x DP=2)")
def test_pp2_dp2_replicas_identical_nccl_captured(tmp_path: Path) -> None:
    _gpu_dp_replicas(tmp_path, 2, 2, "captured-direct")
