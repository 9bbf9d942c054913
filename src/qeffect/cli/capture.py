"""`qeffect capture`: capture a config's stage actions as CUDA graphs, or `--handshake-check`."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from qeffect.cli.common import SET_HELP, SET_METAVAR, Backend, PathMode, Schedule, config_from_cli, write_json
from qeffect.cli.root import app, fail
from qeffect.errors import UserError
from qeffect.runtime.outputs import check_report_target


@app.command("capture")
def capture(
    config: Path | None = typer.Option(None, "--config", "-c", help="Run config TOML whose stage actions to capture."),
    sets: list[str] | None = typer.Option(None, "--set", metavar=SET_METAVAR, help=SET_HELP),
    handshake_check: bool = typer.Option(False, "--handshake-check",
                                         help="Run the producer-consumer race check of both replay protocols."),
    processes: int = typer.Option(3, "--processes", min=1, help="Fresh processes per protocol."),
    checks: int = typer.Option(200, "--checks", min=1, help="Producer-consumer checks per process."),
    path: PathMode = typer.Option(PathMode.captured_direct, "--path", help="captured-copy or captured-direct."),
    schedule: Schedule | None = typer.Option(None, "--schedule", help="Pipeline schedule (default: the config's)."),
    backend: Backend | None = typer.Option(None, "--backend", help="FP8 backend (default: the config's)."),
    steps: int = typer.Option(50, "--steps", min=1, help="Steps replayed after capture (memory growth)."),
    json_out: Path | None = typer.Option(None, "--json", help="Also write the report as JSON to this file."),
) -> None:
    """Capture stage actions into CUDA graphs, or check the replay handshake.

    --handshake-check replays a graph that reads its input, spins about a millisecond and then writes
    its output, and reads that output on the caller stream right after each replay. It runs
    PROCESSES fresh processes of CHECKS checks for GraphPP's one-way handoff, for qeffect's two-way
    handshake and for stream-ordered replay (the graph launched on the caller's stream). Exit 0 only if
    one-way showed stale reads (the check can see the race) and the other two none.
    """
    cfg = None if handshake_check else _config(config, path, schedule, backend, sets)  # its errors first
    check_report_target(json_out)
    import torch

    if not torch.cuda.is_available():
        raise UserError("qeffect capture needs a CUDA device; none is available")
    console = Console()
    if cfg is not None:
        _capture_config(cfg, path, steps, json_out, console)
        return
    from qeffect.graphs.handshake import SAFE, HandshakeError, run_handshake_suite

    command = f"qeffect capture --handshake-check --processes {processes} --checks {checks}" + \
        (f" --json {json_out}" if json_out else "")
    try:
        with console.status(f"handshake check: {processes} processes x {checks} checks per protocol"):
            report = run_handshake_suite(processes, checks, command=command)
    except HandshakeError as err:
        fail(str(err).replace("\n", " "), 1)
    table = Table(title=f"replay handshake: producer-consumer checks on {report.device_name}")
    for col, justify in (("protocol", "left"), ("processes", "right"), ("checks", "right"),
                         ("stale reads", "right")):
        table.add_column(col, justify=justify, no_wrap=True)
    for s in report.protocols:
        bad = (s.protocol in SAFE and s.stale_reads) or (s.protocol == "one-way" and not s.stale_reads)
        table.add_row(s.protocol, str(s.processes), str(s.checks), f"{s.stale_reads} / {s.checks}",
                      style="red" if bad else None)
    console.print(table)
    console.print(f"PASS: one-way races, {' and '.join(SAFE)} do not" if report.passed else
                  f"[red]FAIL: expected stale reads with one-way and none with {' or '.join(SAFE)}[/red]")
    if json_out:
        write_json(json_out, report)
    raise typer.Exit(0 if report.passed else 1)


def _config(config: Path | None, path: PathMode, schedule: Schedule | None, backend: Backend | None,
            sets: list[str] | None):
    """The config to capture: the file, --schedule / --backend, train.device cuda, then --set."""
    if path is PathMode.eager:
        raise UserError("qeffect capture: --path must be captured-copy or captured-direct")
    cfg = config_from_cli(config, sets=sets, **{"pipeline.schedule": schedule.value if schedule else None,
                                                "fp8.backend": backend.value if backend else None,
                                                "train.device": "cuda"})
    if cfg.train.device != "cuda":
        raise UserError(f"qeffect capture captures CUDA graphs: train.device must be cuda, not {cfg.train.device}")
    return cfg


def _capture_config(cfg, path: PathMode, steps: int, json_out: Path | None, console: Console) -> None:
    from qeffect.profile.capture import run_capture

    with console.status(f"capturing every stage action ({path.value}) and replaying {steps} steps"):
        r = run_capture(cfg, path=path.value, steps=steps)
    table = Table(title=f"capture: {r.schedule} / {r.path} / {r.backend} on {r.device_name}")
    table.add_column("measure")
    table.add_column("value", justify="right")
    rows = [
        ("graphs per rank (planned)", f"{r.graphs_per_rank} ({r.expected_graphs_per_rank})"),
        ("graphs in all", str(r.graph_count)),
        ("capture host time", f"{r.capture_host_seconds:.3f} s"),
        ("setup (build + capture)", f"{r.setup_seconds:.3f} s"),
        ("arena bytes", f"{r.arena_bytes:,}"),
        ("allocated before / after capture", f"{r.memory_allocated_before_capture:,} / "
                                             f"{r.memory_allocated_after_capture:,}"),
        ("reserved after capture", f"{r.memory_reserved_after_capture:,}"),
        ("median step", f"{r.median_step_seconds * 1e3:.2f} ms"),
        ("replays / handoffs per step", f"{r.replays_per_step:.0f} / {r.handoffs_per_step:.0f}"),
        (f"persistent growth per step over {r.steps} steps", f"{r.persistent_growth_bytes_per_step:,.0f} B"),
    ]
    for k, v in rows:
        table.add_row(k, v)
    console.print(table)
    console.print("PASS" if r.passed else "[red]FAIL[/red]")
    if json_out:
        write_json(json_out, r)
    raise typer.Exit(0 if r.passed else 1)
