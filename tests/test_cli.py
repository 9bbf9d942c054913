"""The command line: version, help, one-line usage errors with exit code 2, verify-state --faults."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from qeffect import __version__
from qeffect.cli.app import main


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exc:
        main(list(argv))
    out, err = capsys.readouterr()
    return int(exc.value.code or 0), out, err


def test_version(capsys) -> None:
    rc, out, _ = run(capsys, "--version")
    assert rc == 0 and out.strip() == f"qeffect {__version__}"


def test_help_lists_commands(capsys) -> None:
    rc, out, _ = run(capsys, "--help")
    assert rc == 0
    for cmd in ("train", "verify-state", "config"):
        assert cmd in out


@pytest.mark.parametrize("argv", [
    ["--bogus"],
    ["no-such-command"],
    ["verify-state", "--steps", "x"],
    ["verify-state", "--schedule", "bogus"],
    ["verify-state", "--steps", "0"],
    ["train", "--pp", "-1"],
    ["verify-state", "--offload", "release"],
    ["verify-state", "--offload", "bogus"],
    ["verify-state", "--set", "model.hiden=64"],
    ["train", "--set", "optim.lr"],
    ["train", "--set", "optim.lr=-1"],
    ["config", "show", "--set", "nosuch.field=1"],
    ["config", "bogus"],
])
def test_bad_usage_is_one_line_exit_2(capsys, argv: list[str]) -> None:
    rc, _, err = run(capsys, *argv)
    assert rc == 2
    assert len(err.strip().splitlines()) == 1 and err.startswith("qeffect: error:")
    assert "Traceback" not in err


def _toml(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "cfg.toml"
    p.write_text(text)
    return p


@pytest.mark.parametrize("text, needle", [
    ("[model]\nhiden = 64\n", "model.hiden: unknown field"),
    ("[model]\nhidden = 64\nheads = 3\n", "heads (3) must divide hidden (64)"),
    ("[pipeline]\nschedule = 'gpipe'\n", "pipeline.schedule"),
    ("[model\n", "not valid TOML"),
])
def test_bad_config_names_file_and_field(capsys, tmp_path: Path, text: str, needle: str) -> None:
    cfg = _toml(tmp_path, text)
    rc, _, err = run(capsys, "verify-state", "--config", str(cfg), "--steps", "1")
    assert rc == 2
    assert str(cfg) in err and needle in err
    assert len(err.strip().splitlines()) == 1


def test_faults_report(capsys, tmp_path: Path) -> None:
    out = tmp_path / "faults.json"
    rc, stdout, _ = run(capsys, "verify-state", "--faults", "--json", str(out))
    assert rc == 0
    report = json.loads(out.read_text())
    assert report["passed"] is True
    assert report["cuda_initialized"] is False
    assert len(report["injections"]) >= 7 and len(report["families"]) >= 6
    assert all(i["first_invalid"] and i["state_preserved"] for i in report["injections"])
    assert "PASS" in stdout


def test_cuda_without_gpu_is_one_line(capsys) -> None:
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    rc, _, err = run(capsys, "verify-state", "--device", "cuda")
    assert rc == 2 and "no CUDA device" in err
