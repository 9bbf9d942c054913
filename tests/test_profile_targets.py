"""`qeffect profile`'s targets from a user's file, rounds, the lower-bound floors and the megatron-graphs row."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest
import torch

from qeffect.cli.app import main
from qeffect.config import load_config
from qeffect.errors import UserError
from qeffect.profile.flops import (
    ADAMW_BYTES_PER_PARAM_BF16,
    ADAMW_BYTES_PER_PARAM_FP32,
    EAGER_METHOD,
    DeviceRates,
    count_matrix_flops,
    floor_of,
    measure_device_rates,
    optimizer_params,
    row_lazy_token_table,
    time_in_graph,
)
from qeffect.profile.matrix import CONFIG_NAMES, derive_ratios, merge_rounds
from qeffect.profile.report import ConfigResult, ProfileReport, TraceSummary
from qeffect.profile.targets import FASTEST_CAPTURED, TargetSpec, evaluate_targets, load_targets, with_targets

ROOT = Path(__file__).resolve().parent.parent
H200 = ROOT / "examples" / "targets" / "h200.toml"


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exc:
        main(list(argv))
    out, err = capsys.readouterr()
    return int(exc.value.code or 0), out, err


# ------------------------------------------------------------------------------------- the targets file
def test_the_h200_targets_load() -> None:
    specs = load_targets(H200, CONFIG_NAMES)
    by = {s.name: s for s in specs}
    assert list(by) == ["fastest-vs-te-graphed", "fastest-vs-megatron-graphs", "direct-vs-limit", "host-vs-gpu",
                        "losses-bitwise"]
    assert (by["fastest-vs-te-graphed"].of, by["fastest-vs-te-graphed"].against) == (FASTEST_CAPTURED, "te-graphed")
    assert by["fastest-vs-te-graphed"].min == 2.0 and by["fastest-vs-megatron-graphs"].min == 1.5
    assert by["fastest-vs-megatron-graphs"].against == "megatron-graphs"
    assert by["direct-vs-limit"].max == 2.0 and by["direct-vs-limit"].hidden == [4096]
    assert by["host-vs-gpu"].max == 0.5 and by["host-vs-gpu"].hidden == [2048]
    for name in ("fastest-vs-te-graphed", "fastest-vs-megatron-graphs"):
        assert by[name].backend == ["te"] and by[name].hidden == [2048, 4096]


BAD = [
    ("", "no [[target]] tables"),
    ("[[target]\n", "not valid TOML"),
    ("[other]\nx = 1\n", "other: Extra inputs are not permitted"),
    ('[[target]]\nname = "a"\nmetric = "speedup"\nof = "captured-direct"\nagainst = "te-graphed"\n',
     "target 1 (a): speedup needs exactly one of min or max"),
    ('[[target]]\nname = "a"\nmetric = "speedup"\nof = "captured-direct"\nagainst = "te-graphed"\nmin = 1\nmax = 2\n',
     "target 1 (a): speedup needs exactly one of min or max"),
    ('[[target]]\nname = "a"\nmetric = "limit-ratio"\nof = "captured-direct"\nagainst = "te-graphed"\nmax = 2\n',
     "target 1 (a): against = <configuration> is for speedup only"),
    ('[[target]]\nname = "a"\nmetric = "speedup"\nof = "captured-direct"\nagainst = "te-grafed"\nmin = 2\n',
     "target 1 (a): unknown configuration 'te-grafed'"),
    ('[[target]]\nname = "a"\nmetric = "speed"\nof = "captured-direct"\nmin = 2\n', "target 1 (a): metric: Input should be"),
    ('[[target]]\nname = "a"\nmetric = "limit-ratio"\nof = "captured-direct"\nmax = 2\nthreshold = 3\n',
     "target 1 (a): threshold: Extra inputs are not permitted"),
    ('[[target]]\nname = "a"\nmetric = "losses-bitwise"\n[[target]]\nname = "a"\nmetric = "losses-bitwise"\n',
     "target 2 (a): name 'a' used twice"),
    ('[[target]]\nname = "a"\nmetric = "losses-bitwise"\nmax = 0\n', "target 1 (a): losses-bitwise takes no"),
    ('[[target]]\nmetric = "losses-bitwise"\n', "target 1: name: Field required"),
]


@pytest.mark.parametrize(("text", "message"), BAD)
def test_a_bad_targets_file_is_one_clear_error_naming_file_and_entry(tmp_path, text: str, message: str) -> None:
    f = tmp_path / "t.toml"
    f.write_text(text)
    with pytest.raises(UserError) as err:
        load_targets(f, CONFIG_NAMES)
    assert str(err.value).startswith(f"{f}: ") and message in str(err.value) and "\n" not in str(err.value)


def test_a_bad_targets_file_stops_the_cli_before_anything_runs(capsys, tmp_path) -> None:
    f = tmp_path / "t.toml"
    f.write_text('[[target]]\nname = "a"\nmetric = "speedup"\n')
    rc, out, err = run(capsys, "profile", "--device", "cpu", "--targets", str(f))
    assert rc == 2 and err.startswith("qeffect: error: ") and len(err.strip().splitlines()) == 1
    assert str(f) in err and "target 1 (a)" in err and out == ""
    rc, _, err = run(capsys, "profile", "--device", "cpu", "--targets", str(tmp_path / "none.toml"))
    assert rc == 2 and "targets file not found" in err
    rc, _, err = run(capsys, "profile", "--device", "cpu", "--rounds", "0")
    assert rc == 2


# --------------------------------------------------------------------------------- judging, by hand
MS = 1e-3


def _config(name: str, path: str, rounds_ms: list[float] | None, **kw) -> ConfigResult:
    if rounds_ms is None:
        return ConfigResult(name=name, description=name, status="not run", reason="not here", path=path)
    medians = [x * MS for x in rounds_ms]
    return ConfigResult(name=name, description=name, status="ok", path=path, round_medians=medians,
                        median_step_seconds=statistics.median(medians), step_seconds=medians, **kw)


def _report(configs: list[ConfigResult], *, backend: str = "te", hidden: int = 4096) -> ProfileReport:
    cfg = load_config().with_overrides(**{"model.hidden": hidden})
    flops = count_matrix_flops(cfg)
    rates = DeviceRates(square_gemm="8 x 8 x 8", fp8_tflops=1e-6, gemm_method="by hand", copy_bytes=1,
                        copy_bytes_per_second=1e6, copy_method="by hand")
    floor = floor_of([], flops, rates, (1000, 500))
    r = ProfileReport(command="by hand", git_revision=None, created="now", device="cuda", device_name="hand",
                      torch_version="x", te_version=None, config_path=None, config=cfg.model_dump(), backend=backend,
                      steps=3, warmup=1, matrix_flops=flops, gemm=[], floor=floor, configs=configs, rounds=3)
    derive_ratios([c for c in r.configs if c.status == "ok"], floor)
    return r


def _spec(**kw) -> TargetSpec:
    return TargetSpec.model_validate({"name": "t", **kw})


def test_a_speedup_is_the_median_of_the_per_round_ratios() -> None:
    """Rounds interleave the configurations: round k of the anchor is divided by round k of ours, and the
    median of those ratios is judged (not the ratio of the medians)."""
    configs = [_config("native-eager", "eager", [120, 110, 130]),
               _config("captured-direct", "captured-direct", [22, 20, 21]),
               _config("captured-zbv-direct", "captured-direct", [20, 24, 19]),
               _config("te-graphed", "te", [40, 49, 42])]
    r = _report(configs)
    spec = _spec(metric="speedup", of=FASTEST_CAPTURED, against="te-graphed", min=2.0)
    (t,) = evaluate_targets(r, [spec])
    ratios = [40 / 20, 49 / 24, 42 / 19]  # the fastest captured by median: zbv (20 ms) over direct (21 ms)
    assert t.round_values == ratios and t.value == statistics.median(ratios) and t.met is True
    assert "captured-zbv-direct" in t.description and t.comparison == ">=" and t.threshold == 2.0
    assert t.note.startswith("wall clock, median of 3 per-round ratios: 2.00, 2.04, 2.21")
    assert "te-graphed over 3 rounds: median 42.00 ms, 40.00-49.00" in t.note
    # missed: by how much, what would meet it, and where the time goes (no trace: said so; the host phase)
    r.result("captured-zbv-direct").host_median_seconds = 5 * MS
    spec = _spec(metric="speedup", of="captured-zbv-direct", against="te-graphed", min=2.5)
    (t,) = evaluate_targets(r, [spec])
    assert t.met is False and t.shortfall == 1 - t.value / 2.5
    assert t.needed == "captured-zbv-direct step <= 16.80 ms (now 20.00 ms)"
    assert t.where == ("captured-zbv-direct: no trace (run with --trace N for where the time goes); "
                       "captured-zbv-direct host: queues a step in 5.00 ms of 20.00 ms wall")


def test_a_speedup_gives_the_gpu_busy_ratio_beside_the_wall_clock_one() -> None:
    def trace(wall_ms: float, busy_ms: float) -> TraceSummary:
        return TraceSummary(steps=2, wall_seconds_per_step=wall_ms * MS, cpu_op_seconds_per_step=0.001,
                            cpu_ops_per_step=10, gpu_busy_seconds_per_step=busy_ms * MS, top_kernels=[],
                            categories={})

    configs = [_config("captured-direct", "captured-direct", [20, 20, 20], trace=trace(21, 15)),
               _config("te-graphed", "te", [40, 40, 40], trace=trace(41, 18))]
    (t,) = evaluate_targets(_report(configs), [_spec(metric="speedup", of="captured-direct", against="te-graphed",
                                                     min=2.0)])
    assert t.met is True and ("traced GPU busy per step: te-graphed 18.00 ms of 41.00 wall, captured-direct 15.00 of "
                              "21.00: on device work alone captured-direct is 1.20x") in t.note
    assert t.gpu_busy_value == (18 * MS) / (15 * MS)


def test_an_anchor_that_did_not_run_leaves_the_target_not_measured_never_met() -> None:
    configs = [_config("captured-direct", "captured-direct", [20, 20, 20]),
               _config("megatron-graphs", "megatron", None)]
    (t,) = evaluate_targets(_report(configs), [_spec(metric="speedup", of=FASTEST_CAPTURED,
                                                     against="megatron-graphs", min=1.5)])
    assert t.met is None and t.value is None and t.note == "not measured: megatron-graphs not run: not here"
    configs = [_config("te-graphed", "te", [40, 40, 40])]  # no captured configuration at all
    (t,) = evaluate_targets(_report(configs), [_spec(metric="speedup", of=FASTEST_CAPTURED, against="te-graphed",
                                                     min=2.0)])
    assert t.met is None and t.note == "not measured: no captured configuration ran"


def test_limit_ratio_host_ratio_and_which_reports_a_target_applies_to() -> None:
    configs = [_config("captured-direct", "captured-direct", [30, 31, 32])]
    r = _report(configs, hidden=4096)
    c = r.result("captured-direct")
    limit = r.floor.limit_seconds
    assert limit == r.floor.peak_rate_seconds + r.floor.optimizer_seconds and c.limit_seconds == limit
    assert r.floor.optimizer_bytes == 1000 * ADAMW_BYTES_PER_PARAM_FP32 and r.floor.optimizer_seconds == 28000 / 1e6
    assert r.floor.optimizer_bytes_layers_only == 500 * ADAMW_BYTES_PER_PARAM_BF16
    assert r.floor.peak_rate_seconds == r.matrix_flops.total / 1e6
    lim = _spec(metric="limit-ratio", of="captured-direct", max=2.0, hidden=[4096])
    (t,) = evaluate_targets(r, [lim])
    assert t.value == statistics.median([x * MS / limit for x in (30, 31, 32)]) and t.comparison == "<="
    assert t.met is (t.value <= 2.0) and t.note.startswith(f"limit {limit * 1e3:.2f} ms = peak-rate floor ")
    # the host queue time over the GPU step (no trace: the median wall step)
    c.host_seconds, c.host_median_seconds = [0.010, 0.012, 0.020], 0.012
    derive_ratios([c], r.floor)
    assert c.host_gpu_ratio == 0.012 / c.median_step_seconds and c.host_gpu_basis == "median wall step"
    host = _spec(metric="host-gpu-ratio", of="captured-direct", max=0.5)
    (t,) = evaluate_targets(r, [host])
    assert t.met is True and t.value == c.host_gpu_ratio and "host 12.00 ms over GPU 31.00 ms" in t.note
    # with a device trace, the GPU's busy time is the basis
    c.trace = TraceSummary(steps=1, wall_seconds_per_step=0.031, cpu_op_seconds_per_step=0.001, cpu_ops_per_step=1,
                           gpu_busy_seconds_per_step=0.020, gpu_idle_fraction=0.35, bound="host", kernels_per_step=9,
                           top_kernels=[], categories={"gemm": 0.015})
    derive_ratios([c], r.floor)
    assert c.host_gpu_ratio == 0.012 / 0.020 and c.host_gpu_basis == "traced GPU busy time per step"
    (t,) = evaluate_targets(r, [host])
    assert t.met is False and t.needed == "captured-direct queued in <= 10.00 ms (now 12.00 ms)"
    assert "captured-direct host by round 10.00, 12.00, 20.00 ms (x2.00" in t.note  # one timed step a round
    # by round, beside native eager's: how fast the machine's host itself ran in each round
    c.host_seconds = [0.010, 0.011, 0.012, 0.020, 0.021, 0.022, 0.011, 0.012, 0.013]
    native = _config("native-eager", "native", [100, 150, 110], host_seconds=[0.09] * 3 + [0.18] * 3 + [0.10] * 3)
    r2 = _report([c, native], hidden=4096)
    assert c.host_medians_by_round() == [0.011, 0.021, 0.012]
    (t,) = evaluate_targets(r2, [host])
    assert ("captured-direct host by round 11.00, 21.00, 12.00 ms (x1.91 slowest over fastest); "
            "native-eager host by round 90.00, 180.00, 100.00 ms (x2.00 slowest over fastest)") in t.note
    c.host_seconds = [0.01] * 4  # not a whole number of steps per round: nothing by round
    assert c.host_medians_by_round() == []
    # filters: another width or backend, the target is left out (not "not measured")
    assert evaluate_targets(_report(configs, hidden=2048), [lim]) == []
    assert evaluate_targets(_report(configs, backend="reference"), [_spec(**{**lim.model_dump(), "backend": ["te"]})]) == []


def test_a_missed_host_target_says_where_the_host_time_goes_by_phase() -> None:
    c = _config("captured-direct", "captured-direct", [10, 10, 10], host_seconds=[0.008] * 3,
                host_median_seconds=0.008,
                host_phase_seconds={"graph launches": [0.003, 0.004, 0.005], "input copies": [0.001] * 3,
                                    "streams and hand-offs": [0.0] * 3, "optimizer": [0.0005] * 3,
                                    "runtime": [0.002] * 3},
                host_phase_calls={"graph launches": 49.0, "input copies": 32.0, "streams and hand-offs": 0.0,
                                  "optimizer": 1.0})
    r = _report([c], hidden=2048)
    (t,) = evaluate_targets(r, [_spec(metric="host-gpu-ratio", of="captured-direct", max=0.5)])
    assert t.met is False
    assert t.where.endswith("captured-direct host: queues a step in 8.00 ms of 10.00 ms wall (graph launches "
                            "4.00 ms (49/step), input copies 1.00 ms (32/step), optimizer 0.50 ms (1/step), "
                            "runtime 2.00 ms)")  # a phase with no calls (no rank streams) left out
    c.host_phase_seconds, c.host_phase_calls = {}, {}  # an older report: the queue time alone
    (t,) = evaluate_targets(r, [_spec(metric="host-gpu-ratio", of="captured-direct", max=0.5)])
    assert t.where.endswith("captured-direct host: queues a step in 8.00 ms of 10.00 ms wall")


def test_losses_bitwise_counts_the_captured_configurations_off_native() -> None:
    configs = [_config("native-eager", "eager", [100, 100, 100], losses=[1.0, 2.0]),
               _config("captured-copy", "captured-copy", [20, 20, 20], losses=[1.0, 2.0]),
               _config("captured-direct", "captured-direct", [20, 20, 20], losses=[1.0, 2.0]),
               _config("captured-zbv-direct", "captured-direct", None),  # not run: not judged
               _config("te-graphed", "te", [40, 40, 40], losses=[])]
    r = _report(configs)
    spec = _spec(metric="losses-bitwise")
    (t,) = with_targets(r, [spec], source="f.toml").targets
    assert t.met is True and t.value == 0.0 and t.note == "compared: captured-copy, captured-direct"
    assert r.targets_source == "f.toml"
    r.result("captured-direct").losses = [1.0, 2.0000002]
    (t,) = with_targets(r, [spec]).targets
    assert t.met is False and t.value == 1.0 and "differ: captured-direct" in t.note and r.targets_source == "f.toml"
    r.result("captured-copy").status = "failed"
    (t,) = with_targets(r, [spec]).targets
    assert t.met is False and t.note == "failed: captured-copy"
    # no file: the saved targets stay
    assert with_targets(r).targets == [t]


# ------------------------------------------------------------------------------------------ rounds
def test_rounds_merge_into_one_result() -> None:
    def one(steps: list[float], host: list[float], losses: list[float], peak: int) -> ConfigResult:
        return ConfigResult(name="c", description="c", status="ok", step_seconds=steps, host_seconds=host,
                            losses=losses, median_step_seconds=statistics.median(steps), warmup_seconds=[9.0],
                            setup_seconds=10.0 + peak, peak_allocated_bytes=peak)

    rounds = [one([1.0, 3.0], [0.1, 0.2], [5.0, 6.0], 7), one([4.0, 4.0], [0.3, 0.4], [5.0, 6.0], 9),
              one([2.0, 2.5], [0.5, 0.6], [5.0, 6.0], 8)]
    for k, c in enumerate(rounds):  # the host's phases per timed step, round by round
        c.host_phase_seconds = {"graph launches": [k + 0.01, k + 0.02], "runtime": [k + 0.03, k + 0.04]}
    r = merge_rounds(rounds)
    assert r.host_phase_seconds == {"graph launches": [0.01, 0.02, 1.01, 1.02, 2.01, 2.02],
                                    "runtime": [0.03, 0.04, 1.03, 1.04, 2.03, 2.04]}
    assert r.host_phase_medians() == {"graph launches": statistics.median([1.01, 1.02]),
                                      "runtime": statistics.median([1.03, 1.04])}
    assert r.round_medians == [2.0, 4.0, 2.25] and r.median_step_seconds == 2.25
    assert r.step_seconds == [1.0, 3.0, 4.0, 4.0, 2.0, 2.5] and r.losses == [5.0, 6.0] * 3
    assert r.host_seconds == [0.1, 0.2, 0.3, 0.4, 0.5, 0.6] and r.host_median_seconds == 0.35
    assert r.setup_seconds == 17.0 and r.peak_allocated_bytes == 9 and r.spread.max == 4.0
    assert r.medians_by_round() == [2.0, 4.0, 2.25]
    assert merge_rounds(rounds[:1]).round_medians == [2.0]
    old = ConfigResult(name="c", description="c", status="ok", median_step_seconds=3.0)  # a report before rounds
    assert old.medians_by_round() == [3.0]


def test_rounds_interleave_the_configurations(monkeypatch) -> None:
    """ABC ABC ABC: each round times every configuration once, in the matrix's order; traces in the last."""
    import qeffect.profile.matrix as matrix

    calls: list[tuple[str, int]] = []

    def fake_time_runner(result, make, device, *, steps, warmup, trace_steps=0, sync=None):
        calls.append((result.name, trace_steps))
        result.step_seconds, result.host_seconds = [0.1] * steps, [0.01] * steps
        result.median_step_seconds = 0.1
        if result.name == "qeffect-eager" and len(calls) > 3:
            raise RuntimeError("round two breaks it")

    monkeypatch.setattr(matrix, "time_runner", fake_time_runner)
    cfg = load_config()
    specs = matrix.resolve_configs(["native-eager", "qeffect-eager", "captured-direct"])
    results = matrix._run_specs(cfg, specs, torch.device("cpu"), False, count_matrix_flops(cfg), steps=2, warmup=1,
                                trace_steps=1, say=lambda _m: None, rounds=3)
    assert calls == [("native-eager", 0), ("qeffect-eager", 0), ("native-eager", 0), ("qeffect-eager", 0),
                     ("native-eager", 1)]  # captured-direct: not run on a CPU; qeffect-eager failed in round 2
    native, qeff, direct = results
    assert native.round_medians == [0.1, 0.1, 0.1] and len(native.step_seconds) == 6
    assert qeff.status == "failed" and qeff.reason == "round 2: RuntimeError: round two breaks it"
    assert direct.status == "not run"


