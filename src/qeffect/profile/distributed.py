"""`qeffect profile` under torchrun: the configuration matrix with one pipeline rank per process (GPU).

Every rank builds the same configuration, and every timed step starts and ends with this device
synchronized and then a barrier of all ranks, so rank 0's step times are the pipeline's. Rank 0
gathers each configuration's per-rank resources (peak memory and its growth, graphs, arena bytes)
and writes one report. With `--trace N`, every rank profiles N more steps (each synchronized and
barriered as the timed ones): the report keeps rank 0's summary as the configuration's `trace` and every
rank's in `trace_by_rank`, since the ranks of a pipeline spend the same step differently (one rank's
idle time is another's bubble). The TE anchor (`te-graphed`) is a single-process construction and is
reported as not run; `--microbatches` is a single-process analysis and is refused.
`breakdown_by_rank` (benchmarks/pipeline_timing.py `--breakdown`) says where each rank's step goes:
compute, receive waits, sends, the loss and data-parallel reductions, the optimizer and the step-end
barrier (`runtime.step_timing`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from qeffect.config import RunConfig
from qeffect.errors import UserError
from qeffect.profile.flops import (
    Floor,
    MatrixFlops,
    count_matrix_flops,
    floor_of,
    measure_device_rates,
    measure_gemm_rates,
    optimizer_params,
    row_lazy_token_table,
)
from qeffect.profile.matrix import (
    ConfigSpec,
    GraphCounters,
    check_inputs,
    derive_ratios,
    initial_weights_drawn_once,
    make_report,
    not_run_reason,
    release_memory,
    resolve_configs,
    te_importable,
    time_runner,
)
from qeffect.profile.report import ConfigResult, ProfileReport
from qeffect.profile.trace import sync_device
from qeffect.runtime.build import dtype_of
from qeffect.runtime.distributed import DistributedPipeline, check_world
from qeffect.runtime.phases import SetupClock
from qeffect.runtime.step_timing import StepLaps, breakdown_step, stream_sync, summarize
from qeffect.verify.state import synthetic_batches

ANCHOR_NOT_RUN = ("single-process anchor (make_graphed_callables over every layer on one GPU); "
                  "run `qeffect profile` without torchrun for it")
MEGATRON_NOT_RUN = ("single-process anchor (Megatron-Core in a child process on one GPU); run `qeffect profile` "
                    "without torchrun for it")


def sync_all(device: torch.device) -> None:
    """This device, then every rank: a step's time is the slowest rank's."""
    sync_device(device)
    dist.barrier()


class DistributedRunner(GraphCounters):
    """This process's rank of a `DistributedPipeline` behind the profile `Runner` interface."""

    def __init__(self, cfg: RunConfig, spec: ConfigSpec) -> None:
        if spec.schedule is not None:
            cfg = cfg.with_overrides(**{"pipeline.schedule": spec.schedule})
        self.cfg = cfg
        clock = SetupClock(cfg.train.device)  # "cuda": this process's device, set when the group was made
        self.pipe = DistributedPipeline(cfg, native=spec.native, path=spec.path, clock=clock)
        self.setup_phases = clock.seconds
        self.device = self.pipe.device
        arena = getattr(self.pipe.rank, "arena", None)
        self._take_stats(self.pipe.manager, 1, None if spec.native or arena is None else arena.nbytes)

    def data(self, step: int) -> Any:
        # each data-parallel replica its own batches, made before the timer starts
        return synthetic_batches(self.cfg, step + 1000 * self.pipe.topo.dp_rank, self.device)

    def step(self, data: Any) -> torch.Tensor:
        return self.pipe.step(data)

    def breakdown(self, steps: int, first_step: int) -> dict[str, Any]:
        """This rank's time breakdown over `steps` more steps (`runtime.step_timing`: synchronised laps, so
        slower than the unperturbed steps; take them after those). Data for step i as `data(i)`, from
        `first_step` on, made before each step's timer as in the unperturbed timing."""
        laps = StepLaps(stream_sync(self.device))
        done = [breakdown_step(self.pipe, self.data(i), laps, lambda: sync_all(self.device))
                for i in range(first_step, first_step + steps)]
        t = self.pipe.topo
        return {"rank": t.rank, "pp_rank": t.pp_rank, "dp_rank": t.dp_rank, "median": summarize(done),
                "steps": done}


def breakdown_by_rank(runner: DistributedRunner, steps: int, first_step: int) -> list[dict[str, Any]] | None:
    """Every rank's `DistributedRunner.breakdown`, gathered on rank 0 in global rank order (None elsewhere).
    A collective: every rank calls it with the same arguments."""
    mine = runner.breakdown(steps, first_step)
    rank0 = dist.get_rank() == 0
    gathered: list[Any] = [None] * dist.get_world_size() if rank0 else []
    dist.gather_object(mine, gathered if rank0 else None, dst=0)
    return gathered if rank0 else None



