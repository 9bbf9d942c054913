"""scripts/offload_sim.py: the discrete-event timing of resident offload's streams (CPU)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "offload_sim.py"


@pytest.fixture(scope="module")
def sim():
    spec = importlib.util.spec_from_file_location("offload_sim", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["offload_sim"] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    yield mod
    del sys.modules["offload_sim"]


def test_a_wait_holds_its_stream_until_the_record_and_the_stall_is_counted(sim) -> None:
    ts = sim.TimedStreams(d2h_gbps=1.0, h2d_gbps=1.0)
    d2h = ts.new_stream("d2h")
    fwd, copied = ts.new_event("g.forward_done"), ts.new_event("g.d2h_done")
    ts.launch(1.0, "F")
    ts.record(fwd, ts.compute)
    ts.wait(d2h, fwd)
    ts.copy(torch.empty(1 << 20, dtype=torch.uint8), torch.empty(1 << 20, dtype=torch.uint8), d2h)
    ts.record(copied, d2h)
    ts.wait(ts.compute, copied)
    ts.wait(ts.compute, ts.new_event("never.recorded"))  # a no-op, as in CUDA
    ts.launch(1.0, "mark:0")
    res = ts.simulate()
    copy_ms = (1 << 20) / 1e9 * 1e3
    assert res["end"] == {"compute": 1.0 + copy_ms + 1.0, "d2h": 1.0 + copy_ms}
    assert res["stalls"] == {"d2h_done": copy_ms} and res["marks"] == [("0", 2.0 + copy_ms)]


def test_a_wait_on_a_later_record_of_its_own_stream_is_a_deadlock(sim) -> None:
    ts = sim.TimedStreams(1.0, 1.0)
    ev = ts.new_event("e")
    ev.last = {"time": None}  # recorded by an operation queued after the wait
    ts.compute.queue.append(("wait", ev.last, "e"))
    ts.compute.queue.append(("record", ev.last, "e"))
    with pytest.raises(RuntimeError, match="simulated deadlock"):
        ts.simulate()


def test_instant_copies_cost_nothing_and_the_plan_copies_only_the_groups_it_does_not_keep(sim) -> None:
    r = sim.simulate("interleaved", gbps=1e12)
    assert r["step_ms"] == pytest.approx(r["off_ms"], rel=1e-9) and sum(r["compute_stall_ms_per_step"].values()) < 1e-6
    slow = sim.simulate("interleaved")
    assert slow["kept"] == 4 and slow["step_ms"] > r["step_ms"]  # the last stage's 4 groups stay in their bank
    group = int(9.8 * (1 << 20))  # each of the other 12 goes out once per step
    assert slow["d2h_mib_per_step"] == pytest.approx(12 * group / (1 << 20))
    assert set(slow["compute_stall_ms_per_step"]) <= {"d2h_done", "restore_done", "consumed", "d2h_chunk"}


def test_given_banks_are_timed_and_bad_ones_are_refused(sim, tmp_path, monkeypatch, capsys) -> None:
    """`--plan` times banks given by hand (here the 4-bank plan of gpu_session's offload-bank-search) and
    writes them to the JSON; banks that do not fit the schedule end the script with a usage error."""
    plan = "0:3:0:1:0:3:2:1:0:1:0:3:2:1:0:3"
    out = tmp_path / "sim.json"
    monkeypatch.setattr("sys.argv", ["offload_sim.py", "--plan", f"interleaved={plan}", "--json", str(out)])
    assert sim.main() == 0
    (row,) = json.loads(out.read_text())["results"]
    assert row["plan"] == [int(b) for b in plan.split(":")] and row["kept"] == 6 and row["banks"] == 4
    assert row["ratio"] < sim.simulate("interleaved")["ratio"]  # the default plan: 2 banks
    monkeypatch.setattr("sys.argv", ["offload_sim.py", "--plan", "interleaved=0:1"])
    with pytest.raises(SystemExit) as err:
        sim.main()
    assert err.value.code == 2 and "expected 16 bank indices" in capsys.readouterr().err
