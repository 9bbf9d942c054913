"""`qeffect audit-megatron` on CPU: orchestration with a fake runner, report schema, and the exit-2 paths.

The fake runner is a real subprocess speaking the runner's command line, so these tests exercise the
same launch / timeout / crash-parsing code the H200 run uses; only Megatron itself is missing.
"""

from __future__ import annotations

import io
import json
import sys
import textwrap
from pathlib import Path

import pytest

from qeffect.audit import megatron as audit
from qeffect.audit.report import AuditReport, AuditShape, ModeResult, logged_loss, render, summarize
from qeffect.audit.runner import MODES, describe_exception, mode_settings
from qeffect.cli.app import main

FAKE = textwrap.dedent('''
    import argparse, json, os, sys, time
    ap = argparse.ArgumentParser()
    for a in ("--mode", "--json", "--shape"):
        ap.add_argument(a)
    for a in ("--steps", "--pp", "--vpp", "--port"):
        ap.add_argument(a, type=int)
    args = ap.parse_args()
    behaviour = json.loads(os.environ["FAKE_BEHAVIOUR"]).get(args.mode, "ok")
    losses = [10.0 - 0.25 * i for i in range(args.steps)]
    def write(status, steps, failure=None, stage="done", times=100.0):
        data = {"mode": args.mode, "status": status, "stage": stage, "steps_completed": steps,
                "step_times_ms": [times] * steps, "losses": losses[:steps], "failure": failure,
                "settings": {"cuda_graph_impl": args.mode, "applied": {"fake": True}},
                "versions": {"torch": "fake-torch", "megatron_core": "fake-mcore", "transformer_engine": "fake-te"},
                "device": "FakeGPU"}
        with open(args.json, "w") as f:
            json.dump(data, f)
    if behaviour == "ok":
        write("finished", args.steps, times=100.0 if args.mode == "eager" else 40.0)
    elif behaviour == "drift":
        losses[7] += 1e-3
        write("finished", args.steps, times=50.0)
    elif behaviour == "recorded":
        write("failed", 0, {"type": "AssertionError", "message": "refused by config",
                            "megatron_location": "megatron/core/transformer/transformer_config.py:2751 in __post_init__",
                            "origin_location": "megatron/core/transformer/transformer_config.py:2751 in __post_init__",
                            "stage": "setup: TransformerConfig"}, stage="setup: TransformerConfig")
        sys.exit(3)
    elif behaviour == "crash":
        write("running", 4, stage="step 4")
        code = compile("def copy_static():\\n    raise RuntimeError('static input copy failed')\\ncopy_static()\\n",
                       "/site/megatron/core/full_cuda_graph.py", "exec")
        exec(code)
    elif behaviour == "abort":
        print("terminate called after throwing an instance of 'c10::Error'", file=sys.stderr, flush=True)
        os.abort()
    elif behaviour == "hang":
        time.sleep(60)
''')


def _runner(tmp_path: Path, behaviour: dict[str, str]) -> audit.SubprocessRunner:
    script = tmp_path / "fake_runner.py"
    script.write_text(FAKE)
    env = {**__import__("os").environ, "FAKE_BEHAVIOUR": json.dumps(behaviour)}
    return audit.SubprocessRunner(prefix=[sys.executable, str(script)], env=env)


def _audit(tmp_path: Path, behaviour: dict[str, str], **kw) -> AuditReport:
    kw.setdefault("timeout_s", 30.0)
    return audit.run_audit(AuditShape(), steps=10, warmup=2, gpu_count=1, runner=_runner(tmp_path, behaviour),
                           workdir=tmp_path / "work", **kw)


