"""Resource analysis over the microbatch count M: graphs, arena bytes, live tapes, pending dW, capture time.

Everything but capture time comes from the static schedule and the arena specs, so it runs on a CPU:
graphs are what captured-direct captures (`graphs.binding.graph_plan` per chunk: chains bounded by the
schedule's liveness, one route per distinct arena write); the arena is laid out by `GradientArena` itself over the ranks' matrix-parameter specs, on the meta device
(no memory is taken, the layout and its padding are the real ones); peak live tapes and pending dW are
the schedule helpers'. On CUDA each row also captures the pipeline (`run_capture`) and records the
capture host time and the graphs actually captured.
"""

from __future__ import annotations

import gc

import torch

from qeffect.config import RunConfig
from qeffect.contracts import GradientArena
from qeffect.fp8 import get_backend
from qeffect.graphs.binding import chunk_plan
from qeffect.model import GPTShape
from qeffect.model.gpt import StageChunk
from qeffect.profile.report import ResourceRow
from qeffect.runtime.build import dtype_of, recipe_of, staging_of
from qeffect.schedule import Schedule, build_schedule, dw_in_order, max_live_tapes, max_pending_dw
from qeffect.schedule.liveness import slots_for
from qeffect.stage.actions import arena_name
from qeffect.stage.embedding_grad import needs_signed_zeros

Spec = tuple[tuple[int, ...], torch.dtype]


def parse_microbatches(text: str) -> list[int]:
    """"2,4,8,16" -> [2, 4, 8, 16]; ValueError on anything else (empty items, non-integers, < 1, repeats)."""
    items = [t.strip() for t in text.split(",")]
    if not items or any(not t for t in items):
        raise ValueError(f"--microbatches wants comma-separated positive integers, got {text!r}")
    try:
        values = [int(t) for t in items]
    except ValueError:
        raise ValueError(f"--microbatches wants comma-separated positive integers, got {text!r}") from None
    if any(v < 1 for v in values):
        raise ValueError(f"--microbatches values must be >= 1, got {text!r}")
    if len(set(values)) != len(values):
        raise ValueError(f"--microbatches has repeated values: {text!r}")
    return values


def stage_arena_specs(cfg: RunConfig) -> dict[int, dict[str, Spec]]:
    """Per stage: the arena specs a `QEffectRank` builds for it (matrix parameters, fp32 masters).

    Built from meta-device chunks of the reference backend: every backend's matrix parameter is the
    same fp32 `[out, in]` master weight, and the meta device costs neither memory nor initialization.
    """
    backend = get_backend("reference", recipe_of(cfg))
    shape = GPTShape.from_config(cfg)
    out = {}
    for s in range(shape.num_stages):
        chunk = StageChunk(shape, backend, s, device="meta")
        out[s] = {arena_name(s, n): (tuple(p.shape), p.dtype) for n, p in chunk.matrix_params().items()}
    return out


def planned_graphs_per_rank(schedule: Schedule, arenas: list[GradientArena], specs: dict[int, dict[str, Spec]],
                            tokens_per_microbatch: int) -> list[int]:
    """Graphs each rank's captured-direct chunks capture (what `CapturedStageActions.plan_for` plans):
    K per stage from the schedule's liveness, dW routes from the rank's arena writes, and on the first
    stage one dI per microbatch where the token rows need the signed-zero pass."""
    k = slots_for(schedule)
    out = []
    for rank in range(schedule.pp):
        total = 0
        for s in schedule.stages_of(rank):
            names = list(specs[s])
            total += chunk_plan(schedule.microbatches, k[s],
                                signed_zeros=s == 0 and needs_signed_zeros(tokens_per_microbatch),
                                write_signature=lambda m, a=arenas[rank], n=names: a.write_signature(m, n)).graph_count
        out.append(total)
    return out


def rank_arenas(schedule: Schedule, specs: dict[int, dict[str, Spec]], depths: dict[int, int],
                staging_dtype: torch.dtype | None = None) -> list[GradientArena]:
    """Each rank's `GradientArena` as `QEffectRank` lays it out, on the meta device, with each stage's
    staging depth (`runtime.build.staging_of`)."""
    out = []
    for rank in range(schedule.pp):
        rank_specs: dict[str, Spec] = {}
        staging: dict[str, int] = {}
        for s in schedule.stages_of(rank):
            rank_specs.update(specs[s])
            staging.update({n: depths[s] for n in specs[s]})
        accumulate = dw_in_order(schedule, rank)
        dtypes = {n: staging_dtype for n in rank_specs} if staging_dtype is not None else None
        out.append(GradientArena(rank_specs, schedule.microbatches, device="meta", accumulate=accumulate,
                                 staging=staging if accumulate else 0,
                                 staging_dtypes=dtypes, defer_last_fold=True))
    return out


def resource_rows(cfg: RunConfig, microbatches: list[int], schedules: list[str], *,
                  capture: bool = False, capture_steps: int = 2) -> list[ResourceRow]:
    """One row per (schedule, M). `capture=True` (CUDA) also captures each and records its host time."""
    p = cfg.pipeline
    specs = stage_arena_specs(cfg)
    rows = []
    for name in schedules:
        for m in microbatches:
            sch = build_schedule(name, p.pp, p.chunks_per_rank, m)
            # staging slots in the activation dtype: both backends' wgrad GEMMs write it (`wgrad_dtype`)
            arenas = rank_arenas(sch, specs, staging_of(p, sch, range(sch.num_stages)), dtype_of(cfg))
            per_rank = [a.nbytes for a in arenas]
            graphs = planned_graphs_per_rank(sch, arenas, specs, cfg.model.microbatch_size * cfg.model.seq_len)
            live, pending = max_live_tapes(sch), max_pending_dw(sch)
            row = ResourceRow(schedule=name, microbatches=m, graphs_per_rank=max(graphs), graph_count=sum(graphs),
                              graphs_per_rank_by_rank=graphs, graph_slots=slots_for(sch), arena_bytes=sum(per_rank),
                              arena_bytes_per_rank=per_rank, max_live_tapes=[live[r] for r in range(p.pp)],
                              max_pending_dw=[pending[r] for r in range(p.pp)])
            if capture:
                _capture_row(cfg, row, capture_steps)
            else:
                row.capture_note = "not run: capture host time needs a CUDA device"
            rows.append(row)
    return rows


def _capture_row(cfg: RunConfig, row: ResourceRow, steps: int) -> None:
    from qeffect.profile.capture import run_capture

    c = cfg.with_overrides(**{"pipeline.microbatches": row.microbatches, "pipeline.schedule": row.schedule,
                              "train.device": "cuda"})
    try:
        r = run_capture(c, path="captured-direct", steps=steps)
        row.capture_host_seconds = r.capture_host_seconds
        row.graphs_captured_per_rank = r.graphs_per_rank
        notes = []
        if r.arena_bytes != row.arena_bytes:
            notes.append(f"captured pipeline's arena is {r.arena_bytes} bytes, the analysis says {row.arena_bytes}")
        if r.graph_count != row.graph_count:
            notes.append(f"captured {r.graph_count} graphs, the plan says {row.graph_count}")
        row.capture_note = "; ".join(notes) or None
    except Exception as err:  # one M that does not fit must not hide the others
        row.capture_note = f"failed: {type(err).__name__}: {str(err)[:300]}"
    finally:
        gc.collect()
        torch.cuda.empty_cache()
