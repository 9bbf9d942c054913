"""Checked F / dI / dW actions for one stage chunk.

Each action checks its contracts *before* its physical work and commits the transition only after the
work succeeded (a failure aborts the tape). The actions keep explicit tensor signatures (inputs and
outputs are plain tensors plus a `TapeRef` and an effect token).

Why these are not `torch.library` custom ops: an action runs autograd inside (F records the chunk's
graph into the tape, dI runs `torch.autograd.backward` over it) and mutates Python-side contract state
(tape pool, ledger, cache version, arena bookkeeping). A custom op must be functional over tensors and
opaque to autograd, so registering these would either hide the autograd graph that dI needs or force
us to re-derive every layer's backward by hand. CUDA graphs capture the tensor work of the actions
directly (graphs/), which is what the custom-op boundary would have bought us.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol, TypeVar

import torch

from qeffect.contracts import (
    Consumer,
    EffectLedger,
    EffectToken,
    EpochClock,
    GradientArena,
    InvocationKey,
    TapePool,
    TapeRef,
    WeightCacheVersion,
)

T = TypeVar("T")


def arena_name(stage: int, param: str) -> str:
    """Arena entry of a matrix parameter: unique across the chunks a rank owns."""
    return f"s{stage}.{param}"


def input_grad_body(chunk: torch.nn.Module, x: torch.Tensor, out: torch.Tensor, grad_output: torch.Tensor,
                    *, retain_graph: bool, extra: torch.Tensor | None = None
                    ) -> tuple[torch.Tensor | None, dict[str, torch.Tensor]]:
    """dI's tensor work (shared by the eager and the captured path): the input gradient and this
    microbatch's non-matrix gradients as independent tensors. The matrix modules' retained `dW` work
    lands in their stores (delay_wgrad), not in any `.grad`. `extra`: one more tensor of the graph whose
    gradient is wanted (the token lookup's output, `stage/embedding_grad.py`), returned under `EXTRA`."""
    names, params = zip(*chunk.nonmatrix_grad_inputs().items(), strict=True)
    lead = ([x] if x.requires_grad else []) + ([extra] if extra is not None else [])
    grads = torch.autograd.grad(out, lead + list(params), grad_output, retain_graph=retain_graph, allow_unused=True)
    grad_in = grads[0] if x.requires_grad else None
    nonmatrix = dict(zip(names, grads[len(lead):], strict=True))
    if extra is not None:
        nonmatrix[EXTRA] = grads[len(lead) - 1]
    return grad_in, {n: g for n, g in nonmatrix.items() if g is not None}


EXTRA = "<extra>"  # key of `input_grad_body(extra=...)`'s gradient: never a parameter name


def take_wgrad_work(matrix: dict[str, torch.nn.Module]) -> dict[str, object]:
    """Move each matrix module's retained dW work (exactly one item per dI) out of the module."""
    work = {name: lin.pop_wgrad_work() for name, lin in matrix.items()}
    for name, items in work.items():
        if len(items) != 1:
            raise RuntimeError(f"{name}: expected one retained dW work item, found {len(items)}")
    return {name: items[0] for name, items in work.items()}


def accumulate_grads(params: dict[str, torch.nn.Parameter], grads: dict[str, torch.Tensor]) -> None:
    """Accumulate a microbatch's non-matrix gradients into `.grad` exactly as autograd's
    AccumulateGrad does for the reference (first: a copy; later: an in-place add), so the bits match.
    A gradient in another dtype (a bias TE took in the activation dtype) is added in the parameter's:
    the exact cast the reference's engine makes, then the same fp32 addition.
    `params`: the chunk's `nonmatrix_params()`, looked up once by the caller (walking the module tree
    on every action was a measurable share of a captured step's host time)."""
    with torch.no_grad():
        for name, g in grads.items():
            p = params[name]
            if p.grad is None:
                p.grad = g.detach().to(p.dtype, copy=True)
            else:
                p.grad += g


class FoldingOptimizer(Protocol):
    """An optimizer that can finish a parameter's deferred staged fold in its next step
    (`runtime.adamw.TritonAdamW`)."""

    def fold_into_step(self, param: torch.Tensor, block: torch.Tensor, count: int, init: bool) -> None: ...

    def folds_in_pass(self, param: torch.Tensor, block: torch.Tensor) -> bool: ...

    def fold_without_region(self, param: torch.Tensor, block: torch.Tensor, count: int) -> None: ...


@dataclass
class ForwardOut:
    output: torch.Tensor  # activation for the next stage, or the loss on the last stage (detached)
    ref: TapeRef
    token: EffectToken


@dataclass
class InputGradOut:
    grad_input: torch.Tensor | None  # gradient for the previous stage (None on the first stage)
    nonmatrix_grads: dict[str, torch.Tensor]  # accumulated `.grad` of norms, biases, embeddings
    token: EffectToken


@dataclass
class WeightGradOut:
    grads: dict[str, torch.Tensor]  # copy path: independent tensors; direct path: the arena views written
    token: EffectToken


@dataclass
class StageActions:
    """The three actions of one chunk, bound to the rank's contract objects.

    `direct=True` is direct placement: dW's GEMM writes straight into the arena view bound for
    (parameter, microbatch). `direct=False` is the copied-gradient path: dW returns independent
    gradients and `place_copies` copies them into the arena.
    """

    chunk: torch.nn.Module
    pool: TapePool
    clock: EpochClock
    arena: GradientArena
    direct: bool = True
    ledger: EffectLedger = field(init=False)
    cache: WeightCacheVersion = field(init=False)

    def __post_init__(self) -> None:
        device = next(self.chunk.parameters()).device
        self.ledger = EffectLedger(f"stage{self.stage}", device=device)
        self.cache = WeightCacheVersion(f"stage{self.stage}")
        self.chunk.set_delay_wgrad(True)
        self._matrix = self.chunk.matrix_linears()
        self._matrix_param = {name: f"{name}.weight" for name in self._matrix}
        # parameter -> its arena name (asked for every matrix weight of every dW: made once)
        self._arena_of = {p: arena_name(self.stage, p) for p in self._matrix_param.values()}
        self._nonmatrix = self.chunk.nonmatrix_params()  # the module tree is fixed: walk it once
        self._keys: dict[int, InvocationKey] = {}  # `key`: microbatch -> its key in epoch `_keys_epoch`
        self._keys_epoch: int | None = None

    @property
    def stage(self) -> int:
        return self.chunk.stage

    def key(self, m: int) -> InvocationKey:
        # Keys are immutable: each (epoch, microbatch) key is made once and handed out again within its
        # epoch (every action asks for it on the host's hot path); a new epoch starts a new set.
        e = self.clock.e_W
        if e != self._keys_epoch:
            self._keys, self._keys_epoch = {}, e
        k = self._keys.get(m)
        if k is None:
            k = self._keys[m] = InvocationKey(e=e, s=self.stage, m=m)
        return k

    def arena_specs(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        return {
            self._arena_of[pname]: (tuple(lin.weight.shape), lin.weight.dtype)
            for pname, lin in ((self._matrix_param[n], lin) for n, lin in self._matrix.items())
        }

    # ---------------------------------------------------------------- F
    def forward(
        self, m: int, inp: torch.Tensor, token: EffectToken, targets: torch.Tensor | None = None
    ) -> ForwardOut:
        key = self.key(m)
        self.ledger.check(token, f"F{m}")  # before the cache refresh: a refused F leaves no effect
        refresh = self.cache.check_forward(self.clock, first_microbatch=(m == 0))
        token = self.ledger.consume(token, f"F{m}", checked=True)  # checked above
        ref = self.pool.allocate(key)

        def run() -> tuple[torch.Tensor, torch.Tensor]:
            x = inp.detach()
            if x.is_floating_point():
                x.requires_grad_(True)  # a distinct retained input owned by the tape
            with torch.enable_grad():
                return x, self.chunk(x, is_first_microbatch=refresh, targets=targets)

        x, out = self.on_tape(ref, run)
        self.pool.resolve(ref, key).payload.update(input=x, output=out)
        return ForwardOut(out.detach(), ref, token)

    # ---------------------------------------------------------------- dI
    def input_grad(
        self, m: int, ref: TapeRef, grad_output: torch.Tensor, token: EffectToken
    ) -> InputGradOut:
        key = self.key(m)
        tape = self.pool.check_consumer(ref, key, Consumer.DI)
        token = self.ledger.consume(token, f"dI{m}")

        def run() -> torch.Tensor | None:
            x, out = tape.payload.pop("input"), tape.payload.pop("output")
            grad_in, grads = input_grad_body(self.chunk, x, out, grad_output, retain_graph=False)
            tape.payload["wgrad_work"] = take_wgrad_work(self._matrix)
            accumulate_grads(self._nonmatrix, grads)
            return grad_in

        grad_in = self.on_tape(ref, run, Consumer.DI)
        return InputGradOut(grad_in, self.nonmatrix_grads(), token)

    def nonmatrix_grads(self) -> dict[str, torch.Tensor]:
        return {n: p.grad for n, p in self._nonmatrix.items() if p.grad is not None}

    # ---------------------------------------------------------------- dW
    def weight_grad(self, m: int, ref: TapeRef, token: EffectToken) -> WeightGradOut:
        key = self.key(m)
        tape = self.pool.check_consumer(ref, key, Consumer.DW)
        # every check before any effect: the arena views this dW's gradients land in (written by its GEMMs
        # here, or copied in by `place_copies` on the copy path) are refused now, before the token moves
        dests = self.checked_destinations(m)
        token = self.ledger.consume(token, f"dW{m}")

        def run() -> dict[str, torch.Tensor]:
            work = tape.payload.pop("wgrad_work")
            if set(work) != set(self._matrix):
                raise RuntimeError(f"retained work covers {sorted(work)}, expected {sorted(self._matrix)}")
            grads: dict[str, torch.Tensor] = {}
            for name, lin in self._matrix.items():
                pname = self._matrix_param[name]
                if self.direct:
                    aname = self._arena_of[pname]
                    grads[pname] = lin.compute_wgrad(work[name], out=dests[pname],
                                                     accumulate=not self.arena.overwrites(m))
                    if self.arena.flushes(m, aname):
                        self.arena.flush(aname, m)
                    self.arena.record_write(aname, m, dests[pname])
                else:
                    grads[pname] = lin.compute_wgrad(work[name])
            return grads

        return WeightGradOut(self.on_tape(ref, run, Consumer.DW), token)

    def on_tape(self, ref: TapeRef, work: Callable[[], T], consumer: Consumer | None = None) -> T:
        """Run an action's physical work for the tape `ref`: a failure aborts the tape (its retained
        state is no longer trustworthy); success records `consumer` (dI, dW), which may release it."""
        try:
            result = work()
        except BaseException:
            self.pool.abort(ref)
            raise
        if consumer is not None:
            self.pool.mark_consumed(ref, consumer)
        return result

    def checked_destinations(self, m: int, dests: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """Check every destination of dW(m) against the arena before any GEMM writes: no alias of another
        view, the binding (shape, dtype, device, data_ptr, stride), no duplicate, the accumulating
        layout's microbatch order (`GradientArena.check_write`, which runs every check of `bind`). `dests`
        (parameter name -> tensor) defaults to the arena's own views; a captured direct dW passes the
        destinations it captured. Returns parameter name -> checked destination."""
        if dests is None:
            dests = {p: self.arena.view(self._arena_of[p], m) for p in self._matrix_param.values()}
        names = self._arena_of
        for pname, dest in dests.items():  # a name that is no matrix weight: the arena's "unknown view"
            self.arena.check_write(names.get(pname) or arena_name(self.stage, pname), m, dest)
        return dests

    def place_copies(self, m: int, grads: dict[str, torch.Tensor]) -> None:
        """Copied-gradient path: copy dW's independent gradients into the arena (the cost direct placement removes)."""
        for pname, g in grads.items():
            name = self._arena_of[pname]
            view = self.arena.view(name, m)
            self.arena.check_write(name, m, view)  # refused before it lands (an accumulating arena: m order)
            if self.arena.overwrites(m):
                view.copy_(g)  # a staging slot is in the GEMM's own dtype: g came from it, the copy is exact
            else:
                view.add_(g)
            if self.arena.flushes(m, name):
                self.arena.flush(name, m)
            self.arena.record_write(name, m, view)

    def _view(self, linear_name: str, m: int) -> torch.Tensor:
        return self.arena.view(self._arena_of[self._matrix_param[linear_name]], m)

    def load_matrix_grads(self, fold_into: FoldingOptimizer | None = None) -> None:
        """Set each matrix parameter's `.grad` to its microbatch gradients summed in fixed order m = 0..M-1.

        `fold_into`: an optimizer that finishes a deferred staged fold inside its update; the parameter's
        `.grad` is then the region without its last group, which the optimizer's next step adds."""
        for lname, pname in self._matrix_param.items():  # the linears found once, their weights read now
            weight = self._matrix[lname].weight
            name = self._arena_of[pname]
            pending = self.arena.take_pending_fold(name) if fold_into is not None else None
            if pending is None:
                weight.grad = self.arena.sum_microbatches(name)
                continue
            region, block, count, init = pending
            if region is None:  # lazy regions, none made yet: the optimizer's pass folds without one
                if fold_into.folds_in_pass(weight, block):
                    fold_into.fold_without_region(weight, block, count)
                    continue
                region = self.arena.region(name)  # makes them: this fold runs first, into `.grad`
            weight.grad = region
            fold_into.fold_into_step(weight, block, count, init)
