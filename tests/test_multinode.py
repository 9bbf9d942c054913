"""Several nodes on CPU: two torchrun "nodes" of one process each on localhost, joined by the c10d
rendezvous (gloo), as docs/multinode.md launches them: `qeffect train` trains and checkpoints, then
`qeffect verify-state --resume` from that checkpoint passes bitwise; only global rank 0 prints.

c10d assigns global ranks in rendezvous order (`--node-rank` is for static rendezvous only), so either
node may hold global rank 0: exactly one node's output carries the run's lines, the other none of them.
Both nodes get a terminal-like output (`TTY_COMPATIBLE=1`), so a progress bar would show where it printed.
The model is the tiny default with launch.SMALL_VOCAB rows.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from launch import ENV, SMALL, free_port, small_train

pytestmark = pytest.mark.slow
# What qeffect prints (lines of the run, a progress bar's escape codes); torchrun's own notes may appear anywhere
RUN_MARKERS = ("loss", "PASS", "run folder", "checkpoints:", "layout", "\x1b[")


def _nodes(tmp_path: Path, name: str, *args: str) -> list[str]:
    """Launch two single-process torchrun nodes of one job concurrently; their combined outputs."""
    port = free_port()
    env = {**ENV, "TTY_COMPATIBLE": "1", "COLUMNS": "200"}
    procs = [subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(i), "--nproc-per-node",
         "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", name,
         "-m", "qeffect", *args], cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True) for i in (0, 1)]
    outs = [p.communicate(timeout=600)[0] for p in procs]
    for p, out in zip(procs, outs, strict=True):
        assert p.returncode == 0, out[-3000:]
    return outs


def _only_one_prints(outs: list[str], expected: str) -> str:
    talking = [o for o in outs if expected in o]
    assert len(talking) == 1, outs
    quiet = outs[1 - outs.index(talking[0])]
    assert not [m for m in RUN_MARKERS if m in quiet], quiet[-2000:]
    return talking[0]


def test_two_nodes_train_and_verify_state(tmp_path: Path) -> None:
    run = tmp_path / "run"
    outs = _nodes(tmp_path, "train", "train", "--steps", "3", "--checkpoint-every", "3", "--set",
                  "train.eval_every=0", *small_train(tmp_path), "--out", str(run))
    text = _only_one_prints(outs, "run folder")
    assert "median step" in text
    summary = json.loads((run / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 3
    assert (run / "checkpoints" / "latest").read_text().strip() == "step-00000003"

    report = tmp_path / "verify.json"
    outs = _nodes(tmp_path, "verify", "verify-state", "--steps", "2", "--resume", str(run / "checkpoints"),
                  *SMALL, "--json", str(report))
    _only_one_prints(outs, "PASS: bitwise equal")
    r = json.loads(report.read_text())
    assert r["passed"] and r["world_size"] == 2 and r["start_step"] == 3
    assert all(c["compared"] > 0 and c["mismatches"] == 0 for c in r["categories"])
