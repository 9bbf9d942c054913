"""The `qeffect profile` report (pydantic, versioned) and its small pieces of arithmetic.

Raw timings stay in the report next to their summaries, with the command, git revision, device and
library versions, so a later reader can recompute any ratio or check the spread without rerunning.
"""

from __future__ import annotations

import math
import statistics
import struct
from typing import Any, Literal

from pydantic import BaseModel, Field

from qeffect.profile.flops import Floor, GemmRate, MatrixFlops
from qeffect.profile.memory import MemorySplit

# 2: optional per-configuration `trace`; 3: `world_size` and per-rank memory (torchrun); 4: `targets`;
# 5: `trace_by_rank` (traces under torchrun); 6: per-configuration `setup_phases`; 7: rounds, host enqueue
# times, lower-bound floors and the limit, targets from a user's file (`targets_source`); 8: the host's queue
# time by phase (`host_phase_seconds`, `host_phase_calls`)
SCHEMA_VERSION = 8
READABLE_SCHEMA_VERSIONS = (1, 2, 3, 4, 5, 6, 7, 8)  # older reports are newer ones of one process, one round,
# without traces, host times, host phases or the newer floors; a targets file judges any of them
# (`qeffect.profile.targets`)
Status = Literal["ok", "not run", "failed"]


class Spread(BaseModel):
    """Order statistics of the timed steps (seconds); quartiles by the inclusive method."""

    min: float
    q1: float
    median: float
    q3: float
    max: float

    @classmethod
    def of(cls, values: list[float]) -> Spread:
        if not values:
            raise ValueError("no values")
        if len(values) == 1:
            v = values[0]
            return cls(min=v, q1=v, median=v, q3=v, max=v)
        q1, med, q3 = statistics.quantiles(values, n=4, method="inclusive")
        return cls(min=min(values), q1=q1, median=med, q3=q3, max=max(values))


def break_even_steps(setup: float, step: float, ref_setup: float, ref_step: float) -> float | None:
    """Steps after which `setup + n * step` is no more than `ref_setup + n * ref_step`.

    Setup difference over per-step saving; 0 when the configuration is faster and also cheaper to set
    up; None when it is not faster per step (it never breaks even).
    """
    saving = ref_step - step
    if saving <= 0:
        return None
    extra = setup - ref_setup
    return 0.0 if extra <= 0 else extra / saving


class TraceRow(BaseModel):
    """One device kernel (on CPU: one aten op) of the traced steps, all its calls together."""

    name: str  # truncated to 120 characters
    calls_per_step: float
    seconds_per_step: float  # CUDA: device time; CPU: the op's self time (minus nested aten ops)
    fraction: float  # of gpu_busy_seconds_per_step (CUDA) or of cpu_op_seconds_per_step (CPU)


class TraceSummary(BaseModel):
    """Where a step's time goes, from a `torch.profiler` trace of `steps` extra (untimed) steps.

    Per-step values are totals over the traced steps divided by `steps`. The wall time includes the
    profiler's own overhead, so it is at or above the untraced median; compare shares, not absolutes.
    CUDA fields are null on CPU.
    """

    steps: int
    wall_seconds_per_step: float  # host wall time of a traced step, device synchronized at both ends
    # host time inside aten ops: the union of the `aten::` op intervals (so top-level ops, nested ones
    # counted once, several threads merged); approximate: excludes Python and framework code between ops
    cpu_op_seconds_per_step: float
    cpu_ops_per_step: float  # top-level aten ops (not nested in another aten op) per step
    gpu_kernel_seconds_per_step: float | None = None  # sum of kernel durations (overlapping streams add up)
    gpu_busy_seconds_per_step: float | None = None  # union of kernel, memcpy and memset intervals
    gpu_idle_fraction: float | None = None  # 1 - busy / wall: the GPU waiting on the host
    kernels_per_step: float | None = None
    memcpy_seconds_per_step: float | None = None
    memset_seconds_per_step: float | None = None
    bound: Literal["gpu", "host"] | None = None  # gpu: idle < 10% of the wall; host: the GPU waits more
    top_kernels: list[TraceRow]  # the 10 largest by time (CUDA: device kernels/copies; CPU: aten ops)
    # seconds per step by coarse kernel-name bucket (`qeffect.profile.trace.CATEGORIES`, first match
    # wins; "other" for the rest): device time on CUDA (sums durations, so overlapping streams may sum
    # past the busy time), aten-op self time on CPU
    categories: dict[str, float]
    # the largest kernels of each category (`qeffect.profile.trace.TOP_PER_CATEGORY`, by time): what a bucket
    # such as "other" or "copy" holds (schema 8; empty in older reports)
    top_by_category: dict[str, list[TraceRow]] = Field(default_factory=dict)


