"""`qeffect profile`: report schema, not-run records, break-even arithmetic, FLOP count, resource analysis,
CLI exit codes, figures and the profiler trace summary. One real profile run (tiny shape, 1 warm-up + 2 timed
steps + 1 traced step) serves most tests.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import pytest
import torch

from qeffect.cli.app import main
from qeffect.config import RunConfig, bit_changing_fields, load_config
from qeffect.fp8.te import te_available
from qeffect.graphs.binding import graph_plan
from qeffect.graphs.handshake import run_settings
from qeffect.profile.flops import count_matrix_flops, gemm_problems
from qeffect.profile.report import SCHEMA_VERSION, ProfileReport, Spread, TraceSummary, break_even_steps
from qeffect.profile.resources import parse_microbatches, resource_rows
from qeffect.profile.targets import with_targets
from qeffect.profile.trace import (
    CATEGORY_NAMES,
    WINDOW,
    Event,
    category,
    clip_to_windows,
    merge_intervals,
    summarize,
    trace_line,
    union_length,
)
from qeffect.runtime.build import build_single_process
from qeffect.schedule import build_schedule, max_live_tapes, max_pending_dw
from qeffect.schedule.liveness import slots_for
from qeffect.stage.actions import arena_name

# The embedded tiny config with a small vocabulary (the head GEMM dominates a CPU step otherwise).
SMALL = "[model]\nvocab_size = 512\n"


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exc:
        main(list(argv))
    out, err = capsys.readouterr()
    return int(exc.value.code or 0), out, err


@pytest.fixture(scope="module")
def profiled(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, ProfileReport]:
    """One CPU run of the whole matrix through the CLI; the JSON it wrote and the parsed report."""
    d = tmp_path_factory.mktemp("profile")
    (d / "small.toml").write_text(SMALL)
    out = d / "report.json"
    with pytest.raises(SystemExit) as exc:
        main(["profile", "--config", str(d / "small.toml"), "--device", "cpu", "--steps", "2", "--warmup", "1",
              "--microbatches", "2,4", "--trace", "1", "--rounds", "2", "--json", str(out)])
    assert exc.value.code in (0, None)
    return out, ProfileReport.model_validate_json(out.read_text())


# ------------------------------------------------------------------------------------------- report
def test_report_schema_round_trip(profiled) -> None:
    path, report = profiled
    raw = json.loads(path.read_text())
    assert raw["schema_version"] == SCHEMA_VERSION and raw["kind"] == "profile"
    again = ProfileReport.model_validate_json(report.model_dump_json())
    assert again == report
    assert report.command.startswith("qeffect profile --config ") and "--microbatches 2,4" in report.command
    assert "--trace 1" in report.command and report.trace_steps == 1
    assert raw["configs"][0]["trace"]["steps"] == 1 and again.result("native-eager").trace is not None
    assert report.device == "cpu" and report.torch_version == torch.__version__
    # the settings it ran under: every bit-changing one and the [runtime] section; no environment
    assert report.settings == run_settings(RunConfig.model_validate(report.config)) and report.environment == {}
    assert report.settings["model.vocab_size"] == 512 and report.settings["runtime.rank_streams"] is True
    assert set(bit_changing_fields()) < set(report.settings)
    assert report.init_draw_seconds is not None and report.init_draw_seconds > 0  # drawn once, outside setups
    q = report.result("qeffect-eager")
    assert q.losses_equal_native is True and q.non_finite_losses == 0 and len(q.losses) == 6  # 2 rounds x 3
    assert report.rounds == 2 and "--rounds 2" in report.command
    assert report.result("native-eager").losses_equal_native is None
    assert [c.name for c in report.configs] == ["native-eager", "qeffect-eager", "captured-copy", "captured-direct",
                                                "captured-zbv-direct", "captured-direct-launched", "te-graphed",
                                                "te-graphed-model", "te-graphed-mcore", "megatron-graphs"]


def test_losses_off_native_or_not_finite_are_flagged(profiled, capsys) -> None:
    _, report = profiled
    r = ProfileReport.model_validate_json(report.model_dump_json())
    q = r.result("qeffect-eager")
    q.losses = [q.losses[0], float("nan"), q.losses[2] + 1e-6]
    with_targets(r)
    assert q.losses_equal_native is False and q.non_finite_losses == 1
    from rich.console import Console

    from qeffect.cli.profile import render

    console = Console(width=200, record=True)
    render(r, console)
    text = console.export_text()
    assert "qeffect-eager: 1 of 3 are NaN or infinite" in text and "qeffect-eager: not native eager's" in text


def test_ran_configurations_have_raw_timings_and_summaries(profiled) -> None:
    _, report = profiled
    for name in ("native-eager", "qeffect-eager"):
        c = report.result(name)
        assert c.status == "ok" and c.reason is None
        # two rounds of 1 warm-up + 2 timed steps: the first round's warm-up, every round's timed steps
        assert len(c.warmup_seconds) == 1 and len(c.step_seconds) == 4 and len(c.host_seconds) == 4
        assert c.round_medians == [statistics.median(c.step_seconds[:2]), statistics.median(c.step_seconds[2:])]
        assert c.median_step_seconds == statistics.median(c.round_medians)
        assert c.host_median_seconds == statistics.median(c.host_seconds)
        assert all(0 < h <= t for h, t in zip(c.host_seconds, c.step_seconds, strict=True))
        assert c.host_gpu_ratio == c.host_median_seconds / c.median_step_seconds  # no device trace: the wall
        assert c.host_gpu_basis == "median wall step"
        assert c.spread.min == min(c.step_seconds) and c.spread.max == max(c.step_seconds)
        assert c.first_step_seconds == c.warmup_seconds[0]
        assert c.setup_seconds == c.build_seconds + c.first_step_seconds
        # where the build went, in build order, inside the build's own time
        assert list(c.setup_phases) == ["modules", "values", "ranks"]  # eager: nothing captured
        assert all(v >= 0 for v in c.setup_phases.values()) and sum(c.setup_phases.values()) <= c.build_seconds
        assert c.setup_line().startswith(f"{c.setup_seconds:.2f} s = modules ")
        assert c.setup_line().endswith(f" + first step {c.first_step_seconds:.2f}")
        assert c.floor_ratio == c.median_step_seconds / report.floor.seconds
        assert c.matrix_flops == report.matrix_flops.total
        # CPU: memory is not measured, and says why
        assert c.peak_allocated_bytes is None and c.persistent_growth_bytes_per_step is None
        assert "CUDA" in c.memory_note
        assert c.graph_count == 0 and c.replays_per_step == 0 and c.handoffs_per_step == 0
        # the host's queue time by phase, per phased step (eager: no launches or copies; the commit once a step)
        assert list(c.host_phase_seconds) == ["graph launches", "input copies", "streams and hand-offs",
                                              "optimizer", "runtime"]
        # (over min(steps, PHASE_STEPS) more steps a round, after the timed ones)
        assert all(len(v) == len(c.host_seconds) for v in c.host_phase_seconds.values())
        assert all(min(v) >= 0 for v in c.host_phase_seconds.values())
        assert c.host_phase_calls["optimizer"] == 1 and c.host_phase_calls["graph launches"] == 0
        assert c.host_phase_line().startswith("optimizer ") and "runtime " in c.host_phase_line()
    # one model, one data sequence: the split eager run computes the same losses, bit for bit
    native, qeff = report.result("native-eager"), report.result("qeffect-eager")
    assert len(native.losses) == 6 and native.losses == qeff.losses
    assert native.losses[:3] == native.losses[3:]  # every round starts from the same weights and data
    assert native.arena_bytes is None and qeff.arena_bytes > 0
    assert qeff.speedup_vs_native == native.median_step_seconds / qeff.median_step_seconds
    assert qeff.break_even_steps == break_even_steps(qeff.setup_seconds, qeff.median_step_seconds,
                                                     native.setup_seconds, native.median_step_seconds)


def test_not_run_records_say_why(profiled) -> None:
    _, report = profiled
    for name in ("captured-copy", "captured-direct", "captured-zbv-direct", "captured-direct-launched"):
        c = report.result(name)
        assert c.status == "not run" and "needs a CUDA device" in c.reason
        assert c.step_seconds == [] and c.median_step_seconds is None and c.setup_seconds is None
        assert c.break_even_steps is None and c.floor_ratio is None
    m = report.result("megatron-graphs")  # an anchor in a child process: needs TE, megatron-core and CUDA
    assert m.status == "not run" and m.reason in ("Transformer Engine not importable (Megatron-Core's FP8 runs on it)",
                                                  "Megatron-Core's CUDA graphs need a CUDA device (this run is on cpu)")
    for name in ("te-graphed", "te-graphed-model", "te-graphed-mcore"):
        te = report.result(name)
        assert te.status == "not run" and te.median_step_seconds is None
        assert te.reason == ("Transformer Engine not importable" if not te_available()
                             else "make_graphed_callables captures CUDA graphs; needs a CUDA device (this run is on cpu)")


def test_break_even_arithmetic() -> None:
    # 8 s more setup, 2 s saved per step -> 4 steps
    assert break_even_steps(setup=10.0, step=1.0, ref_setup=2.0, ref_step=3.0) == 4.0
    # faster and cheaper to set up: even from the start
    assert break_even_steps(setup=1.0, step=1.0, ref_setup=2.0, ref_step=3.0) == 0.0
    # not faster per step: never, whatever the setup
    assert break_even_steps(setup=1.0, step=3.0, ref_setup=2.0, ref_step=3.0) is None
    assert break_even_steps(setup=1.0, step=4.0, ref_setup=9.0, ref_step=3.0) is None
    assert break_even_steps(setup=3.5, step=0.25, ref_setup=1.0, ref_step=0.5) == 10.0


def test_spread() -> None:
    s = Spread.of([5.0, 1.0, 3.0, 2.0, 4.0])
    assert (s.min, s.q1, s.median, s.q3, s.max) == (1.0, 2.0, 3.0, 4.0, 5.0)
    one = Spread.of([0.5])
    assert one.min == one.median == one.max == 0.5


# -------------------------------------------------------------------------------------------- FLOPs
def _hand_cfg():
    return load_config(None).with_overrides(**{
        "model.hidden": 8, "model.ffn": 32, "model.heads": 2, "model.vocab_size": 16, "model.seq_len": 4,
        "model.microbatch_size": 2, "pipeline.pp": 2, "pipeline.chunks_per_rank": 1, "pipeline.microbatches": 3})


def test_flop_count_matches_hand_count() -> None:
    f = count_matrix_flops(_hand_cfg())
    # N = 2 x 4 = 8 tokens, M = 3, 2 layers. in*out per layer: qkv 8*24 + proj 8*8 + fc1 8*32 + fc2 32*8
    # = 192 + 64 + 256 + 256 = 768; two layers 1536; head 8*16 = 128. Forward 2*N*in*out, backward twice it.
    assert f.tokens_per_microbatch == 8 and f.microbatches == 3
    assert f.total == 6 * 8 * 3 * (1536 + 128) == 239_616
    assert f.layers_only == 6 * 8 * 3 * 1536 == 221_184
    head = next(r for r in f.linears if r.name == "head")
    assert (head.forward_flops, head.backward_flops) == (2 * 8 * 3 * 128, 4 * 8 * 3 * 128)
    # the GEMM problems timed for the floor are exactly the counted FLOPs
    probs = gemm_problems(_hand_cfg(), torch.float32)
    assert len(probs) == 15
    assert sum(p["calls_per_step"] * 2 * p["m"] * p["n"] * p["k"] for p in probs) == f.total


def test_flop_count_matches_the_gemms_a_step_runs(monkeypatch) -> None:
    """Count every fp8_mm the native reference runs in one step: the same FLOPs as the formula."""
    import qeffect.fp8.reference as ref
    from qeffect.verify.state import synthetic_batches

    cfg = _hand_cfg()
    seen = []
    real = ref.fp8_mm

    def counting(a, a_s, b, b_s, out_dtype, out=None, bias=None):
        seen.append(2 * a.shape[0] * b.shape[0] * a.shape[1])
        return real(a, a_s, b, b_s, out_dtype, out=out, bias=bias)

    monkeypatch.setattr(ref, "fp8_mm", counting)
    pipe = build_single_process(cfg, native=True, device="cpu")
    pipe.step(synthetic_batches(cfg, 0, "cpu"))
    assert sum(seen) == count_matrix_flops(cfg).total
    assert len(seen) == 3 * (2 * 4 + 1) * 3  # (forward, dgrad, wgrad) x (2 layers x 4 linears + head) x M


# ---------------------------------------------------------------------------------------- resources
def test_resource_analysis_against_schedule_helpers(profiled) -> None:
    def names(rank, stage: int) -> list[str]:  # the arena names of one chunk's matrix parameters
        return [arena_name(stage, f"{n}.weight") for n in rank.chunks[stage].matrix_linears()]

    cfg = load_config(None).with_overrides(**{"model.vocab_size": 512})
    p = cfg.pipeline
    rows = resource_rows(cfg, [2, 4], ["interleaved", "zbv"])
    assert [(r.schedule, r.microbatches) for r in rows] == [("interleaved", 2), ("interleaved", 4), ("zbv", 2),
                                                            ("zbv", 4)]
    for r in rows:
        sch = build_schedule(r.schedule, p.pp, p.chunks_per_rank, r.microbatches)
        live, pending = max_live_tapes(sch), max_pending_dw(sch)
        assert r.max_live_tapes == [live[k] for k in range(p.pp)]
        assert r.max_pending_dw == [pending[k] for k in range(p.pp)]
        # the plan of captured-direct: bounded by the schedule's liveness, never above one graph per action
        assert r.graph_slots == slots_for(sch)
        assert r.graphs_per_rank == max(r.graphs_per_rank_by_rank) <= 3 * r.microbatches * p.chunks_per_rank
        assert r.graph_count == sum(r.graphs_per_rank_by_rank)
        assert r.capture_host_seconds is None and "CUDA" in r.capture_note
    # the arena layout on the meta device is the one the built ranks allocate
    for r in rows:
        c = cfg.with_overrides(**{"pipeline.microbatches": r.microbatches, "pipeline.schedule": r.schedule})
        pipe = build_single_process(c, native=False, device="cpu")
        assert r.arena_bytes_per_rank == [rank.arena.nbytes for rank in pipe.ranks]
        k = slots_for(pipe.schedule)  # the meta arenas' writes are the built ones'
        assert r.graphs_per_rank_by_rank == [
            sum(graph_plan(r.microbatches, k[s], dw_variant=lambda m, a=rank.arena, n=names(rank, s):
                           a.write_signature(m, n)).graph_count for s in rank.chunks) for rank in pipe.ranks]
        assert r.arena_bytes == sum(r.arena_bytes_per_rank)
    # and the profile run recorded the same rows and the measured arena of its qeffect pipeline
    _, report = profiled
    assert report.resources == rows
    assert report.result("qeffect-eager").arena_bytes == rows[1].arena_bytes


def test_parse_microbatches() -> None:
    assert parse_microbatches("2,4,8,16") == [2, 4, 8, 16]
    assert parse_microbatches(" 4 ") == [4]
    for bad in ("", "2,,4", "2,x", "0", "-2", "2.5", "4,4"):
        with pytest.raises(ValueError):
            parse_microbatches(bad)


# ---------------------------------------------------------------------------------------------- CLI
@pytest.mark.parametrize("argv", [
    ["--microbatches", "2,x"],
    ["--microbatches", ""],
    ["--microbatches", "0"],
    ["--microbatches", "2,5"],  # interleaved 1F1B with pp=2 rejects M=5
    ["--configs", "native-eager,bogus"],
    ["--steps", "0"],
    ["--warmup", "0"],
    ["--trace", "-1"],
    ["--device", "gpu"],
    ["--report", "/nonexistent/report.json"],
])
def test_bad_input_is_one_line_exit_2(capsys, argv: list[str]) -> None:
    rc, _, err = run(capsys, "profile", *argv)
    assert rc == 2
    assert len(err.strip().splitlines()) == 1 and err.startswith("qeffect: error:")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_without_cuda_exit_2(capsys) -> None:
    rc, _, err = run(capsys, "profile", "--device", "cuda")
    assert rc == 2 and "CUDA is not available" in err and len(err.strip().splitlines()) == 1


@pytest.mark.skipif(te_available(), reason="Transformer Engine is importable here")
def test_te_backend_without_te_exit_2(capsys) -> None:
    rc, _, err = run(capsys, "profile", "--backend", "te")
    assert rc == 2 and "Transformer Engine" in err and len(err.strip().splitlines()) == 1


def test_plot_without_matplotlib_exit_2(capsys, monkeypatch, tmp_path) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` now raises ImportError
    rc, _, err = run(capsys, "profile", "--plot", str(tmp_path / "figs"))
    assert rc == 2 and "matplotlib" in err
    assert not (tmp_path / "figs").exists()


def test_unreadable_report_exit_1(capsys, tmp_path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text('{"kind": "capture"}')
    rc, _, err = run(capsys, "profile", "--report", str(bad))
    assert rc == 1 and "not a qeffect profile report" in err


def test_saved_report_renders(capsys, profiled) -> None:
    path, _ = profiled
    rc, out, _ = run(capsys, "profile", "--report", str(path))
    assert rc == 0
    assert "native-eager" in out and "not run: te-graphed" in out and "resource analysis over M" in out
    assert "native-eager: trace: wall " in out and "qeffect-eager: trace: wall " in out and "(+ 1 traced)" in out
    assert "host queue time per step by phase" in " ".join(out.split())
    assert "qeffect-eager: optimizer " in out and "(timed steps: " in " ".join(out.split())


def test_version_1_report_still_renders(capsys, profiled, tmp_path) -> None:
    """A report written before traces existed (schema 1, no trace fields) loads; an unknown version does not."""
    path, _ = profiled
    raw = json.loads(path.read_text())
    raw["schema_version"] = 1
    del raw["trace_steps"], raw["settings"]
    raw["environment"] = {"QEFFECT_FUSED_TRANSPOSE": "kernel"}  # what reports recorded before settings
    for c in raw["configs"]:
        del c["trace"], c["trace_error"]
    old = tmp_path / "v1.json"
    old.write_text(json.dumps(raw))
    rc, out, _ = run(capsys, "profile", "--report", str(old))
    assert rc == 0 and "native-eager" in out and "trace:" not in out
    raw["schema_version"] = 99
    old.write_text(json.dumps(raw))
    rc, _, err = run(capsys, "profile", "--report", str(old))
    assert rc == 1 and "schema 99" in err


def test_plot_files(capsys, profiled, tmp_path) -> None:
    pytest.importorskip("matplotlib")
    path, _ = profiled
    rc, out, _ = run(capsys, "profile", "--report", str(path), "--plot", str(tmp_path / "figs"))
    assert rc == 0
    for name in ("step_times.png", "break_even.png", "m_scaling.png"):
        f = tmp_path / "figs" / name
        assert f.is_file() and f.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f.stat().st_size > 5000
        assert str(f) in out


# ---------------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_profile_on_cuda(capsys, tmp_path) -> None:
    out = tmp_path / "r.json"
    rc, _, _ = run(capsys, "profile", "--device", "cuda", "--steps", "3", "--warmup", "2", "--microbatches", "2,4",
                   "--json", str(out))
    assert rc == 0
    report = ProfileReport.model_validate_json(out.read_text())
    p = load_config(None).pipeline
    for name in ("captured-copy", "captured-direct", "captured-zbv-direct", "captured-direct-launched"):
        c = report.result(name)
        assert c.status == "ok", c.reason
        assert c.graphs_per_rank <= 3 * p.microbatches * p.chunks_per_rank  # bounded by liveness
        assert c.replays_per_step == 3 * p.microbatches * p.chunks_per_rank * p.pp  # one replay per action
        assert c.handoffs_per_step == 0  # stream-ordered replay: no caller/graph edge
        assert c.persistent_growth_bytes_per_step == 0
        assert c.losses == report.result("native-eager").losses
        # the capture is a phase of its own, after every rank is built; it holds the graphs' capture host time
        assert list(c.setup_phases) == ["modules", "values", "ranks", "capture"]
        assert c.setup_phases["capture"] >= c.capture_host_seconds > 0
        # the host's phases: a launch per replay (with a step graph, runtime.step_graph = auto on one-process
        # captured-direct, one launch and no input copies), the commit once a step, stream switches and hand-offs
        calls = c.host_phase_calls
        if name in ("captured-direct", "captured-zbv-direct"):
            assert calls["graph launches"] == 1 and calls["input copies"] == 0
        else:
            assert calls["graph launches"] == c.replays_per_step and calls["input copies"] > 0
        assert calls["optimizer"] == 1 and calls["streams and hand-offs"] > 0
        assert all(min(v) >= 0 for v in c.host_phase_seconds.values())
    for c in report.configs:
        if c.status == "ok":
            assert c.peak_allocated_bytes > 0 and c.peak_reserved_bytes >= c.peak_allocated_bytes
    assert all(r.capture_host_seconds is not None and r.graphs_captured_per_rank == r.graphs_per_rank
               for r in report.resources)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or not te_available(), reason="needs CUDA and Transformer Engine")
def test_te_anchors_on_cuda(capsys, tmp_path) -> None:
    """The TE references run: TE's graphed layers alone, the same graphs in the whole model (fp32 masters,
    the run's token data and loss: finite losses, one forward and one backward graph per layer), and that
    model as Megatron-LM sets TE up."""
    cfg = tmp_path / "te.toml"
    text = (Path(__file__).parents[1] / "src/qeffect/configs/tiny.toml").read_text()
    cfg.write_text(text.replace('backend = "reference"', 'backend = "te"').replace('device = "cpu"', 'device = "cuda"'))
    out = tmp_path / "r.json"
    rc, _, _ = run(capsys, "profile", "--config", str(cfg), "--steps", "3", "--warmup", "2", "--rounds", "1",
                   "--configs", "te-graphed,te-graphed-model,te-graphed-mcore", "--json", str(out))
    assert rc == 0
    report = ProfileReport.model_validate_json(out.read_text())
    layers, model, mcore = (report.result(n) for n in ("te-graphed", "te-graphed-model", "te-graphed-mcore"))
    for c in (layers, model, mcore):
        assert c.status == "ok", c.reason
        assert c.graph_count == 2 * 4 and c.replays_per_step == 2 * 4 * 4  # 4 layers, 4 microbatches
        assert len(c.step_seconds) == 3 and c.peak_allocated_bytes > 0
    assert layers.losses == [] and layers.matrix_flops == report.matrix_flops.layers_only
    for c in (model, mcore):
        assert len(c.losses) == 5 and c.non_finite_losses == 0 and c.matrix_flops == report.matrix_flops.total
        assert c.losses_equal_native is None  # another implementation: nothing to compare bit for bit
    # TE's own modules joined TE's global delayed-scaling buffers; between configurations they are emptied
    from transformer_engine.pytorch.quantization import FP8GlobalStateManager

    from qeffect.profile.matrix import release_memory

    release_memory(torch.device("cuda"))
    assert FP8GlobalStateManager.quantization_state.global_amax_buffer == {}


def test_between_configurations_te_global_amax_buffers_are_emptied(monkeypatch) -> None:
    """TE's process-global delayed-scaling buffers (filled by TE's own modules, e.g. the anchors) are emptied
    between configurations, or the next one's autocast exits update the last one's modules too; where TE was
    never imported nothing is imported."""
    import sys
    import types

    from qeffect.fp8.te import clear_global_amax_buffers
    from qeffect.profile.matrix import release_memory

    monkeypatch.delitem(sys.modules, "transformer_engine.pytorch.quantization", raising=False)
    assert clear_global_amax_buffers() == 0 and "transformer_engine.pytorch.quantization" not in sys.modules
    state = types.SimpleNamespace(global_amax_buffer={"forward_r": [1, 2], "backward_r": [3]},
                                  global_amax_history_buffer={"forward_r": [4, 5], "backward_r": [6]},
                                  global_scale_buffer={"forward_r": [7, 8], "backward_r": [9]})
    fake = types.SimpleNamespace(FP8GlobalStateManager=types.SimpleNamespace(quantization_state=state))
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch.quantization", fake)
    assert clear_global_amax_buffers() == 3
    assert state.global_amax_buffer == state.global_amax_history_buffer == state.global_scale_buffer == {}
    state.global_amax_buffer["forward_r"] = [1]
    release_memory(torch.device("cpu"))
    assert state.global_amax_buffer == {}


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or not te_available(), reason="needs CUDA and Transformer Engine")
def test_the_whole_model_reference_is_the_runs_model_in_size_and_precision() -> None:
    """te-graphed-model holds as many fp32 parameters as the run's model (embeddings, layers, final norm
    and head; no more, no fewer), and its first loss on the run's tokens is about ln(vocabulary) at init."""
    import math

    from qeffect.profile.te_anchor import TEGraphedModel
    from qeffect.runtime.build import build_chunks_for

    cfg = load_config(None).with_overrides(**{"fp8.backend": "te", "train.device": "cuda"})
    device = torch.device("cuda")
    ours = sum(p.numel() for c in build_chunks_for(cfg, device).values() for p in c.parameters())
    anchor = TEGraphedModel(cfg, device)
    assert sum(p.numel() for p in anchor.params) == ours
    assert {p.dtype for p in anchor.params} == {torch.float32}
    loss = float(anchor.step(anchor.data(0)))
    assert abs(loss - math.log(cfg.model.vocab_size)) < 0.5, loss


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or not te_available(), reason="needs CUDA and Transformer Engine")
def test_the_megatron_setup_accumulates_the_same_gradients_as_te_defaults() -> None:
    """te-graphed-mcore's fused accumulation sums what autograd sums: with fused wgrad alone, from the same
    initial weights and tokens, the gradients the wgrad GEMMs accumulate into `main_grad` (every microbatch,
    two steps, so the per-step zeroing counts) are te-graphed-model's `.grad` (measured equal on the H200; a
    tolerance of 1e-4 since two TE code paths make no bitwise promise). Dropping a microbatch's accumulation
    or a step's zeroing is off by about 1/M or more.

    With FP8 weight caching as well (te-graphed-mcore itself) the gradients are not te-graphed-model's (10-17%
    apart on the tiny model, measured at b822b6f, also after a first step without update): TE casts a
    step's weights once instead of per microbatch; on the first step the head's weights keep their first cast,
    made before any amax history, for every microbatch. It still trains the same model: the same losses to
    1e-2 (1.5e-3 apart after the first update), and every TE weight moves by its `main_grad` each step."""
    from transformer_engine.pytorch.quantization import FP8GlobalStateManager

    from qeffect.profile.te_anchor import TEGraphedMcore, TEGraphedModel

    class FusedOnly(TEGraphedModel):
        fused_wgrad = True

    cfg = load_config(None).with_overrides(**{"fp8.backend": "te", "train.device": "cuda"})
    device = torch.device("cuda")
    state = FP8GlobalStateManager.quantization_state
    flag = state.skip_fp8_weight_update_tensor  # TE's global, which later graphs of TE modules would read
    model, fused, mcore = TEGraphedModel(cfg, device), FusedOnly(cfg, device), TEGraphedMcore(cfg, device)
    assert state.skip_fp8_weight_update_tensor is flag and mcore._skip_flag is not None
    assert len(fused.fused_weights) == len(mcore.fused_weights) == 4 * 4 + 1  # 4 per layer and the head
    assert all(p.grad is None for p in mcore.fused_weights) and not model.fused_weights
    for other in (fused, mcore):
        assert all(torch.equal(a, b) for a, b in zip(model.params, other.params, strict=True))  # the same init
    for step in range(3):
        data = model.data(step)
        before = [p.detach().clone() for p in mcore.fused_weights]
        la, lf, lm = model.accumulate(data), fused.accumulate(data), mcore.accumulate(data)
        assert float(la) == float(lf) and abs(float(la) - float(lm)) < 1e-2 * abs(float(la)), (step, la, lf, lm)
        rel = {n: float((model.gradient(a) - fused.gradient(b)).norm() / model.gradient(a).norm())
               for n, a, b in zip(model.param_names, model.params, fused.params, strict=True)}
        worst = max(rel.items(), key=lambda kv: kv[1])
        assert worst[1] < 1e-4, (step, worst)
        for anchor in (model, fused, mcore):
            anchor.update()
        for anchor in (fused, mcore):
            assert float(anchor.main_grad.abs().max()) == 0.0 and all(p.grad is None for p in anchor.fused_weights)
        assert not any(torch.equal(p, w) for p, w in zip(mcore.fused_weights, before, strict=True))
        assert state.skip_fp8_weight_update_tensor is flag  # the anchor's own only while it steps


