"""`qeffect.offload.timing` (the discrete-event timing of resident offload's streams and the bank search)
and scripts/offload_sim.py, its command line (CPU)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

from qeffect.config import DEFAULT_SEARCH_TRIES, OffloadConfig, load_config
from qeffect.offload.plan import assign_banks, backward_order, conflicts
from qeffect.offload.timing import MIB, SCALE, StepCosts, TimedStreams, search_banks, simulate

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "offload_sim.py"


def resident(**kw) -> OffloadConfig:
    """A resident offload config with `kw` (the search's budget, tries and preference)."""
    return OffloadConfig(mode="resident", **kw)


@pytest.fixture(scope="module")
def sim():
    spec = importlib.util.spec_from_file_location("offload_sim", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["offload_sim"] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    yield mod
    del sys.modules["offload_sim"]


def test_a_wait_holds_its_stream_until_the_record_and_the_stall_is_counted() -> None:
    ts = TimedStreams(d2h_gbps=1.0, h2d_gbps=1.0)
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
    res = ts.run()
    copy_ms = (1 << 20) / 1e9 * 1e3
    assert res["end"] == {"compute": 1.0 + copy_ms + 1.0, "d2h": 1.0 + copy_ms}
    assert res["stalls"] == {"d2h_done": copy_ms} and res["marks"] == [("0", 2.0 + copy_ms)]


def test_a_wait_on_a_later_record_of_its_own_stream_is_a_deadlock() -> None:
    ts = TimedStreams(1.0, 1.0)
    ev = ts.new_event("e")
    ev.last = {"time": None}  # recorded by an operation queued after the wait
    ts.compute.queue.append(("wait", ev.last, "e"))
    ts.compute.queue.append(("record", ev.last, "e"))
    with pytest.raises(RuntimeError, match="simulated deadlock"):
        ts.run()


def h2048(sim, schedule: str = "interleaved", **kw):
    events = sim.step_events(schedule, 4)
    given = {"group_mib": sim.H2048_GROUP_MIB, "stage_weight": sim.H2048_STAGE_WEIGHT, "f_ms": 0.118, "i_ms": 0.118,
             "w_ms": 0.118, "tail_ms": 2.65, "gbps": 52.0} | kw
    return events, sim.given_costs(events, **given)


def test_instant_copies_cost_nothing_and_the_plan_copies_only_the_groups_it_does_not_keep(sim) -> None:
    events, fast = h2048(sim, gbps=1e12)
    r = simulate(events, fast)
    assert r.step_ms == pytest.approx(r.off_ms, rel=1e-9) and sum(r.stall_ms.values()) < 1e-6
    slow = simulate(events, h2048(sim)[1])
    assert slow.kept == 4 and slow.step_ms > r.step_ms  # the last stage's 4 groups stay in their bank
    group = -(-int(9.8 * MIB) // SCALE) * SCALE  # simulated in units of SCALE bytes
    assert slow.d2h_bytes == 12 * group  # each of the other 12 goes out once per step
    assert set(slow.stall_ms) <= {"d2h_done", "restore_done", "consumed", "d2h_chunk"}
    assert slow.banks == 2 and slow.mapped_bytes == 10 * MIB + 44 * MIB  # each bank: its largest group, 2 MiB pages


def test_the_scaled_simulation_times_as_the_real_bytes_would() -> None:
    """Bytes are simulated divided by SCALE with the bandwidth scaled alike: a copy of n real bytes takes
    n / bandwidth, whatever the scale."""
    ts = TimedStreams(2.0, 2.0, scale=1024)
    d2h = ts.new_stream("d2h")
    ts.copy(torch.empty(1024), torch.empty(1024), d2h)  # 4 KiB simulated: 4 MiB real
    assert ts.run()["end"]["d2h"] == pytest.approx(4 * MIB / 2e9 * 1e3)


@pytest.mark.parametrize("schedule", ["interleaved", "zbv"])
def test_the_search_finds_a_valid_plan_no_slower_and_no_larger_than_the_colouring(sim, schedule: str) -> None:
    """h2048's durations: every plan is valid (no conflicting groups share a bank), the best is within the
    colouring's memory with 4 banks and faster than the colouring with 2 or 4; the same seed, the same plan."""
    events, costs = h2048(sim, schedule)
    found = search_banks(events, costs, resident(search_banks=4, search_tries=60))
    order, edges = backward_order(events), conflicts(events)
    bank = dict(zip(order, found.best.plan, strict=True))
    assert all(bank[g] != bank[h] for g in order for h in edges[g])
    assert found.best.mapped_bytes <= found.budget_bytes == found.colour.mapped_bytes
    assert found.colour.plan == tuple(assign_banks(events, min_banks=4)[g] for g in order)
    assert found.best.step_ms < min(found.colour.step_ms, simulate(events, costs).step_ms)
    assert 1 < found.tried <= 61
    assert search_banks(events, costs, resident(search_banks=4, search_tries=60)).best == found.best


def test_on_a_tie_the_search_takes_the_plan_with_less_memory(sim) -> None:
    """`prefer="memory"`, copies of no cost: every plan runs at the step without offload, so the search only
    trades memory: it ends below the colouring's 4 banks, at no more than the 2-bank colouring's memory."""
    events, costs = h2048(sim, gbps=1e12)
    found = search_banks(events, costs, resident(search_banks=4, search_tries=20, search_prefer="memory"))
    assert found.best.step_ms == pytest.approx(found.best.off_ms, rel=1e-9)
    assert found.best.mapped_bytes < found.colour.mapped_bytes
    assert found.best.mapped_bytes <= simulate(events, costs).mapped_bytes


@pytest.mark.parametrize("schedule", ["interleaved", "zbv"])
def test_preferring_copies_keeps_more_groups_in_their_banks_within_the_budget(sim, schedule: str) -> None:
    """`search_prefer="copies"` (`offload.search_prefer`, the default): with the last stage's groups on the
    device and the 6-bank budget, h2048's plans as fast as without offload, and fewer bytes copied than the
    plan that prefers memory (which may map less); every plan valid; an unknown preference is refused."""
    events, costs = h2048(sim, schedule)
    costs = sim.without_short(costs, events, 2)
    by = {p: search_banks(events, costs, resident(search_banks=6, search_tries=200, search_prefer=p))
          for p in ("memory", "copies")}
    mem, cop = by["memory"].best, by["copies"].best
    assert cop.step_ms == pytest.approx(cop.off_ms, rel=1e-9) and mem.step_ms == pytest.approx(mem.off_ms, rel=1e-9)
    assert cop.d2h_bytes + cop.h2d_bytes < mem.d2h_bytes + mem.h2d_bytes and cop.kept > mem.kept
    assert mem.mapped_bytes <= cop.mapped_bytes <= by["copies"].budget_bytes == by["memory"].budget_bytes
    order, edges = backward_order(events), conflicts(events)
    bank = dict(zip(order, cop.plan, strict=True))
    assert all(bank[g] != bank[h] for g in order for h in edges[g])
    with pytest.raises(ValueError, match="search_prefer"):
        resident(search_tries=2, search_prefer="speed")


def test_an_unknown_preference_is_refused_by_the_config_and_the_manager_takes_only_a_config(tmp_path) -> None:
    """`offload.search_prefer` takes "copies" or "memory": the config file's error names the file and the
    field, the model refuses anything else, and the manager takes nothing but a config."""
    from qeffect.errors import UserError
    from qeffect.offload import OffloadManager

    bad = tmp_path / "bad.toml"
    bad.write_text('[offload]\nsearch_prefer = "bytes"\n')
    with pytest.raises(UserError, match=r"bad\.toml.*offload\.search_prefer"):
        load_config(bad)
    with pytest.raises(ValueError, match="search_prefer"):
        resident(search_prefer="bytes")
    with pytest.raises(TypeError, match="OffloadConfig"):
        OffloadManager("resident", device="cpu", driver=object(), streams=object())


def test_costs_say_the_step_without_offload() -> None:
    costs = StepCosts({"a": 1, "b": 2}, {"a": (1.0, 2.0, 3.0), "b": (0.5, 0.5, 0.5)}, tail_ms=4.0)
    assert costs.off_ms == 11.5


def test_given_banks_are_timed_and_bad_ones_are_refused(sim, tmp_path, monkeypatch, capsys) -> None:
    """`--plan` times banks given by hand (here a 4-bank plan `--search` found, timed on the H200 at 08f6f82) and
    writes them to the JSON; banks that do not fit the schedule end the script with a usage error."""
    plan = "0:3:0:1:0:3:2:1:0:1:0:3:2:1:0:3"
    out = tmp_path / "sim.json"
    monkeypatch.setattr("sys.argv", ["offload_sim.py", "--plan", f"interleaved={plan}", "--min-window", "0",
                                     "--json", str(out)])  # that plan was found with every group offloaded
    assert sim.main() == 0
    (row,) = json.loads(out.read_text())["results"]
    assert row["plan"] == [int(b) for b in plan.split(":")] and row["kept"] == 6 and row["banks"] == 4
    assert row["ratio"] < simulate(*h2048(sim)).ratio  # the colouring: 2 banks
    monkeypatch.setattr("sys.argv", ["offload_sim.py", "--plan", "interleaved=0:1"])
    with pytest.raises(SystemExit) as err:
        sim.main()
    assert err.value.code == 2 and "expected 16 bank indices" in capsys.readouterr().err


def test_the_window_leaves_the_last_stages_groups_out(sim, tmp_path, monkeypatch, capsys) -> None:
    """`--min-window 2` (the script's default; `offload.min_window = 2` does the same): the last
    stage's groups are empty, so the banks shrink; 0 offloads every group; a negative window is a usage
    error."""
    rows = {}
    for window in (0, 2):
        out = tmp_path / f"w{window}.json"
        monkeypatch.setattr("sys.argv", ["offload_sim.py", "--schedule", "interleaved", "--banks", "2",
                                         "--lookahead", "1", "--min-window", str(window), "--json", str(out)])
        assert sim.main() == 0
        (rows[window],) = json.loads(out.read_text())["results"]
    # (the colouring kept those groups in their bank anyway: no more D2H than before, banks under half)
    assert 2 * rows[2]["mapped_mib"] < rows[0]["mapped_mib"]
    assert rows[2]["d2h_mib_per_step"] <= rows[0]["d2h_mib_per_step"]
    assert rows[2]["off_peak_saved_mib"] < rows[0]["off_peak_saved_mib"]
    monkeypatch.setattr("sys.argv", ["offload_sim.py", "--min-window", "-1"])
    with pytest.raises(SystemExit) as err:
        sim.main()
    assert err.value.code == 2 and "--min-window must be >= 0" in capsys.readouterr().err


def test_robustness_compares_the_estimate_with_plans_searched_for_the_given_durations(sim, tmp_path, monkeypatch,
                                                                                      capsys) -> None:
    out = tmp_path / "rob.json"
    monkeypatch.setattr("sys.argv", ["offload_sim.py", "--robustness", "examples/configs/h2048.toml", "--schedule",
                                     "zbv", "--search", "20", "--json", str(out)])
    assert sim.main() == 0
    rows = json.loads(out.read_text())["results"]
    assert [r["durations"] for r in rows] == ["given", "x0.6", "x1.6", "last stage x1.3"]
    for r in rows:  # one plan from the estimate, timed under each; the search under each is within its budget
        assert r["estimate_plan"] == rows[0]["estimate_plan"] and r["searched_plan_ratio"] <= r["colour_6_ratio"]
    assert "estimate's plan x" in capsys.readouterr().out


def test_no_tries_keep_the_colouring_and_the_config_sets_the_tries(sim, tmp_path) -> None:
    """`offload.search_tries`: 0 keeps the colouring with `search_banks` banks; 400 by default; a config file
    sets it, and a bad value is refused naming the file and the field."""
    import gc

    from qeffect.errors import UserError

    events, costs = h2048(sim)
    found = search_banks(events, costs, resident(search_banks=4, search_tries=0))
    assert found.best == found.colour and found.tried == 1
    assert gc.isenabled()  # the search turns collections off while it runs, and back on
    assert OffloadConfig().search_tries == DEFAULT_SEARCH_TRIES == 400
    path = tmp_path / "tries.toml"
    path.write_text("[offload]\nsearch_tries = 12\n")
    assert load_config(path).offload.search_tries == 12
    for bad in ("-1", '"many"'):
        path.write_text(f"[offload]\nsearch_tries = {bad}\n")
        with pytest.raises(UserError, match=r"tries\.toml.*offload\.search_tries"):
            load_config(path)


def test_matrix_elements_count_the_gemm_weights_and_not_the_embeddings() -> None:
    """The capture-time estimate's FLOPs: a first stage's layers (qkv, proj, fc1, fc2: 4h^2 + 2hf) without
    its token and position tables; a last stage's layers and its head (h x vocab)."""
    from qeffect.fp8 import DelayedScalingRecipe, ReferenceBackend
    from qeffect.model import GPTShape, build_chunks
    from qeffect.offload.planning import matrix_elements

    h, f, vocab = 32, 64, 64
    shape = GPTShape(layers_per_chunk=1, num_stages=2, vocab_size=vocab, hidden=h, ffn=f, heads=4, seq_len=8,
                     microbatch_size=2)
    first, last = build_chunks(shape, ReferenceBackend(DelayedScalingRecipe()), seed=0)
    assert matrix_elements(first) == 4 * h * h + 2 * h * f
    assert matrix_elements(last) == 4 * h * h + 2 * h * f + h * vocab