# ------------------------------------------------------------------------------------------- floors
def test_floors_are_named_by_method_and_add_up() -> None:
    cfg = load_config()
    flops = count_matrix_flops(cfg)
    rates = DeviceRates(square_gemm="s", fp8_tflops=2.0, gemm_method="g", copy_bytes=8, copy_bytes_per_second=4e9,
                        copy_method="c")
    params = optimizer_params(cfg)
    mc, h, layers = cfg.model, cfg.model.hidden, cfg.model.layers_per_chunk * cfg.pipeline.num_stages
    # qkv, proj, fc1, fc2 per layer; the model adds the head and both embeddings
    assert params[1] == layers * (3 * h * h + h * h + 2 * h * mc.ffn)
    # one process: the token table is row-lazy, only the rows a step touched are updated (left out)
    assert row_lazy_token_table(cfg) and params[0] == params[1] + h * mc.vocab_size + mc.seq_len * h
    dp = cfg.with_overrides(**{"pipeline.dp": 2})
    assert not row_lazy_token_table(dp)  # data parallel: a dense update of the table
    assert optimizer_params(dp)[0] == params[1] + h * mc.vocab_size + (mc.vocab_size + mc.seq_len) * h
    assert "row-lazy token table left out" in floor_of([], flops, rates, params, lazy_table=True).optimizer_method
    f = floor_of([], flops, rates, params)
    assert f.peak_rate_seconds == flops.total / 2e12 and f.peak_rate_seconds_layers_only == flops.layers_only / 2e12
    assert f.optimizer_seconds == params[0] * 28 / 4e9 and f.optimizer_seconds_layers_only == params[1] * 14 / 4e9
    assert f.limit_seconds == f.peak_rate_seconds + f.optimizer_seconds and f.limit_for(False) == f.limit_seconds
    assert f.limit_for(True) == f.peak_rate_seconds_layers_only + f.optimizer_seconds_layers_only
    assert "FP8 rate of one s GEMM, g" in f.peak_rate_method and f.optimizer_method.endswith(", c")
    assert floor_of([], flops).limit_seconds is None  # no device rates: the GEMM floor alone


