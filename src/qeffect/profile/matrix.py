"""`qeffect profile`: time the configuration matrix on one model, one data sequence, one process.

Rules (the brief's): configurations are compared in one process and as ratios to native eager;
warm-up steps are excluded from the statistics (the first of them is part of setup); medians are
reported with their spread; on CUDA the device is synchronized before and after every timed step, and
the next step's data is made before its timer starts. Every configuration builds its model from the
same seed and runs on the same synthetic data sequence (step i gets `synthetic_batches(cfg, i)`), one
configuration at a time: its pipeline is freed before the next one is built, and CUDA peak-memory
statistics are reset in between. The initial weights are drawn once, before any timer, and copied
into every configuration's build (`model.gpt.shared_init_draws`): the CPU generator's draw is the same
work for every configuration, and its run-to-run noise (seconds at hidden 4,096) would otherwise
decide the break-even steps. Setup (build + first step) covers everything else: module construction,
the copy to the device, arenas, capture.

Rounds: every configuration is timed in `rounds` rounds interleaved in one process (ABC ABC ABC); a
round builds the configuration again, warms it up and times its steps, then frees it, so every round
starts from the same initial weights and data (the losses of every round must match native eager's
too) and each configuration's memory statistics stay its own. A configuration's median is the median
of its round medians; a ratio target is judged on the median of per-round ratios (`profile.targets`),
so a host that slows down for a while moves one round of every configuration, not one configuration.
Setup comes from the first round, memory from the worst round, traces from the last.

A configuration this machine cannot run is recorded as `not run` with the reason, never timed some
other way; one that raises is recorded as `failed` with its error and the matrix goes on (one that
fails in any round is failed).

With `trace_steps` > 0, each configuration then runs that many more steps under `torch.profiler`
(not part of the timings) and its result carries a `TraceSummary`: GPU busy and idle time, host time
in aten ops, the largest kernels and coarse kernel categories (see `qeffect.profile.trace`).
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import platform
import re
import statistics
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from qeffect.config import RunConfig, StepGraph
from qeffect.errors import UserError
from qeffect.fp8.te import clear_global_amax_buffers
from qeffect.graphs.stats import RUNTIME_PHASE, GraphStats, HostPhases
from qeffect.model.gpt import shared_init_draws
from qeffect.profile.flops import (
    Floor,
    GemmRate,
    MatrixFlops,
    count_matrix_flops,
    floor_of,
    measure_device_rates,
    measure_gemm_rates,
    optimizer_params,
    row_lazy_token_table,
)
from qeffect.profile.memory import add_native_ratios, measure_split
from qeffect.profile.report import TE_PATHS, ConfigResult, ProfileReport, Spread, break_even_steps
from qeffect.profile.resources import resource_rows
from qeffect.profile.targets import TargetSpec, with_targets
from qeffect.profile.trace import sync_device
from qeffect.runtime.build import build_chunks_for, build_single_process, dtype_of
from qeffect.runtime.memory_cap import release_device_memory
from qeffect.runtime.phases import SetupClock
from qeffect.schedule import build_schedule
from qeffect.verify.state import synthetic_batches

NATIVE = "native-eager"
TE_ANCHOR = "te-graphed"
MEGATRON = "megatron-graphs"
MIN_ROUNDS = 1  # the CLI's default is 3 (`DEFAULT_ROUNDS`); 1 only for quick looks and tests
DEFAULT_ROUNDS = 3
CPU_MEMORY_NOTE = "not measured: peak and persistent memory come from torch.cuda statistics (CUDA only)"


@dataclass(frozen=True)
class ConfigSpec:
    name: str
    description: str
    native: bool = False
    path: str = "eager"  # eager | captured-copy | captured-direct | te | te-model | te-mcore | megatron
    schedule: str | None = "interleaved"
    step_graph: StepGraph | None = None  # `runtime.step_graph` of the row; None: the config's

    @property
    def captured(self) -> bool:
        return self.path.startswith("captured")

    @property
    def te_anchor(self) -> bool:
        """Transformer Engine's own graphs (`profile.te_anchor`): one process, TE needed."""
        return self.path in TE_PATHS


