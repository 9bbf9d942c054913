"""`qeffect offload-check`: VMM activation offload on a real GPU (see qeffect.offload.checks)."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from qeffect.cli.common import config_from_cli, write_json
from qeffect.cli.root import app
from qeffect.config import OffloadConfig
from qeffect.errors import UserError
from qeffect.runtime.outputs import check_report_target


def offload_check_config(config: Path | None) -> OffloadConfig:
    """The `[offload]` section offload-check builds its managers from: the one `qeffect train` and
    `verify-state` read from the same `--config` (the embedded default's without one), so all three run the
    same knobs; each check then sets its mode (`offload.checks.check_config`)."""
    return config_from_cli(config).offload


@app.command("offload-check")
def offload_check(
    config: Path | None = typer.Option(
        None, "--config", "-c", help="Run config TOML whose [offload] section the checks use (default: the "
        "embedded default's, as train and verify-state)."),
    json_out: Path | None = typer.Option(None, "--json", help="Also write the report as JSON to this file."),
    remaps: int = typer.Option(100, "--remaps", min=1, help="Remaps of one slot in the address-stability check."),
    layers: int = typer.Option(4, "--layers", min=3, help="Layers of the ping-pong and look-ahead stacks (>= 3)."),
    release_mib: int = typer.Option(256, "--release-mib", min=2, help="Slot size (MiB) of the free-memory check."),
    hidden: int = typer.Option(1024, "--hidden", min=64, help="Hidden size of the look-ahead stack."),
    rows: int = typer.Option(4096, "--rows", min=64, help="Rows (tokens) of the look-ahead stack."),
    only: list[str] = typer.Option([], "--only", help="Run only this check (repeatable)."),
    no_children: bool = typer.Option(False, "--no-children", help="Skip the negative checks (child processes)."),
) -> None:
    """Check fixed-VA VMM offload on this GPU; exit 1 if any check fails.

    Address stability across remaps, D2H then unmap with driver-level free memory coming back, H2D
    then replay reading the right bytes, resident ping-pong and release modes bitwise equal to no
    offload, look-ahead restores overlapping the running backward graph (event timings), and two
    negative cases in child processes: a naive torch.empty reload (wrong bytes, detected) and a replay
    over an unmapped slot (hard fault).
    """
    import torch

    from qeffect.offload.checks import CHECKS, run_offload_checks
    from qeffect.offload.driver import OffloadUnavailable

    bad = sorted(set(only) - set(CHECKS))
    if bad:
        raise UserError(f"qeffect offload-check: unknown --only {', '.join(bad)} (known: {', '.join(CHECKS)})")
    offload = offload_check_config(config)  # a bad config file fails first, with or without a GPU
    check_report_target(json_out)
    if not torch.cuda.is_available():
        raise UserError("qeffect offload-check needs a CUDA device; none is available")
    console = Console()
    command = "qeffect offload-check" + (f" --config {config}" if config else "") + (f" --json {json_out}" if json_out else "")
    try:
        with console.status("offload checks") as status:
            report = run_offload_checks(remaps=remaps, layers=layers, release_mib=release_mib, hidden=hidden, rows=rows,
                                        children=not no_children, only=only or None, command=command,
                                        progress=lambda name: status.update(f"offload check: {name}"),
                                        config=offload)
    except OffloadUnavailable as err:
        raise UserError(str(err)) from None
    table = Table(title=f"offload-check on {report.device_name} (VMM granularity "
                        f"{(report.granularity or 0) >> 20} MiB, cuda-bindings {report.cuda_bindings_version})")
    for col, justify in (("check", "left"), ("result", "left"), ("seconds", "right"), ("detail", "left")):
        table.add_column(col, justify=justify, no_wrap=col != "detail")
    for c in report.checks:
        table.add_row(c.name, "PASS" if c.passed else "FAIL", f"{c.seconds:.2f}", c.detail,
                      style=None if c.passed else "red")
    console.print(table)
    console.print("PASS: every offload check passed" if report.passed else "[red]FAIL: see the table[/red]")
    if json_out:
        write_json(json_out, report)
    raise typer.Exit(0 if report.passed else 1)