def test_off_cuda_the_floor_says_it_timed_eagerly() -> None:
    x = torch.ones(8)
    seconds, reps, method = time_in_graph(lambda: x.add_(1), torch.device("cpu"), target_seconds=0.001)
    assert seconds > 0 and reps >= 3 and method == EAGER_METHOD
    rates = measure_device_rates("cpu", square=32, copy_bytes=1024, target_seconds=0.001)
    assert rates.fp8_tflops > 0 and rates.copy_bytes_per_second > 0 and rates.copy_bytes == 1024
    assert rates.gemm_method == EAGER_METHOD and EAGER_METHOD in rates.copy_method
    assert rates.copy_method.startswith("the faster of torch copy_ (a driver memcpy) and an elementwise kernel")


def test_saved_reports_are_judged_again_with_a_targets_file(capsys, tmp_path, monkeypatch) -> None:
    """`--report R --targets F` judges a saved report by F, also one written before rounds and the new floors."""
    monkeypatch.setenv("COLUMNS", "400")  # rich wraps titles at the terminal's width
    (tmp_path / "small.toml").write_text("[model]\nvocab_size = 512\n")
    out = tmp_path / "r.json"
    rc, _, _ = run(capsys, "profile", "--config", str(tmp_path / "small.toml"), "--device", "cpu", "--steps", "2",
                   "--warmup", "1", "--rounds", "1", "--configs", "native-eager,qeffect-eager", "--json", str(out))
    assert rc == 0
    f = tmp_path / "t.toml"
    f.write_text('[[target]]\nname = "eager-speed"\nmetric = "speedup"\nof = "qeffect-eager"\n'
                 'against = "native-eager"\nmin = 0.000001\n')
    judged = tmp_path / "judged.json"
    rc, text, _ = run(capsys, "profile", "--report", str(out), "--targets", str(f), "--json", str(judged))
    assert rc == 0 and "eager-speed" in text and "met" in text and "median of 1 per-round ratios" in text
    again = ProfileReport.model_validate_json(judged.read_text())
    assert [t.name for t in again.targets] == ["eager-speed"] and again.targets_source == str(f)
    assert again.configs == ProfileReport.model_validate_json(out.read_text()).configs  # measurements untouched
    assert "floor (a) GEMM" in text and "limit (b) + (c)" in text
    # a schema-6 report: no rounds, host times, limit or targets source
    raw = json.loads(out.read_text())
    raw["schema_version"] = 6
    for key in ("rounds", "targets_source"):
        del raw[key]
    for key in list(raw["floor"]):
        if key not in ("seconds", "seconds_layers_only", "effective_tflops", "peak_tflops"):
            del raw["floor"][key]
    for c in raw["configs"]:
        for key in ("round_medians", "host_seconds", "host_median_seconds", "host_gpu_ratio", "host_gpu_basis",
                    "limit_seconds", "limit_ratio", "variant"):
            c.pop(key, None)
    old = tmp_path / "v6.json"
    old.write_text(json.dumps(raw))
    f.write_text(f.read_text() + '[[target]]\nname = "lim"\nmetric = "limit-ratio"\nof = "qeffect-eager"\nmax = 9\n')
    rc, text, _ = run(capsys, "profile", "--report", str(old), "--targets", str(f))
    assert rc == 0 and "eager-speed" in text and "not in this report (older than them)" in text
    assert "eager back-to-back launches (an older report)" in text
    r = ProfileReport.model_validate_json(old.read_text())
    (speed, lim) = with_targets(r, load_targets(f, CONFIG_NAMES)).targets
    assert speed.met is True and "one round" in speed.note
    assert lim.met is None and "before the lower-bound floors" in lim.note