# the paths of Transformer Engine's own graphs (`profile.te_anchor`): their arithmetic is not native eager's
TE_PATHS = ("te", "te-model", "te-mcore")
# another implementation's run (Megatron-Core's CUDA graphs, `profile.megatron`): its losses are not compared
OTHER_PATHS = (*TE_PATHS, "megatron")


def _same_floats(a: list[float | None], b: list[float | None]) -> bool:
    """Bit for bit (as fp64, which holds every fp32 loss exactly); NaN (None in JSON) matches NaN."""
    def key(x: float | None) -> bytes:
        return b"nan" if x is None or math.isnan(x) else struct.pack("<d", x)

    return len(a) == len(b) and all(key(x) == key(y) for x, y in zip(a, b, strict=True))


class ConfigResult(BaseModel):
    """One configuration of the matrix. `status` "not run" / "failed" carry the reason; numbers are null."""

    name: str
    description: str
    status: Status
    reason: str | None = None
    schedule: str | None = None
    path: str | None = None
    # raw timings (seconds): warm-up steps (the first is part of setup) and timed steps
    warmup_seconds: list[float] = Field(default_factory=list)
    step_seconds: list[float] = Field(default_factory=list)
    losses: list[float | None] = Field(default_factory=list)  # every step's loss (NaN is written as null)
    # the same model, data and backend as native eager: its losses must be native's, bit for bit (null:
    # nothing to compare, e.g. native itself or Transformer Engine's anchor, another implementation)
    losses_equal_native: bool | None = None
    non_finite_losses: int = 0  # NaN or infinite: a configuration that diverged is timed, not trusted
    median_step_seconds: float | None = None
    spread: Spread | None = None
    build_seconds: float | None = None  # initialization + capture
    first_step_seconds: float | None = None
    setup_seconds: float | None = None  # build + first step
    # where the build went (seconds, in build order; null: not measured, as before schema 6; under torchrun the
    # slowest rank's): "modules" (built on the device), "values" (initial values drawn and copied in), "ranks"
    # (arena, optimizer, actions), "capture" (warm-up and capture of every action); Transformer Engine's anchor:
    # "modules", "capture", "optimizer"
    setup_phases: dict[str, float] | None = None
    speedup_vs_native: float | None = None  # native median / this median
    break_even_steps: float | None = None
    break_even_note: str | None = None
    # memory (CUDA only; null with memory_note elsewhere)
    baseline_allocated_bytes: int | None = None
    peak_allocated_bytes: int | None = None
    peak_reserved_bytes: int | None = None
    persistent_growth_bytes_per_step: float | None = None
    memory_note: str | None = None
    memory_split: MemorySplit | None = None  # the peak by category (`profile.memory`; one process, CUDA)
    # under torchrun (world_size > 1): the fields above are the maximum over ranks, these are by rank
    peak_allocated_bytes_by_rank: list[int] | None = None
    persistent_growth_bytes_per_step_by_rank: list[float] | None = None
    # graphs
    graph_count: int | None = None
    graphs_per_rank: int | None = None
    replays_per_step: float | None = None
    handoffs_per_step: float | None = None
    capture_host_seconds: float | None = None
    arena_bytes: int | None = None
    # compute floor
    matrix_flops: int | None = None
    floor_seconds: float | None = None
    floor_ratio: float | None = None  # median step / floor
    # profiler trace of extra untimed steps (`trace_steps` > 0); a failed trace keeps the timings
    trace: TraceSummary | None = None  # under torchrun: rank 0's
    trace_by_rank: list[TraceSummary | None] | None = None  # under torchrun: every rank's (rank order)
    trace_error: str | None = None
    error: str | None = None  # traceback tail of a failed configuration
    # rounds (schema 7): each round builds, warms up and times the configuration again, interleaved with the
    # others (ABC ABC ABC); `median_step_seconds` is then the median of the round medians, `step_seconds`
    # every round's timed steps in order. Empty: one round (older reports)
    round_medians: list[float] = Field(default_factory=list)
    # host seconds from a timed step's start until its step call returned, before the closing
    # synchronization: the time the host takes to queue the step (schema 7; every round's, in order)
    host_seconds: list[float] = Field(default_factory=list)
    host_median_seconds: float | None = None
    # host queue time over the GPU's step time: the traced GPU busy time per step when traced, else the
    # median wall step (`host_gpu_basis` says which)
    host_gpu_ratio: float | None = None
    host_gpu_basis: str | None = None
    # where the queue time goes (schema 8; one-process pipelines; `graphs.stats.HostPhases`): seconds per step
    # of each phase over a few more steps after the timed ones (`profile.matrix.PHASE_STEPS` a round, every
    # round's in order), "runtime" being the rest of each one's queue time (contracts, ledger, tape pool, arena
    # checks, Python); and each phase's calls per step. Empty: not measured
    host_phase_seconds: dict[str, list[float]] = Field(default_factory=dict)
    host_phase_calls: dict[str, float] = Field(default_factory=dict)
    limit_seconds: float | None = None  # the report's limit for this configuration (`Floor.limit_for`)
    limit_ratio: float | None = None  # median step / limit
    variant: str | None = None  # the variant that ran (megatron-graphs: Megatron-Core's capture mode)

    def host_medians_by_round(self) -> list[float]:
        """The host queue time's median in each round (every round times the same number of steps); empty
        without host times."""
        rounds = max(len(self.round_medians), 1)
        if not self.host_seconds or len(self.host_seconds) % rounds:
            return []
        k = len(self.host_seconds) // rounds
        return [statistics.median(self.host_seconds[i * k:(i + 1) * k]) for i in range(rounds)]

    def host_phase_medians(self) -> dict[str, float]:
        """Each host phase's median seconds per step (empty where not measured)."""
        return {k: statistics.median(v) for k, v in self.host_phase_seconds.items() if v}

    def host_phase_line(self) -> str | None:
        """The host's queue time by phase, e.g. "graph launches 2.10 ms (49/step), input copies 0.41 ms
        (32/step), ..., runtime 1.20 ms" (medians per step; a phase with no calls left out); None where not
        measured."""
        medians = self.host_phase_medians()
        if not medians:
            return None
        calls = self.host_phase_calls
        return ", ".join(f"{k} {v * 1e3:.2f} ms" + (f" ({calls[k]:g}/step)" if calls.get(k) else "")
                         for k, v in medians.items() if calls.get(k, 1))

    def medians_by_round(self) -> list[float]:
        """The round medians; one round (the median) for reports without rounds."""
        if self.round_medians:
            return list(self.round_medians)
        return [self.median_step_seconds] if self.median_step_seconds is not None else []

    def setup_line(self) -> str | None:
        """The setup as its parts, e.g. "9.96 s = modules 0.30 + values 0.55 + ... + first step 0.58"
        (build time outside the named phases is "other"); None before a setup was measured."""
        if self.setup_seconds is None or self.build_seconds is None or self.first_step_seconds is None:
            return None
        parts = dict(self.setup_phases or {})
        other = self.build_seconds - sum(parts.values())
        if not parts:
            parts["build"] = self.build_seconds
        elif other >= 0.005:
            parts["other"] = other
        parts["first step"] = self.first_step_seconds
        return f"{self.setup_seconds:.2f} s = " + " + ".join(f"{k} {v:.2f}" for k, v in parts.items())

    def labelled_traces(self) -> list[tuple[str, TraceSummary | None]]:
        """(label, summary) per trace: one per rank under torchrun ("name rank k"), else one ("name")."""
        if self.trace_by_rank:
            return [(f"{self.name} rank {k}", t) for k, t in enumerate(self.trace_by_rank)]
        return [(self.name, self.trace)]


