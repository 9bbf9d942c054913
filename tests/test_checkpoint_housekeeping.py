"""Checkpoint housekeeping: `train.keep_checkpoints`, leftovers of killed saves, `--resume auto`."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from qeffect.checkpoint import latest_checkpoint, prune_checkpoints, remove_stale_saves
from qeffect.config import load_config
from qeffect.errors import UserError
from qeffect.runtime.train import auto_resume, train


def _dead_pid() -> int:
    """The pid of a process that has exited (what a killed save's token names)."""
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)
    return int(proc.stdout)


def _fake_checkpoint(folder: Path) -> Path:
    folder.mkdir(parents=True)
    (folder / "qeffect.json").write_text("{}")
    (folder / ".metadata").write_bytes(b"x")
    (folder / "__0_0.distcp").write_bytes(b"x")
    return folder


def _cfg(**over):
    """The tiny default cut to one stage and one microbatch: housekeeping, not the pipeline, is under test."""
    return load_config().with_overrides(**{"train.eval_every": 0, "pipeline.pp": 1,
                                           "pipeline.chunks_per_rank": 1, "pipeline.microbatches": 1, **over})


def test_prune_keeps_newest_by_step_and_never_the_one_written(tmp_path: Path) -> None:
    for step in (1, 2, 3, 4, 5, 9):
        _fake_checkpoint(tmp_path / f"step-{step:08d}")
    (tmp_path / "step-00000007").mkdir()  # not a complete checkpoint: never touched
    (tmp_path / "notes").mkdir()
    (tmp_path / "latest").write_text("step-00000005\n")
    written = tmp_path / "step-00000005"
    removed = prune_checkpoints(tmp_path, 2, protect=written)
    # kept: the one just written (also `latest`) and the newest other by step (9, of an abandoned attempt)
    assert sorted(p.name for p in removed) == [f"step-{i:08d}" for i in (1, 2, 3, 4)]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "notes", "step-00000005", "step-00000007",
                                                          "step-00000009"]
    assert prune_checkpoints(tmp_path, 1, protect=written) == [tmp_path / "step-00000009"]
    assert prune_checkpoints(tmp_path, 0, protect=written) == []
    assert latest_checkpoint(tmp_path) == written


def test_remove_stale_saves_only_dead_writers_and_checkpoint_files(tmp_path: Path) -> None:
    dead, alive = _dead_pid(), os.getppid()
    stale = tmp_path / f"step-00000004.tmp-{dead}-18f0a"
    stale.mkdir()
    (stale / "__0_0.distcp").write_bytes(b"half")
    (stale / f".qeffect.json.tmp-{dead}").write_text("{")
    empty = tmp_path / f"step-00000002.tmp-{dead}-1a"
    empty.mkdir()
    in_progress = tmp_path / f"step-00000006.tmp-{alive}-2b"  # another live process's save
    in_progress.mkdir()
    foreign = tmp_path / f"notes.tmp-{dead}-3c"  # not ours: holds other files
    foreign.mkdir()
    (foreign / "todo.txt").write_text("keep me")
    _fake_checkpoint(tmp_path / "step-00000003")
    replaced = _fake_checkpoint(tmp_path / f"step-00000003.old-{dead}-4d")  # its replacement is in place
    only_copy = _fake_checkpoint(tmp_path / f"step-00000005.old-{dead}-5e")  # killed between the two renames
    pruning = _fake_checkpoint(tmp_path / f"step-00000001.del-{dead}-6f")
    latest_tmp = tmp_path / f".latest.tmp-{dead}"
    latest_tmp.write_text("step-")
    removed = remove_stale_saves(tmp_path)
    assert sorted(removed) == sorted([stale, empty, replaced, pruning, latest_tmp])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["step-00000003", in_progress.name, foreign.name, only_copy.name])


def test_keep_two_of_five_and_killed_save_cleaned(tmp_path: Path) -> None:
    """Five saves with keep_checkpoints = 2 leave the last two; a killed save's .tmp folder goes at the
    next save."""
    root = tmp_path / "ck"
    killed = root / f"step-00000001.tmp-{_dead_pid()}-abc"
    killed.mkdir(parents=True)
    (killed / "__0_0.distcp").write_bytes(b"half")
    cfg = _cfg(**{"train.steps": 5, "train.checkpoint_every": 1, "train.keep_checkpoints": 2,
                  "train.checkpoint_dir": str(root)})
    s = train(cfg, out=tmp_path / "run")
    assert not killed.exists()
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step-00000004", "step-00000005"]
    assert (root / "latest").read_text().strip() == "step-00000005"
    assert [Path(c).name for c in s.checkpoints] == [f"step-{i:08d}" for i in range(1, 6)]
    assert [Path(c).name for c in s.checkpoints_removed] == [f"step-{i:08d}" for i in range(1, 4)]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert len(summary["checkpoints_removed"]) == 3


def test_resume_auto_fresh_then_from_the_run_folder(tmp_path: Path) -> None:
    out = tmp_path / "run"
    first = train(_cfg(**{"train.steps": 2, "train.checkpoint_every": 2}), out=out, resume="auto")
    assert first.start_step == 0 and first.resumed_from is None  # nothing there yet: fresh
    # the job is restarted (say after a kill) with more steps: it continues in the same run folder
    again = train(_cfg(**{"train.steps": 3, "train.checkpoint_every": 2}), out=out, resume="auto")
    assert again.start_step == 2 and again.resumed_from == str(out / "checkpoints" / "step-00000002")
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]
    assert json.loads((out / "summary.json").read_text())["start_step"] == 2
    assert latest_checkpoint(out / "checkpoints") == out / "checkpoints" / "step-00000003"


def test_resume_auto_needs_a_folder(tmp_path: Path) -> None:
    with pytest.raises(UserError, match=r"--resume auto needs --out or train\.checkpoint_dir"):
        auto_resume(_cfg(), None)
    assert auto_resume(_cfg(**{"train.checkpoint_dir": str(tmp_path / "none")}), None) is None
    _fake_checkpoint(tmp_path / "ck" / "step-00000003")
    _fake_checkpoint(tmp_path / "ck" / "step-00000010")
    assert auto_resume(_cfg(**{"train.checkpoint_dir": str(tmp_path / "ck")}), tmp_path / "run") == \
        tmp_path / "ck" / "step-00000010"  # no `latest`: the highest step
    proc = subprocess.run([sys.executable, "-m", "qeffect", "train", "--steps", "2", "--resume", "auto"],
                          cwd=tmp_path, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2, proc.stderr
    err = proc.stderr.strip()
    assert len(err.splitlines()) == 1 and "--resume auto needs --out" in err, err
    assert not (tmp_path / "runs").exists()


def test_resume_auto_refuses_a_foreign_folder(tmp_path: Path) -> None:
    out = tmp_path / "not-a-run"
    out.mkdir()
    (out / "data.txt").write_text("x")
    with pytest.raises(UserError, match=r"run folder exists and is not empty \(and is not a run folder\)"):
        train(_cfg(**{"train.steps": 1}), out=out, resume="auto")
