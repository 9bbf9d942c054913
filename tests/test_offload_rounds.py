"""`scripts/offload_rounds.py`: each interleaved round's ratio, binned by the host's time to queue `off`'s step."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "offload_rounds.py"


@pytest.fixture(scope="module")
def rounds_mod():
    spec = importlib.util.spec_from_file_location("offload_rounds", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _report() -> dict:
    """Two rounds of two steps: in the first the host queues off's step in 4 ms and release takes x1.05,
    in the second 6 ms and x1.25 (each round's medians: the middle of two steps)."""
    off = {"step_seconds": [0.010, 0.010, 0.010, 0.010], "host_step_seconds": [0.0039, 0.0041, 0.0059, 0.0061]}
    release = {"step_seconds": [0.0104, 0.0106, 0.0124, 0.0126], "host_step_seconds": [0.007] * 4}
    return {"config": "examples/configs/h2048.toml", "schedule": "interleaved", "interleave": 2,
            "modes": {"off": off, "release": release}}


def test_each_round_pairs_the_modes_medians(rounds_mod) -> None:
    points = rounds_mod.rounds(_report(), "release")
    assert [round(h, 6) for h, _ in points] == [4.0, 6.0]
    assert [round(r, 6) for _, r in points] == [1.05, 1.25]
    bins = rounds_mod.binned(points, (5.0,))
    assert [(b["host_ms_from"], b["host_ms_to"], b["rounds"]) for b in bins] == [(0.0, 5.0, 1), (5.0, None, 1)]
    assert [round(b["median_ratio"], 6) for b in bins] == [1.05, 1.25]
    wider = rounds_mod.binned(points, (1.0, 2.0, 5.0))  # the empty bins below 2 ms are left out
    assert [(b["host_ms_from"], b["host_ms_to"]) for b in wider] == [(2.0, 5.0), (5.0, None)]
    with pytest.raises(ValueError, match="not an interleaved run"):
        rounds_mod.rounds({**_report(), "interleave": None}, "release")


def test_the_command_line_groups_files_and_refuses_bad_input(rounds_mod, tmp_path, monkeypatch, capsys) -> None:
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    a.write_text(json.dumps(_report()))
    b.write_text(json.dumps(_report()))
    out = tmp_path / "rounds.json"
    monkeypatch.setattr(sys, "argv", ["offload_rounds.py", str(a), str(b), "--edges", "5", "--json", str(out)])
    assert rounds_mod.main() == 0
    (row,) = json.loads(out.read_text())["rows"]  # one (config, schedule, mode): both files' rounds together
    assert row["config"] == "h2048.toml" and row["mode"] == "release" and len(row["points"]) == 4
    assert [b["rounds"] for b in row["bins"]] == [2, 2] and "median x1.250" in capsys.readouterr().out
    bad = tmp_path / "bad.json"
    bad.write_text("{")
    monkeypatch.setattr(sys, "argv", ["offload_rounds.py", str(bad)])
    assert rounds_mod.main() == 1 and "bad.json: not a readable JSON report" in capsys.readouterr().err
    monkeypatch.setattr(sys, "argv", ["offload_rounds.py", str(a), "--edges", "5,4"])
    with pytest.raises(SystemExit) as err:
        rounds_mod.main()
    assert err.value.code == 2 and "strictly ascending" in capsys.readouterr().err
