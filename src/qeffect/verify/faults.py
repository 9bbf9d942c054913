"""CPU-only fault injection: every contract family must reject its first invalid operation.

Each injection is a short script of named operations on fresh contract objects. Exactly one operation
(``invalid_index``) is invalid. The runner executes the script in order and requires:

* every operation before the invalid one succeeds (otherwise the contract fired too early);
* the invalid operation raises a :class:`ContractViolation` of the expected family (``first_invalid``);
* the observed state is the same before and after the rejected operation (``state_preserved``). What
  is observed is chosen per injection and described in its ``checks`` text. For a refused commit the
  rejection itself aborts the epoch (tapes purged, arena unusable), so there "preserved" means the
  *committed* state did not advance (``e_W``, parameters, optimizer calls, arena epoch), and the abort
  effects are verified separately (``aftermath``);
* every operation after the invalid one succeeds (the system keeps working on the preserved state).

Nothing here touches CUDA; the report records ``torch.cuda.is_initialized()`` at the end to prove it.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch
from pydantic import BaseModel

from qeffect.contracts import (
    CheckedCompletionLedger,
    CommitBarrier,
    Consumer,
    ContractViolation,
    EffectLedger,
    EpochClock,
    GradientArena,
    InvocationKey,
    ReductionTracker,
    TapePool,
    WeightCacheVersion,
)

Op = tuple[str, Callable[[], object]]

MIN_INJECTIONS = 8
MIN_FAMILIES = 7  # every family of contracts.errors.FAMILIES


@dataclass
class Injection:
    """One scripted fault: ``ops[invalid_index]`` must be the first (and only) rejected operation."""

    family: str
    name: str
    ops: list[Op]
    invalid_index: int
    observe: Callable[[], Hashable]
    checks: str
    aftermath: Callable[[], bool] | None = None


class InjectionResult(BaseModel):
    family: str
    injection: str
    rejected_operation: str | None
    expected_operation: str
    first_invalid: bool
    state_preserved: bool
    error_type: str | None
    message: str
    passed: bool
    found_family: str | None = None
    later_ops_ok: bool = True
    aftermath_ok: bool | None = None
    checks: str = ""


class FaultReport(BaseModel):
    schema_version: int = 1
    kind: Literal["faults"] = "faults"
    injections: list[InjectionResult]
    families: list[str]
    cuda_initialized: bool
    passed: bool


# --------------------------------------------------------------------------------------- runner
def run_injection(inj: Injection) -> InjectionResult:
    """Execute one injection script and judge it (see the module docstring)."""
    expected_op = inj.ops[inj.invalid_index][0]
    rejected: str | None = None
    error_type: str | None = None
    found_family: str | None = None
    message = ""
    first_invalid = False
    preserved = False
    later_ok = True
    for idx, (name, op) in enumerate(inj.ops):
        before = inj.observe() if idx == inj.invalid_index else None
        try:
            op()
        except Exception as exc:  # the runner judges every exception
            if idx < inj.invalid_index:  # rejected too early: not the first invalid operation
                rejected, error_type, message = name, type(exc).__name__, str(exc)
                found_family = getattr(exc, "family", None)
                break
            if idx == inj.invalid_index:
                rejected, error_type, message = name, type(exc).__name__, str(exc)
                found_family = getattr(exc, "family", None)
                first_invalid = isinstance(exc, ContractViolation)
                preserved = before == inj.observe()
                continue
            later_ok = False
            message = f"{message} | later operation {name!r} failed: {type(exc).__name__}: {exc}"
            break
        else:
            if idx == inj.invalid_index:
                message = f"invalid operation {name!r} was accepted"
                break
    aftermath_ok = inj.aftermath() if inj.aftermath is not None and first_invalid else None
    passed = (
        first_invalid
        and found_family == inj.family
        and preserved
        and later_ok
        and aftermath_ok is not False
    )
    return InjectionResult(
        family=inj.family,
        injection=inj.name,
        rejected_operation=rejected,
        expected_operation=expected_op,
        first_invalid=first_invalid,
        state_preserved=preserved,
        error_type=error_type,
        message=message,
        passed=passed,
        found_family=found_family,
        later_ops_ok=later_ok,
        aftermath_ok=aftermath_ok,
        checks=inj.checks,
    )


def run_faults(injections: Sequence[Injection] | None = None) -> FaultReport:
    """Run every injection (default: :func:`build_injections`) and summarize."""
    injs = list(injections) if injections is not None else build_injections()
    results = [run_injection(i) for i in injs]
    families = sorted({r.family for r in results})
    cuda = bool(torch.cuda.is_initialized())
    passed = (
        all(r.passed for r in results)
        and not cuda
        and len(families) >= MIN_FAMILIES
        and len(results) >= MIN_INJECTIONS
    )
    return FaultReport(injections=results, families=families, cuda_initialized=cuda, passed=passed)


# ------------------------------------------------------------------------------------ helpers
K1 = InvocationKey(0, 0, 0)
K2 = InvocationKey(0, 0, 1)


def _consume(pool: TapePool, refs: dict, name: str, key: InvocationKey, consumer: Consumer) -> Callable[[], None]:
    def op() -> None:
        with pool.consume(refs[name], key, consumer) as tape:
            tape.payload.setdefault("done", []).append(consumer.label)

    return op


def _alloc(pool: TapePool, refs: dict, name: str, key: InvocationKey) -> Callable[[], None]:
    def op() -> None:
        refs[name] = pool.allocate(key, {"act": torch.full((2,), float(key.m))})

    return op


def _arena() -> GradientArena:
    return GradientArena({"w1": ((2, 2), torch.float32), "w2": ((3,), torch.float32)}, microbatches=2,
                         name="faults")


def _dw(arena: GradientArena, name: str, m: int, dest: Callable[[], torch.Tensor] | None = None):
    """A simulated ``dW``: check the destination, write the gradient, record the write."""

    def op() -> None:
        d = arena.view(name, m) if dest is None else dest()
        arena.check_write(name, m, d)
        d.add_(float(m + 1))
        arena.record_write(name, m, d)

    return op


def _arena_state(arena: GradientArena) -> tuple:
    # CPU-only: reading the contents shows that a refused write never touched the buffer.
    return (arena.snapshot(), tuple(tuple(arena.view(*k).flatten().tolist()) for k in arena.keys()))


# ---------------------------------------------------------------------------------- injections
def _stale_ref_aba() -> Injection:
    pool, refs = TapePool(1, "aba"), {}
    return Injection(
        family="tape-reference",
        name="stale tape reference after slot reuse (ABA)",
        ops=[
            ("F K1: allocate slot 0", _alloc(pool, refs, "r1", K1)),
            ("dI K1", _consume(pool, refs, "r1", K1, Consumer.DI)),
            ("dW K1 (releases slot 0)", _consume(pool, refs, "r1", K1, Consumer.DW)),
            ("F K2: reuses slot 0, generation 2", _alloc(pool, refs, "r2", K2)),
            ("dI with the old K1 reference", _consume(pool, refs, "r1", K1, Consumer.DI)),
            ("dI K2 still works", _consume(pool, refs, "r2", K2, Consumer.DI)),
            ("dW K2 still works", _consume(pool, refs, "r2", K2, Consumer.DW)),
        ],
        invalid_index=4,
        observe=pool.snapshot,
        checks="pool snapshot unchanged: K2's tape keeps its payload object, consumers and generation; "
        "K2 is then consumed normally",
    )


def _foreign_ref() -> Injection:
    pool, refs = TapePool(2, "foreign"), {}
    return Injection(
        family="tape-reference",
        name="foreign tape reference (K1's reference presented for K2)",
        ops=[
            ("F K1", _alloc(pool, refs, "r1", K1)),
            ("F K2", _alloc(pool, refs, "r2", K2)),
            ("dI K2 with K1's reference", _consume(pool, refs, "r1", K2, Consumer.DI)),
            ("dI K2 with its own reference", _consume(pool, refs, "r2", K2, Consumer.DI)),
        ],
        invalid_index=2,
        observe=pool.snapshot,
        checks="pool snapshot unchanged (both tapes, payloads, consumers, generations)",
    )


def _duplicate_di() -> Injection:
    pool, refs = TapePool(2, "dup"), {}
    return Injection(
        family="consumer-order",
        name="duplicate dI",
        ops=[
            ("F K1", _alloc(pool, refs, "r1", K1)),
            ("dI K1", _consume(pool, refs, "r1", K1, Consumer.DI)),
            ("dI K1 again", _consume(pool, refs, "r1", K1, Consumer.DI)),
            ("dW K1", _consume(pool, refs, "r1", K1, Consumer.DW)),
        ],
        invalid_index=2,
        observe=pool.snapshot,
        checks="pool snapshot unchanged: consumer mask still dI, tape still live; dW then releases it",
    )


def _dw_before_di() -> Injection:
    pool, refs = TapePool(2, "order"), {}
    return Injection(
        family="consumer-order",
        name="dW before dI",
        ops=[
            ("F K1", _alloc(pool, refs, "r1", K1)),
            ("dW K1 before its dI", _consume(pool, refs, "r1", K1, Consumer.DW)),
            ("dI K1", _consume(pool, refs, "r1", K1, Consumer.DI)),
            ("dW K1", _consume(pool, refs, "r1", K1, Consumer.DW)),
        ],
        invalid_index=1,
        observe=pool.snapshot,
        checks="pool snapshot unchanged: no consumer recorded, tape not aborted; dI then dW succeed",
    )


def _stale_token() -> Injection:
    ledger = EffectLedger("stage0", "cpu")
    toks = {"t0": ledger.current}

    def fwd(src: str, dst: str, action: str) -> Callable[[], None]:
        def op() -> None:
            toks[dst] = ledger.consume(toks[src], action)

        return op

    return Injection(
        family="effect-token",
        name="stale effect token",
        ops=[
            ("F m=0 consumes token seq 0", fwd("t0", "t1", "F m=0")),
            ("F m=1 presents token seq 0 again", fwd("t0", "bad", "F m=1")),
            ("F m=1 with the current token", fwd("t1", "t2", "F m=1")),
        ],
        invalid_index=1,
        observe=ledger.snapshot,
        checks="ledger snapshot unchanged: same current token object, seq and history",
    )


def _stale_cache() -> Injection:
    clock, cache = EpochClock(), WeightCacheVersion("stage0.qweights")
    param = torch.zeros(2)
    barrier = CommitBarrier(clock, [], [])

    def fwd(m: int, first: bool) -> Callable[[], None]:
        return lambda: cache.check_forward(clock, first, InvocationKey(clock.e_W, 0, m))

    return Injection(
        family="cache-epoch",
        name="stale weight cache after a commit",
        ops=[
            ("F m=0 refreshes the cache (e_C <- 0)", fwd(0, True)),
            ("F m=1 verifies the cache", fwd(1, False)),
            ("commit (e_W -> 1)", lambda: barrier.commit(lambda: param.add_(1.0))),
            ("F m=1 of the next step without a refresh", fwd(1, False)),
            ("F m=0 of the next step refreshes", fwd(0, True)),
            ("F m=1 verifies again", fwd(1, False)),
        ],
        invalid_index=3,
        observe=lambda: (cache.snapshot(), clock.snapshot(), tuple(param.tolist())),
        checks="e_C stays 0 (the violation does not 'fix' the cache), e_W and parameters unchanged",
    )


def _arena_duplicate() -> Injection:
    arena = _arena()
    return Injection(
        family="arena",
        name="arena duplicate write",
        ops=[
            ("dW w1 m=1", _dw(arena, "w1", 1)),
            ("dW w1 m=0", _dw(arena, "w1", 0)),
            ("dW w1 m=1 again", _dw(arena, "w1", 1)),
        ],
        invalid_index=2,
        observe=lambda: _arena_state(arena),
        checks="arena snapshot and buffer contents unchanged (the duplicate is refused before it writes)",
    )


def _arena_missing() -> Injection:
    arena = _arena()
    return Injection(
        family="arena",
        name="arena missing write at finalize",
        ops=[
            ("dW w1 m=0", _dw(arena, "w1", 0)),
            ("dW w2 m=0", _dw(arena, "w2", 0)),
            ("dW w2 m=1", _dw(arena, "w2", 1)),
            ("finalize without w1 m=1", arena.finalize),
            ("dW w1 m=1", _dw(arena, "w1", 1)),
            ("finalize", arena.finalize),
        ],
        invalid_index=3,
        observe=lambda: _arena_state(arena),
        checks="arena not finalized, writes and contents unchanged; the late write then completes it",
    )


def _arena_aliased() -> Injection:
    arena = _arena()
    return Injection(
        family="arena",
        name="arena aliased write",
        ops=[
            ("dW w1 m=0", _dw(arena, "w1", 0)),
            ("dW w2 m=0 into w2 m=1's storage", _dw(arena, "w2", 0, lambda: arena.view("w2", 1))),
            ("dW w2 m=0", _dw(arena, "w2", 0)),
        ],
        invalid_index=1,
        observe=lambda: _arena_state(arena),
        checks="arena snapshot and contents unchanged (w2 m=1 untouched); the correct write then succeeds",
    )


def _arena_wrong_binding() -> Injection:
    arena = _arena()
    impostor = torch.zeros(2, 2)
    return Injection(
        family="arena",
        name="arena wrong binding (right shape, another data_ptr)",
        ops=[
            ("bind w1 m=0 to its view", lambda: arena.bind("w1", 0, arena.view("w1", 0))),
            ("bind w1 m=1 to a fresh tensor", lambda: arena.bind("w1", 1, impostor)),
            ("bind w1 m=1 to its view", lambda: arena.bind("w1", 1, arena.view("w1", 1))),
        ],
        invalid_index=1,
        observe=lambda: (_arena_state(arena), tuple(impostor.flatten().tolist())),
        checks="arena snapshot and contents unchanged; the impostor tensor untouched",
    )


def _commit_setup(M: int = 1):
    clock = EpochClock()
    pool = TapePool(2, "commit")
    arena = GradientArena({"w": ((2,), torch.float32)}, microbatches=M, name="commit")
    red = ReductionTracker("dp")
    barrier = CommitBarrier(clock, [pool], [arena], red)
    param = torch.zeros(2)
    calls = {"step": 0}

    def step() -> None:
        calls["step"] += 1
        param.sub_(arena.sum_microbatches("w"))

    def committed() -> tuple:
        return (clock.e_W, tuple(param.tolist()), calls["step"], arena.epoch, red.epoch)

    return clock, pool, arena, red, barrier, step, committed


def _commit_live_tape() -> Injection:
    clock, pool, arena, red, barrier, step, committed = _commit_setup()
    refs: dict = {}
    return Injection(
        family="commit",
        name="premature commit with a live tape",
        ops=[
            ("F K1", _alloc(pool, refs, "r1", K1)),
            ("dI K1", _consume(pool, refs, "r1", K1, Consumer.DI)),
            ("dW w m=0 (arena)", _dw(arena, "w", 0)),
            ("commit before dW K1 released the tape", lambda: barrier.commit(step)),
        ],
        invalid_index=3,
        observe=committed,
        checks="committed state unchanged (e_W, parameters, optimizer calls, arena/reducer epochs); "
        "aftermath: the epoch's tapes are purged and the arena is unusable until rebuild",
        aftermath=lambda: pool.live_count == 0 and not arena.usable,
    )


def _commit_pending_reduction() -> Injection:
    clock, pool, arena, red, barrier, step, committed = _commit_setup()
    refs: dict = {}
    return Injection(
        family="commit",
        name="premature commit with a pending reduction",
        ops=[
            ("F K1", _alloc(pool, refs, "r1", K1)),
            ("dI K1", _consume(pool, refs, "r1", K1, Consumer.DI)),
            ("dW K1", _consume(pool, refs, "r1", K1, Consumer.DW)),
            ("dW w m=0 (arena)", _dw(arena, "w", 0)),
            ("start gradient all-reduce", lambda: red.start("all-reduce w")),
            ("commit before the reduction finished", lambda: barrier.commit(step)),
        ],
        invalid_index=5,
        observe=committed,
        checks="committed state unchanged (e_W, parameters, optimizer calls, arena/reducer epochs); "
        "aftermath: the arena is unusable, the reduction is still pending",
        aftermath=lambda: not arena.usable and red.pending() == ["all-reduce w"],
    )


def _checkpoint_live_tape() -> Injection:
    clock, pool, arena, red, barrier, step, committed = _commit_setup()
    refs: dict = {}
    saved: list = []

    def save() -> None:
        barrier.check_quiescent("checkpoint")
        saved.append(committed())

    return Injection(
        family="commit",
        name="premature checkpoint with a live tape",
        ops=[
            ("checkpoint at a quiescent boundary", save),
            ("F K1", _alloc(pool, refs, "r1", K1)),
            ("checkpoint with K1 live", save),
            ("dI K1", _consume(pool, refs, "r1", K1, Consumer.DI)),
            ("dW K1", _consume(pool, refs, "r1", K1, Consumer.DW)),
        ],
        invalid_index=2,
        observe=lambda: (pool.snapshot(), arena.snapshot(), committed(), len(saved)),
        checks="nothing mutated: pool, arena, committed state and the number of saved checkpoints",
    )


class _HostEvents:
    """The device's event calls on the host: streams are names, events plain objects, calls are counted
    (a rejected wait must issue none)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str]] = []

    def new_event(self, name: str) -> object:
        return object()

    def record(self, event: object, stream: str) -> None:
        self.calls.append(("record", stream))

    def wait(self, stream: str, event: object) -> None:
        self.calls.append(("wait", stream))


