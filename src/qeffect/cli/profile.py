"""`qeffect profile`: time the configuration matrix, render it as tables, JSON and PNG figures."""

from __future__ import annotations

import shlex
from pathlib import Path

import typer
from rich.console import Console
from rich.table import Table

from qeffect.cli.common import SET_HELP, SET_METAVAR, Backend, Device, config_from_cli, write_json
from qeffect.cli.root import app
from qeffect.errors import ReportError, UserError
from qeffect.runtime.outputs import check_folder_target, check_report_target


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.2f}"


def _mib(x: int | float | None) -> str:
    return "-" if x is None else f"{x / 2**20:,.1f}"


def _num(x: float | None, fmt: str = "{:.1f}") -> str:
    return "-" if x is None else fmt.format(x)


def _render_losses(report, console: Console) -> None:
    """Timings of a configuration that diverged or computes other losses than native eager are suspect."""
    for c in report.configs:
        if c.status != "ok":
            continue
        if c.non_finite_losses:
            console.print(f"[red]losses: {c.name}: {c.non_finite_losses} of {len(c.losses)} are NaN or infinite[/red]",
                          highlight=False)
        if c.losses_equal_native is False:
            console.print(f"[red]losses: {c.name}: not native eager's bit for bit (same model, data and "
                          "backend)[/red]", highlight=False)
    same = [c.name for c in report.configs if c.losses_equal_native]
    if same:
        console.print(f"losses equal to native eager's, bit for bit: {', '.join(same)}", highlight=False)