def test_help_names_every_configuration(capsys) -> None:
    from qeffect.profile.matrix import CONFIG_NAMES

    rc, out, _ = run(capsys, "profile", "--help")
    assert rc == 0
    flat = "".join(out.split())  # help text wraps lines (also at hyphens)
    assert all(name in flat for name in CONFIG_NAMES)


# -------------------------------------------------------------------------------------------- trace
def test_trace_summary_on_cpu(profiled) -> None:
    """The traced step of each configuration that ran: host fields set, CUDA fields null, timings untouched."""
    _, report = profiled
    for name in ("native-eager", "qeffect-eager"):
        c = report.result(name)
        t = c.trace
        assert c.trace_error is None and t is not None and t.steps == 1
        assert len(c.step_seconds) == 4 and len(c.losses) == 6  # the traced step is not in the timings (2 rounds)
        assert t.gpu_busy_seconds_per_step is None and t.gpu_kernel_seconds_per_step is None
        assert t.gpu_idle_fraction is None and t.kernels_per_step is None and t.bound is None
        assert t.memcpy_seconds_per_step is None and t.memset_seconds_per_step is None
        assert 0 < t.cpu_op_seconds_per_step <= t.wall_seconds_per_step and t.cpu_ops_per_step >= 1
        assert 1 <= len(t.top_kernels) <= 10 and all(k.name.startswith("aten::") for k in t.top_kernels)
        secs = [k.seconds_per_step for k in t.top_kernels]
        assert secs == sorted(secs, reverse=True) and secs[0] > 0
        assert all(0 <= k.fraction <= 1 and k.calls_per_step >= 1 for k in t.top_kernels)
        assert list(t.categories) == list(CATEGORY_NAMES)
        # self times do not nest: they add up to at most the time in top-level ops (up to float rounding)
        assert 0 < sum(t.categories.values()) <= t.cpu_op_seconds_per_step * (1 + 1e-12)
        assert t.cpu_op_seconds_per_step <= t.wall_seconds_per_step
        assert t.categories["gemm"] > 0  # the reference backend's aten::mm
        assert TraceSummary.model_validate_json(t.model_dump_json()) == t


