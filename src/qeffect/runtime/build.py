"""Build the native reference or the qeffect runtime for a configuration, from the same seed."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Sequence
from typing import Literal

import torch

from qeffect.config import OffloadConfig, PipelineConfig, RunConfig
from qeffect.errors import UserError
from qeffect.fp8 import DelayedScalingRecipe, get_backend
from qeffect.graphs.binding import staging_depth
from qeffect.graphs.captured import CapturedStageActions
from qeffect.graphs.handoff import Handoff
from qeffect.graphs.manager import GraphManager
from qeffect.model import GPTShape, build_chunks
from qeffect.offload.group import OffloadGroup, OffloadManager
from qeffect.offload.planning import StepInputs, matrix_elements
from qeffect.offload.planning import plan as plan_offload
from qeffect.runtime.memory_cap import CappedVmm, cap_bytes
from qeffect.runtime.phases import Phase, SetupClock, no_phase, phase_of
from qeffect.runtime.rank import BaseRank, NativeRank, QEffectRank
from qeffect.runtime.single import SingleProcessPipeline
from qeffect.schedule import Action, Schedule, build_native_schedule, build_schedule, dw_in_order
from qeffect.schedule.liveness import slots_for

ActionPath = Literal["eager", "captured-copy", "captured-direct"]


def recipe_of(cfg: RunConfig) -> DelayedScalingRecipe:
    return DelayedScalingRecipe(
        margin=cfg.fp8.margin,
        amax_history_len=cfg.fp8.amax_history_len,
        amax_compute_algo=cfg.fp8.amax_compute_algo,
    )


def dtype_of(cfg: RunConfig) -> torch.dtype:
    return {"float32": torch.float32, "bfloat16": torch.bfloat16}[cfg.train.dtype]


def schedule_of(cfg: RunConfig, native: bool = False) -> Schedule:
    p = cfg.pipeline
    try:
        if native:
            return build_native_schedule(p.pp, p.chunks_per_rank, p.microbatches)
        return build_schedule(p.schedule, p.pp, p.chunks_per_rank, p.microbatches)
    except ValueError as err:  # the schedule cannot take this shape: a config error, not a crash
        raise UserError(f"pipeline: {err}") from None


def build_chunks_for(cfg: RunConfig, device: str | torch.device, phase: Phase = no_phase,
                     stages: Sequence[int] | None = None) -> dict[int, torch.nn.Module]:
    """The configured model's chunks by stage: all of them, or only `stages` (one process's ranks)."""
    backend = get_backend(cfg.fp8.backend, recipe_of(cfg), fused_wgrad=cfg.pipeline.wgrad_accumulation == "fused")
    chunks = build_chunks(GPTShape.from_config(cfg), backend, seed=cfg.train.seed, device=device,
                          dtype=dtype_of(cfg), head=cfg.fp8.head, phase=phase, stages=stages)
    return {c.stage: c for c in chunks}


def build_rank(cfg: RunConfig, schedule: Schedule, rank: int, chunks: dict[int, torch.nn.Module], *,
               native: bool, direct: bool = True, fixed_order_sum: bool = True, reductions=None,
               manager: GraphManager | None = None, offload: OffloadManager | None = None,
               accumulate: bool | None = None, bounded_slots: bool = True) -> BaseRank:
    """One rank of the pipeline over its stages of `chunks`, not yet captured (`capture_ranks` captures
    once every rank is built). `accumulate`: the gradient arena's layout (None: accumulating when
    `dw_in_order`, and never with the deliberately wrong `fixed_order_sum=False`, which needs one view per
    microbatch). Captured, each chunk's graphs and tape slots are bounded by the schedule's liveness
    (`schedule.liveness.slots_for`), with release offload too (`offload.release_chains`: a group per chain,
    `offload.planning.plan_chains`); resident offload keeps one chain per microbatch, since it plans its banks
    per group and window; `bounded_slots=False` keeps one set per microbatch (an A/B)."""
    owned = {s: chunks[s] for s in schedule.stages_of(rank)}
    if accumulate is None:
        accumulate = fixed_order_sum and dw_in_order(schedule, rank)
    p, mc = cfg.pipeline, cfg.model
    if native:
        return NativeRank(rank, owned, schedule.num_stages, p.microbatches, cfg.optim, total_steps=cfg.train.steps)
    activation = ((mc.microbatch_size, mc.seq_len, mc.hidden), dtype_of(cfg))
    bounded = bounded_slots and manager is not None and (
        offload is None or (offload.mode == "release" and offload.config.release_chains == "liveness"))
    return QEffectRank(rank, owned, schedule.num_stages, p.microbatches, cfg.optim, direct=direct,
                       fixed_order_sum=fixed_order_sum, reductions=reductions, manager=manager,
                       activation=activation, offload=offload, accumulate=accumulate,
                       staging=staging_of(p, schedule, owned, direct=direct) if accumulate else 0,
                       total_steps=cfg.train.steps, graph_slots=slots_for(schedule) if bounded else None,
                       graph_pools=cfg.runtime.graph_pools)


def staging_of(p: PipelineConfig, schedule: Schedule, stages: Iterable[int], *, direct: bool = True) -> dict[int, int]:
    """Each stage's staging depth (0: not staged). A direct dW writes its staging slot from its own graph,
    so with `wgrad_staging_by_liveness` a stage stages at a depth that follows its chains
    (`graphs.binding.staging_depth`); eager and captured alike, so the arena is the rank's, not the path's.
    Fused accumulation stages nothing: the GEMM adds into the gradient itself."""
    if p.wgrad_accumulation == "fused":
        return {s: 0 for s in stages}
    slots = slots_for(schedule)
    if direct and p.wgrad_staging_by_liveness:
        return {s: staging_depth(p.wgrad_staging, slots[s], schedule.microbatches) for s in stages}
    return {s: min(p.wgrad_staging, schedule.microbatches) for s in stages}


def check_path(path: str, device: str | torch.device, offload: str = "off") -> None:
    """Captured paths need CUDA graphs, and offload needs captured actions: clear errors, not crashes."""
    if path != "eager" and torch.device(device).type != "cuda":
        raise UserError(f"path {path} captures CUDA graphs and needs a CUDA device (train.device = cuda)")
    if offload != "off" and path == "eager":
        raise UserError(f"offload.mode = {offload} offloads the activations of captured actions: it needs "
                        "train.path = captured-copy or captured-direct (got eager)")


STEP_GRAPH_AFTER = 2  # ordinary steps before a step graph is recorded: the first casts the FP8 weight caches


def build_single_process(cfg: RunConfig, *, native: bool, direct: bool = True,
                         fixed_order_sum: bool = True, device: str | torch.device | None = None,
                         path: ActionPath = "eager", capture: bool = True,
                         accumulate: bool | None = None, clock: SetupClock | None = None,
                         bounded_slots: bool = True) -> SingleProcessPipeline:
    """All ranks of the configured pipeline in this process, parameters from `cfg.train.seed`.

    `path`: "eager" runs the checked actions eagerly; "captured-copy" / "captured-direct" capture every
    action as a CUDA graph (copied gradients / direct placement into the arena), once every rank is built.
    `capture=False` defers the capture to `capture_graphs(cfg, pipe)`, so a resume can restore numerical
    state before any graph is built. `clock`: times the build's phases ("modules", "values", "ranks",
    "capture") for `qeffect profile`'s setup breakdown. `bounded_slots`: see `build_rank`.
    """
    device = device or cfg.train.device
    phase = phase_of(clock)
    manager, offload, direct = path_runtime(cfg, path, device, native=native, direct=direct)
    schedule = schedule_of(cfg, native=native)
    chunks = build_chunks_for(cfg, device, phase)
    with phase("ranks"):
        ranks = [build_rank(cfg, schedule, r, chunks, native=native, direct=direct,
                            fixed_order_sum=fixed_order_sum, manager=manager, offload=offload,
                            accumulate=accumulate, bounded_slots=bounded_slots)
                 for r in range(schedule.pp)]
    pipe = SingleProcessPipeline(ranks, schedule)
    pipe.manager = manager
    pipe.offload = offload
    pipe.rank_streams = rank_streams_for(cfg, manager, offload, device, len(ranks))
    if manager is not None and manager.keep_graphs:  # `path_runtime` keeps the graphs where step graphs apply
        pipe.step_graph_after = STEP_GRAPH_AFTER
    if capture and manager is not None:
        with phase("capture"):
            capture_graphs(cfg, pipe)
    return pipe


def rank_streams(cfg: RunConfig) -> bool:
    """Whether a one-process captured pipeline launches each rank's work on its own stream
    (`SingleProcessPipeline.rank_streams`): without offload, whose copy streams and reaps are ordered
    against the one caller stream; `runtime.rank_streams = false` keeps one stream (A/B runs).

    Each rank's graphs are captured on its stream, so torch's GEMMs keep a cuBLAS workspace of the rank's
    (`GraphManager.capturing_on`); Transformer Engine's take one process-wide workspace whatever the
    stream, so its captures get one of the rank's too (`fp8.te.own_cublas_workspace`)."""
    return cfg.offload.mode == "off" and cfg.runtime.rank_streams


