"""`qeffect capture`: CUDA graph capture; today only `--handshake-check` (one-way vs two-way replay)."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from qeffect.cli.app import app, fail
from qeffect.cli.common import write_json
from qeffect.errors import UserError


@app.command("capture")
def capture(
    config: Path | None = typer.Option(None, "--config", "-c", help="Run config TOML whose stage actions to capture."),
    handshake_check: bool = typer.Option(False, "--handshake-check",
                                         help="Run the producer-consumer race check of both replay protocols."),
    processes: int = typer.Option(3, "--processes", min=1, help="Fresh processes per protocol."),
    checks: int = typer.Option(200, "--checks", min=1, help="Producer-consumer checks per process."),
    json_out: Path | None = typer.Option(None, "--json", help="Also write the report as JSON to this file."),
) -> None:
    """Capture stage actions into CUDA graphs, or check the replay handshake.

    --handshake-check replays a graph that reads its input, spins about a millisecond and then writes
    its output, and reads that output on the caller stream right after each replay. It runs
    PROCESSES fresh processes of CHECKS checks for GraphPP's one-way handoff and for qeffect's two-way
    handshake. Exit 0 only if one-way showed stale reads (the check can see the race) and two-way none.
    """
    import torch

    if not torch.cuda.is_available():
        raise UserError("qeffect capture needs a CUDA device; none is available")
    if not handshake_check:
        raise NotImplementedError("qeffect capture --config: capturing stage actions is not built yet; "
                                  "use --handshake-check")
    from qeffect.graphs.handshake import HandshakeError, run_handshake_suite

    console = Console()
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
        bad = (s.protocol == "two-way" and s.stale_reads) or (s.protocol == "one-way" and not s.stale_reads)
        table.add_row(s.protocol, str(s.processes), str(s.checks), f"{s.stale_reads} / {s.checks}",
                      style="red" if bad else None)
    console.print(table)
    console.print("PASS: one-way races, two-way does not" if report.passed else
                  "[red]FAIL: expected stale reads with one-way and none with two-way[/red]")
    if json_out:
        write_json(json_out, report)
    raise typer.Exit(0 if report.passed else 1)
