"""`qeffect verify-state` under torchrun: native eager and a qeffect mode with the same rank mapping,
compared bitwise after every step on every rank.

Each process builds both pipelines for its (pipeline, data-parallel) rank from the same seed. A step
runs the native reference to its commit, then the qeffect mode to its commit, on the same synthetic
batches (replica d gets batch sequence `step + 1000 d`, as the distributed tests do). After each step
every rank compares, for the chunks it owns: the step loss, every parameter gradient as loaded for
AdamW (after the data-parallel reduction), every parameter, the AdamW state and the FP8 scaling state.
With data parallelism (`pipeline.dp` > 1), also every replica's parameters, AdamW and FP8 state
against data-parallel rank 0 of its stage ("replicas"), and that the commit barrier ran one tracked
reduction per step ("reductions"). With the training recipe (`runtime.recipe`) also the global gradient
norm (all-gathered over every stage: "parameter_gradients") and the learning rate ("optimizer_state"); the
schedule's horizon is the run's `steps`, as in `verify.state`. Counts are summed over ranks; the earliest divergence is reported. The per-action comparison of the
single-process verify (activations, input gradients, cache epochs after each action) needs every
stage in one process and is not repeated here. `resume`: every pipeline (native, qeffect and native
Interleaved) starts from a checkpoint in this run's layout, from its step on (`verify.state`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import torch
import torch.distributed as dist
from pydantic import BaseModel

from qeffect.config import RunConfig
from qeffect.errors import UserError
from qeffect.graphs.handshake import run_settings
from qeffect.runtime.build import schedule_of
from qeffect.runtime.distributed import DistributedPipeline
from qeffect.verify.state import (
    CategoryResult,
    bits,
    bitwise_equal,
    grad_capture,
    non_finite_count,
    recipe_record,
    resume_start,
    synthetic_batches,
)

CATEGORIES = ("loss", "parameter_gradients", "parameters", "optimizer_state", "fp8_state")
DP_CATEGORIES = ("replicas", "reductions")  # only with pipeline.dp > 1
# Only for a schedule with another stage placement than Interleaved's (ZB-V): the step loss against
# native Interleaved on its own placement. The same-placement reference shares the placement's hand-off
# pattern, so a transport fault there (NCCL pairing messages by order) fooled both sides alike.
PLACEMENT_CATEGORIES = ("loss_vs_interleaved",)
Injection = Literal["perturb-scale", "desync-replica"]


class RankDivergence(BaseModel):
    step: int
    rank: int
    category: str
    tensor: str


class DistVerifyReport(BaseModel):
    schema_version: int = 1
    kind: Literal["verify-state-distributed"] = "verify-state-distributed"
    resumed_from: str | None = None  # the checkpoint every pipeline started from (`resume`)
    start_step: int = 0  # its step: the first step compared
    resumed_layout: str | None = None  # how this run lays out the checkpoint's model otherwise, if it does
    schedule: str
    path: str
    backend: str
    device: str
    world_size: int
    pp: int
    dp: int
    chunks_per_rank: int
    microbatches: int
    steps: int
    settings: dict[str, Any] = {}  # bit-changing settings and [runtime] (`graphs.handshake.run_settings`)
    injection: str | None
    categories: list[CategoryResult]
    first_divergence: RankDivergence | None
    losses: list[float | None]
    non_finite_losses: int = 0  # NaN / inf losses: a failure even where every bit matches
    notes: list[str] = []  # checks that could not run here, and why
    graphs_per_rank: list[int] | None  # captured paths: graphs each rank captured
    passed: bool
    seconds: float


def _state(pipe: DistributedPipeline) -> dict[str, dict[str, torch.Tensor]]:
    out: dict[str, dict[str, torch.Tensor]] = {"parameters": {}, "optimizer_state": {}, "fp8_state": {}}
    pipe.settle()  # a row-lazy token table: every row and moment up to date first
    opt = pipe.rank.optimizer
    for s, chunk in pipe.rank.chunks.items():
        for n, p in chunk.named_parameters():
            out["parameters"][f"s{s}.{n}"] = p.detach()
            for k, v in opt.state.get(p, {}).items():
                if torch.is_tensor(v):
                    out["optimizer_state"][f"s{s}.{n}.{k}"] = v.detach()
        for n, t in chunk.fp8_state().items():
            out["fp8_state"][f"s{s}.{n}"] = t.detach()
    return out


def _first_replica_bits(pipe: DistributedPipeline, t: torch.Tensor) -> torch.Tensor:
    """The bits of `t` as data-parallel rank 0 of this stage (global rank `pp_rank`) holds it."""
    b = bits(t).clone()
    dist.broadcast(b, src=pipe.topo.pp_rank, group=pipe.dp_group)
    return b


def run_verify_distributed(cfg: RunConfig, *, steps: int = 20, path: str = "eager",
                           injection: Injection | None = None,
                           progress: Callable[[int, float], None] | None = None,
                           resume: str | Path | None = None) -> DistVerifyReport:
    """Both pipelines in this process group; every rank returns the same report."""
    if not dist.is_initialized():
        raise RuntimeError("run_verify_distributed needs an initialized process group (init_from_env)")
    if injection == "perturb-scale" and cfg.fp8.backend != "reference":
        raise UserError("--inject perturb-scale: only for the reference backend")
    if injection == "desync-replica" and cfg.pipeline.dp < 2:
        raise UserError("--inject desync-replica: needs pipeline.dp >= 2")
    t0 = time.perf_counter()
    start, folder, layout = resume_start(cfg, resume)
    cfg = cfg.with_overrides(**{"train.steps": start + steps})  # the schedule's horizon (`verify.state`)
    native = DistributedPipeline(cfg, native=True)
    qeff = DistributedPipeline(cfg, path=path, capture=folder is None)
    interleaved, notes = None, []
    if cfg.pipeline.schedule != "interleaved":
        il_cfg = cfg.with_overrides(**{"pipeline.schedule": "interleaved"})
        try:
            schedule_of(il_cfg, native=True)  # Interleaved takes fewer microbatch counts than ZB-V
        except UserError as err:
            notes.append(f"loss_vs_interleaved not checked: native Interleaved cannot run this shape ({err})")
        else:
            interleaved = DistributedPipeline(il_cfg, native=True)
    if folder is not None:  # numbers first, then graphs (they hold the loaded tensors by address)
        from qeffect.checkpoint import load_checkpoint

        for pipe in (native, qeff, interleaved):
            if pipe is not None:
                load_checkpoint(pipe, folder, cfg)
        qeff.capture()  # no-op on the eager path
    if cfg.pipeline.dp > 1 and not qeff.rank.arena.accumulate:
        raise UserError(f"pipeline.dp = {cfg.pipeline.dp} needs the accumulating gradient arena (a schedule that "
                        "runs dW in microbatch order): data-parallel averaging of per-microbatch views and of "
                        "summed gradients associate differently")
    me = dist.get_rank()
    categories = (CATEGORIES + (DP_CATEGORIES if cfg.pipeline.dp > 1 else ())
                  + (PLACEMENT_CATEGORIES if interleaved is not None else ()))
    compared = dict.fromkeys(categories, 0)
    mismatched = dict.fromkeys(categories, 0)
    first: RankDivergence | None = None
    losses: list[float] = []

    def check(step: int, category: str, name: str, a: torch.Tensor | None, b: torch.Tensor | None) -> None:
        nonlocal first
        compared[category] += 1
        if a is None or b is None or not bitwise_equal(a, b):
            mismatched[category] += 1
            if first is None:
                first = RankDivergence(step=step, rank=me, category=category, tensor=name)

    for step in range(start, start + steps):
        batches = synthetic_batches(cfg, step + 1000 * qeff.topo.dp_rank, qeff.device)
        ref_grads: dict[str, torch.Tensor] = {}
        ref_loss = native.run_actions(batches)
        native.commit(before_step=grad_capture(native.rank, ref_grads))
        if injection == "perturb-scale" and step == 1 and 0 in qeff.rank.chunks:
            lin = next(iter(qeff.rank.chunks[0].matrix_linears().values()))
            with torch.no_grad():
                lin.input_scale.mul_(2.0)
        if injection == "desync-replica" and step == 1 and qeff.topo.dp_rank == 1:
            # one replica's parameter drifts (as a skipped reduction would leave it): replicas must differ
            p0 = next(iter(next(iter(qeff.rank.chunks.values())).parameters()))
            with torch.no_grad():
                p0.view(-1)[0] += 1.0
        grads: dict[str, torch.Tensor] = {}
        loss = qeff.run_actions(batches)
        qeff.commit(before_step=grad_capture(qeff.rank, grads))
        check(step, "loss", "step loss", ref_loss, loss)
        if interleaved is not None:
            il_loss = interleaved.run_actions(batches)
            interleaved.commit()
            check(step, "loss_vs_interleaved", "step loss (native Interleaved placement)", il_loss, loss)
        for name in sorted(set(ref_grads) | set(grads)):
            check(step, "parameter_gradients", name, ref_grads.get(name), grads.get(name))
        ref_recipe, recipe = recipe_record(native), recipe_record(qeff)
        for category in ("parameter_gradients", "optimizer_state"):  # global_grad_norm (with clipping), lr
            a, b = ref_recipe.get(category, {}), recipe.get(category, {})
            for name in sorted(set(a) | set(b)):
                check(step, category, name, a.get(name), b.get(name))
        ref_state, state = _state(native), _state(qeff)
        for category in ("parameters", "optimizer_state", "fp8_state"):
            for name in sorted(set(ref_state[category]) | set(state[category])):
                check(step, category, name, ref_state[category].get(name), state[category].get(name))
        if cfg.pipeline.dp > 1:
            for category in ("parameters", "optimizer_state", "fp8_state"):
                for name, t in sorted(state[category].items()):
                    check(step, "replicas", f"{category}:{name}", _first_replica_bits(qeff, t), bits(t))
            done = torch.tensor(float(qeff.reductions_run == step - start + 1 and not qeff.reductions.pending()))
            check(step, "reductions", f"one reduction finished before commit {step}", torch.tensor(1.0), done)
        losses.append(float(loss))
        if progress is not None:
            progress(step - start, float(loss))

    counts = torch.tensor([[compared[c], mismatched[c]] for c in categories], dtype=torch.int64,
                          device=qeff.device)
    dist.all_reduce(counts)
    firsts: list[RankDivergence | None] = [None] * dist.get_world_size()
    dist.all_gather_object(firsts, first)
    found = [f for f in firsts if f is not None]
    earliest = min(found, key=lambda f: (f.step, f.rank)) if found else None
    graphs = planned = None
    if qeff.manager is not None:
        box: list[tuple[int, int]] = [(0, 0)] * dist.get_world_size()
        dist.all_gather_object(box, (qeff.manager.stats.graph_count, qeff.rank.planned_graphs()))
        graphs, planned = [g for g, _ in box], [p for _, p in box]
    cats = [CategoryResult(category=c, compared=int(counts[i, 0]), mismatches=int(counts[i, 1]))
            for i, c in enumerate(categories)]
    non_finite = non_finite_count(losses)
    passed = (all(c.mismatches == 0 and c.compared > 0 for c in cats)
              and (graphs is None or graphs == planned) and non_finite == 0)
    p = cfg.pipeline
    return DistVerifyReport(
        resumed_from=None if folder is None else str(folder), start_step=start, resumed_layout=layout,
        schedule=p.schedule, path=path, backend=cfg.fp8.backend, device=str(qeff.device.type),
        world_size=dist.get_world_size(), pp=p.pp, dp=p.dp, chunks_per_rank=p.chunks_per_rank,
        microbatches=p.microbatches, steps=steps, settings=run_settings(cfg), injection=injection, categories=cats,
        first_divergence=earliest, losses=losses, non_finite_losses=non_finite, notes=notes, graphs_per_rank=graphs,
        passed=passed,
        seconds=time.perf_counter() - t0)
