"""`qeffect verify-state`: bitwise comparison against native eager, or `--faults` contract injections."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

from qeffect.cli.common import (
    SET_HELP,
    SET_METAVAR,
    Backend,
    Device,
    Head,
    Offload,
    PathMode,
    Schedule,
    config_from_cli,
    write_json,
)
from qeffect.cli.root import app
from qeffect.errors import UserError
from qeffect.runtime.outputs import check_report_target

if TYPE_CHECKING:
    from qeffect.verify.state import StepGraphCheck


def _faults(json_out: Path | None, console: Console) -> int:
    from qeffect.verify.faults import run_faults

    report = run_faults()
    table = Table(title="contract fault injection (CPU)")
    table.add_column("family", no_wrap=True)
    table.add_column("injection")
    table.add_column("rejected operation")
    for col in ("first invalid", "state preserved", "result"):
        table.add_column(col, no_wrap=True)
    for r in report.injections:
        table.add_row(r.family, r.injection, r.rejected_operation or "-", "yes" if r.first_invalid else "NO",
                      "yes" if r.state_preserved else "NO", "pass" if r.passed else "FAIL")
    console.print(table)
    return _conclude(report, f"{len(report.injections)} injections in {len(report.families)} families; "
                     f"CUDA initialized: {report.cuda_initialized}; {'PASS' if report.passed else 'FAIL'}",
                     json_out, console)


def _conclude(report, verdict: str, json_out: Path | None, console: Console) -> int:
    """Print the verdict line, write the report to `json_out` if given; the exit code (1: not passed)."""
    console.print(verdict)
    if json_out:
        write_json(json_out, report)
    return 0 if report.passed else 1


def _oracle_check(cfg, path: str, json_out: Path | None, console: Console) -> int:
    from qeffect.verify.oracle import run_oracle_check

    steps = 2  # step 0 clean, the perturbation in step 1: a run per category, so short ones
    report = run_oracle_check(cfg, steps=steps, path=path)
    table = Table(title=f"oracle check ({path}): one perturbed tensor per category, {steps} steps each")
    for col in ("category", "step", "action", "perturbed", "first divergence", "result"):
        table.add_column(col)
    for r in report.results:
        d = r.first_divergence
        found = "-" if d is None else f"{d.category}, step {d.step}, {d.action}, stage {d.stage}, m {d.microbatch}"
        table.add_row(r.category, str(r.step), r.action, r.perturbed or "-", found, "pass" if r.passed else "FAIL",
                      style=None if r.passed else "red")
    console.print(table)
    return _conclude(report, f"{sum(r.passed for r in report.results)}/{len(report.results)} categories caught "
                     f"where perturbed; {report.seconds:.1f} s; {'PASS' if report.passed else 'FAIL'}",
                     json_out, console)


@app.command("verify-state")
def verify_state(
    config: Path | None = typer.Option(None, "--config", "-c", help="Run config TOML (default: the embedded tiny CPU config)."),
    sets: list[str] | None = typer.Option(None, "--set", metavar=SET_METAVAR, help=SET_HELP),
    faults: bool = typer.Option(False, "--faults", help="Run the CPU-only contract fault injections instead."),
    oracle_check: bool = typer.Option(
        False, "--oracle-check",
        help="Instead: per category, a 2-step run with one tensor's lowest bit flipped in step 1; the "
             "oracle must name that category, step and action first."),
    steps: int = typer.Option(20, "--steps", min=1, help="Optimizer steps to compare."),
    schedule: Schedule | None = typer.Option(None, "--schedule", help="Pipeline schedule (default: the config's)."),
    path: PathMode = typer.Option(PathMode.eager, "--path", help="qeffect mode to compare with native eager."),
    device: Device | None = typer.Option(None, "--device", help="cpu or cuda (default: the config's)."),
    backend: Backend | None = typer.Option(None, "--backend", help="FP8 backend (default: the config's)."),
    head: Head | None = typer.Option(None, "--head", help="Output head: backend or torchao (default: the config's fp8.head)."),
    offload: Offload | None = typer.Option(
        None, "--offload", help="Captured paths: saved activations in VMM slots, release or resident (cuda)."),
    seed: int | None = typer.Option(None, "--seed", help="Seed for parameters and synthetic data."),
    pp: int | None = typer.Option(None, "--pp", min=1, help="Pipeline-parallel degree (default: the config's)."),
    dp: int | None = typer.Option(None, "--dp", min=1, help="Data-parallel degree (under torchrun; default: the config's)."),
    json_out: Path | None = typer.Option(None, "--json", help="Also write the report as JSON to this file."),
    resume: Path | None = typer.Option(
        None, "--resume", help="Start both sides from this checkpoint (or a checkpoint folder's `latest`), in "
        "this run's layout, and compare --steps steps from its step on."),
) -> None:
    """Prove a qeffect mode bitwise equal to the native eager reference, action by action.

    Runs the native reference (full autograd backward, Interleaved 1F1B) and the qeffect mode from
    the same seed, parameters, data and FP8 recipe, and compares loss, activations, gradients,
    parameters, AdamW state, FP8 scaling state, cache contents and epochs, and resource counts with
    torch.equal after every action and optimizer step. Exit 1 on any mismatch, naming the first.
    The steps compared and the qeffect mode are --steps and --path (not the config's train.steps and
    train.path). With --resume CKPT both start from a checkpoint, laid out as this run's config says
    (--pp, --dp, pipeline.chunks_per_rank, --schedule may differ from the run that saved it).
    """
    check_report_target(json_out)
    console = Console()
    if resume is not None and (faults or oracle_check):
        raise UserError("--resume compares a run started from a checkpoint; --faults and --oracle-check "
                        "build their own: use one of them")
    if faults:
        raise typer.Exit(_faults(json_out, console))
    cfg = config_from_cli(config, sets=sets, **{"pipeline.schedule": schedule.value if schedule else None,
                                                "train.device": device.value if device else None,
                                                "fp8.backend": backend.value if backend else None,
                                                "fp8.head": head.value if head else None,
                                                "offload.mode": offload.value if offload else None,
                                                "train.seed": seed, "pipeline.pp": pp, "pipeline.dp": dp})
    _check_device(cfg.train.device, path.value)
    if oracle_check:
        raise typer.Exit(_oracle_check(cfg, path.value, json_out, console))
    from qeffect.runtime.build import check_path

    check_path(path.value, cfg.train.device, cfg.offload.mode)
    from qeffect.runtime.distributed import launched_by_torchrun

    if launched_by_torchrun():
        raise typer.Exit(_distributed(cfg, steps, path.value, json_out, console, resume))
    from qeffect.verify.state import run_verify_state

    with Progress(TextColumn("verify-state"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[info]}"),
                  TimeElapsedColumn(), console=console, transient=True) as bar:
        task = bar.add_task("steps", total=steps, info="")
        report = run_verify_state(cfg, steps=steps, path=path.value, resume=resume,
                                  progress=lambda s, loss: bar.update(task, advance=1, info=f"loss {loss:.4f}"))
    _print_resume(report, console)
    head_note = "" if cfg.fp8.head == "backend" else f" + {cfg.fp8.head} head"
    console.print(_category_table(f"verify-state: {report.schedule} / {report.path} / {report.backend}{head_note} "
                                  f"on {report.device}, {report.steps} steps", report.categories))
    ro = report.amax_rollover
    console.print(f"amax history length {ro.amax_history_len}: {ro.forward_updates_per_module} forward and "
                  f"{ro.backward_updates_per_module} backward updates per module "
                  f"({'rolled over' if ro.rolled_over else 'NO rollover'}); {report.seconds:.1f} s")
    if report.first_divergence:
        d = report.first_divergence
        console.print(f"[red]first divergence: step {d.step}, action {d.action}, stage {d.stage}, "
                      f"microbatch {d.microbatch}, {d.category}: {d.tensor}[/red]")
    _print_step_graph(report.step_graph, console)
    _print_non_finite(report, console)
    raise typer.Exit(_conclude(report, "PASS: bitwise equal" if report.passed else "[red]FAIL[/red]", json_out,
                               console))


def _print_step_graph(check: StepGraphCheck | None, console: Console) -> None:
    """The step graph's check (`verify.state.StepGraphCheck`) in one line, where it ran."""
    if check is None:
        return
    if check.recorded_at_step is None:
        console.print("step graph: not recorded (a step graph records the third step: run more steps); "
                      f"{check.compared} tensors compared, {check.mismatches} mismatches", highlight=False)
    else:
        console.print(f"step graph: recorded at step {check.recorded_at_step}, {check.replays} steps launched as "
                      f"one graph; losses and final state: {check.compared} tensors compared, "
                      f"{check.mismatches} mismatches", highlight=False)
    if check.first_divergence:
        console.print(f"[red]step graph: first divergence: {check.first_divergence}[/red]")


