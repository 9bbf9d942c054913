"""Build the native reference or the qeffect runtime for a configuration, from the same seed."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence
from typing import Literal

import torch

from qeffect.config import RunConfig
from qeffect.errors import UserError
from qeffect.fp8 import DelayedScalingRecipe, get_backend
from qeffect.graphs.manager import GraphManager
from qeffect.model import GPTShape, build_chunks
from qeffect.offload.group import OffloadManager, count_from_env
from qeffect.offload.plan import assign_banks, backward_order, explicit_banks
from qeffect.offload.timing import DEFAULT_TRIES, StepCosts, search_banks
from qeffect.runtime.phases import Phase, SetupClock, no_phase, phase_of
from qeffect.runtime.rank import BaseRank, NativeRank, QEffectRank
from qeffect.runtime.single import SingleProcessPipeline
from qeffect.schedule import Action, ActionKind, Schedule, build_native_schedule, build_schedule, dw_in_order

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
    backend = get_backend(cfg.fp8.backend, recipe_of(cfg))
    chunks = build_chunks(GPTShape.from_config(cfg), backend, seed=cfg.train.seed, device=device,
                          dtype=dtype_of(cfg), head=cfg.fp8.head, phase=phase, stages=stages)
    return {c.stage: c for c in chunks}


def build_rank(cfg: RunConfig, schedule: Schedule, rank: int, chunks: dict[int, torch.nn.Module], *,
               native: bool, direct: bool = True, fixed_order_sum: bool = True, reductions=None,
               manager: GraphManager | None = None, offload: OffloadManager | None = None,
               accumulate: bool | None = None) -> BaseRank:
    """One rank of the pipeline over its stages of `chunks`, not yet captured (`capture_ranks` captures
    once every rank is built). `accumulate`: the gradient arena's layout (None: accumulating when
    `dw_in_order`, and never with the deliberately wrong `fixed_order_sum=False`, which needs one view per
    microbatch)."""
    owned = {s: chunks[s] for s in schedule.stages_of(rank)}
    if accumulate is None:
        accumulate = fixed_order_sum and dw_in_order(schedule, rank)
    p, mc = cfg.pipeline, cfg.model
    if native:
        return NativeRank(rank, owned, schedule.num_stages, p.microbatches, cfg.optim)
    activation = ((mc.microbatch_size, mc.seq_len, mc.hidden), dtype_of(cfg))
    return QEffectRank(rank, owned, schedule.num_stages, p.microbatches, cfg.optim, direct=direct,
                       fixed_order_sum=fixed_order_sum, reductions=reductions, manager=manager,
                       activation=activation, offload=offload, accumulate=accumulate,
                       staging=p.wgrad_staging if accumulate else 0)


def check_path(path: str, device: str | torch.device, offload: str = "off") -> None:
    """Captured paths need CUDA graphs, and offload needs captured actions: clear errors, not crashes."""
    if path != "eager" and torch.device(device).type != "cuda":
        raise UserError(f"path {path} captures CUDA graphs and needs a CUDA device (train.device = cuda)")
    if offload != "off" and path == "eager":
        raise UserError(f"train.offload = {offload} offloads the activations of captured actions: it needs "
                        "train.path = captured-copy or captured-direct (got eager)")


def build_single_process(cfg: RunConfig, *, native: bool, direct: bool = True,
                         fixed_order_sum: bool = True, device: str | torch.device | None = None,
                         path: ActionPath = "eager", capture: bool = True,
                         accumulate: bool | None = None, clock: SetupClock | None = None) -> SingleProcessPipeline:
    """All ranks of the configured pipeline in this process, parameters from `cfg.train.seed`.

    `path`: "eager" runs the checked actions eagerly; "captured-copy" / "captured-direct" capture every
    action as a CUDA graph (copied gradients / direct placement into the arena), once every rank is built.
    `capture=False` defers the capture to `capture_graphs(cfg, pipe)`, so a resume can restore numerical
    state before any graph is built. `clock`: times the build's phases ("modules", "values", "ranks",
    "capture") for `qeffect profile`'s setup breakdown.
    """
    device = device or cfg.train.device
    phase = phase_of(clock)
    manager, offload, direct = path_runtime(cfg, path, device, native=native, direct=direct)
    schedule = schedule_of(cfg, native=native)
    chunks = build_chunks_for(cfg, device, phase)
    with phase("ranks"):
        ranks = [build_rank(cfg, schedule, r, chunks, native=native, direct=direct,
                            fixed_order_sum=fixed_order_sum, manager=manager, offload=offload,
                            accumulate=accumulate)
                 for r in range(schedule.pp)]
    pipe = SingleProcessPipeline(ranks, schedule)
    pipe.manager = manager
    pipe.offload = offload
    pipe.rank_streams = rank_streams_for(cfg, manager, offload, device, len(ranks))
    if capture and manager is not None:
        with phase("capture"):
            capture_graphs(cfg, pipe)
    return pipe


def rank_streams(cfg: RunConfig) -> bool:
    """Whether a one-process captured pipeline launches each rank's work on its own stream
    (`SingleProcessPipeline.rank_streams`): without offload, whose copy streams and reaps are ordered
    against the one caller stream; ``QEFFECT_RANK_STREAMS=0`` keeps one stream (A/B runs).

    Each rank's graphs are captured on its stream, so torch's GEMMs keep a cuBLAS workspace of the rank's
    (`GraphManager.capturing_on`); Transformer Engine's take one process-wide workspace whatever the
    stream, so its captures get one of the rank's too (`fp8.te.own_cublas_workspace`)."""
    return cfg.train.offload == "off" and os.environ.get("QEFFECT_RANK_STREAMS", "1") != "0"


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


