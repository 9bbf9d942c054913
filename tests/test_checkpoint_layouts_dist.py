"""Layout changes across launches (gloo): a torchrun PP=2 checkpoint resumes into PP=2 x DP=2 (4 processes)
and into one process, through `qeffect train --resume` and `qeffect verify-state --resume`.

One torchrun PP=2 run trains 5 steps and saves at steps 3 and 5. Then: 4 processes (`--dp 2`) train on
from step 3 to 5 (the layout change named in one line, on global rank 0 only) and verify-state from step 3
passes bitwise (replicas identical, reductions tracked); one process trains from step 3 to 5 and its
step-5 checkpoint equals the torchrun run's tensor by tensor, bit for bit; one process's verify-state from
step 3 passes. The model is the tiny default with launch.SMALL_VOCAB rows (the checkpoint fixes it for the
resumed runs).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from launch import SMALL, run, small_train, torchrun
from qeffect.checkpoint import diff_checkpoints
from qeffect.cli.app import main

pytestmark = pytest.mark.slow
NO_EVAL = ["--set", "train.eval_every=0"]
LINE = "layout pipeline.dp 1 -> 2 (4 layers); data epoch 0 goes on after 12 microbatches"


def _ok(proc) -> str:
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout


def _steps(run_dir: Path) -> list[int]:
    return [json.loads(x)["step"] for x in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_torchrun_pp2_checkpoint_into_pp2_dp2_and_into_one_process(tmp_path: Path, capsys) -> None:
    a, small = tmp_path / "a", small_train(tmp_path)
    _ok(run(torchrun(2, "-m", "qeffect", "train", "--steps", "5", "--checkpoint-every", "3", *NO_EVAL, *small,
                     "--out", str(a)), tmp_path))
    ck, last = a / "checkpoints" / "step-00000003", a / "checkpoints" / "step-00000005"
    assert ck.is_dir() and last.is_dir()

    # PP=2 x DP=2: train on, then verify from the same checkpoint
    out = _ok(run(torchrun(4, "-m", "qeffect", "train", "--resume", str(ck), "--dp", "2", "--steps", "5",
                           *NO_EVAL, *small, "--out", str(tmp_path / "dp2"), "--json", str(tmp_path / "dp2.json")), tmp_path))
    assert out.count(LINE) == 1  # global rank 0 only
    summary = json.loads((tmp_path / "dp2.json").read_text())
    assert summary["world_size"] == 4 and summary["start_step"] == 3 and summary["resumed_layout"] == LINE
    assert _steps(tmp_path / "dp2") == [4, 5]
    out = _ok(run(torchrun(4, "-m", "qeffect", "verify-state", "--resume", str(ck), "--dp", "2", "--steps", "3", *SMALL,
                           "--json", str(tmp_path / "v-dp2.json")), tmp_path))
    assert "PASS: bitwise equal" in out and out.count(LINE) == 1
    r = json.loads((tmp_path / "v-dp2.json").read_text())
    assert r["passed"] and (r["pp"], r["dp"], r["world_size"], r["start_step"]) == (2, 2, 4, 3)
    by = {c["category"]: c for c in r["categories"]}
    assert by["replicas"]["compared"] > 0 and all(c["mismatches"] == 0 for c in by.values())

    # one process: the same run as the torchrun one, bit for bit (one thread each, as the torchrun
    # workers: CPU reductions such as a bias gradient's sum split by thread count), and the oracle from step 3
    one = tmp_path / "one"
    _ok(run([sys.executable, "-m", "qeffect", "train", "--resume", str(ck), "--steps", "5", "--checkpoint-every",
             "5", *NO_EVAL, *small, "--out", str(one)], tmp_path))
    assert _steps(one) == [4, 5]
    diff = diff_checkpoints(last, one / "checkpoints" / "step-00000005")
    assert not diff.tensors_differing and not diff.only_in_a and not diff.only_in_b and diff.tensors_compared > 300
    assert _main(capsys, "verify-state", "--resume", str(ck), "--steps", "3", *SMALL, "--json",
                 str(tmp_path / "v1.json")) == 0
    r = json.loads((tmp_path / "v1.json").read_text())
    assert r["passed"] and r["start_step"] == 3 and r["resumed_layout"] is None


def _main(capsys, *argv: str) -> int:
    with pytest.raises(SystemExit) as exc:
        main(list(argv))
    capsys.readouterr()
    return int(exc.value.code or 0)
