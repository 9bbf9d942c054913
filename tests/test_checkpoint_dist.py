"""Checkpoints under torchrun with data parallelism (PP=1 x DP=2, gloo): gathered quiescence, every tensor
saved once by its global name (replicas agree after the commit), bitwise resume. The worker is
tests/dist/run_resume.py."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from launch import torchrun
from qeffect.checkpoint import inspect_checkpoint, open_checkpoint

WORKER = Path(__file__).parent / "dist" / "run_resume.py"
pytestmark = pytest.mark.slow



def test_dp2_save_refusal_and_resume(tmp_path: Path) -> None:
    cmd = [*torchrun(2, str(WORKER)), "--out", str(tmp_path), "--pp", "1", "--dp", "2",
           "--steps", "3", "--save-at", "1"]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for r in (0, 1):
        res = json.loads((tmp_path / f"rank{r}.json").read_text())
        assert res["premature"] == "premature checkpoint"  # rank 1 had no live tape, and refused too
        assert not res["premature_written"]
        assert res["loaded_step"] == 1 and res["e_W"] == 1
        assert res["same_keys"] and res["keys"] > 100 and res["differing"] == []

    ck = tmp_path / "ck"
    keys = set(open_checkpoint(ck).metadata.state_dict_metadata)
    assert "fp8.layers.0.qkv.input_scale" in keys and not any(".dp" in k or k.startswith("fp8.dp") for k in keys)
    assert "model.tok_emb.weight" in keys and "optim.layers.1.fc2.weight.exp_avg" in keys
    report = inspect_checkpoint(ck)
    assert report.world_size == 2 and report.pipeline["dp"] == 2 and report.launch == "torchrun"
    assert {m.replica for m in report.fp8_modules} == {None}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck", "rank0.json", "rank1.json"]