# ----------------------------------------------------------------------------------------- megatron
def test_megatron_graphs_runs_the_fastest_mode_that_finished() -> None:
    from qeffect.profile.megatron import MegatronGraphs, ModeRun, mode_run_of, not_available_reason, shape_of

    assert not_available_reason("cpu") == "Megatron-Core's CUDA graphs need a CUDA device (this run is on cpu)"
    cfg = load_config()
    shape = shape_of(cfg)
    assert shape["layers"] == cfg.model.layers_per_chunk * cfg.pipeline.pp * cfg.pipeline.chunks_per_rank
    # the child's JSON: capture steps left out, milliseconds to seconds, peak memory
    data = {"status": "finished", "step_times_ms": [900.0, 50, 50, 40, 10.0, 12.0, 11.0],
            "peak_allocated_bytes": 123, "peak_reserved_bytes": 456}
    m = mode_run_of("local", data, 0, "", skip=4)
    assert m.finished and m.step_seconds == [0.010, 0.012, 0.011] and m.peak_allocated_bytes == 123
    assert m.peak_reserved_bytes == 456
    failed = mode_run_of("full_iteration", {"status": "failed", "failure": {"type": "RuntimeError", "message": "boom",
                                                                            "stage": "step 3"}}, 3, "", skip=4)
    assert not failed.finished and failed.reason == "RuntimeError: boom (at step 3)"
    crashed = mode_run_of("local", {}, -9, "line\nKilled\n", skip=4)
    assert crashed.reason == "exit code -9: Killed"
    ran: list[str] = []

    def fake(cfg, mode, *, steps, warmup):
        ran.append(mode)
        ms = {"local": 30.0, "transformer_engine": 20.0}
        if mode not in ms:
            return ModeRun(mode, False, reason="no")
        return ModeRun(mode, True, step_seconds=[ms[mode] * MS] * steps, peak_allocated_bytes=5)

    mg = MegatronGraphs(cfg, steps=2, warmup=1, run=fake)
    first = mg.round()
    assert ran == ["local", "transformer_engine", "full_iteration"] and mg.mode == "transformer_engine"
    assert first.median == 0.020
    assert mg.choice_note() == ("fastest working mode transformer_engine of: local 30.00 ms, transformer_engine "
                                "20.00 ms, full_iteration failed (no)")
    mg.round()
    assert ran[3:] == ["transformer_engine"]  # later rounds: the chosen mode only
    mg._run = lambda *a, **k: ModeRun("transformer_engine", False, reason="Timeout")
    with pytest.raises(RuntimeError, match="transformer_engine mode finished an earlier round, not this one: Timeout"):
        mg.round()
    with pytest.raises(RuntimeError, match="no Megatron-Core CUDA-graph mode finished: local: no"):
        MegatronGraphs(cfg, steps=2, warmup=1, modes=("local",),
                       run=lambda *a, **k: ModeRun("local", False, reason="no")).round()


