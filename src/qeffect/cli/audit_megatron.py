"""`qeffect audit-megatron`: Megatron-Core's own capture modes on this machine, each in its own process."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console

from qeffect.cli.common import write_json
from qeffect.cli.root import app
from qeffect.runtime.outputs import check_report_target


@app.command("audit-megatron")
def audit_megatron(
    config: Path | None = typer.Option(None, "--config", "-c",
                                       help="qeffect TOML with the GPT shape (default: examples/configs/h2048.toml)."),
    steps: int = typer.Option(20, "--steps", min=1, help="Training steps per mode (losses compared at each)."),
    warmup: int = typer.Option(5, "--warmup", min=0, help="Steps left out of the median (they include capture)."),
    timeout: float = typer.Option(240.0, "--timeout", min=1.0, help="Seconds one mode may take before it is killed."),
    modes: str = typer.Option("eager,local,transformer_engine,full_iteration", "--modes",
                              help="Comma-separated capture modes (eager is the reference and always runs)."),
    pipeline: str = typer.Option("1,2x2", "--pipeline",
                                 help="Pipeline shapes to run, PP or PPxVPP, comma-separated (2x2: PP=2, VPP=2)."),
    json_out: Path | None = typer.Option(None, "--json", help="Also write the report as JSON to this file."),
    log: Path | None = typer.Option(None, "--log", help="Append every child's full output to this file."),
) -> None:
    """Audit Megatron-Core's CUDA-graph modes against eager: finishes, speed, and loss agreement.

    Runs eager, local, transformer_engine and full_iteration (cuda_graph_impl of the installed
    Megatron-Core) for a GPT with FP8 delayed scaling, each in its own subprocess, at PP=1 and, with two
    GPUs, at PP=2 x VPP=2; then tries the delayed weight-gradient option. Needs megatron-core
    (Python >= 3.12), Transformer Engine and a CUDA GPU; without them it says so and exits 2.
    """
    from qeffect.audit.megatron import check_environment, parse_pipelines, run_audit, shape_from_config
    from qeffect.audit.report import render

    pipelines = parse_pipelines(pipeline)
    check_report_target(json_out)
    gpus = check_environment()
    shape, source = shape_from_config(config)
    console = Console()
    log_file = log.open("a") if log else None

    def write_log(req, outcome) -> None:
        if log_file:
            log_file.write(f"===== {req.mode} PP={req.pp} VPP={req.vpp or 1}: exit {outcome.returncode}, "
                           f"{outcome.wall_s:.1f} s =====\n{outcome.output}\n")
            log_file.flush()

    try:
        report = run_audit(shape, shape_source=source, steps=steps, warmup=warmup, timeout_s=timeout,
                           modes=[m.strip() for m in modes.split(",") if m.strip()], gpu_count=gpus, pipelines=pipelines,
                           log=write_log, progress=lambda tag: console.print(f"running {tag} ...", style="dim"),
                           on_partial=(lambda partial: write_json(json_out, partial)) if json_out else None)
    finally:
        if log_file:
            log_file.close()
    render(report, console)
    if json_out:
        write_json(json_out, report)
    eager = [r for r in report.runs if r.mode == "eager" and r.status != "not-run"]
    raise typer.Exit(0 if eager and all(r.status == "finished" for r in eager) else 1)