@pytest.mark.parametrize(("intervals", "merged"), [
    ([], []),
    ([(0, 10), (5, 15)], [(0, 15)]),  # overlapping
    ([(0, 100), (10, 20), (30, 40)], [(0, 100)]),  # nested
    ([(20, 30), (0, 10)], [(0, 10), (20, 30)]),  # disjoint, unsorted
    ([(0, 10), (10, 20)], [(0, 20)]),  # touching
    ([(0, 10), (2, 4), (8, 12), (20, 25), (21, 22), (5, 5)], [(0, 12), (20, 25)]),  # mixed; an empty one
])
def test_interval_union(intervals, merged) -> None:
    assert merge_intervals(intervals) == merged
    assert union_length(intervals) == sum(e - s for s, e in merged)


def test_clip_to_windows() -> None:
    windows = [(10, 20), (30, 40)]
    assert clip_to_windows(0, 5, windows) == []
    assert clip_to_windows(5, 15, windows) == [(10, 15)]
    assert clip_to_windows(12, 35, windows) == [(12, 20), (30, 35)]
    assert clip_to_windows(22, 28, windows) == []
    assert clip_to_windows(35, 50, windows) == [(35, 40)]


def test_summarize_cuda_by_hand() -> None:
    """Two traced steps, hand-made: overlapping streams count once in busy time, data-making is outside."""
    us = 1000
    ev = [
        Event(WINDOW, "window", 0, 100 * us), Event(WINDOW, "window", 200 * us, 300 * us),
        Event("Memcpy HtoD (Pageable -> Device)", "memcpy", -20 * us, -10 * us),  # the next step's data: outside
        Event("aten::mm", "op", 1 * us, 9 * us, thread=1),
        Event("aten::linear", "op", 0, 10 * us, thread=1),  # contains aten::mm: one top-level op
        Event("aten::add", "op", 210 * us, 220 * us, thread=1),
        Event("nvjet_tst_e4m3_gemm", "kernel", 10 * us, 50 * us),
        Event("vectorized_elementwise_kernel<Float8_e4m3fn>", "kernel", 40 * us, 60 * us),  # second stream
        Event("Memset (Device)", "memset", 70 * us, 75 * us),
        Event("nvjet_tst_e4m3_gemm", "kernel", 210 * us, 250 * us),
        Event("reduce_kernel<ReduceOp>", "kernel", 290 * us, 310 * us),  # runs past the window: clipped
        Event("Memcpy DtoD (Device -> Device)", "memcpy", 260 * us, 270 * us),
    ]
    t = summarize(ev, [100e-6, 100e-6], cuda=True)
    assert t.steps == 2 and t.wall_seconds_per_step == pytest.approx(100e-6)
    # busy: step 1 [10,60] + [70,75] = 55 us; step 2 [210,250] + [260,270] + [290,300] = 60 us
    assert t.gpu_busy_seconds_per_step == pytest.approx(57.5e-6)
    assert t.gpu_kernel_seconds_per_step == pytest.approx((40 + 20 + 40 + 10) * 1e-6 / 2)
    assert t.gpu_idle_fraction == pytest.approx(1 - 57.5 / 100)
    assert t.kernels_per_step == 2 and t.bound == "host"
    assert t.memcpy_seconds_per_step == pytest.approx(5e-6) and t.memset_seconds_per_step == pytest.approx(2.5e-6)
    assert t.cpu_op_seconds_per_step == pytest.approx(10e-6) and t.cpu_ops_per_step == 1
    assert [k.name for k in t.top_kernels] == ["nvjet_tst_e4m3_gemm", "vectorized_elementwise_kernel<Float8_e4m3fn>",
                                                "Memcpy DtoD (Device -> Device)", "reduce_kernel<ReduceOp>",
                                                "Memset (Device)"]
    gemm = t.top_kernels[0]
    assert gemm.calls_per_step == 1 and gemm.seconds_per_step == pytest.approx(40e-6)
    assert gemm.fraction == pytest.approx(80 / 115)
    expected = {"gemm": 40e-6, "fp8-cast/amax": 10e-6, "copy": 5e-6, "reduction": 5e-6, "memset": 2.5e-6}
    assert {k: v for k, v in t.categories.items() if v} == pytest.approx(expected)
    # what each category holds, its largest kernels first (categories with no kernel left out)
    assert list(t.top_by_category) == ["gemm", "fp8-cast/amax", "reduction", "memset", "copy"]
    assert [k.name for k in t.top_by_category["copy"]] == ["Memcpy DtoD (Device -> Device)"]
    assert t.top_by_category["gemm"][0] == gemm
    many = summarize([Event(WINDOW, "window", 0, 10**6)] + [Event(f"other_{i}", "kernel", i * 10, i * 10 + i + 1)
                                                             for i in range(9)], [1e-3], cuda=True)
    assert [k.name for k in many.top_by_category["other"]] == [f"other_{i}" for i in (8, 7, 6, 5, 4)]
    line = trace_line(t)
    assert line.startswith(f"trace: wall 0.1 ms, GPU busy 0.0575 ms (idle {t.gpu_idle_fraction:.0%}, host-bound), "
                           "2 kernels/step, host aten ops 0.01 ms (1/step); top: gemm 0.04 ms, fp8-cast/amax 0.01 ms")
    assert line.endswith(", memset 0.0025 ms")
    # a GPU that never waits is GPU-bound
    busy = summarize([Event(WINDOW, "window", 0, 100), Event("k", "kernel", 0, 95)], [100e-9], cuda=True)
    assert busy.bound == "gpu" and busy.gpu_idle_fraction == pytest.approx(0.05)