# ---------------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_each_gemm_floor_entry_is_at_most_its_traced_kernel_time() -> None:
    """A floor is a lower bound: each GEMM problem's floor per call is at most the kernel time the profiler
    traces for that GEMM run as the step runs it (eagerly, `fp8_mm`), the whole GEMM floor is at most a
    captured step's traced GEMM time, and the optimizer floor at most its traced optimizer time."""
    from torch.profiler import ProfilerActivity, profile

    from qeffect.fp8.gemm import fp8_mm
    from qeffect.profile.flops import gemm_problems, measure_gemm_rates
    from qeffect.profile.matrix import run_profile

    cfg = load_config().with_overrides(**{"train.device": "cuda"})
    device = torch.device("cuda")
    rates = measure_gemm_rates(cfg, device, torch.bfloat16)
    one = torch.ones((), device=device)
    for p, r in zip(gemm_problems(cfg, torch.bfloat16), rates, strict=True):
        a = torch.randn((p["m"], p["k"]), device=device).to(p["a_dtype"])
        b = torch.randn((p["n"], p["k"]), device=device).to(p["b_dtype"])
        fp8_mm(a, one, b, one, p["out_dtype"])
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(20):
                fp8_mm(a, one, b, one, p["out_dtype"])
            torch.cuda.synchronize()
        kernels = [e.end_ns() - e.start_ns() for e in prof.profiler.kineto_results.events()
                   if e.device_type() == torch.autograd.DeviceType.CUDA
                   and not e.name().startswith(("[", "Memcpy", "Memset"))]
        traced = statistics.median(kernels) * 1e-9 * len(kernels) / 20  # kernels per call (1 or a few)
        assert r.seconds_per_call <= traced, (p, r.seconds_per_call, traced)
        assert "CUDA graph" in r.method
    report = run_profile(cfg, steps=2, warmup=2, configs=["captured-direct"], trace_steps=2, rounds=1)
    direct = report.result("captured-direct")
    assert direct.trace is not None and report.floor.seconds <= direct.trace.categories["gemm"]
    assert report.floor.optimizer_seconds <= direct.trace.categories["optimizer"]  # AdamW's pass beats no floor
    assert report.floor.limit_seconds is not None and "CUDA graph" in report.floor.peak_rate_method


