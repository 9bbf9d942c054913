"""`qeffect profile`: report schema, not-run records, break-even arithmetic, FLOP count, resource analysis,
CLI exit codes and figures. One real profile run (tiny shape, 1 warm-up + 2 timed steps) serves most tests.
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import pytest
import torch

from qeffect.cli.app import main
from qeffect.config import load_config
from qeffect.fp8.te import te_available
from qeffect.profile.flops import count_matrix_flops, gemm_problems
from qeffect.profile.report import SCHEMA_VERSION, ProfileReport, Spread, break_even_steps
from qeffect.profile.resources import parse_microbatches, resource_rows
from qeffect.runtime.build import build_single_process
from qeffect.schedule import build_schedule, max_live_tapes, max_pending_dw

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
              "--microbatches", "2,4", "--json", str(out)])
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
    assert report.device == "cpu" and report.torch_version == torch.__version__
    assert [c.name for c in report.configs] == ["native-eager", "qeffect-eager", "captured-copy", "captured-direct",
                                                "captured-zbv-direct", "te-graphed"]


def test_ran_configurations_have_raw_timings_and_summaries(profiled) -> None:
    _, report = profiled
    for name in ("native-eager", "qeffect-eager"):
        c = report.result(name)
        assert c.status == "ok" and c.reason is None
        assert len(c.warmup_seconds) == 1 and len(c.step_seconds) == 2
        assert c.median_step_seconds == statistics.median(c.step_seconds)
        assert c.spread.min == min(c.step_seconds) and c.spread.max == max(c.step_seconds)
        assert c.first_step_seconds == c.warmup_seconds[0]
        assert c.setup_seconds == c.build_seconds + c.first_step_seconds
        assert c.floor_ratio == c.median_step_seconds / report.floor.seconds
        assert c.matrix_flops == report.matrix_flops.total
        # CPU: memory is not measured, and says why
        assert c.peak_allocated_bytes is None and c.persistent_growth_bytes_per_step is None
        assert "CUDA" in c.memory_note
        assert c.graph_count == 0 and c.replays_per_step == 0 and c.handoffs_per_step == 0
    # one model, one data sequence: the split eager run computes the same losses, bit for bit
    native, qeff = report.result("native-eager"), report.result("qeffect-eager")
    assert len(native.losses) == 3 and native.losses == qeff.losses
    assert native.arena_bytes is None and qeff.arena_bytes > 0
    assert qeff.speedup_vs_native == native.median_step_seconds / qeff.median_step_seconds
    assert qeff.break_even_steps == break_even_steps(qeff.setup_seconds, qeff.median_step_seconds,
                                                     native.setup_seconds, native.median_step_seconds)


def test_not_run_records_say_why(profiled) -> None:
    _, report = profiled
    for name in ("captured-copy", "captured-direct", "captured-zbv-direct"):
        c = report.result(name)
        assert c.status == "not run" and "needs a CUDA device" in c.reason
        assert c.step_seconds == [] and c.median_step_seconds is None and c.setup_seconds is None
        assert c.break_even_steps is None and c.floor_ratio is None
    te = report.result("te-graphed")
    assert te.status == "not run"
    assert te.reason == ("Transformer Engine not importable" if not te_available() else te.reason)
    assert te.median_step_seconds is None


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

    def counting(a, a_s, b, b_s, out_dtype, out=None):
        seen.append(2 * a.shape[0] * b.shape[0] * a.shape[1])
        return real(a, a_s, b, b_s, out_dtype, out=out)

    monkeypatch.setattr(ref, "fp8_mm", counting)
    pipe = build_single_process(cfg, native=True, device="cpu")
    pipe.step(synthetic_batches(cfg, 0, "cpu"))
    assert sum(seen) == count_matrix_flops(cfg).total
    assert len(seen) == 3 * (2 * 4 + 1) * 3  # (forward, dgrad, wgrad) x (2 layers x 4 linears + head) x M


# ---------------------------------------------------------------------------------------- resources
def test_resource_analysis_against_schedule_helpers(profiled) -> None:
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
        assert r.graphs_per_rank == 3 * r.microbatches * p.chunks_per_rank
        assert r.graph_count == r.graphs_per_rank * p.pp
        assert r.capture_host_seconds is None and "CUDA" in r.capture_note
    # the arena layout on the meta device is the one the built ranks allocate
    for r in rows:
        c = cfg.with_overrides(**{"pipeline.microbatches": r.microbatches, "pipeline.schedule": r.schedule})
        pipe = build_single_process(c, native=False, device="cpu")
        assert r.arena_bytes_per_rank == [rank.arena.nbytes for rank in pipe.ranks]
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
    for name in ("captured-copy", "captured-direct", "captured-zbv-direct"):
        c = report.result(name)
        assert c.status == "ok", c.reason
        assert c.graphs_per_rank == 3 * p.microbatches * p.chunks_per_rank
        assert c.replays_per_step == c.graph_count  # every graph replays once per step
        assert c.handoffs_per_step == 2 * c.replays_per_step
        assert c.persistent_growth_bytes_per_step == 0
        assert c.losses == report.result("native-eager").losses
    for c in report.configs:
        if c.status == "ok":
            assert c.peak_allocated_bytes > 0 and c.peak_reserved_bytes >= c.peak_allocated_bytes
    assert all(r.capture_host_seconds is not None and r.graphs_captured_per_rank == r.graphs_per_rank
               for r in report.resources)


def test_help_names_every_configuration(capsys) -> None:
    from qeffect.profile.matrix import CONFIG_NAMES

    rc, out, _ = run(capsys, "profile", "--help")
    assert rc == 0
    flat = "".join(out.split())  # help text wraps lines (also at hyphens)
    assert all(name in flat for name in CONFIG_NAMES)
