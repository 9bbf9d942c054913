"""`qeffect train`: the embedded default learns, and bad input fails in one line, writing nothing."""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

QEFFECT = [sys.executable, "-m", "qeffect"]


def qeffect(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*QEFFECT, *args], cwd=cwd, capture_output=True, text=True, timeout=600,
                          env=dict(os.environ, PYTHONUNBUFFERED="1"))


@pytest.mark.slow
def test_default_train_learns(tmp_path: Path) -> None:
    """The README's first command: `qeffect train` with no arguments, on the CPU."""
    proc = qeffect(tmp_path, "train")
    assert proc.returncode == 0, proc.stderr[-3000:]
    runs = list((tmp_path / "runs").iterdir())
    assert len(runs) == 1
    summary = json.loads((runs[0] / "summary.json").read_text())
    assert summary["last_to_first_ratio"] < 0.8
    assert summary["heldout_last"] < summary["heldout_first"]
    lines = (runs[0] / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == summary["steps"] == 60
    assert "ratio" in proc.stdout
    # stdout is a pipe: a plain line every train.log_every (10) steps, with the norm taken on those steps
    logged = [ln.split()[1] for ln in proc.stdout.splitlines() if ln.startswith("step ")]
    assert logged == [f"{s}/60" for s in range(10, 61, 10)], proc.stdout
    records = [json.loads(line) for line in lines]
    assert all(r["lr"] > 0 and r["wall_s"] > 0 and r["mfu"] is None for r in records)
    assert [r["step"] for r in records if r["grad_norm"] is not None] == list(range(10, 61, 10))
    assert summary["mfu"] is None and summary["mfu_note"].startswith("no MFU on cpu")
    # what the run ran under: the whole resolved config, and in the summary every bit-changing setting and
    # the [runtime] section
    from qeffect.config import RunConfig, bit_changing_fields, load_config
    from qeffect.graphs.handshake import run_settings

    cfg = RunConfig.model_validate(json.loads((runs[0] / "config.json").read_text()))
    assert cfg == load_config() and summary["config"] == cfg.model_dump()
    assert summary["settings"] == run_settings(cfg)
    assert set(summary["settings"]) == {*bit_changing_fields(), "runtime.rank_streams", "runtime.step_graph",
                                       "runtime.graph_pools"}


def _bad_shards(tmp_path: Path) -> dict[str, tuple[str, str]]:
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "ok", "timestamp": "t", "url": "u"}\n{"text": broken\n')
    gz = tmp_path / "bad.json.gz"
    with gzip.open(gz, "wt") as f:
        f.write('{"text": "fine"}\n{oops\n')
    cfg = tmp_path / "heads.toml"
    cfg.write_text("[model]\nhidden = 64\nheads = 5\n")
    unknown = tmp_path / "unknown.toml"
    unknown.write_text("[train]\nstepz = 3\n")
    mb = tmp_path / "mb.toml"
    mb.write_text("[pipeline]\nmicrobatches = 5\n")
    return {
        "missing data": ("--data=" + str(tmp_path / "nope.jsonl"), "nope.jsonl"),
        "empty shard": ("--data=" + str(empty), "empty shard"),
        "malformed line": ("--data=" + str(bad), "bad.jsonl:2"),
        "malformed gz line": ("--data=" + str(gz), "bad.json.gz:2"),
        "heads": ("--config=" + str(cfg), "heads (5) must divide hidden (64)"),
        "unknown field": ("--config=" + str(unknown), "train.stepz: unknown field"),
        "microbatches": ("--config=" + str(mb), "microbatches=5"),
        "world size": ("--dp=2", "torchrun"),
        "captured on cpu": ("--path=captured-direct", "needs a CUDA device"),
        "offload without capture": ("--offload=release", "needs train.path = captured-copy or captured-direct"),
    }


@pytest.mark.parametrize("case", ["missing data", "empty shard", "malformed line", "malformed gz line", "heads",
                                  "unknown field", "microbatches", "world size", "captured on cpu",
                                  "offload without capture"])
def test_bad_input_one_line_exit_2_writes_nothing(tmp_path: Path, case: str, capsys, monkeypatch) -> None:
    """In the test's own process: a process per case would cost each about 4 s of CPU to import torch and
    its pipelining; the exit of a real process is the next test's."""
    from qeffect.cli.app import main

    arg, needle = _bad_shards(tmp_path)[case]
    out = tmp_path / "run"
    monkeypatch.chdir(tmp_path)  # the default run folder would be ./runs
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        main(["train", arg, "--steps", "2", "--out", str(out)])
    err = capsys.readouterr().err.strip()
    assert exc.value.code == 2, err
    assert len(err.splitlines()) == 1 and err.startswith("qeffect: error:"), err
    assert needle in err
    assert not out.exists() and not (tmp_path / "runs").exists()


def test_bad_input_in_its_own_process_exits_2_with_one_line(tmp_path: Path) -> None:
    """The same as a user sees it: the process's exit status and its stderr."""
    arg, needle = _bad_shards(tmp_path)["malformed line"]
    proc = qeffect(tmp_path, "train", arg, "--steps", "2", "--out", str(tmp_path / "run"))
    assert proc.returncode == 2, proc.stderr
    err = proc.stderr.strip()
    assert len(err.splitlines()) == 1 and err.startswith("qeffect: error:") and needle in err, err
    assert not (tmp_path / "run").exists() and not (tmp_path / "runs").exists()


def _taken(tmp_path: Path) -> Path:
    out = tmp_path / "run"
    out.mkdir()
    (out / "notes.txt").write_text("someone's")
    return out


def test_a_taken_run_folder_is_refused_before_the_data_and_the_build(tmp_path: Path, capsys, monkeypatch) -> None:
    """A folder that is not empty stops the run in one line before anything costly (data, model) starts."""
    from qeffect.cli.app import main
    from qeffect.runtime import train

    def not_reached(*a, **k):
        raise AssertionError("reached past the run folder's check")

    monkeypatch.setattr(train, "_prepare_data", not_reached)
    monkeypatch.setattr(train, "build_single_process", not_reached)
    out = _taken(tmp_path)
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        main(["train", "--steps", "2", "--out", str(out)])
    err = capsys.readouterr().err.strip()
    assert exc.value.code == 2 and err == f"qeffect: error: {out}: run folder exists and is not empty", err
    assert [x.name for x in out.iterdir()] == ["notes.txt"]


def test_a_rank_variable_outside_torchrun_leaves_the_run_folder_alone(tmp_path: Path, monkeypatch) -> None:
    """RANK alone (some cluster launchers export it) is not torchrun: the one process writes to --out."""
    from launch import small_train
    from qeffect.cli.app import main

    monkeypatch.setenv("RANK", "3")
    monkeypatch.delenv("WORLD_SIZE", raising=False)
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "run"
    with pytest.raises(SystemExit) as exc:
        main(["train", "--steps", "1", "--set", "train.eval_every=0", *small_train(tmp_path), "--out", str(out)])
    assert exc.value.code == 0
    assert json.loads((out / "summary.json").read_text())["steps"] == 1 and not (tmp_path / "runs").exists()


@pytest.mark.slow
def test_a_taken_run_folder_under_torchrun_is_rank_zeros_one_line(tmp_path: Path) -> None:
    """Under torchrun the other rank waits in the rendezvous until the launcher stops it: no second error
    about a peer that left."""
    from launch import run, torchrun

    out = _taken(tmp_path)
    proc = run(torchrun(2, "-m", "qeffect", "train", "--steps", "2", "--out", str(out)), tmp_path)
    text = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert text.count(f"qeffect: error: {out}: run folder exists and is not empty") == 1, text[-3000:]
    assert "[rank1]" not in text and "Connection closed" not in text, text[-3000:]
    assert [x.name for x in out.iterdir()] == ["notes.txt"]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_captured_training_equals_eager_training(tmp_path: Path) -> None:
    """`qeffect train --device cuda`: eager, captured-direct and captured-direct with offload give the same
    losses bit for bit (the captured actions replay exactly the eager actions' kernels)."""
    from qeffect.config import load_config
    from qeffect.offload.driver import bindings_available
    from qeffect.runtime.train import train

    base = load_config().with_overrides(**{"train.device": "cuda", "train.steps": 6, "train.eval_every": 3})
    runs = {"eager": {}, "captured-direct": {"train.path": "captured-direct"}}
    if bindings_available():
        runs["captured-direct+release"] = {"train.path": "captured-direct", "offload.mode": "release"}
    losses = {}
    for name, over in runs.items():
        s = train(base.with_overrides(**over), out=tmp_path / name)
        losses[name] = (json.loads((tmp_path / name / "summary.json").read_text())["heldout_ce"],
                        [json.loads(line)["loss"] for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()])
        assert s.steps == 6
    assert all(v == losses["eager"] for v in losses.values()), losses