def merge_ranks(results: list[dict]) -> ConfigResult:
    """Rank 0's timings, losses and trace; resources summed (graphs, arena, replays) or maxed (memory, host
    time); every rank's trace summary (`trace_by_rank`) and trace errors (named by rank)."""
    rs = [ConfigResult.model_validate(r) for r in results]
    out = rs[0].model_copy(deep=True)

    def nonnull(attr: str) -> list:
        return [getattr(r, attr) for r in rs if getattr(r, attr) is not None]

    built = [r for r in rs if r.build_seconds is not None]
    if built:  # the build phases of the rank whose build was the longest (the `build_seconds` kept below)
        out.setup_phases = max(built, key=lambda r: r.build_seconds).setup_phases
    for attr in ("peak_allocated_bytes", "peak_reserved_bytes", "persistent_growth_bytes_per_step",
                 "capture_host_seconds", "build_seconds", "graphs_per_rank"):
        vals = nonnull(attr)
        setattr(out, attr, max(vals) if vals else None)
    for attr in ("graph_count", "arena_bytes", "replays_per_step", "handoffs_per_step"):
        vals = nonnull(attr)
        setattr(out, attr, sum(vals) if vals else None)
    if out.peak_allocated_bytes is not None:
        out.peak_allocated_bytes_by_rank = [r.peak_allocated_bytes for r in rs]
        out.persistent_growth_bytes_per_step_by_rank = [r.persistent_growth_bytes_per_step for r in rs]
    if out.build_seconds is not None and out.first_step_seconds is not None:
        out.setup_seconds = out.build_seconds + out.first_step_seconds
    if any(r.trace is not None for r in rs):
        out.trace_by_rank = [r.trace for r in rs]
    errors = [f"rank {k}: {r.trace_error}" for k, r in enumerate(rs) if r.trace_error is not None]
    out.trace_error = "; ".join(errors) if errors else None
    return out


def pipeline_floor(floor: Floor, pp: int) -> Floor:
    """The step's floor when its matrix work is split evenly over the `pp` stages of a replica (data-
    parallel replicas each do a replica's work on their own GPUs)."""
    split = ("seconds", "seconds_layers_only", "peak_rate_seconds", "peak_rate_seconds_layers_only",
             "optimizer_seconds", "optimizer_seconds_layers_only", "limit_seconds", "limit_seconds_layers_only")
    return floor.model_copy(update={k: getattr(floor, k) / pp for k in split if getattr(floor, k) is not None})


def run_profile_distributed(cfg: RunConfig, *, steps: int = 20, warmup: int = 3,
                            configs: Sequence[str] | None = None, command: str = "",
                            config_path: str | None = None, progress: Callable[[str], None] | None = None,
                            trace_steps: int = 0) -> ProfileReport | None:
    """Run the matrix on every rank; rank 0 returns the report, the other ranks None. `trace_steps` > 0:
    every rank traces that many more steps per configuration (see the module docstring).

    A configuration that raises on one rank cannot be reported and skipped (its peers wait on it),
    so the error ends the run, as any failure under torchrun does.
    """
    if not dist.is_initialized():
        raise RuntimeError("run_profile_distributed needs an initialized process group (init_from_env)")
    p = cfg.pipeline
    check_world(p.pp, p.dp, dist.get_world_size())
    specs = resolve_configs(configs)
    device = check_inputs(cfg, specs, None, steps, warmup, trace_steps)
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    rank0 = dist.get_rank() == 0
    say = (progress or (lambda _msg: None)) if rank0 else (lambda _msg: None)
    te_ok = te_importable()
    flops = count_matrix_flops(cfg)
    say("measuring the FP8 GEMM rate on the model's shapes")
    gemm = measure_gemm_rates(cfg, device, dtype_of(cfg))
    floor = pipeline_floor(floor_of(gemm, flops, measure_device_rates(device), optimizer_params(cfg),
                              lazy_table=row_lazy_token_table(cfg)), p.pp)
    release_memory(device)
    with initial_weights_drawn_once(cfg, device, say) as init_draw_seconds:  # in every process
        results = _run_specs(cfg, specs, device, te_ok, flops, steps=steps, warmup=warmup,
                             trace_steps=trace_steps, say=say, rank0=rank0)
    if not rank0:
        return None
    derive_ratios(results, floor)
    return make_report(cfg, device, command=command, config_path=config_path, steps=steps, warmup=warmup,
                       flops=flops, gemm=gemm, floor=floor, results=results, world_size=dist.get_world_size(),
                       trace_steps=trace_steps, init_draw_seconds=init_draw_seconds)


def _run_specs(cfg: RunConfig, specs: Sequence[ConfigSpec], device: torch.device, te_ok: bool,
               flops: MatrixFlops, *, steps: int, warmup: int, trace_steps: int, say: Callable[[str], None],
               rank0: bool) -> list[ConfigResult]:
    """Time every configuration on every rank; rank 0 gathers and merges each one's results."""
    results: list[ConfigResult] = []
    for spec in specs:
        r = ConfigResult(name=spec.name, description=spec.description, status="ok", schedule=spec.schedule,
                         path=spec.path)
        if spec.path == "megatron":
            reason = MEGATRON_NOT_RUN
        else:
            reason = ANCHOR_NOT_RUN if spec.te_anchor else not_run_reason(spec, cfg, device, te_ok)
        if reason is not None:
            r.status, r.reason = "not run", reason
            results.append(r)
            continue
        say(f"{spec.name}: build, {warmup} warm-up and {steps} timed steps on {dist.get_world_size()} ranks"
            + (f", {trace_steps} traced" if trace_steps else ""))
        time_runner(r, lambda spec=spec: DistributedRunner(cfg, spec), device, steps=steps, warmup=warmup,
                    trace_steps=trace_steps, sync=sync_all)
        release_memory(device)
        gathered: list[Any] = [None] * dist.get_world_size() if rank0 else []
        dist.gather_object(r.model_dump(), gathered if rank0 else None, dst=0)
        if rank0:
            merged = merge_ranks(gathered)
            merged.matrix_flops = flops.total
            results.append(merged)
        sync_all(device)
    return results


def refuse_single_process_options(microbatches: str | None) -> None:
    """`--microbatches` analyses one process; under torchrun it is refused up front."""
    if microbatches is not None:
        raise UserError("--microbatches: the resource analysis over M is single-process; run it without torchrun")


__all__ = ["DistributedRunner", "breakdown_by_rank", "merge_ranks", "pipeline_floor", "run_profile_distributed",
           "refuse_single_process_options", "sync_all"]