def _completion_use_without_wait() -> Injection:
    ops = _HostEvents()
    led = CheckedCompletionLedger(ops, "transport")
    a0, a1 = ("act", 0, 0), ("act", 0, 1)
    return Injection(
        family="device-completion",
        name="hand-off read on a rank stream that did not wait",
        ops=[
            ("F(0,0) publishes act(0,0) on rank0", lambda: led.record(a0, "rank0")),
            ("rank1 waits on act(0,0)", lambda: led.wait(a0, "rank1")),
            ("F(1,0) reads act(0,0) on rank1", lambda: led.use(a0, "rank1")),
            ("F(0,1) publishes act(0,1) on rank0", lambda: led.record(a1, "rank0")),
            ("F(1,1) reads act(0,1) on rank1 without a wait", lambda: led.use(a1, "rank1")),
            ("rank1 waits on act(0,1)", lambda: led.wait(a1, "rank1")),
            ("F(1,1) reads act(0,1) on rank1", lambda: led.use(a1, "rank1")),
        ],
        invalid_index=4,
        observe=lambda: (led.snapshot(), tuple(ops.calls)),
        checks="ledger snapshot (records, generations, waits) and the device calls issued unchanged; "
        "the wait then makes the read valid",
    )


def _completion_stale_wait() -> Injection:
    ops = _HostEvents()
    led = CheckedCompletionLedger(ops, "graph tails")
    g = "stage0.F0"  # the graph manager keys a graph's tail by the graph's name
    return Injection(
        family="device-completion",
        name="graph outputs read after a replay the caller did not wait for (one-way)",
        ops=[
            ("capture F0: tail recorded on the graph stream", lambda: led.record(g, "graph")),
            ("replay 1 fires the tail", lambda: led.fired(g, "graph")),
            ("caller waits on the tail", lambda: led.wait(g, "caller")),
            ("caller reads replay 1's outputs", lambda: led.use(g, "caller")),
            ("replay 2 fires the tail (no wait: one-way)", lambda: led.fired(g, "graph")),
            ("caller reads replay 2's outputs", lambda: led.use(g, "caller")),
            ("caller waits on the tail", lambda: led.wait(g, "caller")),
            ("caller reads replay 2's outputs after the wait", lambda: led.use(g, "caller")),
        ],
        invalid_index=5,
        observe=lambda: (led.snapshot(), tuple(ops.calls)),
        checks="ledger snapshot unchanged (the caller's wait still covers replay 1 only); a new wait then "
        "covers replay 2",
    )


def build_injections() -> list[Injection]:
    """Fresh objects for every injection (15 injections, 7 families)."""
    return [
        _stale_ref_aba(),
        _foreign_ref(),
        _duplicate_di(),
        _dw_before_di(),
        _stale_token(),
        _stale_cache(),
        _arena_duplicate(),
        _arena_missing(),
        _arena_aliased(),
        _arena_wrong_binding(),
        _commit_live_tape(),
        _commit_pending_reduction(),
        _checkpoint_live_tape(),
        _completion_use_without_wait(),
        _completion_stale_wait(),
    ]