def path_runtime(cfg: RunConfig, path: str, device: str | torch.device, *, native: bool,
                 direct: bool) -> tuple[GraphManager | None, OffloadManager | None, bool]:
    """What an action path needs on `device`, checked first: the graph manager and offload manager of a
    captured path (None, None on the eager path and for native) and the `direct` flag it implies."""
    offload_mode = "off" if native else cfg.train.offload
    check_path("eager" if native else path, device, offload_mode)
    if native or path == "eager":
        return None, None, direct
    t = cfg.train
    offload = (make_offload_manager(offload_mode, device, t.offload_banks, t.offload_reap, t.offload_skip_kept_d2h,
                                    t.offload_min_window, t.offload_lookahead, t.offload_bank_plan,
                                    t.offload_search_banks, t.offload_search_prefer)
               if offload_mode != "off" else None)
    # stream-ordered: graphs launched on the caller's stream (no cross-stream edge per replay; the same
    # guarantees as the two-way handshake, 1.5% faster at h2048: benchmarks/replay_protocol.py)
    return GraphManager(device, protocol="stream-ordered"), offload, path == "captured-direct"


def make_offload_manager(mode: str, device: str | torch.device, banks: int = 2, reap: bool = False,
                         skip_kept_d2h: bool = True, min_window: int = 0, lookahead: int = 1,
                         bank_plan: str = "search", search_banks: int = 6,
                         search_prefer: str = "copies") -> OffloadManager:
    """One offload manager per device (`banks`: resident mode's minimum bank count for the colouring;
    `reap`: release mode also releases consumed slots; `skip_kept_d2h`: resident mode copies no group the
    schedule's plan keeps in its bank; `min_window`: no group with fewer other actions between its forward
    and its backward is offloaded; `lookahead`: offloaded groups each backward restores ahead; `bank_plan`,
    `search_banks`, `search_prefer`: how `capture_ranks` plans resident banks, `train.offload_bank_plan`);
    a clear error where VMM offload cannot work."""
    from qeffect.offload.driver import OffloadUnavailable

    try:
        return OffloadManager(mode, device=torch.device(device), num_banks=banks, release_consumed=reap,
                              skip_kept_d2h=skip_kept_d2h, min_window=min_window, lookahead=lookahead,
                              bank_plan=bank_plan, search_banks=search_banks, search_prefer=search_prefer)
    except OffloadUnavailable as err:
        raise UserError(f"train.offload = {mode}: {err}") from None