def test_summarize_cpu_self_times_by_hand() -> None:
    ev = [Event(WINDOW, "window", 0, 1000),
          Event("aten::linear", "op", 0, 100), Event("aten::mm", "op", 10, 60), Event("aten::add", "op", 70, 80),
          Event("aten::mul", "op", 100, 130), Event("aten::mul", "op", 2000, 2100)]  # the last is outside
    t = summarize(ev, [1000e-9], cuda=False)
    assert [k.name for k in t.top_kernels] == ["aten::mm", "aten::linear", "aten::mul", "aten::add"]
    assert [k.seconds_per_step for k in t.top_kernels] == pytest.approx([50e-9, 40e-9, 30e-9, 10e-9])
    assert all(k.calls_per_step == 1 for k in t.top_kernels)
    assert t.cpu_op_seconds_per_step == pytest.approx(130e-9) and t.cpu_ops_per_step == 2
    assert t.categories["gemm"] == pytest.approx(90e-9) and t.categories["other"] == pytest.approx(40e-9)
    assert sum(k.fraction for k in t.top_kernels) == pytest.approx(1.0)
    assert t.gpu_busy_seconds_per_step is None and t.bound is None


@pytest.mark.parametrize(("name", "bucket"), [
    ("nvjet_tst_128x256_64x4_2x1_v_bz_coopA_NNT", "gemm"),
    ("sm90_xmma_gemm_e4m3e4m3_e4m3f32_f32_tn_n_tilesize128x128x128", "gemm"),
    ("void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_16x16_32x1_nn_align8>", "gemm"),
    ("void at::native::reduce_kernel<512, 1, ReduceOp<float, func_wrapper_t<float, amax_kernel_impl>>>", "fp8-cast/amax"),
    ("void at::native::unrolled_elementwise_kernel<direct_copy_kernel_cuda, c10::Float8_e4m3fn>", "fp8-cast/amax"),
    ("void at::native::(anonymous namespace)::vectorized_layer_norm_kernel<float, float>", "norm/softmax/attention"),
    ("flash_fwd_kernel", "norm/softmax/attention"),
    ("void at::native::multi_tensor_apply_kernel<FusedAdamMathFunctor>", "optimizer"),
    ("void at::native::reduce_kernel<512, 1, ReduceOp<float, MeanOps>>", "reduction"),
    ("Memset (Device)", "memset"),
    ("Memcpy DtoD (Device -> Device)", "copy"),
    ("void at::native::vectorized_elementwise_kernel<4, direct_copy_kernel_cuda, float>", "copy"),
    ("void at::native::vectorized_elementwise_kernel<4, BinaryFunctor<float, MulFunctor<float>>>", "elementwise"),
    ("void at::native::elementwise_kernel<128, 2, broadcast_add>", "elementwise"),
    # a bf16 gradient added into an fp32 accumulator, and a bf16 -> fp32 copy: not FP8 casts
    ("void at::native::unrolled_elementwise_kernel<at::native::CUDAFunctor_add<float>, std::array<char*, 3ul>, 4, "
     "TrivialOffsetCalculator<2, unsigned int>, TrivialOffsetCalculator<1, unsigned int>, "
     "at::native::memory::LoadWithCast<2>, at::native::memory::StoreWithCast<1> >", "elementwise"),
    ("void at::native::unrolled_elementwise_kernel<at::native::direct_copy_kernel_cuda(at::TensorIteratorBase&)"
     "::{lambda()#3}::operator()() const, memory::LoadWithCast<1>, memory::StoreWithCast<1> >", "copy"),
    ("aten::mm", "gemm"),
    ("aten::mul", "other"),
    ("void some_custom_kernel<float>", "other"),
])
def test_kernel_categories(name: str, bucket: str) -> None:
    assert category(name) == bucket


