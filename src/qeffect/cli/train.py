"""`qeffect train`: train the configured pipeline (the embedded tiny CPU default with no arguments)."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from qeffect.cli.common import Backend, Device, Offload, PathMode, Schedule, config_from_cli, write_json
from qeffect.cli.root import app


@app.command("train")
def train(
    config: Path | None = typer.Option(None, "--config", "-c", help="Run config TOML (default: embedded tiny CPU config)."),
    steps: int | None = typer.Option(None, "--steps", min=1, help="Optimizer steps."),
    seed: int | None = typer.Option(None, "--seed", help="Seed for parameters and data order."),
    schedule: Schedule | None = typer.Option(None, "--schedule", help="Pipeline schedule."),
    backend: Backend | None = typer.Option(None, "--backend", help="FP8 backend."),
    device: Device | None = typer.Option(None, "--device", help="cpu or cuda."),
    path: PathMode | None = typer.Option(
        None, "--path", help="eager, or every action captured as a CUDA graph (captured-copy / captured-direct; cuda)."),
    offload: Offload | None = typer.Option(
        None, "--offload", help="Captured paths: keep saved activations in VMM slots, release or resident (cuda)."),
    data: str | None = typer.Option(None, "--data", help="C4-format JSON-lines file or glob of shards (.json[.gz])."),
    tokenizer: str | None = typer.Option(None, "--tokenizer", help="A tokenizer.json (default: the bundled BPE)."),
    pp: int | None = typer.Option(None, "--pp", min=1, help="Pipeline-parallel degree."),
    dp: int | None = typer.Option(None, "--dp", min=1, help="Data-parallel degree (needs torchrun)."),
    out: Path | None = typer.Option(None, "--out", help="Run folder (default: <train.run_dir>/<time>-<schedule>-<backend>)."),
    json_out: Path | None = typer.Option(None, "--json", help="Also write the run summary JSON here."),
    checkpoint_every: int | None = typer.Option(
        None, "--checkpoint-every", min=1, help="Save a checkpoint every N steps (and at the last step)."),
    checkpoint_dir: Path | None = typer.Option(
        None, "--checkpoint-dir", help="Checkpoint folder (default: <run folder>/checkpoints); step-<N>/ inside."),
    resume: Path | None = typer.Option(
        None, "--resume", help="Continue from this checkpoint (or a checkpoint folder's `latest`) up to --steps."),
) -> None:
    """Train a GPT pipeline with FP8 delayed scaling and checked split F / dI / dW actions.

    With no arguments: the embedded tiny CPU config on the bundled Jargon File asset. For several
    processes: `torchrun --nproc-per-node N -m qeffect train --pp P --dp D` with P x D = N. On one GPU,
    `--device cuda --path captured-direct` replays every F / dI / dW as a CUDA graph (bitwise equal to
    the eager path) and `--offload release|resident` moves the activations they save to pinned host
    memory between forward and backward, at fixed device addresses.
    Writes metrics.jsonl, config.json and summary.json into the run folder.

    Checkpoints: `--checkpoint-every N` saves DIR/step-<N>/ (DCP tensors + qeffect.json) after every
    N-th commit and after the last step; `--resume DIR --steps 8` continues a run from its saved step to
    step 8. A resume with another pipeline shape, schedule, recipe or model is refused, naming each
    difference.
    """
    cfg = config_from_cli(config, **{
        "train.steps": steps, "train.seed": seed, "pipeline.schedule": schedule.value if schedule else None,
        "fp8.backend": backend.value if backend else None, "train.device": device.value if device else None,
        "train.path": path.value if path else None, "offload.mode": offload.value if offload else None,
        "train.data": data, "train.tokenizer": tokenizer, "pipeline.pp": pp, "pipeline.dp": dp,
        "train.checkpoint_every": checkpoint_every,
        "train.checkpoint_dir": str(checkpoint_dir) if checkpoint_dir is not None else None,
    })
    from qeffect.runtime.train import train as run_train

    console = Console()
    with Progress(TextColumn("train"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[info]}"),
                  TimeRemainingColumn(), console=console) as bar:
        task = bar.add_task("steps", total=cfg.train.steps, info="")

        def on_step(m) -> None:
            info = f"loss {m.loss:.4f}  {m.tokens_per_s:,.0f} tok/s  {m.step_time_s * 1e3:.1f} ms/step"
            if m.heldout_ce is not None:
                info += f"  held-out {m.heldout_ce:.4f}"
            bar.update(task, completed=m.step, info=info)

        summary = run_train(cfg, out=out, on_step=on_step, resume=resume)
    if summary.run_dir is None:  # not global rank 0
        return
    console.print(f"run folder: {summary.run_dir}")
    if summary.resumed_from:
        console.print(f"resumed from {summary.resumed_from} at step {summary.start_step}")
    if summary.checkpoints:
        console.print(f"checkpoints: {len(summary.checkpoints)}, last {summary.checkpoints[-1]}")
    console.print(f"training cross-entropy: first ten {summary.first_ten_ce:.4f}, last ten {summary.last_ten_ce:.4f}, "
                  f"ratio {summary.last_to_first_ratio:.3f}")
    if summary.heldout_first is not None:
        console.print(f"held-out cross-entropy: {summary.heldout_first:.4f} -> {summary.heldout_last:.4f}")
    console.print(f"median step {summary.median_step_time_s * 1e3:.1f} ms, {summary.tokens_per_s:,.0f} tokens/s, "
                  f"{summary.seconds:.1f} s in all")
    if json_out:
        write_json(json_out, summary)