CONFIGS: tuple[ConfigSpec, ...] = (
    ConfigSpec(NATIVE, "native eager: Interleaved 1F1B, full autograd backward", native=True),
    ConfigSpec("qeffect-eager", "qeffect eager: checked split F / dI / dW, Interleaved 1F1B"),
    ConfigSpec("captured-copy", "captured actions, copied gradients, Interleaved 1F1B", path="captured-copy"),
    ConfigSpec("captured-direct", "captured actions, direct placement into the arena, Interleaved 1F1B",
               path="captured-direct"),
    ConfigSpec("captured-zbv-direct", "captured actions, direct placement, ZB-V zero bubble",
               path="captured-direct", schedule="zbv"),
    ConfigSpec("captured-direct-launched", "extra row: captured-direct with every action launched by the host, "
               "no step graph (runtime.step_graph = false)", path="captured-direct", step_graph=False),
    ConfigSpec(TE_ANCHOR, "anchor: Transformer Engine make_graphed_callables per TransformerLayer, the layers "
               "alone (docs/design.md)", path="te", schedule=None),
    ConfigSpec("te-graphed-model", "extra row: the same per-layer TE graphs in the whole model (fp32 masters, "
               "embeddings, head, loss, fused AdamW)", path="te-model", schedule=None),
    ConfigSpec("te-graphed-mcore", "extra row: te-graphed-model as Megatron-LM sets TE up (wgrad GEMMs accumulate "
               "into fp32 main_grad, FP8 weights cached per step)", path="te-mcore", schedule=None),
    ConfigSpec(MEGATRON, "anchor: Megatron-Core's fastest working CUDA-graph mode on the same model, one GPU, "
               "in a child process (profile.megatron)", path="megatron", schedule=None),
)
CONFIG_NAMES: tuple[str, ...] = tuple(c.name for c in CONFIGS)


class Runner(Protocol):
    graph_count: int
    graphs_per_rank: int | None
    capture_host_seconds: float | None
    arena_bytes: int | None
    setup_phases: dict[str, float] | None  # seconds per build phase (`runtime.phases.SetupClock`)

    def data(self, step: int) -> Any: ...
    def step(self, data: Any) -> torch.Tensor | None: ...
    def counters(self) -> tuple[int, int]: ...
    def host_phases(self) -> HostPhases | None: ...


class GraphCounters:
    """The `Runner` statistics of a pipeline built with `manager` (None: not captured): graphs, capture
    host time and arena bytes at build, replays and handoffs as it runs. Shared by both runners."""

    setup_phases: dict[str, float] | None = None

    def _take_stats(self, manager: Any, ranks_here: int, arena_bytes: int | None) -> None:
        self.manager = manager
        stats = manager.stats if manager is not None else None
        self.graph_count = stats.graph_count if stats else 0
        self.graphs_per_rank = self.graph_count // ranks_here
        self.capture_host_seconds = stats.capture_host_seconds if stats else None
        self.arena_bytes = arena_bytes

    def counters(self) -> tuple[int, int]:
        if self.manager is None:
            return 0, 0
        return self.manager.stats.replay_count, self.manager.stats.handoffs

    def host_phases(self) -> HostPhases | None:
        """The clock of the host's phases, turned on (None: this runner does not time them)."""
        return None