class _FakeRunner:
    """A `Runner` whose step is a few aten ops; it records which data steps it was asked for."""

    graph_count, graphs_per_rank, capture_host_seconds, arena_bytes, setup_phases = 0, None, None, None, None

    def __init__(self) -> None:
        self.asked: list[int] = []

    def data(self, step: int) -> torch.Tensor:
        self.asked.append(step)
        # large enough that the matmul outweighs the relu on a loaded CPU (two xdist workers): at 64 x 64 the
        # relu once came out on top
        return torch.full((256, 256), float(step))

    def step(self, data: torch.Tensor) -> torch.Tensor:
        return (data @ data).relu().sum()

    def counters(self) -> tuple[int, int]:
        return 0, 0

    def host_phases(self) -> None:
        return None


def test_time_runner_traces_after_the_timed_steps(monkeypatch) -> None:
    from qeffect.profile.matrix import time_runner
    from qeffect.profile.report import ConfigResult

    def result() -> ConfigResult:
        return ConfigResult(name="fake", description="fake", status="ok")

    fake, r = _FakeRunner(), result()
    time_runner(r, lambda: fake, torch.device("cpu"), steps=3, warmup=2, trace_steps=2)
    assert fake.asked == list(range(7))  # the traced steps continue the data sequence
    assert len(r.step_seconds) == 3 and len(r.losses) == 5 and r.trace_error is None
    assert r.trace.steps == 2 and r.trace.top_kernels[0].name == "aten::mm" and r.trace.cpu_ops_per_step >= 3
    assert r.trace.categories["gemm"] > 0
    # no trace asked: none taken
    fake, r = _FakeRunner(), result()
    time_runner(r, lambda: fake, torch.device("cpu"), steps=3, warmup=2)
    assert fake.asked == list(range(5)) and r.trace is None
    # a trace that fails keeps the timings and says why

    def broken(*_args, **_kwargs):
        raise RuntimeError("no profiler here")

    monkeypatch.setattr("qeffect.profile.trace.trace_runner", broken)
    fake, r = _FakeRunner(), result()
    time_runner(r, lambda: fake, torch.device("cpu"), steps=3, warmup=2, trace_steps=2)
    assert r.trace is None and r.trace_error == "RuntimeError: no profiler here" and len(r.step_seconds) == 3
    assert len(r.host_seconds) == 3 and r.host_median_seconds == statistics.median(r.host_seconds)