class ResourceRow(BaseModel):
    """Resources of one split schedule at `microbatches` microbatches (per rank lists are by rank)."""

    schedule: str
    microbatches: int
    graphs_per_rank: int  # planned for captured-direct (`graphs.binding`): the most over ranks
    graph_count: int
    graphs_per_rank_by_rank: list[int] | None = None  # the plan, by rank
    graph_slots: dict[int, int] | None = None  # K per stage (`schedule.liveness.slots_for`)
    arena_bytes: int
    arena_bytes_per_rank: list[int]
    max_live_tapes: list[int]
    max_pending_dw: list[int]
    capture_host_seconds: float | None = None
    graphs_captured_per_rank: int | None = None
    capture_note: str | None = None


class TargetCheck(BaseModel):
    """One acceptance target: the measured value against its threshold (`profile.targets` evaluates
    them; the class is here, with the report's other parts, because the report holds them)."""

    name: str
    description: str
    value: float | None  # None: not measured in this report
    threshold: float
    comparison: Literal[">=", "<=", "<"]  # value <comparison> threshold meets it
    met: bool | None  # None: not measured (see `note`)
    shortfall: float | None = None  # missed: how far from the threshold, relative (0.06 = 6% short)
    needed: str | None = None  # missed: what would meet it, in the report's own units
    where: str | None = None  # missed: the trace summary of the configuration the target is about
    note: str | None = None
    round_values: list[float] | None = None  # the value of each round (the value is their median)
    gpu_busy_value: float | None = None  # a speedup on the traced GPU busy time per step alone (both traced)