def render(report, console: Console) -> None:
    """Rich tables of a `ProfileReport`: timings, resources, GEMM floor and the M analysis."""
    cfg = report.config
    title = (f"profile: h{cfg['model']['hidden']}, pp {cfg['pipeline']['pp']} x {cfg['pipeline']['chunks_per_rank']} "
             f"chunks, M {cfg['pipeline']['microbatches']}, {report.backend} on "
             + (f"{report.world_size} x " if report.world_size > 1 else "") + f"{report.device_name}; "
             f"{report.warmup} warm-up + {report.steps} timed steps"
             + (f" (+ {report.trace_steps} traced)" if report.trace_steps else "")
             + (f", {report.rounds} rounds interleaved" if report.rounds > 1 else ""))
    t = Table(title=title)
    t.add_column("configuration", no_wrap=True)
    for col in ("median ms", "rounds min-max ms", "q1-q3 ms", "x native", "setup s", "break-even steps", "x floor",
                "x limit", "host/GPU"):
        t.add_column(col, justify="right")
    for c in report.configs:
        if c.status != "ok":
            continue
        be = "-" if c.name == "native-eager" else ("never" if c.break_even_steps is None else f"{c.break_even_steps:.1f}")
        rm = c.medians_by_round()
        t.add_row(c.name + (f" ({c.variant})" if c.variant else ""), _ms(c.median_step_seconds),
                  f"{_ms(min(rm))}-{_ms(max(rm))}" if len(rm) > 1 else "-", f"{_ms(c.spread.q1)}-{_ms(c.spread.q3)}",
                  _num(c.speedup_vs_native, "{:.2f}"), _num(c.setup_seconds, "{:.2f}"), be,
                  _num(c.floor_ratio, "{:.1f}"), _num(c.limit_ratio, "{:.2f}"), _num(c.host_gpu_ratio, "{:.2f}"))
    console.print(t)
    if report.te_fallbacks:  # a slower path after a failed private TE lookup: timings may not be TE's best
        console.print("[yellow]warning: Transformer Engine internals not as expected, slower paths ran "
                      "(fp8.te_compat): " + ", ".join(f"{k} x{n}" for k, n in sorted(report.te_fallbacks.items())) + "[/yellow]",
                      highlight=False)
    _render_losses(report, console)
    _render_traces(report, console)
    for c in report.configs:
        if c.status != "ok":
            style = "red" if c.status == "failed" else "dim"
            console.print(f"[{style}]{c.status}: {c.name}: {c.reason}[/{style}]", highlight=False)
    r = Table(title="resources per configuration")
    r.add_column("configuration", no_wrap=True)
    for col in ("peak alloc MiB", "peak resv MiB", "growth B/step", "graphs", "replays /step", "handoffs /step",
                "arena MiB", "capture host s"):
        r.add_column(col, justify="right")
    for c in report.configs:
        if c.status == "ok":
            r.add_row(c.name, _mib(c.peak_allocated_bytes), _mib(c.peak_reserved_bytes),
                      _num(c.persistent_growth_bytes_per_step, "{:,.0f}"), str(c.graph_count),
                      _num(c.replays_per_step, "{:.0f}"), _num(c.handoffs_per_step, "{:.0f}"), _mib(c.arena_bytes),
                      _num(c.capture_host_seconds, "{:.3f}"))
    console.print(r)
    if report.world_size > 1:
        console.print("under torchrun: memory columns are the maximum over ranks; graphs, replays, handoffs and "
                      "arena are summed over ranks (by-rank values in the JSON)", highlight=False)
    for n in sorted({c.memory_note for c in report.configs if c.memory_note}):
        console.print(f"memory: {n}", highlight=False)
    setups = [(c.name, c.setup_line()) for c in report.configs if c.status == "ok" and c.setup_phases]
    if setups:
        console.print("setup (build phases, then the first step; seconds):", highlight=False)
        for name, line in setups:
            console.print(f"  {name}: {line}", highlight=False)
    hosts = [(c, c.host_phase_line()) for c in report.configs if c.status == "ok" and c.host_phase_seconds]
    if hosts:
        console.print("host queue time per step by phase, medians over a few steps after the timed ones "
                      "(runtime: the rest, its own bookkeeping):", highlight=False)
        for c, line in hosts:
            console.print(f"  {c.name}: {line} (timed steps: {_ms(c.host_median_seconds)} ms)", highlight=False)
    if report.init_draw_seconds is not None:
        console.print(f"setup: the initial weights were drawn once ({report.init_draw_seconds:.2f} s, before any "
                      "timer) and copied into every configuration's build", highlight=False)
    f = report.floor
    console.print(f"matrix FLOPs per step: {report.matrix_flops.total:,} ({report.matrix_flops.layers_only:,} in the "
                  f"layers); FP8 GEMM on these shapes: {f.effective_tflops:.3g} TFLOP/s effective, "
                  f"{f.peak_tflops:.3g} peak; floor {f.seconds * 1e3:.3f} ms "
                  f"({f.seconds_layers_only * 1e3:.3f} ms layers only)", highlight=False)
    _render_floors(report, console)
    if report.resources:
        m = Table(title="resource analysis over M (graphs provisioned: 3 x M x chunks per rank)")
        m.add_column("schedule", no_wrap=True)
        for col in ("M", "graphs /rank", "arena MiB", "live tapes /rank", "pending dW /rank", "capture host s"):
            m.add_column(col, justify="right")
        for row in report.resources:
            m.add_row(row.schedule, str(row.microbatches), str(row.graphs_per_rank), _mib(row.arena_bytes),
                      ",".join(map(str, row.max_live_tapes)), ",".join(map(str, row.max_pending_dw)),
                      _num(row.capture_host_seconds, "{:.3f}"))
        console.print(m)
        for n in sorted({f"M={row.microbatches} {row.schedule}: {row.capture_note}" if not
                         row.capture_note.startswith("not run") else row.capture_note
                         for row in report.resources if row.capture_note}):
            console.print(f"capture: {n}", highlight=False)
    _render_targets(report, console)


def _render_floors(report, console: Console) -> None:
    """The floors by method: GEMM (a), peak-rate (b), optimizer (c) and the limit (b) + (c)."""
    f = report.floor
    console.print(f"floor (a) GEMM {f.seconds * 1e3:.3f} ms: {f.gemm_method or 'eager back-to-back launches (an older report)'}",
                  highlight=False, soft_wrap=True)
    if f.limit_seconds is None:
        console.print("floor (b) peak-rate, (c) optimizer and the limit: not in this report (older than them)",
                      highlight=False)
        return
    console.print(f"floor (b) peak-rate {f.peak_rate_seconds * 1e3:.3f} ms ({f.peak_rate_tflops:.0f} TFLOP/s): "
                  f"{f.peak_rate_method}", highlight=False, soft_wrap=True)
    console.print(f"floor (c) optimizer {f.optimizer_seconds * 1e3:.3f} ms ({f.optimizer_bytes / 1e9:.2f} GB at "
                  f"{f.copy_bytes_per_second / 1e9:.0f} GB/s): {f.optimizer_method}", highlight=False, soft_wrap=True)
    console.print(f"limit (b) + (c): {f.limit_seconds * 1e3:.3f} ms ({f.limit_seconds_layers_only * 1e3:.3f} ms for "
                  "the layers alone in bf16, te-graphed's)", highlight=False)