def test_the_host_phases_are_timed_on_steps_of_their_own_between_the_timed_and_the_traced() -> None:
    """A runner that times its phases gets min(steps, PHASE_STEPS) more steps with its clock read, after the
    timed steps (whose host times stay free of the clock's reads) and before the traced ones."""
    import time

    from qeffect.graphs.stats import LAUNCH, HostPhases
    from qeffect.profile.matrix import PHASE_STEPS, time_runner
    from qeffect.profile.report import ConfigResult

    class Phased(_FakeRunner):
        def __init__(self) -> None:
            super().__init__()
            self.clock = HostPhases()
            self.read_in: list[int] = []

        def host_phases(self) -> HostPhases:
            self.clock.on = True
            return self.clock

        def step(self, data: torch.Tensor) -> torch.Tensor:
            if self.clock.on:
                self.read_in.append(int(data[0, 0]))
                t = time.perf_counter()
                time.sleep(0.001)
                self.clock.add(LAUNCH, t, time.perf_counter(), 2)
            return super().step(data)

    for steps in (3, 8):
        fake, r = Phased(), ConfigResult(name="fake", description="fake", status="ok")
        time_runner(r, lambda fake=fake: fake, torch.device("cpu"), steps=steps, warmup=2, trace_steps=1)
        n = min(steps, PHASE_STEPS)
        assert fake.asked == list(range(2 + steps + n + 1)) and fake.read_in[:n] == list(range(2 + steps, 2 + steps + n))
        assert len(r.step_seconds) == steps and len(r.host_phase_seconds[LAUNCH]) == n
        assert min(r.host_phase_seconds[LAUNCH]) >= 0.001 and r.host_phase_calls[LAUNCH] == 2
        assert len(r.host_phase_seconds["runtime"]) == n and r.trace is not None