# an action's offload event (`offload.plan.Event`): its group's forward, backward start, last reader
OFFLOAD_EVENT_KINDS = {ActionKind.F: "F", ActionKind.DI: "B", ActionKind.DW: "E"}


def named_events(order: Sequence[tuple[int, Action]]) -> list[tuple[str, tuple[int, int]]]:
    """One step's offload events as `offload_events` gives them, each group named (stage, microbatch): for
    the plans made from a schedule alone (tests, `scripts/offload_sim.py`), before any pipeline exists."""
    return [(OFFLOAD_EVENT_KINDS[a.kind], (a.stage, a.microbatch)) for _, a in order]


def offload_events(order: Sequence[tuple[int, Action]], ranks: Sequence[BaseRank]) -> list[tuple[str, object]]:
    """One step's offload events in execution order: F, backward start (dI) and last reader (dW) per group."""
    events = []
    for r, a in order:
        group = ranks[r].actions[a.stage].groups.get(a.microbatch)
        if group is not None:
            events.append((OFFLOAD_EVENT_KINDS[a.kind], group))
    return events


# Action durations for the bank search, from a chunk's matrix FLOPs: 1e15 FLOP/s plus 0.09 ms per action
# fit the per-layer action times the simulation was calibrated with on the H200 (h2048 0.118 ms, h4096
# 0.173 ms, each from its measured step); the rest of the step (optimizer, embedding) taken as 0.4 of the
# actions' time (h2048 0.37, h4096 0.43). The plans found are not very sensitive to them: in the simulation
# (scripts/offload_sim.py --robustness, benchmarks/results/offload-sim-robustness-*), timed with the calibrated
# durations, with them x1.6 or with the last stage's weight 1.3 instead of 2, the estimate's plan ran as fast
# as a plan searched with those durations (x1.000); with them x0.6 (copies relatively longer) x1.019-1.050
# against x1.000-1.001, still ahead of the colouring (x1.08-1.35).
ESTIMATE_FLOPS = 1e15
ESTIMATE_ACTION_MS = 0.09
ESTIMATE_TAIL = 0.4


def matrix_elements(chunk: torch.nn.Module) -> int:
    """Elements of a chunk's weight matrices: its GEMMs take 2 FLOPs per element and token, per action
    (forward, input gradient, weight gradient). Embedding tables are lookups, not GEMMs."""
    return sum(p.numel() for m in chunk.modules() if not isinstance(m, torch.nn.Embedding)
               for p in m.parameters(recurse=False) if p.dim() == 2)


def estimated_costs(nbytes: dict, elements: dict, tokens: int) -> StepCosts:
    """`offload.timing.StepCosts` from each group's slot bytes and its chunk's `matrix_elements`: every
    action of the group takes `ESTIMATE_ACTION_MS` plus its GEMMs at `ESTIMATE_FLOPS`; the rest of the
    step `ESTIMATE_TAIL` of the actions' time."""
    action_ms = {g: (ESTIMATE_ACTION_MS + 2 * tokens * n / ESTIMATE_FLOPS * 1e3,) * 3 for g, n in elements.items()}
    return StepCosts(nbytes, action_ms, ESTIMATE_TAIL * sum(sum(t) for t in action_ms.values()))


