"""`qeffect train`: train the configured pipeline (the embedded tiny CPU default with no arguments)."""

from __future__ import annotations

import os
from pathlib import Path

import typer
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

from qeffect.cli.common import (
    SET_HELP,
    SET_METAVAR,
    Backend,
    Device,
    Offload,
    PathMode,
    Schedule,
    config_from_cli,
    write_json,
)
from qeffect.cli.root import app
from qeffect.runtime.outputs import check_report_target


@app.command("train")
def train(
    config: Path | None = typer.Option(None, "--config", "-c", help="Run config TOML (default: embedded tiny CPU config)."),
    sets: list[str] | None = typer.Option(None, "--set", metavar=SET_METAVAR, help=SET_HELP),
    steps: int | None = typer.Option(None, "--steps", min=1, help="Optimizer steps."),
    seed: int | None = typer.Option(None, "--seed", help="Seed for parameters and data order."),
    schedule: Schedule | None = typer.Option(None, "--schedule", help="Pipeline schedule."),
    backend: Backend | None = typer.Option(None, "--backend", help="FP8 backend."),
    device: Device | None = typer.Option(None, "--device", help="cpu or cuda."),
    path: PathMode | None = typer.Option(
        None, "--path", help="eager, or every action captured as a CUDA graph (captured-copy / captured-direct; cuda)."),
    offload: Offload | None = typer.Option(
        None, "--offload", help="Captured paths: keep saved activations in VMM slots, release or resident (cuda)."),
    data: str | None = typer.Option(
        None, "--data", help="A prepared folder (qeffect prepare-data), or a C4-format JSON-lines file or glob of "
        "shards (.json[.gz]): data.path."),
    tokenizer: str | None = typer.Option(None, "--tokenizer", help="A tokenizer.json (default: the bundled BPE)."),
    pp: int | None = typer.Option(None, "--pp", min=1, help="Pipeline-parallel degree."),
    dp: int | None = typer.Option(None, "--dp", min=1, help="Data-parallel degree (needs torchrun)."),
    out: Path | None = typer.Option(None, "--out", help="Run folder (default: <train.run_dir>/<time>-<schedule>-<backend>)."),
    json_out: Path | None = typer.Option(None, "--json", help="Also write the run summary JSON here."),
    checkpoint_every: int | None = typer.Option(
        None, "--checkpoint-every", min=1, help="Save a checkpoint every N steps (and at the last step)."),
    checkpoint_dir: Path | None = typer.Option(
        None, "--checkpoint-dir", help="Checkpoint folder (default: <run folder>/checkpoints); step-<N>/ inside."),
    resume: str | None = typer.Option(
        None, "--resume", help="Continue from this checkpoint (or a checkpoint folder's `latest`) up to "
        "--steps; 'auto': from the newest in train.checkpoint_dir, else <--out>/checkpoints, if any, else "
        "start fresh."),
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
    step 8. The checkpoint is keyed by layer and parameter, so the resumed run may lay the model out
    otherwise (--pp, --dp, pipeline.chunks_per_rank with the same layer count, --schedule; one line names
    the change); another recipe, model or microbatch count is refused, naming each difference. `--resume auto` (for a job that may be restarted) resumes from the newest checkpoint in
    train.checkpoint_dir, else in <--out>/checkpoints (reusing that run folder), and starts fresh when
    there is none; it needs --out or train.checkpoint_dir. `train.keep_checkpoints = K` keeps the newest K.

    Output: with a terminal, a progress bar; without one (a log file, a pipe), a plain line every
    train.log_every steps and at the last, and one per held-out evaluation. Only global rank 0 prints.
    """
    check_report_target(json_out)
    cfg = config_from_cli(config, sets=sets, **{
        "train.steps": steps, "train.seed": seed, "pipeline.schedule": schedule.value if schedule else None,
        "fp8.backend": backend.value if backend else None, "train.device": device.value if device else None,
        "train.path": path.value if path else None, "offload.mode": offload.value if offload else None,
        "data.path": data, "data.tokenizer": tokenizer, "pipeline.pp": pp, "pipeline.dp": dp,
        "train.checkpoint_every": checkpoint_every,
        "train.checkpoint_dir": str(checkpoint_dir) if checkpoint_dir is not None else None,
    })
    # the data and the tokenizer, checked before the model's modules are imported: one line within seconds
    from qeffect.data.plan import plan_from_config

    plan_from_config(cfg.data, vocab_size=cfg.model.vocab_size)
    from qeffect.runtime.train import train as run_train

    console = Console()
    where = None if resume is None else resume if resume == "auto" else Path(resume)
    total, every = cfg.train.steps, cfg.train.log_every
    if not console.is_terminal or os.environ.get("RANK", "0") != "0":  # a log: plain lines (rank 0 only)
        def on_step(m) -> None:
            if m.step % every == 0 or m.step == total:
                print(step_line(m, total), flush=True)

        def on_eval(step: int, ce: float | None) -> None:
            if ce is not None:
                print(f"eval step {step}/{total}  held-out ce {ce:.4f}", flush=True)

        summary = run_train(cfg, out=out, on_step=on_step, resume=where, on_eval=on_eval,
                            on_resume=lambda line: print(line, flush=True))
    else:
        with Progress(TextColumn("train"), BarColumn(), MofNCompleteColumn(),
                      TextColumn("{task.fields[info]}"), TimeRemainingColumn(), console=console) as bar:
            task = bar.add_task("steps", total=total, info="")

            norm: list[float | None] = [None]  # the bar shows the last norm taken (on the logged steps)

            def on_bar(m) -> None:
                norm[0] = m.grad_norm if m.grad_norm is not None else norm[0]
                info = step_line(m.model_copy(update={"grad_norm": norm[0]}), total).split("  ", 1)[1]
                if m.heldout_ce is not None:
                    info += f"  held-out {m.heldout_ce:.4f}"
                bar.update(task, completed=m.step, info=info)

            summary = run_train(cfg, out=out, on_step=on_bar, resume=where,
                                on_resume=lambda line: console.print(line, highlight=False))
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
    if summary.mfu is not None:
        peak = summary.mfu_peak_flops / 1e12
        console.print(f"MFU {summary.mfu:.1%} of {summary.mfu_peak_name} ({peak:,.0f} TFLOP/s per device)")
    if summary.peak_allocated_bytes is not None:
        console.print(f"peak allocated {summary.peak_allocated_bytes / 2**30:.2f} GiB")
    if json_out:
        write_json(json_out, summary)


def step_line(m, total: int) -> str:
    """`step 2/4  loss 9.1234  lr 3.00e-03  grad_norm 1.234  12,345 tok/s  55.1 ms/step` (+ MFU and the
    peak allocated memory where known)."""
    grad = "-" if m.grad_norm is None else f"{m.grad_norm:.4g}"
    line = (f"step {m.step}/{total}  loss {m.loss:.4f}  lr {m.lr:.2e}  grad_norm {grad}  "
            f"{m.tokens_per_s:,.0f} tok/s  {m.step_time_s * 1e3:.1f} ms/step")
    if m.mfu is not None:
        line += f"  mfu {m.mfu:.1%}"
    if m.peak_allocated_bytes is not None:
        line += f"  peak {m.peak_allocated_bytes / 2**30:.2f} GiB"
    return line