def test_one_failing_mode_never_takes_the_others_down(tmp_path):
    report = _audit(tmp_path, {"transformer_engine": "crash", "local": "drift", "delay_wgrad": "recorded"})
    pp1 = {r.mode: r for r in report.runs if r.pp == 1}
    assert list(pp1) == list(MODES)
    assert [pp1[m].status for m in MODES] == ["finished", "finished", "failed", "finished"]

    te = pp1["transformer_engine"]  # died with a traceback after writing 4 steps
    assert te.failure.type == "RuntimeError"
    assert te.failure.message == "static input copy failed"
    assert te.failure.megatron_location == "megatron/core/full_cuda_graph.py:2 in copy_static"
    assert te.failure.stage == "step 4" and te.failure.exit_code == 1
    assert te.steps_completed == 4 and len(te.losses) == 4
    assert te.losses_match_eager is False  # an incomplete trajectory never counts as a match

    full = pp1["full_iteration"]
    assert full.median_step_ms == 40.0 and full.time_ratio_to_eager == pytest.approx(0.4)
    assert full.speedup_vs_eager == pytest.approx(2.5)
    assert full.losses_match_eager is True and full.losses_bitwise_equal_eager is True
    assert full.loss_matches_eager == [True] * 10

    local = pp1["local"]  # 1e-3 on a loss of 8.25 shows at six significant digits
    assert local.losses_match_eager is False and local.first_loss_mismatch_step == 7
    assert local.loss_matches_eager.count(False) == 1

    (wgrad,) = [r for r in report.delayed_wgrad if r.pp == 1]
    assert wgrad.status == "failed" and wgrad.failure.type == "AssertionError"
    assert wgrad.failure.megatron_location.startswith("megatron/core/transformer/transformer_config.py:")
    assert wgrad.failure.stage == "setup: TransformerConfig"

    # PP=2/VPP=2 needs two GPUs: every mode is reported as not run, with the reason.
    pp2 = [r for r in report.runs + report.delayed_wgrad if r.pp == 2]
    assert len(pp2) == 5 and {r.status for r in pp2} == {"not-run"}
    assert all(r.vpp == 2 and "needs 2 GPUs" in r.reason for r in pp2)
    assert report.versions.megatron_core == "fake-mcore" and report.device == "FakeGPU"


def test_abort_and_timeout_are_failures_of_their_mode_only(tmp_path):
    report = _audit(tmp_path, {"local": "abort", "full_iteration": "hang"}, timeout_s=3.0)
    pp1 = {r.mode: r for r in report.runs if r.pp == 1}
    assert pp1["eager"].status == "finished" and pp1["transformer_engine"].status == "finished"
    assert pp1["local"].status == "failed" and pp1["local"].failure.type == "signal SIGABRT"
    assert "terminate called" in pp1["local"].failure.message
    assert pp1["full_iteration"].status == "failed" and pp1["full_iteration"].failure.type == "Timeout"
    assert pp1["full_iteration"].failure.exit_code is None


def test_eager_failure_leaves_no_reference(tmp_path):
    report = _audit(tmp_path, {"eager": "crash"})
    pp1 = {r.mode: r for r in report.runs if r.pp == 1}
    assert pp1["eager"].status == "failed"
    assert pp1["local"].status == "finished" and pp1["local"].time_ratio_to_eager is None
    assert pp1["local"].loss_matches_eager is None


def test_report_round_trips_through_the_schema(tmp_path):
    from qeffect.cli.common import write_json

    report = _audit(tmp_path, {"local": "crash"})
    path = tmp_path / "report.json"
    write_json(path, report)
    again = AuditReport.model_validate_json(path.read_text())
    assert again == report
    assert again.model_dump() == json.loads(path.read_text())
    console_out = io.StringIO()
    from rich.console import Console

    render(again, Console(file=console_out, width=250))
    text = console_out.getvalue()
    assert "transformer_engine" in text and "RuntimeError" in text and "not-run" in text


def test_pipeline_shape_launches_through_torchrun():
    req = audit.ModeRequest(mode="eager", pp=2, vpp=2, steps=3, shape=AuditShape(), json_path=Path("/tmp/x.json"),
                            timeout_s=1.0, port=12345)
    cmd = audit.SubprocessRunner().command(req)
    assert cmd[1:4] == ["-m", "torch.distributed.run", "--nproc-per-node=2"]
    assert "--master-port=12345" in cmd and cmd[cmd.index("--vpp") + 1] == "2"
    assert audit._pipeline_blocker(AuditShape(), 2, 2, 2) is None
    assert "do not split" in audit._pipeline_blocker(AuditShape(layers=6), 2, 2, 2)