def _render_targets(report, console: Console) -> None:
    """The targets file's targets: met or missed, by how much, and (missed) where the time goes."""
    if not report.targets:
        return
    t = Table(title=f"targets ({report.targets_source or 'built into the report'}; from this run's measurements)")
    t.add_column("target", no_wrap=True)
    for col in ("value", "on GPU busy", "threshold", "result"):
        t.add_column(col, justify="right")
    t.add_column("what would meet it")
    for c in report.targets:
        if c.met is None:
            result = "[dim]not measured[/dim]"
        elif c.met:
            result = "[green]met[/green]"
        else:
            result = "[red]missed[/red]" + (f" by {c.shortfall:.0%}" if c.shortfall is not None else "")
        t.add_row(c.name, "-" if c.value is None else f"{c.value:,.2f}", _num(c.gpu_busy_value, "{:.2f}"),
                  f"{c.comparison} {c.threshold:g}", result,
                  c.needed or (c.note if c.value is None else None) or "")
    console.print(t)
    for c in report.targets:
        if c.value is not None and c.note:  # measured: how robust the ratio is to a noisy baseline
            console.print(f"{c.name}: {c.note}", highlight=False, soft_wrap=True)
    for c in report.targets:
        if c.met is False and c.where:
            console.print(f"{c.name}: {c.where}", highlight=False, soft_wrap=True)


def _render_traces(report, console: Console) -> None:
    """One trace line per configuration (per rank under torchrun) with a trace summary, and trace errors."""
    from qeffect.profile.trace import trace_line

    for c in report.configs:
        for label, t in c.labelled_traces():
            if t is not None:
                console.print(f"{label}: {trace_line(t)}", highlight=False, soft_wrap=True)
        if c.trace_error is not None:
            console.print(f"[red]{c.name}: trace failed: {c.trace_error}[/red]", highlight=False)


def _command(config: Path | None, device: Device | None, backend: Backend | None, steps: int, warmup: int,
             microbatches: str | None, configs: str | None, json_out: Path | None, plot: Path | None,
             trace: int = 0, sets: list[str] | None = None, rounds: int | None = None,
             targets: Path | None = None) -> str:
    parts = ["qeffect profile"]
    for flag, value in (("--config", config), ("--device", device and device.value),
                        ("--backend", backend and backend.value), ("--steps", steps), ("--warmup", warmup),
                        ("--rounds", rounds), ("--targets", targets),
                        ("--trace", trace or None), ("--microbatches", microbatches), ("--configs", configs), ("--json", json_out),
                        ("--plot", plot)):
        if value is not None:
            parts.append(f"{flag} {value}")
    parts += [f"--set {shlex.quote(item)}" for item in sets or ()]
    return " ".join(parts)