def rank_streams_for(cfg: RunConfig, manager: GraphManager | None, offload: OffloadManager | None,
                     device: str | torch.device, ranks: int) -> list[torch.cuda.Stream] | None:
    """One new stream per rank where `rank_streams` applies to this build (captured, CUDA), else None."""
    if manager is None or offload is not None or ranks < 2 or not rank_streams(cfg):
        return None
    return [torch.cuda.Stream(torch.device(device)) for _ in range(ranks)]


def rank_workspace(cfg: RunConfig, device: torch.device):
    """The scope one rank's captures run in: Transformer Engine's GEMMs on a cuBLAS workspace of the
    rank's (`fp8.te.own_cublas_workspace`, which yields it); nothing for the reference backend (torch
    keys its workspaces by stream), which yields None."""
    if cfg.fp8.backend != "te":
        return contextlib.nullcontext()
    from qeffect.fp8.te import own_cublas_workspace

    return own_cublas_workspace(device)


def offload_config(cfg: RunConfig, *, native: bool = False) -> OffloadConfig:
    """The offload manager's config for `cfg`'s build: its `[offload]` section ("off" for the native
    reference). `path_runtime` builds the manager from it; tests compare it with `qeffect offload-check`'s."""
    return cfg.offload.model_copy(update={"mode": "off"}) if native else cfg.offload


