"""Resource analysis over the microbatch count M: graphs, arena bytes, live tapes, pending dW, capture time.

Everything but capture time comes from the static schedule and the arena specs, so it runs on a CPU:
graphs are provisioned as 3 x M x chunks per rank (one F, dI and dW graph per microbatch slot); the
arena is laid out by `GradientArena` itself over the ranks' matrix-parameter specs, on the meta device
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
from qeffect.model import GPTShape
from qeffect.model.gpt import StageChunk
from qeffect.profile.report import ResourceRow
from qeffect.runtime.build import dtype_of, recipe_of
from qeffect.schedule import Schedule, build_schedule, dw_in_order, max_live_tapes, max_pending_dw
from qeffect.stage.actions import arena_name

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


def arena_bytes_per_rank(schedule: Schedule, specs: dict[int, dict[str, Spec]], microbatches: int,
                         staging: int = 0, staging_dtype: torch.dtype | None = None) -> list[int]:
    """Bytes of each rank's `GradientArena` (laid out on the meta device: real sizes and padding),
    staging slots included (`staging_dtype`: the wgrad GEMM's output dtype, None: the parameter's)."""
    out = []
    for rank in range(schedule.pp):
        rank_specs: dict[str, Spec] = {}
        for s in schedule.stages_of(rank):
            rank_specs.update(specs[s])
        accumulate = dw_in_order(schedule, rank)
        dtypes = {n: staging_dtype for n in rank_specs} if staging_dtype is not None else None
        out.append(GradientArena(rank_specs, microbatches, device="meta", accumulate=accumulate,
                                 staging=staging if accumulate else 0, staging_dtypes=dtypes).nbytes)
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
            per_rank = arena_bytes_per_rank(sch, specs, m, p.wgrad_staging, dtype_of(cfg))
            live, pending = max_live_tapes(sch), max_pending_dw(sch)
            row = ResourceRow(schedule=name, microbatches=m, graphs_per_rank=3 * m * p.chunks_per_rank,
                              graph_count=3 * m * p.chunks_per_rank * p.pp, arena_bytes=sum(per_rank),
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
        if r.arena_bytes != row.arena_bytes:
            row.capture_note = f"captured pipeline's arena is {r.arena_bytes} bytes, the analysis says {row.arena_bytes}"
    except Exception as err:  # one M that does not fit must not hide the others
        row.capture_note = f"failed: {type(err).__name__}: {str(err)[:300]}"
    finally:
        gc.collect()
        torch.cuda.empty_cache()