@app.command("profile")
def profile(
    config: Path | None = typer.Option(None, "--config", "-c", help="Run config TOML (default: the embedded tiny CPU config)."),
    sets: list[str] | None = typer.Option(None, "--set", metavar=SET_METAVAR, help=SET_HELP),
    device: Device | None = typer.Option(None, "--device", help="cpu or cuda (default: the config's)."),
    backend: Backend | None = typer.Option(None, "--backend", help="FP8 backend (default: the config's)."),
    steps: int = typer.Option(20, "--steps", min=1, help="Timed steps per configuration (after warm-up)."),
    warmup: int = typer.Option(3, "--warmup", min=1, help="Warm-up steps, excluded from the statistics; the first is part of setup. "
                              "Keep 3 or more: a captured configuration's optimizer step is captured on its third."),
    trace: int = typer.Option(0, "--trace", min=0, help="Profile this many extra steps per configuration (not timed) "
                              "and summarize where a step's time goes: GPU busy/idle, host aten time, top kernels (under torchrun: every rank)."),
    microbatches: str | None = typer.Option(None, "--microbatches", help="Also analyse resources for these M, e.g. 2,4,8,16."),
    configs: str | None = typer.Option(None, "--configs", help="Comma-separated subset (default: all): native-eager, qeffect-eager, captured-copy, "
                                "captured-direct, captured-zbv-direct, captured-direct-launched (captured-direct with every action launched by the host, "
                                "no step graph: an extra row), te-graphed (TE's graphed layers alone, as docs/design.md §8 describes them: "
                                "the TE anchor), te-graphed-model (the same graphs in the whole model, fp32 masters: an extra row), "
                                "te-graphed-mcore (te-graphed-model as Megatron-LM sets TE up: fused wgrad accumulation, FP8 weights cached per step: "
                                "an extra row), megatron-graphs (Megatron-Core's fastest working CUDA-graph mode, a child process: an anchor)."),
    json_out: Path | None = typer.Option(None, "--json", help="Write the report as JSON to this file (with --report "
                                         "and --targets: the saved report judged again)."),
    plot: Path | None = typer.Option(None, "--plot", help="Write PNG figures into this folder (needs matplotlib)."),
    report_in: Path | None = typer.Option(None, "--report", help="Render a saved JSON report (tables, --plot) instead of running; "
                                          "with --targets, judge it again by that file."),
    rounds: int = typer.Option(3, "--rounds", min=1, help="Rounds per configuration, interleaved in one process (ABC ABC "
                               "ABC); medians over rounds, ratio targets on the median of per-round ratios (single-process)."),
    targets: Path | None = typer.Option(None, "--targets", help="TOML file of acceptance targets to judge the report by "
                                        "(e.g. examples/targets/h200.toml); default: none."),
) -> None:
    """Time native eager, qeffect eager, captured (copy, direct, ZB-V direct) and the anchors: TE's graphs and
    Megatron-Core's.

    One model, one synthetic data sequence, one process, every configuration in --rounds interleaved
    rounds (ABC ABC ABC). For each configuration: the median of its round medians and their min-max,
    the spread of its steps, the host's time to queue a step over the GPU's (and by phase: graph
    launches, input copies, stream switches and hand-offs, optimizer, the runtime's own bookkeeping),
    setup time (build + capture + first step, the build split by phase: modules, values, ranks, capture),
    break-even steps against native eager, peak and persistent memory (CUDA), graphs, replays and handoffs
    per step, arena bytes, capture host time, and the ratios to the floors measured in the same run, each named by its method:
    (a) the GEMM floor (each GEMM timed inside a CUDA graph), (b) the peak-rate floor (matrix FLOPs at a
    large square FP8 GEMM's rate), (c) the optimizer floor (AdamW's bytes at a large copy's bandwidth);
    the limit is (b) + (c). With --trace N, a profiler summary of N more steps; with --targets FILE, the
    targets of that file judged on the medians of per-round ratios. Configurations this machine cannot run
    are reported as not run, with the reason.

    Under torchrun (`torchrun --nproc-per-node P*D -m qeffect profile ...`), one pipeline rank per
    process and GPU: every timed step ends with the device synchronized and a barrier of all ranks;
    rank 0 prints and writes the report, with memory per rank and the floor split over the stages
    (--trace: every rank's summary; --microbatches is single-process). Each configuration's path and
    schedule, and the step counts, are profile's own (--configs, --steps, --warmup), not the config's.
    """
    check_report_target(json_out)
    if plot is not None:
        check_folder_target(plot, "the plot folder")
    console = Console()
    if plot is not None:
        from qeffect.profile.plot import require_matplotlib

        require_matplotlib()
    from qeffect.runtime.distributed import launched_by_torchrun

    specs = _targets(targets)
    if report_in is not None or launched_by_torchrun():  # a saved report, or torchrun's (one round)
        if report_in is not None:
            report = _load(report_in)
        else:
            report = _distributed(config, device, backend, steps, warmup, microbatches, configs, json_out, plot,
                                  console, trace, sets)
            if report is None:  # ranks other than 0: rank 0 prints and writes
                raise typer.Exit(0)
        if specs is not None:
            from qeffect.profile.targets import with_targets

            with_targets(report, specs, source=str(targets))
    else:
        report = _run(config, device, backend, steps, warmup, microbatches, configs, json_out, plot, console, trace,
                      sets, rounds, targets, specs)
    render(report, console)
    if json_out and (report_in is None or specs is not None):  # a saved report: written again once re-judged
        write_json(json_out, report)
        console.print(f"report: {json_out}")
    if plot is not None:
        from qeffect.profile.plot import write_plots

        for p in write_plots(report, plot):
            console.print(f"figure: {p}")
    failed = [c.name for c in report.configs if c.status == "failed"]
    if failed:
        console.print(f"[red]failed: {', '.join(failed)}[/red]")
    raise typer.Exit(1 if failed else 0)