def step_graph_applies(cfg: RunConfig, path: str, device: str | torch.device, *, offload: str,
                       one_process: bool = True) -> bool:
    """Whether a captured build records step graphs (`runtime.step_graph`): "auto" where they apply (one
    process, a CUDA device, captured-direct, no offload), true there and a `UserError` elsewhere, false never."""
    setting = cfg.runtime.step_graph
    if setting is False:
        return False
    if setting is True and not one_process:
        raise UserError("runtime.step_graph records one-process pipelines only (this is one rank per process)")
    if setting is True and (path != "captured-direct" or offload != "off"):
        raise UserError(f"runtime.step_graph records captured-direct steps without offload; got train.path = "
                        f"{path}, offload.mode = {offload}")
    return one_process and path == "captured-direct" and offload == "off" and torch.device(device).type == "cuda"


def path_runtime(cfg: RunConfig, path: str, device: str | torch.device, *, native: bool,
                 direct: bool, one_process: bool = True) -> tuple[GraphManager | None, OffloadManager | None, bool]:
    """What an action path needs on `device`, checked first: the graph manager and offload manager of a
    captured path (None, None on the eager path and for native) and the `direct` flag it implies.
    `one_process`: every rank in this process (`step_graph_applies`)."""
    config = offload_config(cfg, native=native)
    check_path("eager" if native else path, device, config.mode)
    if native or path == "eager":
        return None, None, direct
    step_graph = step_graph_applies(cfg, path, device, offload=config.mode, one_process=one_process)
    offload = make_offload_manager(config, device, cap=cap_bytes(torch.device(device))) \
        if config.mode != "off" else None
    # stream-ordered: graphs launched on the caller's stream (no cross-stream edge per replay; the same
    # guarantees as the two-way handshake, 1.5% faster at h2048: benchmarks/replay_protocol.py); a step
    # graph adds each action's graph to its capture, so the graphs keep their `cudaGraph_t`
    manager = GraphManager(device, protocol="stream-ordered", keep_graphs=step_graph)
    return manager, offload, path == "captured-direct"


def make_offload_manager(config: OffloadConfig, device: str | torch.device, *, cap: int | None = None) -> OffloadManager:
    """One offload manager per device, every knob from `config` (the run's `[offload]` section); a clear
    error where VMM offload cannot work. `cap` (the `train.memory_fraction` in force, in bytes): its slots count against
    the cap with torch's memory (`memory_cap.CappedVmm`)."""
    from qeffect.offload.driver import OffloadUnavailable, VmmDriver

    dev = torch.device(device)
    try:
        if cap is None:
            return OffloadManager(config, device=dev)
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        return OffloadManager(config, device=torch.device("cuda", index), driver=CappedVmm(VmmDriver(index), cap),
                              owns_driver=True)
    except OffloadUnavailable as err:
        raise UserError(f"offload.mode = {config.mode}: {err}") from None


