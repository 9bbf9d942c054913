"""`qeffect inspect-checkpoint`: read a checkpoint's DCP metadata and qeffect payload without a model."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from qeffect.cli.root import app, fail
from qeffect.errors import ReportError, UserError


def _mib(n: int) -> str:
    return f"{n:,} B ({n / 2**20:.2f} MiB)" if n >= 2**20 else f"{n:,} B"


def _short(n: int) -> str:
    for unit, size in (("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def _g(x: float) -> str:
    return f"{x:.4g}"


def _render(report, console: Console, modules: int) -> None:
    console.print(f"checkpoint {report.path}: step {report.step}, e_W per pipeline rank "
                  f"{report.epochs}, schema {report.checkpoint_schema_version}, {report.launch} "
                  f"(world size {report.world_size})")
    p = report.pipeline
    console.print(f"pipeline: schedule {report.schedule}, pp {p['pp']}, dp {p['dp']}, {p['chunks_per_rank']} "
                  f"chunks per rank ({p['num_stages']} stages), {p['microbatches']} microbatches")
    console.print(f"keys: {report.layers} layers, " + (
        "by global layer and parameter: resumes into any pipeline layout of this model" if report.keys == "global"
        else "by stage (schema 1): resumes into any layout, translated through its stages"))
    console.print("recipe: " + ", ".join(f"{k} {v}" for k, v in report.recipe.items()))
    model = report.config.get("model", {})
    console.print("model: " + ", ".join(f"{k} {v}" for k, v in model.items()))

    sizes = Table(title="checkpoint bytes")
    for col in ("section", "tensors", "numbers", "stored"):
        sizes.add_column(col, justify="right" if col != "section" else "left")
    for name, s in report.sections.items():
        sizes.add_row(name, str(s.tensors), _mib(s.logical_bytes), _mib(s.stored_bytes))
    sizes.add_row("qeffect.json", "-", "-", _mib(report.payload_bytes))
    console.print(sizes)
    console.print(f"total checkpoint bytes {_mib(report.total_bytes)}; qeffect runtime state (FP8 tensors as "
                  f"stored + qeffect.json) {_mib(report.qeffect_runtime_state_bytes)} = "
                  f"{100 * report.qeffect_runtime_state_fraction:.2f}%")

    stages = Table(title="per stage (numbers = numel x element size; stored = bytes in the shard files)")
    for col in ("stage", "rank", "params", "optimizer", "fp8 tensors", "fp8 numbers", "qeffect payload"):
        stages.add_column(col, justify="right")
    for s in report.stages:
        stages.add_row(str(s.stage), str(s.pp_rank), _short(s.param_bytes), _short(s.optim_bytes),
                       str(s.fp8_tensors), _short(s.fp8_bytes), _short(s.qeffect_payload_bytes))
    console.print(stages)
    console.print("qeffect payload of a stage = its FP8 tensors as stored + its entry in qeffect.json")

    fp8 = Table(title="FP8 state per module (ranges over input / weight / grad; amax = history max)")
    for col in ("module", "history", "amax range", "scale range"):
        fp8.add_column(col, justify="left" if col == "module" else "right", no_wrap=True)
    shown = report.fp8_modules if modules <= 0 else report.fp8_modules[:modules]
    for m in shown:
        who = f"s{m.stage} {m.module}" if m.replica is None else f"dp{m.replica} s{m.stage} {m.module}"
        fp8.add_row(who, str(m.history_len), f"{_g(m.amax_range[0])} .. {_g(m.amax_range[1])}",
                    f"{_g(m.scale_range[0])} .. {_g(m.scale_range[1])}")
    console.print(fp8)
    if len(shown) < len(report.fp8_modules):
        console.print(f"({len(report.fp8_modules) - len(shown)} more modules; --modules 0 lists all, --json "
                      "has each tensor's last amax and scale)")
    for d in report.data:
        console.print(f"data position: epoch {d.get('epoch')}, cursor {d.get('cursor')} "
                      f"(data-parallel rank {d.get('dp_rank')})")
    console.print(f"cache: {report.cache_semantics}")
    console.print("not saved (process-local): " + ", ".join(report.not_saved))


def _render_diff(diff, console: Console) -> None:
    console.print(f"a: {diff.a}\nb: {diff.b}")
    console.print(f"{diff.tensors_compared} tensors compared bitwise; {len(diff.tensors_differing)} differ; "
                  f"{len(diff.only_in_a)} only in a; {len(diff.only_in_b)} only in b")
    if diff.tensors_differing:
        t = Table(title="differing tensors")
        t.add_column("key")
        t.add_column("difference")
        for d in diff.tensors_differing:
            what = d.reason if d.reason != "bits" else f"{d.differing_elements} of {d.elements} elements"
            t.add_row(d.key, what)
        console.print(t)
    for k in diff.only_in_a:
        console.print(f"only in a: {k}")
    for k in diff.only_in_b:
        console.print(f"only in b: {k}")
    for s in diff.state_differences:
        console.print(f"state differs: {s}")
    for s in diff.other_config_differences:
        console.print(f"(not counted) config: {s}")
    console.print("IDENTICAL" if diff.identical else "[red]DIFFERENT[/red]")


@app.command("inspect-checkpoint")
def inspect_checkpoint(
    path: Path = typer.Argument(..., help="Checkpoint folder (or a checkpoint root with a `latest` file)."),
    json_flag: bool = typer.Option(False, "--json", help="Print the report as JSON (CheckpointReport) instead."),
    diff: Path | None = typer.Option(
        None, "--diff", help="Compare with another checkpoint, tensor by tensor (bitwise); exit 1 if they differ, "
        "2 if either cannot be read."),
    modules: int = typer.Option(12, "--modules", min=0, help="FP8 modules to list in the table (0: all)."),
) -> None:
    """Summarize a checkpoint without building a model: step and epochs, recipe, configuration, sizes
    (total checkpoint bytes against qeffect runtime-state bytes, per stage), and per-module FP8 state.

    With --diff OTHER: every tensor is loaded from both and compared on its bits, and the step, epochs,
    data position, RNG, recipe and run-shape configuration are compared; exit 0 when identical, 1
    otherwise (other config fields such as steps or paths are listed but not counted), 2 when either
    cannot be read (as diff(1), so that a script never reads a missing checkpoint as a difference). A
    folder that is not a checkpoint, a missing or truncated or corrupted file, or an unknown schema
    version: one line on stderr, exit 1 (2 with --diff).
    """
    from qeffect.checkpoint import diff_checkpoints
    from qeffect.checkpoint import inspect_checkpoint as run_inspect

    console = Console()
    if diff is not None:
        try:
            result = diff_checkpoints(path, diff)
        except (ReportError, UserError) as err:  # exit 1 means "they differ" here
            fail(str(err).replace("\n", " "), 2)
        if json_flag:
            typer.echo(result.model_dump_json(indent=2))
        else:
            _render_diff(result, console)
        raise typer.Exit(0 if result.identical else 1)
    report = run_inspect(path)
    if json_flag:
        typer.echo(report.model_dump_json(indent=2))
    else:
        _render(report, console, modules)
