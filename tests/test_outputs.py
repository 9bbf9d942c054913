"""Output paths are judged before any work: a report, run or checkpoint folder that cannot be created is
one line, exit 2, before a verification, a build or a GPU check (not an OSError after minutes of work)."""

from __future__ import annotations

from pathlib import Path

import pytest

from qeffect.cli.app import main
from qeffect.errors import UserError
from qeffect.runtime import outputs
from qeffect.runtime.outputs import check_creatable, check_folder_target, check_report_target

REPORT = "saved.json"  # not read: the output is judged first


def test_check_creatable(tmp_path: Path, monkeypatch) -> None:
    check_creatable(tmp_path / "a" / "b" / "c.json", "the report")  # missing folders are made later
    (tmp_path / "file").write_text("x")
    with pytest.raises(UserError, match=r"f/x\.json: cannot create the report: .*file is not a folder"):
        check_creatable(tmp_path / "file" / "f" / "x.json", "the report")
    monkeypatch.setattr(outputs.os, "access", lambda path, mode: False)  # a read-only folder (root may write any)
    with pytest.raises(UserError, match=r"cannot create the run folder: .* is not writable"):
        check_creatable(tmp_path / "run", "the run folder")


def test_check_folder_target(tmp_path: Path) -> None:
    check_folder_target(tmp_path, "the plot folder")
    check_folder_target(tmp_path / "new", "the plot folder")
    (tmp_path / "file").write_text("x")
    with pytest.raises(UserError, match=r"file: the plot folder exists and is not a folder"):
        check_folder_target(tmp_path / "file", "the plot folder")


def test_check_report_target(tmp_path: Path) -> None:
    check_report_target(None)
    check_report_target(tmp_path / "r.json")
    with pytest.raises(UserError, match=r"is a folder; --json wants a file name"):
        check_report_target(tmp_path)


@pytest.mark.parametrize("argv", [
    ["train", "--steps", "1", "--json", "{bad}/s.json"],
    ["train", "--steps", "1", "--out", "{bad}/run"],
    ["train", "--steps", "1", "--checkpoint-every", "1", "--checkpoint-dir", "{bad}/ck"],
    ["verify-state", "--steps", "1", "--json", "{bad}/v.json"],
    ["profile", "--report", REPORT, "--json", "{bad}/p.json"],
    ["profile", "--report", REPORT, "--plot", "{bad}/plots"],
    ["capture", "--json", "{bad}/c.json"],
    ["offload-check", "--json", "{bad}/o.json"],
    ["audit-megatron", "--json", "{bad}/a.json"],
], ids=["train-json", "train-out", "train-checkpoint-dir", "verify-state-json", "profile-json", "profile-plot", "capture-json",
        "offload-check-json", "audit-megatron-json"])
def test_an_output_under_a_file_is_one_line_before_any_work(argv: list[str], tmp_path: Path, capsys,
                                                            monkeypatch) -> None:
    bad = tmp_path / "a-file"
    bad.write_text("mine")
    monkeypatch.chdir(tmp_path)  # train's default run folder would be ./runs
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        main([a.replace("{bad}", str(bad)) for a in argv])
    err = capsys.readouterr().err.strip()
    assert exc.value.code == 2 and len(err.splitlines()) == 1, err
    assert f"{bad} is not a folder" in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a-file"] and bad.read_text() == "mine"
