"""`qeffect capture --config`: capture every stage action of a config and measure what capture costs.

Builds the captured pipeline (all ranks of the config in this process, one GPU), runs `steps` steps on
synthetic data, and reports graph count against the planned count (`graphs.binding`: bounded by the
schedule's liveness), capture host time, arena bytes, memory before/after capture and persistent
allocated-memory growth per step.
"""

from __future__ import annotations

import time
from typing import Literal

import torch
from pydantic import BaseModel

from qeffect.config import RunConfig
from qeffect.runtime.build import build_single_process
from qeffect.verify.state import synthetic_batches


class CaptureReport(BaseModel):
    schema_version: int = 1
    kind: Literal["capture"] = "capture"
    config: dict
    path: str
    schedule: str
    backend: str
    device_name: str
    torch_version: str
    graph_count: int
    graphs_per_rank: int
    expected_graphs_per_rank: int
    capture_host_seconds: float
    setup_seconds: float
    arena_bytes: int
    memory_allocated_before_capture: int
    memory_allocated_after_capture: int
    memory_reserved_after_capture: int
    steps: int
    step_allocated: list[int]
    persistent_growth_bytes_per_step: float
    median_step_seconds: float
    replays_per_step: float
    handoffs_per_step: float
    passed: bool


def run_capture(cfg: RunConfig, *, path: str = "captured-direct", steps: int = 50) -> CaptureReport:
    device = torch.device("cuda")
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    pipe = build_single_process(cfg, native=False, device=device, path=path)
    torch.cuda.synchronize()
    setup = time.perf_counter() - t0
    mgr = pipe.manager
    after, reserved = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    times = []
    replays0, handoffs0 = mgr.stats.replay_count, mgr.stats.handoffs
    for step in range(steps):
        batches = synthetic_batches(cfg, step, device)
        torch.cuda.synchronize()
        t = time.perf_counter()
        pipe.step(batches)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
        mgr.mark_step()
    p = cfg.pipeline
    planned = sum(r.planned_graphs() for r in pipe.ranks)
    expected = max(r.planned_graphs() for r in pipe.ranks)
    growth = mgr.persistent_growth_per_step()
    per_rank = max(r.captured_graphs() for r in pipe.ranks)  # the busiest rank, as the plan counts it
    return CaptureReport(
        config=cfg.model_dump(), path=path, schedule=p.schedule, backend=cfg.fp8.backend,
        device_name=torch.cuda.get_device_name(), torch_version=torch.__version__,
        graph_count=mgr.stats.graph_count, graphs_per_rank=per_rank, expected_graphs_per_rank=expected,
        capture_host_seconds=mgr.stats.capture_host_seconds, setup_seconds=setup,
        arena_bytes=sum(r.arena.nbytes for r in pipe.ranks), memory_allocated_before_capture=before,
        memory_allocated_after_capture=after, memory_reserved_after_capture=reserved, steps=steps,
        step_allocated=list(mgr.stats.step_allocated), persistent_growth_bytes_per_step=growth,
        median_step_seconds=sorted(times)[len(times) // 2],
        replays_per_step=(mgr.stats.replay_count - replays0) / steps,
        handoffs_per_step=(mgr.stats.handoffs - handoffs0) / steps,
        passed=mgr.stats.graph_count == planned and growth == 0,
    )