def _targets(path: Path | None):
    """The targets of `--targets` (None: none given), read and checked before anything runs."""
    if path is None:
        return None
    from qeffect.profile.matrix import CONFIG_NAMES
    from qeffect.profile.targets import load_targets

    return load_targets(path, CONFIG_NAMES)


def _run(config, device, backend, steps, warmup, microbatches, configs, json_out, plot, console, trace=0, sets=None,
         rounds=3, targets=None, specs=None):
    from qeffect.profile.matrix import run_profile
    from qeffect.profile.resources import parse_microbatches

    try:
        ms = parse_microbatches(microbatches) if microbatches is not None else None
    except ValueError as err:
        raise UserError(str(err)) from None
    cfg, names = _inputs(config, device, backend, configs, sets)
    command = _command(config, device, backend, steps, warmup, microbatches, configs, json_out, plot, trace, sets,
                       rounds, targets)
    with console.status("profiling") as status:
        return run_profile(cfg, steps=steps, warmup=warmup, configs=names, microbatches=ms, command=command,
                           config_path=str(config) if config else None, trace_steps=trace,
                           progress=lambda msg: status.update(f"profiling: {msg}"), rounds=rounds,
                           targets=specs, targets_source=str(targets) if targets else None)


def _inputs(config, device, backend, configs, sets=None):
    """The run config (with the CLI's device and backend, then --set) and the configuration names (None: all)."""
    names = [n.strip() for n in configs.split(",")] if configs is not None else None
    cfg = config_from_cli(config, sets=sets, **{"train.device": device.value if device else None,
                                                "fp8.backend": backend.value if backend else None})
    return cfg, names


def _distributed(config, device, backend, steps, warmup, microbatches, configs, json_out, plot, console, trace,
                 sets=None):
    """Under torchrun: the matrix with one pipeline rank per process; rank 0 gets the report, others None."""
    import contextlib

    import torch.distributed as dist

    from qeffect.profile.distributed import refuse_single_process_options, run_profile_distributed
    from qeffect.runtime.distributed import init_from_env

    refuse_single_process_options(microbatches)
    cfg, names = _inputs(config, device, backend, configs, sets)
    init_from_env(cfg.train.device)
    command = f"torchrun --nproc-per-node {dist.get_world_size()} " + _command(
        config, device, backend, steps, warmup, None, configs, json_out, plot, trace, sets)
    rank0 = dist.get_rank() == 0
    try:
        with console.status("profiling") if rank0 else contextlib.nullcontext() as status:
            report = run_profile_distributed(
                cfg, steps=steps, warmup=warmup, configs=names, command=command,
                config_path=str(config) if config else None,
                progress=(lambda msg: status.update(f"profiling: {msg}")) if rank0 else None, trace_steps=trace)
    finally:
        dist.barrier()
    dist.destroy_process_group()
    return report


def _load(path: Path):
    from pydantic import ValidationError

    from qeffect.profile.report import READABLE_SCHEMA_VERSIONS, ProfileReport
    from qeffect.profile.targets import with_targets

    if not path.is_file():
        raise UserError(f"{path}: report file not found")
    try:
        report = ProfileReport.model_validate_json(path.read_text())
    except ValidationError as err:
        raise ReportError(f"{path}: not a qeffect profile report ({err.error_count()} schema errors)") from None
    if report.schema_version not in READABLE_SCHEMA_VERSIONS:
        raise ReportError(f"{path}: profile report schema {report.schema_version}, this qeffect reads "
                          f"{', '.join(map(str, READABLE_SCHEMA_VERSIONS))}")
    return with_targets(report)  # reports older than the loss check: from their recorded losses