class ProfileReport(BaseModel):
    schema_version: int = SCHEMA_VERSION
    kind: Literal["profile"] = "profile"
    command: str
    git_revision: str | None
    # the bit-changing settings and the [runtime] section it ran under (`graphs.handshake.run_settings`)
    settings: dict[str, Any] = Field(default_factory=dict)
    # legacy: the QEFFECT_* environment switches older reports ran under (read, never written)
    environment: dict[str, str] = Field(default_factory=dict)
    created: str
    device: str
    device_name: str
    torch_version: str
    te_version: str | None
    # slower paths taken because a private TE lookup failed ({name: times}, `fp8.te_compat.fallbacks`)
    te_fallbacks: dict[str, int] = Field(default_factory=dict)
    config_path: str | None
    config: dict
    backend: str
    steps: int
    warmup: int
    trace_steps: int = 0  # profiled steps per configuration after the timed ones (0: no traces)
    world_size: int = 1  # processes (one GPU each) under torchrun; 1: the single-process matrix
    # seconds to draw the initial weights once, before any configuration's timer (every configuration's
    # build then copies them: `model.gpt.shared_init_draws`); None: each build drew its own
    init_draw_seconds: float | None = None
    matrix_flops: MatrixFlops
    gemm: list[GemmRate]
    floor: Floor
    configs: list[ConfigResult]
    resources: list[ResourceRow] | None = None
    rounds: int = 1  # rounds per configuration, interleaved (schema 7)
    # the acceptance targets evaluated from the measurements above (met, by how much, where the time goes),
    # from the targets file `targets_source` (schema 7; older reports: the targets that used to be built in)
    targets: list[TargetCheck] = Field(default_factory=list)
    targets_source: str | None = None

    def check_losses(self) -> None:
        """Fill each configuration's `non_finite_losses` and `losses_equal_native` from the losses."""
        from qeffect.verify.state import non_finite_count

        native = self.result("native-eager")
        for c in self.configs:
            c.non_finite_losses = non_finite_count(c.losses)
            comparable = (native is not None and native.losses and c.losses and c is not native
                          and c.path not in OTHER_PATHS)  # te-graphed has no losses: also without a path
            c.losses_equal_native = (_same_floats(c.losses, native.losses) if comparable else None)

    def result(self, name: str) -> ConfigResult | None:
        return next((c for c in self.configs if c.name == name), None)
