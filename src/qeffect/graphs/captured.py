"""Captured stage actions: every F / dI / dW of a chunk is a CUDA graph bound to a tape slot (chain).

`CapturedStageActions` keeps the checked protocol of `StageActions` (tape pool, effect token, cache
epoch, arena) and replaces only the physical action by a graph replay through the `GraphManager`
(stream-ordered: launched on the caller's stream, see `graphs/manager.py`). With `graph_slots` = K from
the schedule's liveness, microbatch m runs in a chain of `graphs.binding.graph_plan` (its class m % K,
split where a body still differs per microbatch): one F, dI and dW graph per chain, a number that stops
growing with M; without it, one chain per microbatch (3 x M graphs). A chain is tape pool slot
`slot_base + chain`: F refuses to bind a microbatch while the slot's previous generation is not fully
consumed, and every consumer presents its generation, so a premature reuse is rejected before it
touches the chain's buffers. Results a caller keeps past the chain's next replay (the loss, the input
gradient handed to the previous stage) are copied out when the chain serves several microbatches.

Capture, per chunk: all F graphs first, then all dI graphs, then all dW graphs (chains in order of their
first microbatch: Transformer Engine's FIFO of retained wgrad GEMMs drains in the order it filled). dI is
captured with `torch.autograd.grad(..., retain_graph=True)` over the autograd graph that F's capture
recorded (the make_graphed_callables technique), so every saved activation, the retained dW work (the FP8 operands
each linear stores in dI) and every output stay at fixed addresses for the life of the graphs. By default
each graph gets its own memory pool: with one shared pool a block freed inside one capture could be handed
to another graph's live output, and replaying the first in a different order than it was captured
(ZB-V reorders) would overwrite it. `graph_pools = "shared"` shares pools only among graphs whose replays
follow their capture order (`_pools`), and checks every replay against it (`manager.PoolCycle`). One
eager warm-up (F and dI of slot 0, on the graph stream) runs before the first capture so that libraries
initialize outside it; warm-up and capture execute the bodies for real, so the FP8 state is snapshotted
before and restored (in place, same addresses) after; caches, tokens and arena are rewritten by the first
replays.

The effect token's device update (one int64 buffer per chunk that every graph of the chunk increments in
place, so a replay copies no token in: stream order is the chain's order on the device), the
backends' amax/scale updates (te: batched, one fused kernel per
direction at the end of each F or dI, `fp8.te.batched_scaling_updates`) and the accumulation of
the non-matrix gradients (into fixed buffers that `.grad` is bound to after each dI replay) are inside
the graphs; copying gradients (copy path) runs eagerly between replays, on the caller stream. The first
stage's token table accumulates its gradient over the rows each microbatch touched
(`stage/embedding_grad.py`: the same bits as the dense accumulation).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from qeffect.config import GraphPools
from qeffect.contracts import Consumer, EffectToken, TapeRef, TapeViolation
from qeffect.contracts.arena import FoldMode
from qeffect.fp8.te import batched_scaling_updates
from qeffect.fp8.weight_cast import WeightCastTarget
from qeffect.graphs.binding import GraphPlan, chunk_plan
from qeffect.graphs.handoff import Handoff
from qeffect.graphs.manager import CapturedAction, GraphManager, PoolCycle
from qeffect.offload.group import OffloadGroup, OffloadManager
from qeffect.stage.accumulate import accumulate_into
from qeffect.stage.actions import (
    EXTRA,
    ForwardOut,
    InputGradOut,
    StageActions,
    WeightGradOut,
    input_grad_body,
    take_wgrad_work,
)
from qeffect.stage.embedding_grad import TokenEmbeddingGrad

if TYPE_CHECKING:  # given by the runtime above (`QEffectRank`); only its methods are called here
    from qeffect.runtime.lazy_rows import LazyRows

TOKEN_TABLE = "tok_emb.weight"


@dataclass
class SlotGraphs:
    F: CapturedAction
    dI: CapturedAction | None = None
    dW: CapturedAction | None = None


@dataclass
class CapturedStageActions(StageActions):
    """Graph-replayed F / dI / dW for one chunk (`direct` selects direct placement or copied gradients)."""

    manager: GraphManager | None = None
    input_shape: tuple[int, ...] = ()
    input_dtype: torch.dtype = torch.float32
    slots: dict[int, SlotGraphs] = field(default_factory=dict)
    offload: OffloadManager | None = None  # saved activations of each slot's F in a fixed-VA group
    groups: dict[int, OffloadGroup] = field(default_factory=dict)
    # fixed non-matrix gradient buffers the dI graphs accumulate into, and the next dI they expect
    _ngrad: dict[str, torch.Tensor] = field(default_factory=dict, repr=False)
    _chain_f: dict[int, CapturedAction] = field(default_factory=dict, repr=False)
    _di_next: int = 0
    # the first stage's token table: its gradient over the touched rows only (stage/embedding_grad.py)
    _token_grad: TokenEmbeddingGrad | None = None
    # given (by `QEffectRank`): makes the optimizer update the token table row-lazily over the rows
    # `_token_grad` records (`runtime.lazy_rows`); the F graphs then catch up their tokens' rows first
    lazy_rows: Callable[[torch.Tensor, torch.Tensor], LazyRows | None] | None = field(default=None, repr=False)
    _lazy: LazyRows | None = field(default=None, repr=False)
    # effect token on the device: one buffer per chunk, incremented in place by every graph (no copy per replay)
    _tok_buf: torch.Tensor | None = field(default=None, repr=False)
    # the optimizer casts the FP8 weight caches (`fp8.weight_cast`): slot 0's F graph takes them as they are
    weight_cast: bool = False
    weight_casts: list[WeightCastTarget] = field(default_factory=list)
    # K (`schedule.liveness.slots_for`): chains bounded by liveness; None: one chain per microbatch
    graph_slots: int | None = None
    # `runtime.graph_pools`: "private" (a pool per graph) or "shared" (`_pools`: pools whose replays follow
    # their capture order, each replay checked); the shared pools by kind ("F", "dI") or by chain
    graph_pools: GraphPools = "private"
    _cycles: dict[object, PoolCycle] = field(default_factory=dict, repr=False)
    slot_base: int = 0  # this chunk's chains are tape pool slots slot_base, slot_base + 1, ...
    plan: GraphPlan | None = None  # set by `prepare`; None (tests that fake the graphs): chain = microbatch
    # the first stage's token rows: microbatch m's index on the device (one dI graph records any m > 0);
    # `_mb` serves the warm-up, `_mb_chain` each chain's dI graph (one buffer per chain: with one chain per
    # microbatch, each buffer keeps its index and a replay copies nothing: `GraphManager.mark_constant`)
    _mb: torch.Tensor | None = field(default=None, repr=False)
    _mb_chain: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)
    _mb_views: list[torch.Tensor] = field(default_factory=list, repr=False)
    # per microbatch: the gated folds' mode values its dW replay copies in (empty: no fold in its graph)
    _dw_modes: list[dict[str, torch.Tensor]] = field(default_factory=list, repr=False)
    # one process: the buffers shared with the next stage (`send`) and the previous one (`recv`), given by
    # the builder before `prepare` (`graphs.handoff`); per microbatch whose chain is its own, on both sides
    send: Handoff | None = None
    recv: Handoff | None = None
    _send_act: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)  # m -> next F's input (view)
    _recv_act: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)  # m -> what F is handed
    _send_grad: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)  # m -> previous dI's input
    _recv_grad: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)  # m -> what dI is handed

    # ------------------------------------------------------------------------------------ capture
    def chain(self, m: int) -> int:
        """The chain (graphs and tape slot, relative to `slot_base`) microbatch `m` runs in."""
        return m if self.plan is None else self.plan.per_microbatch[m].chain

    def capture(self, microbatches: int, microbatch_size: int, seq_len: int) -> None:
        """Capture this chunk's graphs (see the module docstring for which ones and their order).

        With offload, the pipeline calls `prepare` on every chunk, allocates the offload manager
        (which needs every group discovered) and then `capture_graphs` (see `capture_ranks`)."""
        self.prepare(microbatches, microbatch_size, seq_len)
        self.capture_graphs()

    def prepare(self, microbatches: int, microbatch_size: int, seq_len: int) -> None:
        """Static inputs of every slot, the offload groups and the eager warm-up (which is discovery)."""
        assert self.manager is not None
        chunk, dev = self.chunk, next(self.chunk.parameters()).device
        first, last = chunk.stage == 0, chunk.stage == chunk.num_stages - 1
        self._saved = {k: v.detach().clone() for k, v in chunk.fp8_state().items()}
        self._microbatches = microbatches
        self._x: dict[int, torch.Tensor] = {}
        self._tgt: dict[int, torch.Tensor] = {}
        self._gout: dict[int, torch.Tensor] = {}
        # every graph of this chunk increments it in place: stream order is the chain's order on the device
        self._tok_buf = torch.zeros((), dtype=torch.int64, device=dev)
        self._out: dict[int, torch.Tensor] = {}
        self._work: dict[int, dict[str, object]] = {}  # chain -> retained work its dI capture queued
        self._token_out: dict[int, torch.Tensor] = {}
        if first and TOKEN_TABLE in self._nonmatrix:  # before warm-up: every F it runs or captures uses it
            chunk.sparse_token_grad = True
            self._token_grad = TokenEmbeddingGrad(self._nonmatrix[TOKEN_TABLE], microbatch_size * seq_len,
                                                  microbatches)
            if self.lazy_rows is not None:
                self._lazy = self.lazy_rows(self._nonmatrix[TOKEN_TABLE], self._token_grad.rows_all.view(-1))
            # the rank offers the row-lazy table only without data parallelism, whose reduction writes rows no
            # local token names: then only the dI graphs write the gradient, and a step clears the rows the
            # last one recorded, not the whole table
            self._token_grad.zero_rows_only = self._lazy is not None
        self.plan = self.plan_for(microbatches)
        # the gated folds' mode words (`contracts.arena.FoldMode`), one per staging depth, and the values a
        # dW replay copies in: which mode is the only fold detail that differs between a chain's microbatches
        depths = {self.arena.depth(n) for n in self._arena_names()} if self.direct and self.arena.staging else set()
        self._fold_mode = {g: torch.zeros((), dtype=torch.int32, device=dev) for g in sorted(depths)}
        modes = torch.tensor([FoldMode.SKIP, FoldMode.INIT, FoldMode.ADD], dtype=torch.int32, device=dev)
        self._mode_values = {int(v): modes[i] for i, v in enumerate((FoldMode.SKIP, FoldMode.INIT, FoldMode.ADD))}
        self._dw_modes = [{f"fold{g}": self._mode_values[self.arena.fold_mode(m, name)]
                           for g, name in self._live_folds(m).items()} for m in range(microbatches)]
        self.manager.mark_constant(*self._mode_values.values())  # a dW replay copies a mode only when it changes
        if self._token_grad is not None and not self._token_grad.signed_zeros:
            self._mb = torch.zeros(1, dtype=torch.int64, device=dev)
            values = torch.arange(microbatches, dtype=torch.int64, device=dev)
            self._mb_views = [values[m: m + 1] for m in range(microbatches)]
            self.manager.mark_constant(*self._mb_views)
        self._send_act, self._recv_act, self._send_grad, self._recv_grad = {}, {}, {}, {}
        for c, m in self.plan.chains.items():  # static buffers per chain, not per microbatch
            own = not self.plan.shared(m)  # the chain serves microbatch m only: a hand-off buffer may be its own
            if first:
                self._x[c] = torch.zeros((microbatch_size, seq_len), dtype=torch.int64, device=dev)
            elif self.recv is not None and own:  # the previous stage's F graph writes it
                self._x[c] = self.recv.act(m)
                self._recv_act[m] = self.recv.act_view(m)
            else:
                self._x[c] = torch.zeros(self.input_shape, dtype=self.input_dtype, device=dev, requires_grad=True)
            if self.send is not None and own:  # this stage's F and dI graphs of chain c meet the next stage's
                self._send_act[m] = self.send.act_view(m)
                self._recv_grad[m] = self.send.grad(m)
            if self.recv is not None and own:
                self._send_grad[m] = self.recv.grad(m)
            if last:
                self._tgt[c] = torch.zeros((microbatch_size, seq_len), dtype=torch.int64, device=dev)
            if self.offload is not None:  # a group per chain: its microbatches' saved tensors, one at a time
                name = f"s{self.stage}.m{c}" if len(self.plan.chains) == microbatches else f"s{self.stage}.c{c}"
                self.groups[c] = self.offload.group(name)
        self._warm_up(dev)

    def plan_for(self, microbatches: int) -> GraphPlan:
        """The chunk's chains for M microbatches: classes from `graph_slots`, split by what each body
        does differently per microbatch (the arena writes of a direct dW; the first stage's token rows
        when their +0.0 pass reads the rows of the microbatches before)."""
        token = self._token_grad
        names = self._arena_names()
        return chunk_plan(microbatches, self.graph_slots or microbatches,
                          signed_zeros=token is not None and token.signed_zeros,
                          write_signature=(lambda m: self.arena.write_signature(m, names)) if self.direct else None)

    def _arena_names(self) -> list[str]:
        """The arena names of this chunk's matrix parameters."""
        return list(self._arena_of.values())

    def _gated_folds(self, m: int) -> dict[int, str]:
        """Staging depth -> one parameter of that depth, for each gated fold that dW(m)'s graph holds (a
        direct dW that ends a staging group: `GradientArena.fold_count`)."""
        out: dict[int, str] = {}
        for name in self._arena_names() if self.direct else ():
            if self.arena.fold_count(m, name):
                out.setdefault(self.arena.depth(name), name)
        return out

    def _live_folds(self, m: int) -> dict[int, str]:
        """The gated folds dW(m)'s graph holds: those of `_gated_folds` that some microbatch of its chain runs
        (not SKIP). A fold every one of them skips (the deferred last group, where the last microbatch has a
        chain of its own) is left out of the graph: its kernel would launch every step to do nothing."""
        members = [m] if self.plan is None else [k for k, g in enumerate(self.plan.per_microbatch)
                                                 if g.chain == self.chain(m)]
        return {g: name for g, name in self._gated_folds(m).items()
                if any(self.arena.fold_mode(k, name) != FoldMode.SKIP for k in members)}

    def _f_body(self, c: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Chain `c`'s forward (its first microbatch is `c`; only chain 0 refreshes the weight cache)."""
        if self._lazy is not None:  # the rows the lookup reads, up to the optimizer's last step
            self._lazy.catch_up(self._x[c])
        with batched_scaling_updates():  # te: one scaling-update kernel per F graph, not one per linear
            out = self.chunk(self._x[c], is_first_microbatch=(c == 0), targets=self._tgt.get(c))
        self._out[c] = out
        if self._token_grad is not None:
            self._token_out[c] = self.chunk.token_out
        return out, self._next_token()

    def _f_send(self, c: int, send: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Chain `c`'s captured forward; with `send`, its output also written into the next stage's F input
        (`graphs.handoff`)."""
        out, token = self._f_body(c)
        if send is not None:
            self.send.check("F's output", out)
            with torch.no_grad():
                send.copy_(out)
        return out, token

    def _next_token(self) -> torch.Tensor:
        """Inside a graph body: the next token's device value (in place on the chunk's buffer)."""
        return self._tok_buf.add_(1)

    def _pools(self, kind: str, c: int) -> dict[str, object]:
        """How chain c's F or dI graph gets its memory pool (`manager.capture`'s keywords).

        Shared, one chain per microbatch: the chunk's F graphs share a pool, and so do its dI graphs. Each
        replays once a step, in microbatch order (F by the schedule, dI checked at every dI), so what one
        keeps live (saved activations, retained dW work) is consumed within the step, before the earlier
        graphs of its pool run again. Shared, chains serving several microbatches: a pool per chain for its
        F and dI, whose cycle is one microbatch: the chain's F runs again only once its tape slot is free,
        after its dW consumed what F and dI left. dW graphs keep private pools: a schedule may run them out
        of microbatch order, and they write the arena, outside any pool."""
        if self.graph_pools != "shared":
            return {"private_pool": True}
        key: object = kind if len(self.plan.chains) == self._microbatches else c
        cycle = self._cycles.get(key)
        if cycle is None:
            name = f"s{self.stage}.{kind}" if isinstance(key, str) else f"s{self.stage}.chain{c}"
            cycle = self._cycles[key] = self.manager.pool_cycle(name)
        return {"cycle": cycle}

    def _slot_mapped(self, c: int):
        """While a capture of chain `c` reads its offload group's slot: the slot mapped (`mapped_for_capture`)."""
        return self.groups[c].mapped_for_capture() if c in self.groups else contextlib.nullcontext()

    def capture_graphs(self) -> None:
        """Capture every slot's F, then dI, then dW; restore the FP8 state that warm-up moved."""
        chunk, dev = self.chunk, next(self.chunk.parameters()).device
        tag = f"s{self.stage}"
        self._cycles = {}
        if self.weight_cast:  # after the warm-up, which made TE build each cache
            self.weight_casts = [lin.weight_cast_target(name) for name, lin in self._matrix.items()
                                 if hasattr(lin, "weight_cast_target")]
            for t in self.weight_casts:
                t.captured = True
        plan = self.plan
        for c in plan.chains:
            inputs = {"x": self._x[c]}
            if c in self._tgt:
                inputs["targets"] = self._tgt[c]
            hooks = self.groups[c].capture_hooks() if c in self.groups else contextlib.nullcontext()
            send = self._send_act.get(plan.chains[c])
            with hooks:  # offload: the tensors F saves for backward are copied into the group's fixed slot
                f = self.manager.capture(f"{tag}.F{c}", lambda c=c, send=send: self._f_send(c, send),
                                         static_inputs=inputs, warmup=0, **self._pools("F", c))
            self._chain_f[c] = f
        # The non-matrix gradients accumulate into fixed buffers inside the dI graphs (no eager kernel
        # launches per dI); `.grad` is bound to them after each replay. Valid because a stage runs dI in
        # microbatch order (checked at every dI).
        self._ngrad = {n: (self._token_grad.grad if n == TOKEN_TABLE and self._token_grad is not None
                           else torch.zeros_like(p)) for n, p in self._nonmatrix.items()}
        for c, m in plan.chains.items():
            out = self._out[c]
            if m in self._recv_grad:  # the next stage's dI graph writes it (the warm-up's buffer is let go)
                self._gout[c] = self._recv_grad[m]
            elif c not in self._gout:
                self._gout[c] = torch.zeros(out.shape, dtype=out.dtype, device=dev)
        graphs_di: dict[int, CapturedAction] = {}
        for c, m in plan.chains.items():  # m: the chain's first microbatch, whose bodies it captures

            def di_body(c: int = c, m: int = m) -> tuple:
                with batched_scaling_updates():  # te: one scaling-update kernel per dI graph
                    grad_in, grads = input_grad_body(chunk, self._x[c], self._out[c], self._gout[c],
                                                     retain_graph=True, extra=self._token_out.get(c))
                self._work[c] = take_wgrad_work(self._matrix)
                with torch.no_grad():  # AccumulateGrad's bits, inside the graph: dI(0) copies, later dIs add
                    token_grad = grads.pop(EXTRA, None)  # (several tensors per launch: stage/accumulate.py)
                    accumulate_into([self._ngrad[n] for n in grads], list(grads.values()), init=m == 0)
                    if token_grad is not None:  # the same bits from the rows this microbatch touched
                        # the rows of whichever microbatch replays it; with the +0.0 pass each microbatch
                        # has a dI graph of its own (`graph_plan`'s variant), which records its own rows
                        index = self._mb_chain[c] if self._mb is not None and m > 0 else None
                        grads[TOKEN_TABLE] = self._token_grad.accumulate(m, self._x[c], token_grad, index=index)
                    send = self._send_grad.get(m)
                    if send is not None:  # into the previous stage's dI input (`graphs.handoff`)
                        self.recv.check("dI's input gradient", grad_in)
                        send.copy_(grad_in)
                return grad_in, grads, self._next_token()

            inputs = {"grad": self._gout[c]}
            if self._mb is not None and m > 0:
                inputs["mb"] = self._mb_chain[c] = torch.zeros(1, dtype=torch.int64, device=dev)
            with self._slot_mapped(c):  # offload: the saved tensors dI reads
                graphs_di[c] = self.manager.capture(f"{tag}.dI{c}", di_body, static_inputs=inputs,
                                                    warmup=0, **self._pools("dI", c))
        written = [sorted(g.outputs[1]) for g in graphs_di.values()]
        if any(w != written[0] for w in written):  # dI(0) copies what later dIs add to: the same set each
            raise RuntimeError(f"stage {self.stage}: the captured dI graphs write different non-matrix gradients "
                               f"per microbatch ({written}); in-graph accumulation needs the same set")
        graphs_dw: dict[int, CapturedAction] = {}
        for c, m in plan.chains.items():  # the order the dI captures queued the retained work (a FIFO in te)

            live = self._live_folds(m)

            def dw_body(c: int = c, m: int = m, live: dict[int, str] = live) -> tuple:
                grads = {}
                for name, lin in self._matrix.items():
                    pname = self._matrix_param[name]
                    if self.direct:
                        aname = self._arena_of[pname]
                        grads[pname] = lin.compute_wgrad(self._work[c][name], out=self._view(name, m),
                                                         accumulate=not self.arena.overwrites(m))
                        depth = self.arena.depth(aname)
                        if depth in live:  # the group's fold (`_live_folds`), its mode read at replay
                            self.arena.flush_gated(aname, m, self._fold_mode[depth])
                    else:
                        grads[pname] = lin.compute_wgrad(self._work[c][name])
                return grads, self._next_token()

            folds = {f"fold{g}": self._fold_mode[g] for g in live}
            with self._slot_mapped(c):  # offload: the saved tensors the retained work reads
                graphs_dw[c] = self.manager.capture(f"{tag}.dW{c}", dw_body, static_inputs=folds,
                                                    warmup=0, private_pool=True)
        for m, g in enumerate(plan.per_microbatch):  # what each microbatch replays (shared within a chain)
            self.slots[m] = SlotGraphs(F=self._chain_f[g.chain], dI=graphs_di[g.chain], dW=graphs_dw[g.chain])
        saved = self._saved
        with torch.no_grad():
            for k, v in chunk.fp8_state().items():
                if k in saved:
                    v.copy_(saved[k])
                elif "amax" in k:  # created lazily by the capture itself (te): back to its fresh value
                    v.zero_()
                elif "scale" in k:
                    v.fill_(1.0)
                else:
                    raise RuntimeError(f"{k}: FP8 state created during capture with no known fresh value")
        del self._saved
        if self._tok_buf is not None:  # warm-up's F moved it: the device chain starts at the ledger's seq 0
            self._tok_buf.zero_()
        self.manager.backend.synchronize()

    def _warm_up(self, dev: torch.device) -> None:
        """One eager F and dI of slot 0 on the graph stream before any capture: libraries initialize
        lazily (cuBLAS/cuBLASLt handles, FP8 GEMM and attention kernels, Transformer Engine's weight
        workspace), and doing that inside a capture is an error. The FP8 state this moves is restored
        with the rest after capture; retained dW work it leaves in a backend's queue is discarded.

        With offload, discovery follows: every slot's F is captured once more into a throwaway graph
        (nothing runs, so no state moves) under its group's discovery hooks, after the warm-up so that
        libraries are in their steady state. Under capture rather than eagerly, because some ops save
        other tensors when captured (SDPA's RNG seed and offset live on the device then); per slot,
        because slot 0 refreshes the weight cache and the others read it."""
        stream = self.manager.stream
        be = self.manager.backend  # the device's streams (a fake backend runs this on a CPU)
        stream.wait_stream(be.current_stream())
        with be.use_stream(stream):
            out, _ = self._f_body(0)
            self._gout[0] = torch.zeros(out.shape, dtype=out.dtype, device=dev)
            _, grads = input_grad_body(self.chunk, self._x[0], out, self._gout[0], retain_graph=False,
                                       extra=self._token_out.get(0))
            with torch.no_grad():  # the batched accumulation's kernels (compiled now, never inside a capture)
                rest = {n: g for n, g in grads.items() if n != EXTRA}
                scratch = [torch.zeros_like(self._nonmatrix[n]) for n in rest]
                accumulate_into(scratch, list(rest.values()), init=True)
                accumulate_into(scratch, list(rest.values()), init=False)
                del scratch, rest
            if self._token_grad is not None:  # its kernels too (the first dI of every step rewrites it)
                with torch.no_grad():
                    self._token_grad.accumulate(0, self._x[0], grads[EXTRA])
                    later = 1 % self._microbatches
                    self._token_grad.accumulate(later, self._x[0], grads[EXTRA],
                                                index=self._mb if later else None)
            take_wgrad_work(self._matrix)
            for lin in self._matrix.values():
                if hasattr(lin, "discard_wgrad_work"):
                    lin.discard_wgrad_work()
            # every gated fold the dW graphs will capture, once: a JIT kernel (Triton) compiles and loads
            # its module on first launch, which must not happen inside a capture. SKIP: nothing is written.
            skip = self._mode_values[FoldMode.SKIP]
            for m in range(self._microbatches):
                for g in self._live_folds(m):  # the folds the graphs hold (a lazy-region arena has none)
                    self._fold_mode[g].copy_(skip)
                    for aname in self._arena_names():
                        if self.arena.depth(aname) == g:
                            self.arena.flush_gated(aname, m, self._fold_mode[g])
            del out
            self._out.clear()
            for c in self.groups:  # every chain's group
                with self._discovery(c):  # under a throwaway capture: the real capture must see the same
                    self.manager.dry_capture(lambda c=c: self._f_body(c))
                self._out.clear()  # drop the autograd graph and what it saved
        be.current_stream().wait_stream(stream)
        self._out.clear()
        self._token_out.clear()

    def _discovery(self, m: int):
        return self.groups[m].discovery_hooks() if m in self.groups else contextlib.nullcontext()

    # ------------------------------------------------------------------------------------ actions
    def forward(self, m: int, inp: torch.Tensor, token: EffectToken,
                targets: torch.Tensor | None = None) -> ForwardOut:
        key = self.key(m)
        graphs = self.slots[m]
        chain = self.chain(m)
        self.ledger.check(token, f"F{m}")  # before any other effect: a refused F leaves none
        # the chain's buffers hold its previous tape until that tape's dW ran: refuse before any effect
        self.pool.check_slot_free(self.slot_base + chain, key)
        if m == 0:  # a new step (after an aborted one too): its dIs start again at microbatch 0
            self._di_next = 0
            for cycle in self._cycles.values():  # and its shared pools' cycles (`_pools`)
                cycle.restart()
        refresh = self.cache.check_forward(self.clock, first_microbatch=(m == 0))
        if refresh != (m == 0):  # the slot-0 graph is the one that refreshes the weight cache
            raise RuntimeError(f"stage {self.stage}: cache refresh on microbatch {m} is not captured")
        out, tok = graphs.F.outputs
        token = self.ledger.consume(token, f"F{m}", value=tok, checked=True)  # checked above
        ref = self.pool.allocate(key, slot=self.slot_base + chain)
        # handed the buffer the previous stage's F graph wrote, which is this graph's own input: no copy
        dynamic = {} if inp is self._recv_act.get(m) else {"x": inp}
        if targets is not None:
            dynamic["targets"] = targets
        group = self.groups.get(chain)
        if group is not None and (group.live or group.phase is not None):
            group.abandon()  # the pool gave this slot a new tape: the old one was aborted with its step

        def run() -> None:
            if group is not None:
                group.before_forward()
            self.manager.replay(graphs.F, dynamic)
            if group is not None:
                group.after_forward()  # D2H on the copy stream; release mode: unmap

        self.on_tape(ref, run)
        self.pool.resolve(ref, key).payload.update(slot=m, chain=chain)
        if self.chunk.stage == self.chunk.num_stages - 1 and self._shared(m):
            # the loss is kept to the end of the step, and a later microbatch of the chain rewrites it
            out = self.manager.step_tensor((self.stage, m, "loss"), out.clone)
        sent = self._send_act.get(m)
        return ForwardOut(out.detach() if sent is None else sent, ref, token)

    def _shared(self, m: int) -> bool:
        """Whether microbatch m's graphs also serve another microbatch of the step (bounded chains)."""
        return self.plan is not None and self.plan.shared(m)

    def _check_chain(self, m: int, ref: TapeRef) -> None:
        """The graphs of microbatch m read tape slot `slot_base + chain(m)`: a reference to another slot
        cannot be the tape those buffers hold."""
        slot = self.slot_base + self.chain(m)
        if ref.slot != slot:
            raise TapeViolation.build("tape outside its chain", key=ref.key, expected=f"slot {slot}",
                                      found=f"slot {ref.slot}", note=f"stage {self.stage}")

    def input_grad(self, m: int, ref: TapeRef, grad_output: torch.Tensor, token: EffectToken) -> InputGradOut:
        key = self.key(m)
        self.pool.check_consumer(ref, key, Consumer.DI)
        self._check_chain(m, ref)
        if m != self._di_next:  # the dI graphs copy at m = 0 and add after: only microbatch order is right
            raise RuntimeError(f"stage {self.stage}: captured dI accumulates non-matrix gradients in microbatch "
                               f"order: expected dI({self._di_next}), got dI({m})")
        graphs = self.slots[m]
        grad_in, grads, tok = graphs.dI.outputs
        token = self.ledger.consume(token, f"dI{m}", value=tok)
        group = self.groups.get(self.chain(m))
        # handed the buffer the next stage's dI graph wrote, which is this graph's own input: no copy
        dynamic = {} if grad_output is self._recv_grad.get(m) else {"grad": grad_output}
        if self._mb is not None and m > 0:  # the token rows' microbatch index (`graph_plan`)
            dynamic["mb"] = self._mb_views[m]

        def run() -> None:
            if group is not None:
                group.before_backward()  # restore (remap + H2D) unless look-ahead did; then look ahead
            self.manager.replay(graphs.dI, dynamic)
            if group is not None:
                group.backward_launched()  # launch-first: reaps and look-ahead restores now, beside the replay
            for n in grads:  # the parameters this dI's graph wrote (allow_unused may leave some out)
                buf, p = self._ngrad[n], self._nonmatrix[n]
                if p.grad is not buf:
                    p.grad = buf

        self.on_tape(ref, run, Consumer.DI)
        self._di_next = (m + 1) % len(self.slots)
        if grad_in is not None and self._shared(m):
            # the previous stage's dI(m) may run after this chain's next replay rewrote the buffer
            grad_in = self.manager.step_tensor((self.stage, m, "grad_in"), grad_in.clone)
        grad_in = self._send_grad.get(m, grad_in)  # the graph wrote it into the previous stage's buffer too
        return InputGradOut(grad_in, self.nonmatrix_grads(), token)

    def weight_grad(self, m: int, ref: TapeRef, token: EffectToken) -> WeightGradOut:
        key = self.key(m)
        self.pool.check_consumer(ref, key, Consumer.DW)
        self._check_chain(m, ref)
        graphs = self.slots[m]
        grads, tok = graphs.dW.outputs
        # before the token moves and the replay writes: the destinations captured into a direct graph must be
        # the arena's views (data_ptr too); the copy path's views are checked as the eager dW checks them
        self.checked_destinations(m, grads if self.direct else None)
        token = self.ledger.consume(token, f"dW{m}", value=tok)

        group = self.groups.get(self.chain(m))

        def run() -> None:  # with the gated folds' modes of m (the graph folds every group of its slot)
            self.manager.replay(graphs.dW, self._dw_modes[m] if self._dw_modes else {})
            if group is not None:  # dW is the last reader: the retained dW work references saved tensors
                group.after_backward()
            if self.direct:  # `checked_destinations` ran every check of these writes before the replay
                for pname in grads:
                    self.arena.record_checked(self._arena_of[pname], m)

        self.on_tape(ref, run, Consumer.DW)
        return WeightGradOut(grads, token)