def estimate_costs(ranks: Sequence[BaseRank], offload: OffloadManager, events: Sequence[tuple[str, object]],
                   tokens: int) -> StepCosts:
    """The step's `estimated_costs` for the capture-time bank search: the groups of `events`, each with
    its chunk's weights; a group `offload` does not offload (a short window) counts as empty."""
    groups = {g for _, g in events}
    elements = {g: matrix_elements(act.chunk) for r in ranks for act in r.actions.values()
                for g in act.groups.values() if g in groups}
    short = offload.short_window(events)  # not offloaded: no bank, no copies
    return estimated_costs({g: 0 if g in short else offload.layout(g.specs)[1] for g in groups}, elements, tokens)


def search_tries() -> int:
    """Plans the capture-time bank search tries: `offload.timing.DEFAULT_TRIES`, or
    QEFFECT_OFFLOAD_SEARCH_TRIES (an A/B switch; 0 keeps the colouring with `offload_search_banks` banks)."""
    try:
        return count_from_env("QEFFECT_OFFLOAD_SEARCH_TRIES", DEFAULT_TRIES)
    except ValueError as err:
        raise UserError(str(err)) from None


def capture_ranks(ranks: Sequence[BaseRank], order: Sequence[tuple[int, Action]], offload: OffloadManager | None,
                  microbatch_size: int, seq_len: int) -> None:
    """Capture every action of `ranks` (all on one device). Without offload, chunk by chunk. With
    offload: warm up and discover every chunk, allocate the groups in backward order (resident mode:
    banks from the schedule's conflicts, `offload.plan`, and the step's events, so that groups the plan
    keeps in their bank skip the D2H; both modes: the same events name the groups whose window is too
    short to offload, `train.offload_min_window`), then capture."""
    if offload is None:
        for r in ranks:
            r.capture(microbatch_size, seq_len)
        return
    for r in ranks:
        for act in r.actions.values():
            if act.offload is not offload:
                raise RuntimeError(f"stage {act.stage}: its captured actions were built without the offload manager")
            act.prepare(r.microbatches, microbatch_size, seq_len)
    events = offload_events(order, ranks)
    backward = backward_order(events)
    banks = None
    if offload.mode == "resident":
        given = os.environ.get("QEFFECT_OFFLOAD_BANKS")  # banks by hand (scripts/offload_sim.py --search)
        if given:
            banks = explicit_banks(events, given)
        elif offload.bank_plan_kind == "search":
            found = search_banks(events, estimate_costs(ranks, offload, events, microbatch_size * seq_len),
                                 max_banks=offload.search_banks, tries=search_tries(), prefer=offload.search_prefer,
                                 lookahead=offload.lookahead, chunk_bytes=offload.copy_chunk_bytes,
                                 skip_kept_d2h=offload.skip_kept_d2h)
            offload.bank_search = found
            banks = list(found.best.plan)
        else:
            plan = assign_banks(events, min_banks=offload.num_banks)
            banks = [plan[g] for g in backward]
    offload.allocate(backward, banks=banks, events=events)
    for r in ranks:
        for act in r.actions.values():
            act.capture_graphs()


def capture_graphs(cfg: RunConfig, pipe: SingleProcessPipeline) -> None:
    """Capture every action of a pipeline, all ranks built (`build_single_process` calls it; after a
    checkpoint was loaded, whoever built with `capture=False`)."""
    if pipe.manager is None:
        return  # eager path: nothing to capture
    if pipe.rank_streams is not None:  # each rank's graphs captured on its own stream (`capturing_on`)
        for r, stream in zip(pipe.ranks, pipe.rank_streams, strict=True):
            with pipe.manager.capturing_on(stream), rank_workspace(cfg, stream.device) as workspace:
                capture_ranks([r], pipe.order, pipe.offload, cfg.model.microbatch_size, cfg.model.seq_len)
            if workspace is not None:
                pipe.keep_alive.append(workspace)  # the graphs hold its address only
        return
    capture_ranks(pipe.ranks, pipe.order, pipe.offload, cfg.model.microbatch_size,
                  cfg.model.seq_len)