def test_megatron_child_process_is_read_from_its_json(tmp_path) -> None:
    """`run_mode` launches `python -m qeffect.audit.runner ...` and reads what the child wrote (here a stand-in
    interpreter that writes the runner's JSON), leaving the capture steps out."""
    import sys

    from qeffect.profile.megatron import CAPTURE_STEPS, run_mode

    fake = tmp_path / "python"
    fake.write_text(f"#!{sys.executable}\n" + '''
import json, sys
args = sys.argv[1:]
assert args[:2] == ["-m", "qeffect.audit.runner"], args
opt = dict(zip(args[2::2], args[3::2]))
shape = json.loads(opt["--shape"])
steps = int(opt["--steps"])
ok = opt["--mode"] == "local"
data = {"status": "finished" if ok else "failed", "step_times_ms": [100.0] * 4 + [float(shape["hidden"])] * (steps - 4),
        "peak_allocated_bytes": 77, "failure": None if ok else {"type": "X", "message": "no", "stage": "setup"}}
open(opt["--json"], "w").write(json.dumps(data))
sys.exit(0 if ok else 3)
''')
    fake.chmod(0o755)
    cfg = load_config()
    m = run_mode(cfg, "local", steps=3, warmup=1, python=str(fake))
    assert CAPTURE_STEPS + 1 == 4 and m.finished and m.step_seconds == [cfg.model.hidden * 1e-3] * 3
    assert m.peak_allocated_bytes == 77 and m.setup_seconds is not None
    bad = run_mode(cfg, "full_iteration", steps=3, warmup=1, python=str(fake))
    assert not bad.finished and bad.reason == "X: no (at setup)"