def forward_groups(ranks: Sequence[BaseRank]) -> dict[tuple[int, int], OffloadGroup]:
    """Each captured forward's offload group by (stage, microbatch), once the chunks are prepared: its chain's
    (one group serves each microbatch of a chain)."""
    return {(act.stage, m): act.groups[act.chain(m)] for r in ranks for act in r.actions.values()
            for m in range(len(act.plan.per_microbatch)) if act.chain(m) in act.groups}


def offload_step(ranks: Sequence[BaseRank], order: Sequence[tuple[int, Action]], microbatch_size: int,
                 seq_len: int) -> StepInputs:
    """What `offload.planning.plan` needs of one step of `ranks`: the actions in `order`, each captured
    forward's group (`forward_groups`) and each stage's weight-matrix elements."""
    actions = [act for r in ranks for act in r.actions.values()]
    return StepInputs(order=[a for _, a in order], groups=forward_groups(ranks),
                      elements={act.stage: matrix_elements(act.chunk) for act in actions},
                      tokens=microbatch_size * seq_len)


def link_stages(ranks: Sequence[BaseRank]) -> int:
    """Give consecutive captured stages of these ranks (one process, one device) their hand-off buffers
    (`graphs.handoff`): stage s's F graph then writes stage s+1's F input and stage s+1's dI graph stage s's
    dI input, with no input copy queued per replay. Not with offload: its groups, planner and checks were
    verified with every chunk owning its input buffers. Before any capture; returns the links made."""
    stages = {s: act for r in ranks for s, act in r.actions.items() if isinstance(act, CapturedStageActions)}
    made = 0
    for s, producer in sorted(stages.items()):
        consumer = stages.get(s + 1)
        if consumer is None or producer.send is not None or consumer.recv is not None:
            continue
        if producer.offload is not None or consumer.offload is not None:
            continue
        device = next(consumer.chunk.parameters()).device
        if next(producer.chunk.parameters()).device != device:
            continue
        producer.send = consumer.recv = Handoff(s, tuple(consumer.input_shape), consumer.input_dtype, device)
        made += 1
    return made


def capture_ranks(ranks: Sequence[BaseRank], order: Sequence[tuple[int, Action]], offload: OffloadManager | None,
                  microbatch_size: int, seq_len: int) -> None:
    """Capture every action of `ranks` (all on one device). Without offload, chunk by chunk. With
    offload: warm up and discover every chunk, plan the step's offload and allocate the groups
    (`offload.planning.plan`, with the manager's config), then capture."""
    if offload is None:
        for r in ranks:
            r.capture(microbatch_size, seq_len)
        return
    for r in ranks:
        for act in r.actions.values():
            if act.offload is not offload:
                raise RuntimeError(f"stage {act.stage}: its captured actions were built without the offload manager")
            act.prepare(r.microbatches, microbatch_size, seq_len)
    plan_offload(offload, offload_step(ranks, order, microbatch_size, seq_len))
    for r in ranks:
        for act in r.actions.values():
            act.capture_graphs()


def capture_graphs(cfg: RunConfig, pipe: SingleProcessPipeline) -> None:
    """Capture every action of a pipeline, all ranks built (`build_single_process` calls it; after a
    checkpoint was loaded, whoever built with `capture=False`)."""
    if pipe.manager is None:
        return  # eager path: nothing to capture
    link_stages(pipe.ranks)  # across the ranks, before any rank captures
    if pipe.rank_streams is not None:  # each rank's graphs captured on its own stream (`capturing_on`)
        for r, stream in zip(pipe.ranks, pipe.rank_streams, strict=True):
            with pipe.manager.capturing_on(stream), rank_workspace(cfg, stream.device) as workspace:
                capture_ranks([r], pipe.order, pipe.offload, cfg.model.microbatch_size, cfg.model.seq_len)
            if workspace is not None:
                pipe.keep_alive.append(workspace)  # the graphs hold its address only
        return
    capture_ranks(pipe.ranks, pipe.order, pipe.offload, cfg.model.microbatch_size,
                  cfg.model.seq_len)

