"""torch.distributed executor: one process per rank, launched with torchrun.

Global rank layout is data-parallel major: `global = dp_rank * pp + pp_rank`. Each process builds every
chunk from the seed (so parameters match the single-process run bit for bit) and keeps the stages its
pipeline rank owns. Activations and input gradients move with point-to-point messages between actions
(`isend` as soon as produced, `irecv` + wait when consumed; never inside an action). Before the commit,
data-parallel replicas all-reduce their gradients (arena views and non-matrix `.grad`) and merge their
FP8 scaling state; the reduction is a resource tracked by the commit barrier, so a commit with a
reduction in flight is rejected.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist

from qeffect.config import RunConfig
from qeffect.contracts import ReductionTracker
from qeffect.errors import UserError
from qeffect.graphs.manager import GraphManager
from qeffect.runtime.build import (
    build_chunks_for,
    build_rank,
    capture_ranks,
    dtype_of,
    path_runtime,
    schedule_of,
)
from qeffect.runtime.rank import BaseRank, Batch, Observer, QEffectRank
from qeffect.schedule import Schedule, native_with_placement
from qeffect.stage.actions import arena_name

_KINDS = {"act": 0, "grad": 1, "eval": 2}
_TAG_STRIDE = 1 << 16  # microbatch (or evaluation batch) index space per (kind, stage)


@dataclass(frozen=True)
class Topology:
    pp: int
    dp: int
    rank: int  # global rank

    @property
    def pp_rank(self) -> int:
        return self.rank % self.pp

    @property
    def dp_rank(self) -> int:
        return self.rank // self.pp

    def global_rank(self, pp_rank: int) -> int:
        """The process holding `pp_rank` in this replica."""
        return self.dp_rank * self.pp + pp_rank


def check_world(pp: int, dp: int, world_size: int) -> None:
    if pp * dp != world_size:
        raise UserError(f"pipeline.pp x pipeline.dp = {pp} x {dp} = {pp * dp} does not match the world size "
                        f"{world_size} (torchrun --nproc-per-node)")


class P2PTransport:
    """Point-to-point hand-off between pipeline ranks of one replica (same-rank hand-offs stay local)."""

    def __init__(self, topo: Topology, schedule: Schedule, shape: tuple[int, ...], dtype: torch.dtype,
                 device: torch.device) -> None:
        self.topo, self.schedule = topo, schedule
        self.shape, self.dtype, self.device = shape, dtype, device
        self._local: dict[tuple[str, int, int], torch.Tensor] = {}
        self._sends: list[tuple[dist.Work, torch.Tensor]] = []

    def _tag(self, kind: str, stage: int, m: int) -> int:
        return (_KINDS[kind] * self.schedule.num_stages + stage) * _TAG_STRIDE + m

    def _peer(self, kind: str, stage: int) -> int:
        """Pipeline rank that consumes what `stage` produces (grad goes backward, the rest forward)."""
        return self.schedule.stage_to_rank[stage - 1 if kind == "grad" else stage + 1]

    def put(self, kind: str, stage: int, m: int, tensor: torch.Tensor) -> None:
        peer = self._peer(kind, stage)
        if peer == self.topo.pp_rank:
            self._local[(kind, stage, m)] = tensor
            return
        t = tensor.detach().contiguous()
        work = dist.isend(t, dst=self.topo.global_rank(peer), tag=self._tag(kind, stage, m))
        self._sends.append((work, t))

    def get(self, kind: str, stage: int, m: int) -> torch.Tensor:
        key = (kind, stage, m)
        if key in self._local:
            return self._local.pop(key)
        src = self.schedule.stage_to_rank[stage]
        buf = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        dist.irecv(buf, src=self.topo.global_rank(src), tag=self._tag(kind, stage, m)).wait()
        return buf

    def finish(self) -> None:
        """Wait for every send of the step (buffers stay alive until then)."""
        for work, _ in self._sends:
            work.wait()
        self._sends.clear()
        if self._local:
            raise RuntimeError(f"unconsumed local hand-offs: {sorted(self._local)}")


class DistributedPipeline:
    """This process's pipeline rank, its transport and its data-parallel group."""

    def __init__(self, cfg: RunConfig, *, native: bool = False, direct: bool = True, path: str = "eager",
                 capture: bool = True) -> None:
        """`path`: eager, or captured-copy / captured-direct (this rank's actions as CUDA graphs on its
        GPU, with `cfg.train.offload`). `capture=False` defers capture to `capture()` (resume)."""
        if not dist.is_initialized():
            raise RuntimeError("DistributedPipeline needs an initialized process group (use init_from_env)")
        p = cfg.pipeline
        check_world(p.pp, p.dp, dist.get_world_size())
        self.cfg = cfg
        self.topo = Topology(p.pp, p.dp, dist.get_rank())
        if native and p.schedule != "interleaved":
            # The native reference must own the same stages as the qeffect mode (one stage set per process).
            self.schedule = native_with_placement(schedule_of(cfg))
        else:
            self.schedule = schedule_of(cfg, native=native)
        self.device = torch.device(cfg.train.device, _local_rank()) if cfg.train.device == "cuda" else torch.device("cpu")
        self.manager: GraphManager | None
        self.manager, self.offload, direct = path_runtime(cfg, path, self.device, native=native, direct=direct)
        chunks = build_chunks_for(cfg, self.device)
        self.reductions = ReductionTracker(f"rank{self.topo.rank}.reductions")
        self.reductions_run = 0
        self.rank: BaseRank = build_rank(cfg, self.schedule, self.topo.pp_rank, chunks, native=native,
                                         direct=direct, reductions=self.reductions, manager=self.manager,
                                         capture=False, offload=self.offload)
        # Every process creates every group in the same order (a torch.distributed requirement).
        self.dp_group = None
        for pr in range(p.pp):
            ranks = [d * p.pp + pr for d in range(p.dp)]
            group = dist.new_group(ranks)
            if pr == self.topo.pp_rank:
                self.dp_group = group
        mc = cfg.model
        self.transport = P2PTransport(self.topo, self.schedule, (mc.microbatch_size, mc.seq_len, mc.hidden),
                                      dtype_of(cfg), self.device)
        if capture:
            self.capture()

    def capture(self) -> None:
        """Capture this rank's actions (captured paths; a no-op on the eager path). Each process captures
        on its own GPU; no collective runs inside a capture (activations move between replays)."""
        if self.manager is None:
            return
        mc = self.cfg.model
        capture_ranks([self.rank], [(0, a) for a in self.program], self.offload, mc.microbatch_size, mc.seq_len)

    @property
    def program(self):
        return self.schedule.programs[self.topo.pp_rank]

    def run_actions(self, batches: Sequence[Batch], observer: Observer | None = None) -> torch.Tensor:
        """Run this rank's program for one step; returns the step loss (broadcast to every rank)."""
        for action in self.program:
            self.rank.run(action, batches, self.transport)
            if observer is not None:
                observer(action, self.rank)
        self.transport.finish()
        loss = self.rank.step_loss()
        out = torch.zeros((), dtype=torch.float32, device=self.device) if loss is None else loss.detach().float().clone()
        # The last stage's rank of each replica holds the loss; a sum with zeros elsewhere is exact.
        dist.all_reduce(out)
        return out / self.topo.dp if self.topo.dp > 1 else out

    def reduce_gradients(self) -> None:
        """Data-parallel average of every gradient, tracked by the commit barrier."""
        if self.topo.dp == 1:
            return
        handle = self.reductions.start("data-parallel gradients")
        grads: list[torch.Tensor] = []
        if isinstance(self.rank, QEffectRank):
            for s, chunk in self.rank.chunks.items():
                for pname in chunk.matrix_params():
                    grads += self.rank.arena.storage_views(arena_name(s, pname))
                grads += [p.grad for p in chunk.nonmatrix_params().values() if p.grad is not None]
        else:
            grads = [p.grad for c in self.rank.chunks.values() for p in c.parameters() if p.grad is not None]
        for g in grads:
            _all_reduce(g, dist.ReduceOp.SUM, self.dp_group)
            g.div_(self.topo.dp)
        self._merge_fp8_state()
        self.reductions.finish(handle)
        self.reductions_run += 1

    def _merge_fp8_state(self) -> None:
        """Make replicas' delayed-scaling state identical at the step boundary.

        Each replica saw other data, so its amax histories (and the scales derived from them) differ.
        The merge is conservative and order-free: the elementwise max of every amax history and the
        min of every scale (a smaller scale never saturates more), so every replica ends the step
        with the same FP8 state, as it does with the same parameters.
        """
        for chunk in self.rank.chunks.values():
            for name, t in chunk.fp8_state().items():
                if "amax" in name:
                    _all_reduce(t, dist.ReduceOp.MAX, self.dp_group)
                elif "scale" in name:
                    _all_reduce(t, dist.ReduceOp.MIN, self.dp_group)

    def commit(self, before_step: Callable[[], None] | None = None) -> None:
        """Data-parallel reduction, then the rank's commit (`before_step` runs with the gradients AdamW
        is about to use in `.grad`: what verification reads)."""
        self.reduce_gradients()
        self.rank.commit(before_step=before_step)

    def step(self, batches: Sequence[Batch], observer: Observer | None = None) -> torch.Tensor:
        loss = self.run_actions(batches, observer)
        self.commit()
        return loss


def _all_reduce(t: torch.Tensor, op, group) -> None:
    """In place, also for a strided view (TE's per-GEMM amax history column): NCCL reduces contiguous
    buffers only, so a strided tensor goes through a contiguous copy."""
    if t.is_contiguous():
        dist.all_reduce(t, op=op, group=group)
        return
    c = t.contiguous()
    dist.all_reduce(c, op=op, group=group)
    t.copy_(c)


def _local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def launched_by_torchrun() -> bool:
    return "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ
                                                   and "MASTER_ADDR" in os.environ)


def init_from_env(device: str) -> None:
    """Initialize the default process group from torchrun's environment (gloo on CPU, NCCL on GPU)."""
    if dist.is_initialized():
        return
    backend = "nccl" if device == "cuda" else "gloo"
    if device == "cuda":
        torch.cuda.set_device(_local_rank())
    dist.init_process_group(backend=backend)