# ------------------------------------------------------------------------------------------ targets
def test_without_a_targets_file_a_report_has_no_targets(profiled) -> None:
    """Targets come from a user's file (`--targets`, tests/test_profile_targets.py); none given, none judged."""
    _, report = profiled
    assert report.targets == [] and report.targets_source is None


def test_setup_line_by_hand() -> None:
    from qeffect.profile.report import ConfigResult

    c = ConfigResult(name="x", description="", status="ok", build_seconds=5.0, first_step_seconds=0.5,
                     setup_seconds=5.5, setup_phases={"modules": 3.0, "ranks": 1.25, "capture": 0.5})
    assert c.setup_line() == "5.50 s = modules 3.00 + ranks 1.25 + capture 0.50 + other 0.25 + first step 0.50"
    c.setup_phases = None  # not measured (e.g. under torchrun): the build as one part
    assert c.setup_line() == "5.50 s = build 5.00 + first step 0.50"
    c.setup_seconds = None
    assert c.setup_line() is None


def test_the_te_references_floors(profiled) -> None:
    """The same-model references' floor and limit are the whole model's; the layers alone have the layers-only
    ones."""
    from qeffect.profile.matrix import derive_ratios

    _, report = profiled
    r = report.model_copy(deep=True)
    paths = {"captured-direct": "captured-direct", "te-graphed": "te", "te-graphed-model": "te-model",
             "te-graphed-mcore": "te-mcore"}
    for c in r.configs:
        if c.name in paths:
            c.status, c.median_step_seconds, c.path = "ok", 0.02, paths[c.name]
    derive_ratios([c for c in r.configs if c.status == "ok"], r.floor)
    assert r.floor.seconds > r.floor.seconds_layers_only > 0  # the head's GEMMs
    assert r.floor.limit_seconds > r.floor.limit_seconds_layers_only > 0
    for name in ("te-graphed-model", "te-graphed-mcore", "captured-direct"):
        assert r.result(name).floor_seconds == r.floor.seconds and r.result(name).limit_seconds == r.floor.limit_seconds
    assert r.result("te-graphed").floor_seconds == r.floor.seconds_layers_only
    assert r.result("te-graphed").limit_seconds == r.floor.limit_seconds_layers_only
    assert r.result("captured-direct").limit_ratio == 0.02 / r.floor.limit_seconds