def test_loss_precision_and_summary():
    assert logged_loss(10.3974) == "1.03974E+01"
    assert logged_loss(10.39744) == logged_loss(10.39741) != logged_loss(10.39746)
    eager = summarize(ModeResult(mode="eager", pp=1, status="finished", steps_requested=3, warmup_steps=1,
                                 step_times_ms=[900.0, 10.0, 12.0], losses=[3.0, 2.0, 1.0]), None)
    assert eager.median_step_ms == 11.0
    graph = summarize(ModeResult(mode="local", pp=1, status="finished", steps_requested=3, warmup_steps=1,
                                 step_times_ms=[5000.0, 5.0, 6.0], losses=[3.0, 2.0000001, 1.0]), eager)
    assert graph.losses_match_eager is True and graph.losses_bitwise_equal_eager is False
    assert graph.time_ratio_to_eager == pytest.approx(0.5)


def test_exception_location_is_the_innermost_megatron_frame():
    code = compile("def check():\n    assert False, 'needs MoE overlap'\n", "/x/megatron/core/transformer/cfg.py", "exec")
    ns: dict = {}
    exec(code, ns)
    try:
        ns["check"]()
    except AssertionError as exc:
        info = describe_exception(exc, "setup")
    assert info == {"type": "AssertionError", "message": "needs MoE overlap", "stage": "setup",
                    "megatron_location": "megatron/core/transformer/cfg.py:2 in check",
                    "origin_location": "megatron/core/transformer/cfg.py:2 in check"}
    assert mode_settings("full_iteration")["cuda_graph_impl"] == "full_iteration"
    assert mode_settings("delay_wgrad")["delay_wgrad_compute"] is True
    with pytest.raises(ValueError):
        mode_settings("bogus")


def test_real_runner_records_its_own_failure(tmp_path):
    """The real child, on a machine without CUDA or Megatron, still writes a failed result and exits 3."""
    req = audit.ModeRequest(mode="eager", pp=1, vpp=None, steps=2, shape=AuditShape(), json_path=tmp_path / "e.json",
                            timeout_s=120.0, port=audit._free_port())
    outcome = audit.SubprocessRunner()(req)
    assert outcome.returncode == 3, outcome.output
    res = audit.outcome_to_result(req, outcome, warmup=1)
    assert res.status == "failed" and res.failure.stage.startswith("setup")
    assert res.failure.type and res.failure.message


def _cli(capsys, argv):
    with pytest.raises(SystemExit) as exc:
        main(argv)
    err = capsys.readouterr().err
    return exc.value.code, err


def test_cli_without_megatron_is_one_line_exit_2(capsys, monkeypatch):
    monkeypatch.setattr(audit, "_has_megatron", lambda: False)
    code, err = _cli(capsys, ["audit-megatron"])
    assert code == 2 and err.count("\n") == 1 and "megatron-core" in err and "Traceback" not in err


def test_cli_old_python_is_one_line_exit_2(capsys, monkeypatch):
    monkeypatch.setattr(audit, "_has_megatron", lambda: True)
    monkeypatch.setattr(audit, "_python_ok", lambda: False)
    code, err = _cli(capsys, ["audit-megatron"])
    assert code == 2 and err.count("\n") == 1 and "Python >= 3.12" in err


def test_cli_without_gpu_is_one_line_exit_2(capsys, monkeypatch):
    monkeypatch.setattr(audit, "_has_megatron", lambda: True)
    monkeypatch.setattr(audit, "_python_ok", lambda: True)
    monkeypatch.setattr(audit, "_gpu_count", lambda: 0)
    code, err = _cli(capsys, ["audit-megatron", "--json", "never.json"])
    assert code == 2 and err.count("\n") == 1 and "GPU" in err
    assert not Path("never.json").exists()


def test_cli_runs_the_audit_and_writes_json(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(audit, "_has_megatron", lambda: True)
    monkeypatch.setattr(audit, "_python_ok", lambda: True)
    monkeypatch.setattr(audit, "_gpu_count", lambda: 1)
    fake = _runner(tmp_path, {"local": "crash"})
    real = audit.run_audit
    monkeypatch.setattr(audit, "run_audit", lambda shape, **kw: real(shape, **{**kw, "runner": fake}))
    out = tmp_path / "r.json"
    with pytest.raises(SystemExit) as exc:
        main(["audit-megatron", "--steps", "6", "--warmup", "1", "--json", str(out), "--log", str(tmp_path / "log")])
    assert exc.value.code == 0
    report = AuditReport.model_validate_json(out.read_text())
    assert report.shape.hidden == 2048 and report.shape.layers == 4 and report.steps == 6
    assert report.find("local", 1).status == "failed" and report.find("eager", 1).status == "finished"
    assert "===== local PP=1" in (tmp_path / "log").read_text()