def _category_table(title: str, categories) -> Table:
    table = Table(title=title)
    table.add_column("category")
    table.add_column("compared", justify="right")
    table.add_column("mismatches", justify="right")
    for c in categories:
        table.add_row(c.category, str(c.compared), str(c.mismatches), style=None if c.mismatches == 0 else "red")
    return table


def _print_resume(report, console: Console) -> None:
    """The checkpoint both sides started from, and the layout change, in one line each."""
    if report.resumed_from is not None:
        console.print(f"started from {report.resumed_from} at step {report.start_step}", highlight=False)
    if report.resumed_layout is not None:
        console.print(report.resumed_layout, highlight=False)


def _distributed(cfg, steps: int, path: str, json_out: Path | None, console: Console,
                 resume: Path | None = None) -> int:
    """Under torchrun: native eager and the qeffect mode with the same rank mapping, compared after every
    step on every rank (see qeffect.verify.distributed). Rank 0 prints and writes the report."""
    import torch.distributed as dist

    from qeffect.runtime.distributed import init_from_env
    from qeffect.verify.distributed import run_verify_distributed

    init_from_env(cfg.train.device)
    try:
        report = run_verify_distributed(cfg, steps=steps, path=path, resume=resume)
    finally:
        dist.barrier()
    if dist.get_rank() == 0:
        _print_resume(report, console)
        console.print(_category_table(
            f"verify-state under torchrun: {report.schedule} / {report.path} / {report.backend} on "
            f"{report.world_size} x {report.device} (PP={report.pp}), {report.steps} steps", report.categories))
        if report.graphs_per_rank is not None:
            console.print(f"graphs per rank: {report.graphs_per_rank}")
        if report.first_divergence:
            d = report.first_divergence
            console.print(f"[red]first divergence: step {d.step}, rank {d.rank}, {d.category}: {d.tensor}[/red]")
        _print_non_finite(report, console)
        for note in report.notes:
            console.print(f"note: {note}", highlight=False)
        _conclude(report, "PASS: bitwise equal" if report.passed else "[red]FAIL[/red]", json_out, console)
    dist.destroy_process_group()
    return 0 if report.passed else 1


def _check_device(device: str, path: str) -> None:
    import torch

    if device == "cuda" and not torch.cuda.is_available():
        raise UserError("--device cuda: no CUDA device is available on this machine")
    if path != "eager" and device != "cuda":
        raise UserError(f"--path {path} captures CUDA graphs and needs --device cuda")


def _print_non_finite(report, console: Console) -> None:
    if report.non_finite_losses:
        console.print(f"[red]{report.non_finite_losses} of {len(report.losses)} losses are NaN or infinite: "
                      "both runs diverged, so matching bits prove nothing[/red]")
