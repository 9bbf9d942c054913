"""torch.distributed executor: one process per rank, launched with torchrun.

Global rank layout is data-parallel major: `global = dp_rank * pp + pp_rank`. Each process builds every
chunk from the seed (so parameters match the single-process run bit for bit) and keeps the stages its
pipeline rank owns. Activations and input gradients move with point-to-point messages between actions
(`isend` as soon as produced, `irecv` + wait when consumed; never inside an action). Before the commit,
data-parallel replicas all-reduce their gradients (arena views and non-matrix `.grad`) and merge their
FP8 scaling state; the reduction is a resource tracked by the commit barrier, so a commit with a
reduction in flight is rejected.

With clipping (`optim.clip_grad_norm`, `runtime.recipe`), after that reduction every process computes
its stages' square sums, all processes all-gather one fixed-size vector (one entry per stage) and each
adds the stages in stage order itself, taking data-parallel replica 0's entries (every replica's are the
same: the replicas hold identical reduced gradients). Every rank so holds the same global norm and clip
factor, bit for bit, and the same as one process computes.
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
from qeffect.runtime.phases import SetupClock, phase_of
from qeffect.runtime.rank import BaseRank, Batch, Observer, QEffectRank
from qeffect.runtime.recipe import clip_factor, global_norm
from qeffect.runtime.step_timing import StepLaps
from qeffect.schedule import ActionKind, Schedule, native_with_placement
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


Key = tuple[str, int, int]  # (kind, producing stage, microbatch)


def send_order(schedule: Schedule, src: int, dst: int) -> list[Key]:
    """The hand-offs pipeline rank `src` puts for rank `dst` in one training step, in the order it puts
    them: its program's order (`F` of a stage whose successor lives on `dst`: its activation; `dI` or `B`
    of a stage whose predecessor lives on `dst`: its input gradient), as `BaseRank` does."""
    out: list[Key] = []
    last = schedule.num_stages - 1
    for a in schedule.programs[src]:
        s, m = a.stage, a.microbatch
        if a.kind is ActionKind.F and s < last and schedule.stage_to_rank[s + 1] == dst:
            out.append(("act", s, m))
        elif a.kind in (ActionKind.DI, ActionKind.B) and s > 0 and schedule.stage_to_rank[s - 1] == dst:
            out.append(("grad", s, m))
    return out


class P2PTransport:
    """Point-to-point hand-off between pipeline ranks of one replica (same-rank hand-offs stay local).

    Why receives follow the sender's order: NCCL ignores tags and matches a pair's sends and receives in
    the order they were posted, and every hand-off has the same shape and dtype. A rank that receives in
    its own program's order (ZB-V: rank 1 wants a gradient from rank 0 before an activation rank 0 sent
    earlier) silently got the wrong tensor; both the native reference with the same placement and the
    qeffect run got it, so bitwise verification agreed (two H200s: ZB-V's step-0 loss 10.838 against
    Interleaved's 10.850). So a training step receives from each peer in that peer's `send_order`, keeping
    what comes early until it is asked for, and a send off that order raises. Tags stay (gloo checks them).
    Evaluation hand-offs (`evaluate`: every process walks (batch, stage) in order) are sent and wanted in
    the same order on both sides of a pair.
    """

    def __init__(self, topo: Topology, schedule: Schedule, shape: tuple[int, ...], dtype: torch.dtype,
                 device: torch.device) -> None:
        self.topo, self.schedule = topo, schedule
        self.shape, self.dtype, self.device = shape, dtype, device
        self._local: dict[Key, torch.Tensor] = {}
        self._sends: list[tuple[dist.Work, torch.Tensor]] = []
        me, pp = topo.pp_rank, schedule.pp
        self._out_order = {r: send_order(schedule, me, r) for r in range(pp) if r != me}
        self._in_order = {r: send_order(schedule, r, me) for r in range(pp) if r != me}
        self._sent = dict.fromkeys(self._out_order, 0)  # cursor into _out_order per peer
        self._received = dict.fromkeys(self._in_order, 0)
        self._early: dict[Key, torch.Tensor] = {}  # received before they were asked for

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
        if kind != "eval":
            order, i = self._out_order[peer], self._sent[peer]
            if i >= len(order) or order[i] != (kind, stage, m):
                raise RuntimeError(f"pipeline rank {self.topo.pp_rank}: sends {(kind, stage, m)} to rank {peer}, "
                                   f"but its program's order says {order[i] if i < len(order) else 'nothing more'}")
            self._sent[peer] = i + 1
        t = tensor.detach().contiguous()
        work = dist.isend(t, dst=self.topo.global_rank(peer), tag=self._tag(kind, stage, m))
        self._sends.append((work, t))

    def _recv(self, src: int, key: Key) -> torch.Tensor:
        buf = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        dist.irecv(buf, src=self.topo.global_rank(src), tag=self._tag(*key)).wait()
        return buf

    def get(self, kind: str, stage: int, m: int) -> torch.Tensor:
        key = (kind, stage, m)
        if key in self._local:
            return self._local.pop(key)
        if key in self._early:
            return self._early.pop(key)
        src = self.schedule.stage_to_rank[stage]
        if kind == "eval":
            return self._recv(src, key)
        order = self._in_order[src]
        if key not in order[self._received[src]:]:
            raise RuntimeError(f"pipeline rank {self.topo.pp_rank}: wants {key} from rank {src}, which does not "
                               "send it (any more) this step")
        while True:  # the peer's sends in its order, keeping the ones that come early
            nxt = order[self._received[src]]
            self._received[src] += 1
            buf = self._recv(src, nxt)
            if nxt == key:
                return buf
            self._early[nxt] = buf

    def finish(self) -> None:
        """Wait for every send of the step (buffers stay alive until then); check nothing is left over."""
        for work, _ in self._sends:
            work.wait()
        self._sends.clear()
        if self._local or self._early:
            raise RuntimeError(f"unconsumed hand-offs: {sorted(self._local) + sorted(self._early)}")
        for name, cursors, orders in (("sent", self._sent, self._out_order),
                                      ("received", self._received, self._in_order)):
            short = {r: len(orders[r]) - c for r, c in cursors.items() if c not in (0, len(orders[r]))}
            if short:
                raise RuntimeError(f"pipeline rank {self.topo.pp_rank}: a step ended with hand-offs not {name} "
                                   f"(peer: how many) {short}")
        self._sent = dict.fromkeys(self._sent, 0)
        self._received = dict.fromkeys(self._received, 0)


class DistributedPipeline:
    """This process's pipeline rank, its transport and its data-parallel group."""

    def __init__(self, cfg: RunConfig, *, native: bool = False, direct: bool = True, path: str = "eager",
                 capture: bool = True, clock: SetupClock | None = None) -> None:
        """`path`: eager, or captured-copy / captured-direct (this rank's actions as CUDA graphs on its
        GPU, with `cfg.offload.mode`). `capture=False` defers capture to `capture()` (resume). Only this
        rank's stages are built. `clock`: times the build's phases, as `build_single_process`'s."""
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
        self.manager, self.offload, direct = path_runtime(cfg, path, self.device, native=native, direct=direct,
                                                          one_process=False)
        phase = phase_of(clock)
        chunks = build_chunks_for(cfg, self.device, phase, stages=self.schedule.stages_of(self.topo.pp_rank))
        self.reductions = ReductionTracker(f"rank{self.topo.rank}.reductions")
        self.reductions_run = 0
        self.track_grad_norm = False  # as `SingleProcessPipeline.track_grad_norm`
        self.last_grad_norm: torch.Tensor | None = None
        self.last_lr: float | None = None
        self._prepared: tuple[torch.Tensor, torch.Tensor | None] | None = None  # (norm, clip factor)
        # set only while `runtime.step_timing.breakdown_step` cuts a step into laps; None costs nothing
        self.step_laps: StepLaps | None = None
        with phase("ranks"):
            self.rank: BaseRank = build_rank(cfg, self.schedule, self.topo.pp_rank, chunks, native=native,
                                             direct=direct, reductions=self.reductions, manager=self.manager,
                                             offload=self.offload)
        if p.dp > 1 and isinstance(self.rank, QEffectRank):  # the reduction brings rows no local token names
            self.rank.lazy_token_rows = False
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
        if capture and self.manager is not None:
            with phase("capture"):
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
        if self.offload is not None:
            self.offload.begin_step()  # groups left live by an aborted step are dropped first
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
        if self.step_laps is not None:
            self.step_laps.lap("optimizer")
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
        if self.step_laps is not None:
            self.step_laps.lap("reduction")

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

    def _wants_norm(self) -> bool:
        return self.track_grad_norm or self.rank.recipe.clip > 0

    def grad_norm(self) -> torch.Tensor | None:
        """The global gradient norm of the step over every stage (see the module docstring), once the
        actions ran and before the commit: the data-parallel reduction, this rank's stages' square sums, an
        all-gather over every process, the sum in stage order. None when neither clipping nor
        `track_grad_norm` asks for it. A collective: every process calls it, or none."""
        if self._prepared is None:
            if not self._wants_norm():
                return None
            self.reduce_gradients()
            n = self.schedule.num_stages
            mine = torch.zeros(n, dtype=torch.float64, device=self.device)
            for s, t in self.rank.gradient_square_sums().items():
                mine[s] = t
            every = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
            dist.all_gather(every, mine)
            # stage s of data-parallel replica 0 lives on global rank stage_to_rank[s] (`Topology`)
            norm = global_norm([every[self.schedule.stage_to_rank[s]][s] for s in range(n)])
            clip = self.rank.recipe.clip
            self._prepared = (norm, clip_factor(norm, clip) if clip > 0 else None)
        return self._prepared[0]

    def commit(self, before_step: Callable[[], None] | None = None, *, skip: bool = False) -> None:
        """Data-parallel reduction, then the rank's commit (`before_step` runs just before AdamW, and reads
        the gradients it is about to use through `rank.gradient`: what verification reads). With clipping,
        the global norm first (`grad_norm`), whose factor the rank's commit applies. `skip`: no optimizer
        step (`BaseRank.commit`); every process must pass the same."""
        try:
            if self._prepared is None and not self._wants_norm():
                self.reduce_gradients()
                self.rank.commit(before_step=before_step, skip=skip)
                self.last_grad_norm = None
            else:
                norm = self.grad_norm()
                self.rank.commit(before_step=before_step, factor=self._prepared[1], skip=skip)
                self.last_grad_norm = norm
        finally:
            self._prepared = None
        self.last_lr = self.rank.last_lr

    def step(self, batches: Sequence[Batch], observer: Observer | None = None) -> torch.Tensor:
        loss = self.run_actions(batches, observer)
        self.commit()
        return loss

    def settle(self) -> None:
        """This rank's parameters and optimizer state up to date, for a reader outside the steps."""
        self.rank.settle()


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