class PipelineRunner(GraphCounters):
    """A `SingleProcessPipeline` (native, qeffect eager or captured) behind the `Runner` interface."""

    def __init__(self, cfg: RunConfig, device: torch.device, spec: ConfigSpec) -> None:
        if spec.schedule is not None:
            cfg = cfg.with_overrides(**{"pipeline.schedule": spec.schedule})
        graph = cfg.runtime.step_graph if spec.step_graph is None else spec.step_graph
        if graph is True and spec.path != "captured-direct":  # required by the config: where it applies
            graph = "auto"
        if cfg.runtime.step_graph != graph:
            cfg = cfg.with_overrides(**{"runtime.step_graph": graph})
        self.cfg, self.device = cfg, device
        clock = SetupClock(device)
        self.pipe = build_single_process(cfg, native=spec.native, device=device, path=spec.path, clock=clock)
        self.setup_phases = clock.seconds
        self._take_stats(self.pipe.manager, cfg.pipeline.pp,
                         None if spec.native else sum(r.arena.nbytes for r in self.pipe.ranks))

    def data(self, step: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return synthetic_batches(self.cfg, step, self.device)

    def step(self, data: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
        return self.pipe.step(data)

    def host_phases(self) -> HostPhases:
        return self.pipe.time_host_phases()


def te_version() -> str | None:
    try:
        import transformer_engine
    except Exception:  # not installed, or a broken install (missing CUDA libraries)
        return None
    return getattr(transformer_engine, "__version__", "unknown")


def git_revision() -> str | None:
    from qeffect.graphs.handshake import git_revision as rev

    return rev()


def not_run_reason(spec: ConfigSpec, cfg: RunConfig, device: torch.device, te_ok: bool) -> str | None:
    """Why this machine or config cannot run `spec` (None: it can)."""
    if spec.path == "megatron":
        from qeffect.profile.megatron import not_available_reason

        if not te_ok:
            return "Transformer Engine not importable (Megatron-Core's FP8 runs on it)"
        return not_available_reason(device.type)
    if spec.te_anchor:
        if not te_ok:
            return "Transformer Engine not importable"
        if device.type != "cuda":
            return f"make_graphed_callables captures CUDA graphs; needs a CUDA device (this run is on {device.type})"
        return None
    if spec.captured and device.type != "cuda":
        return f"captures CUDA graphs; needs a CUDA device (this run is on {device.type})"
    if spec.schedule == "zbv" and cfg.pipeline.chunks_per_rank != 2:
        return f"ZB-V needs exactly 2 chunks per rank; the config has {cfg.pipeline.chunks_per_rank}"
    return None


def release_memory(device: torch.device) -> None:
    """Between configurations: the last one's memory back to the device, and Transformer Engine's global
    delayed-scaling buffers emptied (`fp8.te.clear_global_amax_buffers`: else every TE autocast exit of the
    next configuration, captured ones included, updates the last one's modules too)."""
    clear_global_amax_buffers()
    release_device_memory(device)


def time_runner(result: ConfigResult, make: Callable[[], Runner], device: torch.device, *, steps: int,
                warmup: int, trace_steps: int = 0,
                sync: Callable[[torch.device], None] = sync_device) -> None:
    """Build, warm up and time one configuration, filling `result` (status stays "ok").

    Then, with `trace_steps` > 0, trace that many more steps (after every statistic above is taken);
    a trace that raises is recorded in `result.trace_error` and keeps the timings. `sync`: what
    "synchronized" means (under torchrun: this device, then a barrier of every rank).
    """
    cuda = device.type == "cuda"
    release_memory(device)
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
        result.baseline_allocated_bytes = torch.cuda.memory_allocated(device)
    else:
        result.memory_note = CPU_MEMORY_NOTE
    sync(device)
    t0 = time.perf_counter()
    runner = make()
    sync(device)
    result.build_seconds = time.perf_counter() - t0
    result.capture_host_seconds = runner.capture_host_seconds
    result.graph_count, result.graphs_per_rank = runner.graph_count, runner.graphs_per_rank
    result.arena_bytes = runner.arena_bytes
    result.setup_phases = dict(runner.setup_phases) if runner.setup_phases is not None else None

    def one(i: int) -> float:
        data = runner.data(i)  # made (and moved to the device) before the timer starts
        sync(device)
        t = time.perf_counter()
        loss = runner.step(data)
        queued = time.perf_counter()  # the host has queued the step (nothing on the hot path synchronizes)
        sync(device)
        dt = time.perf_counter() - t
        if loss is not None:
            result.losses.append(float(loss))
        return dt, queued - t

    for i in range(warmup):
        result.warmup_seconds.append(one(i)[0])
    replays0, handoffs0 = runner.counters()
    growth = GraphStats()
    for i in range(warmup, warmup + steps):
        dt, host = one(i)
        result.step_seconds.append(dt)
        result.host_seconds.append(host)
        if cuda:
            growth.mark_step(torch.cuda.memory_allocated(device))
    replays1, handoffs1 = runner.counters()
    result.replays_per_step = (replays1 - replays0) / steps
    result.handoffs_per_step = (handoffs1 - handoffs0) / steps
    if cuda:
        result.peak_allocated_bytes = torch.cuda.max_memory_allocated(device)
        result.peak_reserved_bytes = torch.cuda.max_memory_reserved(device)
        result.persistent_growth_bytes_per_step = growth.persistent_growth_per_step()
        pipe = getattr(runner, "pipe", None)  # one-process pipelines: the peak by category
        if pipe is not None:
            try:
                result.memory_split = measure_split(
                    pipe, peak=result.peak_allocated_bytes, baseline=result.baseline_allocated_bytes,
                    steady=torch.cuda.memory_allocated(device) - result.baseline_allocated_bytes,
                    peak_reserved=result.peak_reserved_bytes, native=result.name == NATIVE)
            except ValueError as err:  # the accounting cannot split this peak: say so, keep the timing
                result.memory_note = f"no memory split: {err}"
    result.first_step_seconds = result.warmup_seconds[0]
    result.setup_seconds = result.build_seconds + result.first_step_seconds
    result.spread = Spread.of(result.step_seconds)
    result.median_step_seconds = result.spread.median
    result.host_median_seconds = statistics.median(result.host_seconds)
    first = warmup + steps
    phases = runner.host_phases()
    if phases is not None:  # after the timed steps: the clock's reads are not in the times judged above
        n = min(steps, PHASE_STEPS)
        time_phases(result, runner, phases, range(first, first + n), device, sync)
        first += n
    if trace_steps > 0:
        from qeffect.profile.trace import trace_runner

        try:
            result.trace = trace_runner(runner, device, steps=trace_steps, first_step=first, sync=sync)
        except Exception as err:  # the profiler failing (e.g. no CUPTI) must not lose the timings
            result.trace_error = f"{type(err).__name__}: {str(err)[:500]}"


PHASE_STEPS = 5  # steps per round timed by host phase, after the timed steps


def time_phases(result: ConfigResult, runner: Runner, phases: HostPhases, indices: range, device: torch.device,
                sync: Callable[[torch.device], None]) -> None:
    """The host's queue time by phase (`graphs.stats.HostPhases`) over the steps `indices`, taken apart from
    the timed steps (the clock reads cost the host a little): per step, each phase's seconds and the rest of
    that step's queue time as "runtime"; per phase, its calls per step."""
    calls0 = phases.snapshot()[1]
    for i in indices:
        data = runner.data(i)
        sync(device)
        before = phases.snapshot()[0]
        t = time.perf_counter()
        runner.step(data)
        host = time.perf_counter() - t
        after = phases.snapshot()[0]
        sync(device)
        timed = {k: after[k] - before[k] for k in after}
        timed[RUNTIME_PHASE] = max(0.0, host - sum(timed.values()))
        for k, v in timed.items():
            result.host_phase_seconds.setdefault(k, []).append(v)
    result.host_phase_calls = {k: (n - calls0[k]) / len(indices) for k, n in phases.snapshot()[1].items()}


def _make_runner(spec: ConfigSpec, cfg: RunConfig, device: torch.device) -> Callable[[], Runner]:
    if spec.te_anchor:
        from qeffect.profile.te_anchor import TEGraphedLayers, TEGraphedMcore, TEGraphedModel

        anchor = {"te": TEGraphedLayers, "te-model": TEGraphedModel, "te-mcore": TEGraphedMcore}[spec.path]
        return lambda: anchor(cfg, device)
    return lambda: PipelineRunner(cfg, device, spec)


def resolve_configs(names: Sequence[str] | None) -> list[ConfigSpec]:
    if names is None:
        return list(CONFIGS)
    unknown = [n for n in names if n not in CONFIG_NAMES]
    if unknown or not names:
        raise UserError(f"--configs: unknown configuration(s) {', '.join(unknown) or '(none given)'}; "
                        f"choose from {', '.join(CONFIG_NAMES)}")
    return [c for c in CONFIGS if c.name in names]


def resource_schedules(specs: Sequence[ConfigSpec], cfg: RunConfig) -> list[str]:
    """The split schedules the selected configurations use (interleaved when none does)."""
    out = []
    if any(not s.native and s.schedule == "interleaved" for s in specs):
        out.append("interleaved")
    if any(s.schedule == "zbv" for s in specs) and cfg.pipeline.chunks_per_rank == 2:
        out.append("zbv")
    return out or ["interleaved"]


def check_inputs(cfg: RunConfig, specs: Sequence[ConfigSpec], microbatches: Sequence[int] | None,
                 steps: int, warmup: int, trace_steps: int = 0, rounds: int = 1) -> torch.device:
    """Bad input raises `UserError` before anything runs (the CLI prints one line, exit 2)."""
    if rounds < MIN_ROUNDS:
        raise UserError(f"--rounds must be >= {MIN_ROUNDS}, got {rounds}")
    if steps < 1 or warmup < 1:
        raise UserError(f"--steps and --warmup must be >= 1 (the first warm-up step is part of setup), "
                        f"got {steps} and {warmup}")
    if trace_steps < 0:
        raise UserError(f"--trace must be >= 0, got {trace_steps}")
    device = torch.device(cfg.train.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UserError("device cuda requested but CUDA is not available here")
    if cfg.fp8.backend == "te":
        from qeffect.fp8.te import require_te

        require_te()
    p = cfg.pipeline
    for name in resource_schedules(specs, cfg) if microbatches else []:
        for m in microbatches:
            try:
                build_schedule(name, p.pp, p.chunks_per_rank, m)
            except ValueError as err:
                raise UserError(f"--microbatches {m}: schedule {name}: {err}") from None
    return device


def run_profile(cfg: RunConfig, *, steps: int = 20, warmup: int = 3, configs: Sequence[str] | None = None,
                microbatches: Sequence[int] | None = None, command: str = "", config_path: str | None = None,
                progress: Callable[[str], None] | None = None, trace_steps: int = 0, rounds: int = DEFAULT_ROUNDS,
                targets: Sequence[TargetSpec] | None = None, targets_source: str | None = None) -> ProfileReport:
    """Run the configuration matrix in `rounds` interleaved rounds (and the resource analysis over
    `microbatches`) and report it, judged by `targets` (from the file `targets_source`; None: no targets).

    `trace_steps` > 0: after each configuration's timed steps of the last round, profile that many more
    and attach a trace summary (where the step's time goes) to its result.
    """
    specs = resolve_configs(configs)
    device = check_inputs(cfg, specs, microbatches, steps, warmup, trace_steps, rounds)
    say = progress or (lambda _msg: None)
    te_ok = te_importable()
    flops = count_matrix_flops(cfg)
    say("measuring the FP8 GEMM rates on the model's shapes, a large square GEMM and a large copy")
    gemm = measure_gemm_rates(cfg, device, dtype_of(cfg))
    floor = floor_of(gemm, flops, measure_device_rates(device), optimizer_params(cfg),
                     lazy_table=row_lazy_token_table(cfg))
    release_memory(device)
    with initial_weights_drawn_once(cfg, device, say) as init_draw_seconds:
        results = _run_specs(cfg, specs, device, te_ok, flops, steps=steps, warmup=warmup,
                             trace_steps=trace_steps, say=say, rounds=rounds)
        derive_ratios(results, floor)
        resources = None
        if microbatches:
            say(f"resource analysis for M = {', '.join(map(str, microbatches))}")
            resources = resource_rows(cfg, list(microbatches), resource_schedules(specs, cfg),
                                      capture=device.type == "cuda")
    return make_report(cfg, device, command=command, config_path=config_path, steps=steps, warmup=warmup,
                       flops=flops, gemm=gemm, floor=floor, results=results, trace_steps=trace_steps,
                       resources=resources, init_draw_seconds=init_draw_seconds, rounds=rounds,
                       target_specs=targets, targets_source=targets_source)


@contextlib.contextmanager
def initial_weights_drawn_once(cfg: RunConfig, device: torch.device,
                               say: Callable[[str], None]) -> Iterator[float]:
    """A `shared_init_draws` scope whose model is drawn at once: builds it (then drops it and frees its
    memory) and yields the seconds that took; every build inside the scope copies those values."""
    with shared_init_draws():
        say("drawing the initial weights once (shared by every configuration, outside their setup)")
        t0 = time.perf_counter()
        build_chunks_for(cfg, device)
        seconds = time.perf_counter() - t0
        release_memory(device)
        yield seconds


def _run_specs(cfg: RunConfig, specs: Sequence[ConfigSpec], device: torch.device, te_ok: bool,
               flops: MatrixFlops, *, steps: int, warmup: int, trace_steps: int,
               say: Callable[[str], None], rounds: int = 1) -> list[ConfigResult]:
    """Time every configuration of the matrix in `rounds` interleaved rounds (ABC ABC ABC); one that fails
    in a round is reported failed and left out of later rounds, the others still run."""
    done: dict[str, ConfigResult] = {}  # not run or failed: final
    by_round: dict[str, list[ConfigResult]] = {s.name: [] for s in specs}
    megatron = None
    for spec in specs:
        reason = not_run_reason(spec, cfg, device, te_ok)
        if reason is not None:
            done[spec.name] = ConfigResult(name=spec.name, description=spec.description, status="not run",
                                           reason=reason, schedule=spec.schedule, path=spec.path)
    for k in range(rounds):
        last = k == rounds - 1
        for spec in specs:
            if spec.name in done:
                continue
            r = ConfigResult(name=spec.name, description=spec.description, status="ok", schedule=spec.schedule,
                             path=spec.path)
            say(f"round {k + 1}/{rounds}: {spec.name}: build, {warmup} warm-up and {steps} timed steps"
                + (f", {trace_steps} traced" if trace_steps and last else ""))
            try:
                if spec.path == "megatron":
                    if megatron is None:
                        from qeffect.profile.megatron import MegatronGraphs

                        megatron = MegatronGraphs(cfg, steps=steps, warmup=warmup)
                    megatron_round(r, megatron)
                else:
                    time_runner(r, _make_runner(spec, cfg, device), device, steps=steps, warmup=warmup,
                                trace_steps=trace_steps if last else 0)
                by_round[spec.name].append(r)
            except Exception as err:  # report and go on: one failing configuration must not hide the others
                done[spec.name] = ConfigResult(
                    name=spec.name, description=spec.description, status="failed", schedule=spec.schedule,
                    path=spec.path, reason=f"round {k + 1}: {type(err).__name__}: {str(err)[:500]}",
                    error=traceback.format_exc()[-4000:])
            finally:
                release_memory(device)
    results = []
    for spec in specs:
        r = done.get(spec.name) or merge_rounds(by_round[spec.name])
        r.matrix_flops = flops.layers_only if spec.path == "te" else flops.total
        results.append(r)
    return results


def megatron_round(result: ConfigResult, megatron: Any) -> None:
    """One round of `megatron-graphs` (`profile.megatron.MegatronGraphs`) into `result`: its timed steps,
    peak memory and the mode chosen (no losses: another implementation; no host queue time: a child)."""
    run = megatron.round()
    result.variant = megatron.mode
    result.description = f"{result.description}; {megatron.choice_note()}"
    result.step_seconds = list(run.step_seconds)
    result.spread = Spread.of(result.step_seconds)
    result.median_step_seconds = result.spread.median
    result.peak_allocated_bytes = run.peak_allocated_bytes
    result.peak_reserved_bytes = run.peak_reserved_bytes
    result.setup_seconds = run.setup_seconds
    result.memory_note = "peak: the child process's torch.cuda.max_memory_allocated (and _reserved)"


def merge_rounds(rounds: Sequence[ConfigResult]) -> ConfigResult:
    """One configuration's rounds as one result: every round's timed steps, host times and losses in order;
    the median of the round medians; setup, warm-up and graph counters of the first round; memory peaks
    and growth the worst round's; the trace of the last."""
    first, last = rounds[0], rounds[-1]
    r = first.model_copy(deep=True)
    if len(rounds) == 1 and not r.round_medians:
        r.round_medians = [first.median_step_seconds]
        return r
    r.step_seconds = [x for c in rounds for x in c.step_seconds]
    r.host_seconds = [x for c in rounds for x in c.host_seconds]
    r.losses = [x for c in rounds for x in c.losses]
    r.round_medians = [c.median_step_seconds for c in rounds]
    r.median_step_seconds = statistics.median(r.round_medians)
    r.spread = Spread.of(r.step_seconds)
    r.host_median_seconds = statistics.median(r.host_seconds) if r.host_seconds else None
    r.host_phase_seconds = {k: [x for c in rounds for x in c.host_phase_seconds.get(k, [])]
                            for k in first.host_phase_seconds}

    def worst(values: list[Any]) -> Any:
        values = [v for v in values if v is not None]
        return max(values) if values else None

    r.peak_allocated_bytes = worst([c.peak_allocated_bytes for c in rounds])
    r.peak_reserved_bytes = worst([c.peak_reserved_bytes for c in rounds])
    r.persistent_growth_bytes_per_step = worst([c.persistent_growth_bytes_per_step for c in rounds])
    r.memory_split = max(rounds, key=lambda c: c.peak_allocated_bytes or 0).memory_split  # the worst round's
    r.trace, r.trace_by_rank, r.trace_error = last.trace, last.trace_by_rank, last.trace_error
    return r


def make_report(cfg: RunConfig, device: torch.device, *, command: str, config_path: str | None, steps: int,
                warmup: int, flops: MatrixFlops, gemm: list[GemmRate], floor: Floor, results: list[ConfigResult],
                target_specs: Sequence[TargetSpec] | None = None, **extra: Any) -> ProfileReport:
    """The report of a finished matrix: provenance (command, revision, device, versions), the config, the
    results, and the targets (`target_specs`) judged on them. `extra`: trace_steps, resources, world_size,
    rounds, targets_source."""
    from qeffect.fp8.te_compat import fallbacks
    from qeffect.graphs.handshake import run_settings

    return with_targets(ProfileReport(
        command=command, git_revision=git_revision(), settings=run_settings(cfg),
        created=_dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        device=device.type, device_name=device_name_of(device), torch_version=torch.__version__,
        te_version=te_version(), te_fallbacks=fallbacks(),
        config_path=config_path, config=cfg.model_dump(), backend=cfg.fp8.backend,
        steps=steps, warmup=warmup, matrix_flops=flops, gemm=gemm, floor=floor, configs=results,
        **extra), target_specs)


def derive_ratios(results: list[ConfigResult], floor: Floor) -> None:
    """Ratios against native eager, the GEMM floor and the limit (only between configurations that ran),
    and each configuration's host queue time over its GPU step time."""
    native = next((r for r in results if r.name == NATIVE and r.status == "ok"), None)
    add_native_ratios(results, NATIVE)
    for r in results:
        if r.status != "ok":
            continue
        layers_only = r.path == "te"
        f = floor.seconds_layers_only if layers_only else floor.seconds
        r.floor_seconds = f
        r.floor_ratio = r.median_step_seconds / f if f > 0 else None
        r.limit_seconds = floor.limit_for(layers_only)
        r.limit_ratio = r.median_step_seconds / r.limit_seconds if r.limit_seconds else None
        host_gpu(r)
        if r.name == NATIVE:
            r.speedup_vs_native = 1.0
            r.break_even_note = "reference"
            continue
        if native is None:
            r.break_even_note = "native-eager did not run"
            continue
        r.speedup_vs_native = native.median_step_seconds / r.median_step_seconds
        if r.setup_seconds is None or native.setup_seconds is None:
            r.break_even_note = "setup not measured"
            continue
        r.break_even_steps = break_even_steps(r.setup_seconds, r.median_step_seconds, native.setup_seconds,
                                              native.median_step_seconds)
        if r.break_even_steps is None:
            r.break_even_note = "never: not faster per step than native eager"


def host_gpu(r: ConfigResult) -> None:
    """`host_gpu_ratio`: the median host queue time of a step over its GPU time (the traced GPU busy time per
    step where there is a trace, else the median wall step, which is at least the GPU's)."""
    if r.host_median_seconds is None:
        return
    busy = r.trace.gpu_busy_seconds_per_step if r.trace is not None else None
    if busy:
        r.host_gpu_ratio, r.host_gpu_basis = r.host_median_seconds / busy, "traced GPU busy time per step"
    elif r.median_step_seconds:
        r.host_gpu_ratio, r.host_gpu_basis = r.host_median_seconds / r.median_step_seconds, "median wall step"


def te_importable() -> bool:
    from qeffect.fp8.te import te_available

    return te_available()


def device_name_of(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or platform.machine() or "cpu"


def device_tag(device: torch.device | str) -> str:
    """The device's part of a report name: "h200", "h100" (the GPU's model), "cuda" for another GPU, else
    the device type."""
    device = torch.device(device)
    if device.type != "cuda":
        return device.type
    m = re.search(r"\b([A-Z]\d{2,4})\b", torch.cuda.get_device_name(device))
    return m.group(1).lower() if m else "cuda"
