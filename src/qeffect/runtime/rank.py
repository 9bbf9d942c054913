"""One pipeline rank: its chunks, its program, its contract objects and its optimizer commit.

`QEffectRank` runs the checked split actions (F, dI, dW) through the contracts; `NativeRank` runs the
native eager reference (F and full backward B). Both take their inputs from a `Transport` and run one
action at a time, so the same classes serve the single-process executor (all ranks in one global order)
and the torch.distributed executor (one rank per process).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from qeffect.config import GraphPools, OptimConfig
from qeffect.contracts import CommitBarrier, EpochClock, GradientArena, ReductionTracker, TapePool
from qeffect.graphs.captured import CapturedStageActions
from qeffect.graphs.manager import GraphManager
from qeffect.offload.group import OffloadManager
from qeffect.runtime.adamw import TritonAdamW
from qeffect.runtime.recipe import Recipe, scale_gradients, stage_square_sum
from qeffect.runtime.transport import Transport
from qeffect.schedule import Action, ActionKind
from qeffect.stage.accumulate import fold_staged, fold_staged_gated
from qeffect.stage.actions import StageActions, arena_name
from qeffect.stage.native import NativeStage

Batch = tuple[torch.Tensor, torch.Tensor]  # (input ids, targets) of one microbatch
Observer = Callable[[Action, "BaseRank"], None]


def mean_loss(losses: Sequence[torch.Tensor]) -> torch.Tensor:
    """The step loss: the microbatch losses summed in microbatch order, over their count."""
    total = losses[0].clone()
    for loss in losses[1:]:
        total += loss
    return total / len(losses)


def make_optimizer(params: list[torch.nn.Parameter], cfg: OptimConfig, *, triton: bool = False) -> torch.optim.Optimizer:
    """torch's fused AdamW (native eager, the TE anchor), or with `triton` its Triton form (qeffect's
    runtimes): the same arithmetic and state, so native and qeffect runs stay bitwise comparable.

    fused=True: one multi-tensor kernel per step instead of ~10 per parameter (the single-tensor loop's
    launches and memory passes were a visible part of a captured step). `TritonAdamW` moves the same
    bytes faster on large tensors (`benchmarks/results/adamw-ab-h4096-h200.json`) and also folds the
    deferred staged gradients and casts the FP8 weights in its pass."""
    kwargs = dict(lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps, weight_decay=cfg.weight_decay)
    if triton:
        return TritonAdamW(params, **kwargs)
    return torch.optim.AdamW(params, fused=True, **kwargs)


class BaseRank:
    """Shared by both runtimes: chunk ownership, loss seed, data routing, optimizer."""

    triton_optimizer = False  # `make_optimizer(triton=...)`: qeffect's ranks take the Triton AdamW

    def __init__(self, rank: int, chunks: dict[int, torch.nn.Module], num_stages: int, microbatches: int,
                 optim: OptimConfig, *, total_steps: int | None = None) -> None:
        self.rank = rank
        self.chunks = dict(sorted(chunks.items()))
        self.num_stages = num_stages
        self.microbatches = microbatches
        params = [p for c in self.chunks.values() for p in c.parameters()]
        self.optimizer = make_optimizer(params, optim, triton=self.triton_optimizer)
        if total_steps is None and optim.schedule != "constant" and not optim.decay_steps:
            raise ValueError(f"optim.schedule = {optim.schedule} decays until the run's last step: give the "
                             "rank total_steps (train.steps) or set optim.decay_steps")
        # the learning-rate schedule and clipping (`runtime.recipe`); the commit applies them
        self.recipe = Recipe(optim, total_steps or 0)
        self.last_lr: float | None = None  # the learning rate of the last commit
        self.step_index = 0
        self.losses: dict[int, torch.Tensor] = {}
        self._seeds: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}  # `loss_seed`, made once
        self.last_output: torch.Tensor | None = None

    def gradient(self, param: torch.Tensor) -> torch.Tensor | None:
        """The gradient the commit's AdamW step uses for `param`, for a `before_step` hook: `.grad`, or,
        where the Triton AdamW will finish a deferred staged fold, a new tensor with it finished."""
        if isinstance(self.optimizer, TritonAdamW):
            return self.optimizer.gradient(param)
        return param.grad

    def loss_seed(self, like: torch.Tensor) -> torch.Tensor:
        """d(step loss)/d(microbatch loss): the step loss is the mean of the microbatch losses. One tensor
        per dtype and device, made at its first use and only ever read (a backward does not write its
        incoming gradient): the host saves a fill per last-stage dI."""
        key = (like.dtype, like.device)
        seed = self._seeds.get(key)
        if seed is None:
            seed = torch.full((), 1.0 / self.microbatches, dtype=like.dtype, device=like.device)
            if not (like.is_cuda and torch.cuda.is_current_stream_capturing()):  # a captured fill runs only on replay
                self._seeds[key] = seed
                self._constant_made(seed)
        return seed

    def _constant_made(self, tensor: torch.Tensor) -> None:
        """`tensor` is made once and only ever read from now on (a loss seed)."""

    def cast_stale_weights(self) -> None:
        """Cast every FP8 weight cache that is not fresh now, as each stage's first F does: a step graph
        launched before its bookkeeping reads the caches before that F's bookkeeping runs. Nothing to do
        without cached casts."""

    def _input(self, stage: int, m: int, batches: Sequence[Batch], transport: Transport) -> torch.Tensor:
        return batches[m][0] if stage == 0 else transport.get("act", stage - 1, m)

    def _targets(self, stage: int, m: int, batches: Sequence[Batch]) -> torch.Tensor | None:
        return batches[m][1] if stage == self.num_stages - 1 else None

    def _publish_forward(self, stage: int, m: int, out: torch.Tensor, transport: Transport) -> None:
        self.last_output = out
        if stage == self.num_stages - 1:
            self.losses[m] = out
        else:
            transport.put("act", stage, m, out)

    def _grad_output(self, stage: int, m: int, transport: Transport) -> torch.Tensor:
        if stage == self.num_stages - 1:
            return self.loss_seed(self.losses[m])
        return transport.get("grad", stage + 1, m)

    def step_loss(self) -> torch.Tensor | None:
        """Mean microbatch loss, summed in microbatch order (None on ranks without the last stage)."""
        return self.step_loss_of_losses()()

    def step_loss_of_losses(self) -> Callable[[], torch.Tensor | None]:
        """`step_loss` bound to this step's microbatch loss tensors: the loss of whatever they hold when it is
        called, not of the rank's state then (a step graph's replay recomputes it from the same tensors)."""
        if not self.losses:
            return lambda: None
        losses = [self.losses[m] for m in range(self.microbatches)]
        return lambda: mean_loss(losses)

    def fp8_state(self, stage: int) -> dict[str, torch.Tensor]:
        return self.chunks[stage].fp8_state()

    def settle(self) -> None:
        """Bring every parameter and optimizer state up to date before anything outside the step reads
        them (a row-lazy token table: `runtime.lazy_rows`); nothing to do elsewhere."""
        if isinstance(self.optimizer, TritonAdamW):
            self.optimizer.settle()

    def state_loaded(self) -> None:
        """The parameters and optimizer state were written in place (a checkpoint load): a row-lazy
        token table counts every row current at the loaded step."""
        if isinstance(self.optimizer, TritonAdamW):
            self.optimizer.reset_lazy()

    def _set_lr(self) -> float:
        """Put the schedule's learning rate of the step being committed (`step_index + 1`) into every
        parameter group; the default recipe puts back `optim.lr`, the value the groups were built with."""
        lr = self.recipe.lr(self.step_index + 1)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        self.last_lr = lr
        return lr

    def _owned_grads(self) -> list[torch.Tensor]:
        return [p.grad for c in self.chunks.values() for p in c.parameters() if p.grad is not None]

    def gradient_square_sums(self) -> dict[int, torch.Tensor]:
        """Per owned stage, the sum of its gradients' squared norms (`recipe.stage_square_sum`): the
        gradients as the commit will use them, every one complete (before clipping)."""
        self.prepare_gradients()
        return {s: stage_square_sum((n, p.grad) for n, p in c.named_parameters()) for s, c in self.chunks.items()}

    def prepare_gradients(self) -> None:
        """Make every `.grad` the complete gradient of the step (nothing left for the optimizer to fold)
        before a global norm reads it; nothing to do for the native reference."""

    def _apply_factor(self, factor: torch.Tensor | None) -> None:
        if factor is not None:
            scale_gradients(self._owned_grads(), factor)
        elif self.recipe.clip > 0:
            raise RuntimeError("optim.clip_grad_norm: the commit needs the clip factor of the global gradient "
                               "norm (commit through the pipeline, which reduces it over every stage)")


class NativeRank(BaseRank):
    """The native eager reference for one rank (F and full backward B)."""

    def __init__(self, rank: int, chunks: dict[int, torch.nn.Module], num_stages: int, microbatches: int,
                 optim: OptimConfig, *, total_steps: int | None = None) -> None:
        super().__init__(rank, chunks, num_stages, microbatches, optim, total_steps=total_steps)
        self.stages = {s: NativeStage(c) for s, c in self.chunks.items()}
        self.grad_input: torch.Tensor | None = None

    def run(self, action: Action, batches: Sequence[Batch], transport: Transport) -> None:
        s, m = action.stage, action.microbatch
        st = self.stages[s]
        if action.kind is ActionKind.F:
            out = st.forward(m, self._input(s, m, batches, transport), self._targets(s, m, batches))
            self._publish_forward(s, m, out, transport)
        elif action.kind is ActionKind.B:
            self.grad_input = st.backward(m, self._grad_output(s, m, transport))
            if s > 0:
                transport.put("grad", s, m, self.grad_input)
        else:
            raise ValueError(f"the native reference runs F and B only, got {action}")

    def commit(self, before_step: Callable[[], None] | None = None, *, factor: torch.Tensor | None = None,
               skip: bool = False) -> None:
        """The optimizer step at the schedule's learning rate, on gradients multiplied by the clip
        `factor` (with clipping on: the pipeline's, from the global norm). `skip`: no optimizer step (the
        parameters and AdamW state stay; the FP8 state keeps what the step's actions did); the step counts."""
        self._set_lr()
        if not skip:
            self._apply_factor(factor)
            if before_step is not None:  # the gradients AdamW is about to use are in .grad now (`gradient`)
                before_step()
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.losses.clear()
        self.step_index += 1


class QEffectRank(BaseRank):
    """Checked split actions for one rank, with its tape pool, epoch clock, gradient arena and barrier."""

    triton_optimizer = True

    def __init__(self, rank: int, chunks: dict[int, torch.nn.Module], num_stages: int, microbatches: int,
                 optim: OptimConfig, *, direct: bool = True, tape_capacity: int | None = None,
                 reductions: ReductionTracker | None = None, fixed_order_sum: bool = True,
                 manager: GraphManager | None = None, activation: tuple[tuple[int, ...], torch.dtype] | None = None,
                 offload: OffloadManager | None = None, accumulate: bool = False, staging: int | dict[int, int] = 0,
                 total_steps: int | None = None, graph_slots: dict[int, int] | None = None,
                 graph_pools: GraphPools = "private") -> None:
        super().__init__(rank, chunks, num_stages, microbatches, optim, total_steps=total_steps)
        # captured: the token table's AdamW row-lazy (`runtime.lazy_rows`); off under data parallelism (set
        # before capture: the replicas' reduced table gradient is dense)
        self.lazy_token_rows = True
        device = next(next(iter(self.chunks.values())).parameters()).device
        for chunk in self.chunks.values():  # TE's biases cast once per step, not per call
            if hasattr(chunk, "use_activation_biases"):
                chunk.use_activation_biases()
        self.clock = EpochClock()
        # captured: chunk i's chains are pool slots i * M + chain (`graphs.binding`: at most M chains, fewer
        # with `graph_slots`, K per stage from the schedule's liveness); the pool's slots are bookkeeping only
        self.pool = TapePool(tape_capacity or len(self.chunks) * microbatches, name=f"rank{rank}.tapes")
        specs: dict[str, tuple[tuple[int, ...], torch.dtype]] = {}
        staging_dtypes: dict[str, torch.dtype] = {}
        depths: dict[str, int] = {}
        for s, chunk in self.chunks.items():
            for lname, lin in chunk.matrix_linears().items():
                p, name = lin.weight, arena_name(s, f"{lname}.weight")
                specs[name] = (tuple(p.shape), p.dtype)
                depths[name] = staging[s] if isinstance(staging, dict) else staging
                # direct placement: the slot is the wgrad GEMM's own output buffer, in its dtype; copied
                # gradients arrive in the parameter's dtype and are staged in it (an exact copy always)
                act = activation[1] if activation is not None else p.dtype
                staging_dtypes[name] = lin.wgrad_dtype(act) if direct else p.dtype
                if getattr(lin, "needs_main_grad", False):  # fused accumulation: each dW names its destination
                    lin.bind_main_grad(None)
        self.arena = GradientArena(specs, microbatches, device=device, name=f"rank{rank}.arena",
                                   accumulate=accumulate, staging=depths if accumulate else 0,
                                   staging_dtypes=staging_dtypes, reduce=fold_staged, reduce_gated=fold_staged_gated,
                                   defer_last_fold=True)  # the commit's AdamW folds the last group
        self.reductions = reductions or ReductionTracker()
        self.barrier = CommitBarrier(self.clock, [self.pool], [self.arena], self.reductions)
        if manager is None:
            self.actions = {
                s: StageActions(c, self.pool, self.clock, self.arena, direct=direct) for s, c in self.chunks.items()
            }
        else:  # captured: the same checked protocol, graph replays as the physical actions
            shape, dtype = activation
            cast = isinstance(self.optimizer, TritonAdamW)  # the optimizer's pass casts the FP8 weights
            self.actions = {
                s: CapturedStageActions(c, self.pool, self.clock, self.arena, direct=direct, manager=manager,
                                        input_shape=shape, input_dtype=dtype, offload=offload, weight_cast=cast,
                                        lazy_rows=self._lazy_rows, slot_base=i * microbatches,
                                        graph_slots=(graph_slots or {}).get(s), graph_pools=graph_pools)
                for i, (s, c) in enumerate(self.chunks.items())
            }
        self.manager = manager
        if manager is not None and isinstance(self.optimizer, TritonAdamW):
            self.optimizer.use_graph()  # captured: the optimizer step replays from a graph too
            if self.recipe.varies:  # the graph reads each step's learning rate from the device
                self.optimizer.use_tensor_lr()
        self._grads_ready = False  # `prepare_gradients` loaded this step's gradients (a global norm)
        self.tokens = {s: a.ledger.current for s, a in self.actions.items()}
        self.refs: dict[tuple[int, int], object] = {}
        self.direct = direct
        self.fixed_order_sum = fixed_order_sum
        self.dw_order: dict[int, list[int]] = {s: [] for s in self.chunks}
        self.grad_input: torch.Tensor | None = None

    def cast_stale_weights(self) -> None:
        for act in self.actions.values():
            casts = getattr(act, "weight_casts", None)
            if casts:
                self.optimizer.cast_now(casts)

    def _constant_made(self, tensor: torch.Tensor) -> None:
        if self.manager is not None:  # a last-stage dI replay then copies the seed only once
            self.manager.mark_constant(tensor)

    def _lazy_rows(self, table: torch.Tensor, rows: torch.Tensor):
        """The optimizer's row-lazy state of `table` over `rows`, or None where it does not apply."""
        from qeffect.runtime import lazy_rows

        per_microbatch = rows.numel() // self.microbatches  # what each F's catch-up takes
        if (self.lazy_token_rows and isinstance(self.optimizer, TritonAdamW) and lazy_rows.available(table)
                and per_microbatch <= lazy_rows.MAX_TOKENS):
            return self.optimizer.lazy_rows(table, rows)
        return None

    def run(self, action: Action, batches: Sequence[Batch], transport: Transport) -> None:
        s, m = action.stage, action.microbatch
        act = self.actions[s]
        if action.kind is ActionKind.F:
            casts = getattr(act, "weight_casts", None) if m == 0 else None
            if casts:  # the slot-0 graph takes the caches as they are: cast stale ones (first step, resume)
                self.optimizer.cast_now(casts)  # registers new targets: each later step casts them
            out = act.forward(m, self._input(s, m, batches, transport), self.tokens[s], self._targets(s, m, batches))
            for t in casts or ():
                t.mark_consumed()
            self.tokens[s] = out.token
            self.refs[(s, m)] = out.ref
            self._publish_forward(s, m, out.output, transport)
        elif action.kind is ActionKind.DI:
            res = act.input_grad(m, self.refs[(s, m)], self._grad_output(s, m, transport), self.tokens[s])
            self.tokens[s] = res.token
            self.grad_input = res.grad_input
            if s > 0:
                transport.put("grad", s, m, res.grad_input)
        elif action.kind is ActionKind.DW:
            res = act.weight_grad(m, self.refs.pop((s, m)), self.tokens[s])
            self.tokens[s] = res.token
            if not self.direct:
                act.place_copies(m, res.grads)
            self.dw_order[s].append(m)
        else:
            raise ValueError(f"qeffect runs F, dI and dW, got {action}")

    def capture(self, microbatch_size: int, seq_len: int) -> None:
        """Capture every action of every owned chunk (captured mode only, no offload: with offload the
        pipeline prepares every chunk, allocates the groups, then captures; see `capture_ranks`)."""
        for act in self.actions.values():
            act.capture(self.microbatches, microbatch_size, seq_len)

    def planned_graphs(self) -> int:
        """Graphs this rank's captured actions capture (`graphs.binding`); 0 on the eager path."""
        return sum(a.plan.graph_count for a in self.actions.values() if getattr(a, "plan", None) is not None)

    def captured_graphs(self) -> int:
        """Distinct graphs this rank's captured actions replay (microbatches of one chain share theirs)."""
        return len({id(g) for a in self.actions.values() for sg in getattr(a, "slots", {}).values()
                    for g in (sg.F, sg.dI, sg.dW) if g is not None})

    def matrix_grad_prefix(self, stage: int, upto: int) -> dict[str, torch.Tensor]:
        """Microbatch gradients 0..upto of a stage summed in fixed order (what `.grad` holds in the reference).

        An accumulating arena holds only the running sum: `upto` must be the last microbatch written."""
        return {pname: self.arena.prefix_sum(arena_name(stage, pname), upto)
                for pname in self.chunks[stage].matrix_params()}

    def _load_grads(self, defer: bool = True) -> None:
        """`.grad` of every matrix parameter for AdamW. The arena's deferred last staging group goes to the
        Triton AdamW, which adds it inside its pass: `.grad` then lacks that group (`gradient` has it).
        `defer=False`: the arena folds it first, so `.grad` is complete (a global norm reads it)."""
        if self.fixed_order_sum:
            folding = self.optimizer if defer and isinstance(self.optimizer, TritonAdamW) else None
            for act in self.actions.values():
                act.load_matrix_grads(folding)
            return
        # Deliberately wrong (fault injection only): accumulate in the order dW ran, like a single
        # fused accumulation buffer would. Any non-ascending dW order then changes the bits.
        for s, act in self.actions.items():
            for pname, p in act.chunk.matrix_params().items():
                order = self.dw_order[s]
                acc = self.arena.view(arena_name(s, pname), order[0]).clone()
                for k in order[1:]:
                    acc += self.arena.view(arena_name(s, pname), k)
                p.grad = acc

    def prepare_gradients(self) -> None:
        """The first half of a commit that needs the whole gradient first (clipping's global norm): the
        barrier's checks, then every `.grad` loaded complete (the arena folds its last staging group
        itself instead of leaving it to the optimizer's pass). A refused barrier aborts the epoch, as the
        commit's does; `commit` then runs the rest. Idempotent within a step."""
        if self._grads_ready:
            return
        try:
            self.barrier.check_quiescent("commit")
            for arena in self.barrier.arenas:
                arena.finalize()
            self._load_grads(defer=False)
        except BaseException:
            self.barrier.abort_epoch()
            raise
        self._grads_ready = True

    def commit(self, before_step: Callable[[], None] | None = None, *, factor: torch.Tensor | None = None,
               skip: bool = False) -> None:
        """Optimizer commit through the barrier: quiescence, fixed-order gradient sums, the clip `factor`
        (with clipping on), AdamW at the schedule's learning rate, epochs. `skip`: every epoch advances but
        no optimizer step runs (parameters and AdamW state stay; see `NativeRank.commit`)."""
        self._set_lr()

        def step() -> None:
            if not self._grads_ready:  # a clip factor scales `.grad`: complete, no fold left to the pass
                self._load_grads(defer=factor is None)
            if skip:
                if isinstance(self.optimizer, TritonAdamW):
                    self.optimizer.drop_folds()  # a deferred fold of this step must not reach the next one
            else:
                self._apply_factor(factor)
                if before_step is not None:
                    before_step()
                self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)

        try:
            self.barrier.commit(step)
        finally:
            self._grads_ready = False
        self.losses.clear()
        self.dw_order = {s: [] for s in self.chunks}
        self.step_index += 1
