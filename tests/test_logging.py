"""`qeffect train` output and metrics: plain lines without a terminal, metrics.jsonl fields, MFU,
TensorBoard."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from launch import ENV, torchrun
from qeffect.cli.train import step_line
from qeffect.config import load_config
from qeffect.errors import UserError
from qeffect.runtime import metrics as M

# one stage, one microbatch, one held-out batch: the output is under test, not the pipeline
SMALL = ["--pp", "1", "--set", "pipeline.chunks_per_rank=1", "--set", "pipeline.microbatches=1",
         "--set", "train.eval_batches=1"]
FIELDS = {"step", "loss", "lr", "grad_norm", "step_time_s", "tokens_per_s", "heldout_ce", "mfu",
          "peak_allocated_bytes", "wall_s"}


def test_log_lines_metrics_and_tensorboard(tmp_path: Path) -> None:
    """The acceptance run: stdout is a pipe, so a plain line every log_every steps (with the grad norm), one
    per evaluation; metrics.jsonl has every field; TensorBoard event files hold the same scalars."""
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "qeffect", "train", "--steps", "4", "--out", str(out),
         "--set", "train.log_every=2", "--set", "train.eval_every=2", "--set", "logging.tensorboard=true",
         *SMALL],
        cwd=tmp_path, capture_output=True, text=True, timeout=600, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stdout.splitlines()
    steps = [ln for ln in lines if ln.startswith("step ")]
    assert [ln.split()[1] for ln in steps] == ["2/4", "4/4"], proc.stdout
    pattern = (r"step \d/4  loss \d+\.\d{4}  lr \d\.\d\de[-+]\d\d  grad_norm (\S+)  [\d,]+ tok/s  "
               r"\d+\.\d ms/step")
    for ln in steps:
        m = re.fullmatch(pattern, ln)
        assert m is not None, ln
        assert float(m[1]) > 0
    evals = [ln for ln in lines if ln.startswith("eval ")]
    assert [ln.split()[2] for ln in evals] == ["0/4", "2/4", "4/4"], proc.stdout
    assert "━" not in proc.stdout  # no progress bar in a log

    records = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    for r in records:
        assert FIELDS <= set(r), set(r)
        assert r["lr"] > 0 and r["tokens_per_s"] > 0
    # no clipping here: the norm is taken on the steps the log shows only
        assert r["mfu"] is None and r["peak_allocated_bytes"] is None  # the CPU: no peak, no device memory
    assert [r["grad_norm"] is not None for r in records] == [False, True, False, True]
    assert records[1]["grad_norm"] > 0
    walls = [r["wall_s"] for r in records]
    assert walls == sorted(walls) and walls[0] > 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["mfu"] is None and summary["mfu_peak_flops"] is None and summary["mfu_peak_name"] is None
    assert "no MFU on cpu" in summary["mfu_note"] and summary["mfu_flops_per_step"] > 0

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = list((out / "tensorboard").iterdir())
    assert events and all(f.stat().st_size > 0 for f in events)
    acc = EventAccumulator(str(out / "tensorboard"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    assert {"train/loss", "train/lr", "train/grad_norm", "train/tokens_per_s", "train/wall_s",
            "heldout/ce"} <= tags
    assert [e.step for e in acc.Scalars("train/loss")] == [1, 2, 3, 4]
    assert [e.value for e in acc.Scalars("train/loss")] == pytest.approx([r["loss"] for r in records])
    assert [e.step for e in acc.Scalars("heldout/ce")] == [0, 2, 4]


@pytest.mark.slow
def test_only_rank_zero_prints(tmp_path: Path) -> None:
    """torchrun PP=2: one process per pipeline rank, one set of lines."""
    out = tmp_path / "run"
    sets = ["train.log_every=1", "train.eval_every=0", "pipeline.chunks_per_rank=1",
            "pipeline.microbatches=2"]
    proc = subprocess.run([*torchrun(2, "-m", "qeffect"), "train", "--steps", "2", "--out", str(out),
                           *(a for kv in sets for a in ("--set", kv))],
                          cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = [ln for ln in proc.stdout.splitlines() if ln.startswith("step ")]
    assert [ln.split()[1] for ln in steps] == ["1/2", "2/2"], proc.stdout
    assert proc.stdout.count("run folder:") == 1


def test_step_line_format() -> None:
    m = SimpleNamespace(step=2, loss=9.12341, lr=3e-3, grad_norm=1.2345, tokens_per_s=12345.6,
                        step_time_s=0.0551, mfu=None, peak_allocated_bytes=None)
    assert step_line(m, 4) == ("step 2/4  loss 9.1234  lr 3.00e-03  grad_norm 1.234  12,346 tok/s  "
                               "55.1 ms/step")
    m.grad_norm, m.mfu, m.peak_allocated_bytes = None, 0.4123, int(7.83 * 2**30)
    assert step_line(m, 4).endswith("grad_norm -  12,346 tok/s  55.1 ms/step  mfu 41.2%  peak 7.83 GiB")


@pytest.mark.parametrize(("name", "peak"), [
    ("NVIDIA H100 80GB HBM3", "NVIDIA H100 SXM"), ("NVIDIA H100 PCIe", "NVIDIA H100 PCIe"),
    ("NVIDIA H100 NVL", "NVIDIA H100 NVL"), ("NVIDIA H200", "NVIDIA H200 SXM"),
    ("NVIDIA H200 NVL", "NVIDIA H200 NVL"),
    ("NVIDIA A100-SXM4-80GB", None), ("Tesla T4", None)])
def test_peak_table(name: str, peak: str | None) -> None:
    found = M.peak_for(name)
    assert (found.name if found else None) == peak
    if found is not None:
        assert found.fp8_flops == pytest.approx(2 * found.bf16_flops, rel=1e-3)
        assert "datasheet" in found.source


def test_mfu_arithmetic(monkeypatch: pytest.MonkeyPatch) -> None:
    """MFU = matrix FLOPs per step (all replicas) / seconds / (dense FP8 peak x devices)."""
    from qeffect.model.flops import count_matrix_flops

    cfg = load_config().with_overrides(**{"pipeline.dp": 2})
    cpu = M.mfu_basis(cfg, torch.device("cpu"), 1)
    assert cpu.mfu(0.1) is None and cpu.flops_per_step == 2 * count_matrix_flops(cfg).total
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 80GB HBM3")
    b = M.mfu_basis(cfg, torch.device("cuda"), 4)
    assert b.peak_name == "NVIDIA H100 SXM dense FP8" and b.peak_flops == 1978.9e12
    assert b.mfu(0.5) == pytest.approx(b.flops_per_step / 0.5 / (1978.9e12 * 4))
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "NVIDIA GeForce RTX 4090")
    unknown = M.mfu_basis(cfg, torch.device("cuda"), 1)
    assert unknown.mfu(0.5) is None and "RTX 4090" in unknown.note


def test_tensorboard_missing_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "tensorboard" else real(name, *a))
    with pytest.raises(UserError, match=r"needs the tensorboard package: pip install "
                                        r"'qeffect\[tensorboard\]'"):
        M.check_tensorboard()
