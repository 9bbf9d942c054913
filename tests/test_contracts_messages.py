"""Every contract rejection, word for word: the exception type, the message, and the `relation`, `key`,
`expected` and `found` attributes that reports read (`contracts.errors`). A rejection is the whole
interface of a contract to the person debugging it, so its text is pinned here, not only its type."""

from __future__ import annotations

import re

import pytest
import torch

from qeffect.contracts import (
    ArenaViolation,
    CacheEpochViolation,
    CheckedCompletionLedger,
    CommitBarrier,
    CommitViolation,
    CompletionLedger,
    Consumer,
    ConsumerOrderViolation,
    DeviceCompletionViolation,
    EffectLedger,
    EffectTokenViolation,
    EpochClock,
    GradientArena,
    InvocationKey,
    PoolCapacityError,
    ReductionTracker,
    TapePool,
    TapeRef,
    TapeViolation,
    WeightCacheVersion,
)
from qeffect.contracts.token import EffectToken

K = InvocationKey
K0, K1, K2 = K(0, 0, 0), K(0, 0, 1), K(0, 0, 2)


def _token():
    led = EffectLedger("L")
    t0 = led.current
    led.consume(t0, "F0")
    return led, t0


def _pool():
    pool = TapePool(2, "P")
    r1, r2 = pool.allocate(K0), pool.allocate(K1)
    return pool, r1, r2


def _freed():
    pool, r1, r2 = _pool()
    pool.abort(r2)
    return pool, r2


def _di_done():
    pool, r1, _ = _pool()
    pool.mark_consumed(r1, Consumer.DI)
    return pool, r1


def _cache():
    clock, cache = EpochClock(), WeightCacheVersion("C")
    cache.check_forward(clock, True)
    clock.advance()
    return clock, cache


def _barrier():
    pool = TapePool(2, "P")
    pool.allocate(K0)
    red = ReductionTracker("R")
    red.start("ar")
    return CommitBarrier(EpochClock(1), [pool], [GradientArena({"w": ((2,), torch.float32)}, 1, name="A")], red)


class _Ops:
    def new_event(self, name):
        return object()

    def record(self, event, stream):
        pass

    def wait(self, stream, event):
        pass


def _recorded():
    led = CheckedCompletionLedger(_Ops(), "D")
    led.record("k", "p")
    return led


def _stale():
    led = _recorded()
    led.wait("k", "c")
    led.fired("k", "p")
    return led


S = {"w": ((4,), torch.float32), "v": ((2, 2), torch.float32)}


def _arena():
    return GradientArena(S, 2, name="A")


def _written():
    a = _arena()
    a.record_write("w", 0, a.view("w", 0))
    return a


def _aborted():
    a = _written()
    a.abort()
    return a


def _staged():
    c = GradientArena({"w": ((4,), torch.float32)}, 3, name="C", accumulate=True, staging=2, defer_last_fold=True)
    for m in range(2):
        c.record_write("w", m, c.view("w", m))
    return c


def _taken():
    c = _staged()
    c.record_write("w", 2, c.view("w", 2))
    c.finalize()
    c.take_pending_fold("w")
    return c


def _accumulating():
    return GradientArena({"w": ((4,), torch.float32)}, 3, name="B", accumulate=True)


NO_KEY = "C"  # WeightCacheVersion's name stands in for a missing key
Q = "quiescence"
NONE = "none (never recorded, or retired: CUDA would not wait at all)"
REC = "a record on the producer's stream before consumer stream 's1'"

# (id, call, type, message, relation, key, expected, found); a message starting with "re:" is a regex
CASES = [
    ("token: not a token", lambda: _token()[0].consume("x", "F1"), EffectTokenViolation,
     "[effect-token] not an effect token for L: expected EffectToken, found str; action F1",
     "not an effect token", "L", "EffectToken", "str"),
    ("token: foreign", lambda: _token()[0].consume(EffectLedger("M").current, "F1"), EffectTokenViolation,
     "[effect-token] foreign token for L: expected ledger L, found M; action F1", "foreign token", "L", "L", "M"),
    ("token: stale", lambda: (lambda led, t0: led.consume(t0, "F1"))(*_token()), EffectTokenViolation,
     "[effect-token] stale token for L: expected seq 1, found 0; action F1", "stale token", "L", 1, 0),
    ("token: forged", lambda: _token()[0].consume(EffectToken(torch.zeros((), dtype=torch.int64), 1, "L"), "F1"),
     EffectTokenViolation, "[effect-token] forged token for L: expected the ledger's current token (seq 1), found "
     "another token object with seq 1; action F1", "forged token", "L", "the ledger's current token (seq 1)",
     "another token object with seq 1"),
    ("tape: duplicate live key", lambda: _pool()[0].allocate(K0), TapeViolation,
     "[tape-reference] duplicate live key for K(e=0,s=0,m=0,u=0,i=0): expected no live tape, found live tape in "
     "slot 0 generation 1; pool 'P'", "duplicate live key", K0, "no live tape", "live tape in slot 0 generation 1"),
    ("tape: full", lambda: _pool()[0].allocate(K2), PoolCapacityError,
     "[tape-reference] pool 'P' is full for K(e=0,s=0,m=2,u=0,i=0): capacity 2, live keys "
     "[K(e=0,s=0,m=0,u=0,i=0), K(e=0,s=0,m=1,u=0,i=0)]", "capacity", K2, "a free slot (capacity 2)", [K0, K1]),
    ("tape: not a reference", lambda: _pool()[0].resolve("r", K0), TapeViolation,
     "[tape-reference] not a tape reference for K(e=0,s=0,m=0,u=0,i=0): expected TapeRef, found str",
     "not a tape reference", K0, "TapeRef", "str"),
    ("tape: foreign (expected key)", lambda: (lambda p, r1, r2: p.resolve(r1, K1))(*_pool()), TapeViolation,
     "[tape-reference] foreign reference for K(e=0,s=0,m=1,u=0,i=0): expected key K(e=0,s=0,m=1,u=0,i=0), "
     "found reference for K(e=0,s=0,m=0,u=0,i=0)", "foreign reference", K1, "key K(e=0,s=0,m=1,u=0,i=0)",
     "reference for K(e=0,s=0,m=0,u=0,i=0)"),
    ("tape: slot out of range", lambda: _pool()[0].resolve(TapeRef(5, 1, K0), K0), TapeViolation,
     "[tape-reference] slot out of range for K(e=0,s=0,m=0,u=0,i=0): expected slot in [0, 2), found 5; pool 'P'",
     "slot out of range", K0, "slot in [0, 2)", 5),
    ("tape: negative slot", lambda: _pool()[0].resolve(TapeRef(-1, 1, K0), K0), TapeViolation,
     "[tape-reference] slot out of range for K(e=0,s=0,m=0,u=0,i=0): expected slot in [0, 2), found -1; pool 'P'",
     "slot out of range", K0, "slot in [0, 2)", -1),
    ("tape: foreign slot", lambda: _pool()[0].resolve(TapeRef(1, 1, K0), K0), TapeViolation,
     "[tape-reference] foreign reference for K(e=0,s=0,m=0,u=0,i=0): expected slot holding "
     "K(e=0,s=0,m=0,u=0,i=0), found slot 1 holding K(e=0,s=0,m=1,u=0,i=0)", "foreign reference", K0,
     "slot holding K(e=0,s=0,m=0,u=0,i=0)", "slot 1 holding K(e=0,s=0,m=1,u=0,i=0)"),
    ("tape: stale generation", lambda: _pool()[0].resolve(TapeRef(0, 7, K0), K0), TapeViolation,
     "[tape-reference] stale generation for K(e=0,s=0,m=0,u=0,i=0): expected generation 1, found 7; slot 0 of "
     "pool 'P' now holds K(e=0,s=0,m=0,u=0,i=0)", "stale generation", K0, 1, 7),
    ("tape: free slot", lambda: (lambda p, r2: p.resolve(r2, K1))(*_freed()), TapeViolation,
     "[tape-reference] free slot for K(e=0,s=0,m=1,u=0,i=0): expected live generation 1, found slot 1 free "
     "(current generation 1); pool 'P'", "free slot", K1, 1, "slot 1 free (current generation 1)"),
    ("consumer: dW before dI", lambda: (lambda p, r1, r2: p.check_consumer(r1, K0, Consumer.DW))(*_pool()),
     ConsumerOrderViolation, "[consumer-order] dW before dI for K(e=0,s=0,m=0,u=0,i=0): expected completed "
     "consumers dI, found completed consumers none", "dW before dI", K0, "completed consumers dI",
     "completed consumers none"),
    ("consumer: duplicate dI", lambda: (lambda p, r1: p.check_consumer(r1, K0, Consumer.DI))(*_di_done()),
     ConsumerOrderViolation, "[consumer-order] duplicate dI for K(e=0,s=0,m=0,u=0,i=0): expected dI not yet "
     "completed, found completed consumers dI", "duplicate dI", K0, "dI not yet completed", "completed consumers dI"),
    ("consumer: both at once", lambda: (lambda p, r1: p.check_consumer(r1, K0, Consumer.DI | Consumer.DW))(*_di_done()),
     ValueError, "consumer must be Consumer.DI or Consumer.DW, got <Consumer.DI|DW: 3>", None, None, None, None),
    ("pool: capacity", lambda: TapePool(0), ValueError, "TapePool capacity must be an int >= 1, got 0",
     None, None, None, None),
    ("pool: key type", lambda: TapePool(1).allocate((0, 0, 0)), TypeError,
     "allocate needs an InvocationKey, got tuple", None, None, None, None),
    ("cache: stale with key", lambda: (lambda c, w: w.check_forward(c, False, K(1, 0, 1)))(*_cache()),
     CacheEpochViolation, "[cache-epoch] stale weight cache for cache 'C' at K(e=1,s=0,m=1,u=0,i=0): expected "
     "e_C == e_W = 1, found e_C = 0; only the first microbatch of a step may refresh the cache",
     "stale weight cache", K(1, 0, 1), 1, 0),
    ("cache: stale without key", lambda: (lambda c, w: w.check_forward(c, False))(*_cache()), CacheEpochViolation,
     "[cache-epoch] stale weight cache for cache 'C': expected e_C == e_W = 1, found e_C = 0; only the first "
     "microbatch of a step may refresh the cache", "stale weight cache", NO_KEY, 1, 0),
    ("epoch: negative", lambda: EpochClock(-1), ValueError, "epoch must be an int >= 0, got -1", None, None, None, None),
    ("reduction: unknown", lambda: ReductionTracker("R").finish(99), CommitViolation,
     "[commit] unknown reduction for tracker 'R': expected a pending handle, found 99 (never started or already "
     "finished)", "unknown reduction", 99, [], 99),
    ("reduction: pending", lambda: (lambda r: (r.start("ar"), r.advance_epoch()))(ReductionTracker("R")),
     CommitViolation, "[commit] premature advance for tracker 'R': expected no pending reductions, found ['ar']",
     "pending reduction", None, [], ["ar"]),
    ("commit: premature", lambda: _barrier().check_quiescent(), CommitViolation,
     "[commit] premature commit at e_W=1: expected quiescence, found: pool 'P' has 1 live tape(s) "
     "[K(e=0,s=0,m=0,u=0,i=0)]; arena 'A' has 1 missing write(s) [w[m=0]]; tracker 'R' has 1 pending "
     "reduction(s) [ar]", "premature commit", None, Q,
     ["pool 'P' has 1 live tape(s) [K(e=0,s=0,m=0,u=0,i=0)]", "arena 'A' has 1 missing write(s) [w[m=0]]",
      "tracker 'R' has 1 pending reduction(s) [ar]"]),
    ("checkpoint: premature", lambda: _barrier().check_quiescent("checkpoint"), CommitViolation,
     "[commit] premature checkpoint at e_W=1: expected quiescence, found: pool 'P' has 1 live tape(s) "
     "[K(e=0,s=0,m=0,u=0,i=0)]; tracker 'R' has 1 pending reduction(s) [ar]", "premature checkpoint", None, Q,
     ["pool 'P' has 1 live tape(s) [K(e=0,s=0,m=0,u=0,i=0)]", "tracker 'R' has 1 pending reduction(s) [ar]"]),
    ("commit: purpose", lambda: _barrier().check_quiescent("x"), ValueError,
     "purpose must be one of ('commit', 'checkpoint'), got 'x'", None, None, None, None),
    ("completion: wait before record", lambda: CheckedCompletionLedger(_Ops(), "D").wait("k", "s1"),
     DeviceCompletionViolation, f"[device-completion] wait before record for k: expected {REC}, found {NONE}; "
     "ledger 'D'", "wait before record", "k", REC, NONE),
    ("completion: use before record", lambda: CheckedCompletionLedger(_Ops(), "D").use("k", "s1"),
     DeviceCompletionViolation, f"[device-completion] use before record for k: expected {REC}, found {NONE}; "
     "ledger 'D'", "use before record", "k", REC, NONE),
    ("completion: fired before record", lambda: CheckedCompletionLedger(_Ops(), "D").fired("k", "s1"),
     DeviceCompletionViolation, f"[device-completion] fired before record for k: expected {REC}, found {NONE}; "
     "ledger 'D'", "fired before record", "k", REC, NONE),
    ("completion: use without wait", lambda: _recorded().use("k", "c"), DeviceCompletionViolation,
     "[device-completion] use without wait for k: expected consumer stream 'c' to wait on the record on producer "
     "stream 'p', found no wait on 'c'; ledger 'D'", "use without wait", "k",
     "consumer stream 'c' to wait on the record on producer stream 'p'", "no wait on 'c'"),
    ("completion: stale wait", lambda: _stale().use("k", "c"), DeviceCompletionViolation,
     "[device-completion] stale wait for k: expected consumer stream 'c' to wait on record 2 (the latest, on "
     "producer stream 'p'), found its wait covers record 1 only (re-recorded after the wait); ledger 'D'",
     "stale wait", "k", "consumer stream 'c' to wait on record 2 (the latest, on producer stream 'p')",
     "its wait covers record 1 only (re-recorded after the wait)"),
    ("completion (production): wait before record", lambda: CompletionLedger(_Ops(), "E").wait("k", "s1"),
     DeviceCompletionViolation, f"[device-completion] wait before record for k: expected {REC}, found {NONE}; "
     "ledger 'E'", "wait before record", "k", REC, NONE),
    ("completion (production): take before record", lambda: CompletionLedger(_Ops(), "E").take("k", "s1"),
     DeviceCompletionViolation, f"[device-completion] wait before record for k: expected {REC}, found {NONE}; "
     "ledger 'E'", "wait before record", "k", REC, NONE),
    ("arena: unknown parameter", lambda: _arena().view("z", 0), ArenaViolation,
     "[arena] unknown view for arena 'A': expected one of 2 parameters x 2 microbatches, found ('z', 0) in view",
     "unknown view", ("z", 0), ["v", "w"], ("z", 0)),
    ("arena: unknown microbatch", lambda: _arena().view("w", 5), ArenaViolation,
     "[arena] unknown view for arena 'A': expected one of 2 parameters x 2 microbatches, found ('w', 5) in view",
     "unknown view", ("w", 5), ["v", "w"], ("w", 5)),
    ("arena: binding type", lambda: _arena().bind("w", 0, "x"), ArenaViolation,
     "[arena] wrong binding for arena 'A' view w[m=0] in bind: expected type torch.Tensor, found str",
     "wrong binding", ("w", 0), "torch.Tensor", "str"),
    ("arena: binding shape", lambda: _arena().bind("w", 0, torch.zeros(3)), ArenaViolation,
     "[arena] wrong binding for arena 'A' view w[m=0] in bind: expected shape (4,), found (3,)",
     "wrong binding", ("w", 0), (4,), (3,)),
    ("arena: binding dtype", lambda: _arena().bind("w", 0, torch.zeros(4, dtype=torch.float64)), ArenaViolation,
     "[arena] wrong binding for arena 'A' view w[m=0] in bind: expected dtype torch.float32, found torch.float64",
     "wrong binding", ("w", 0), torch.float32, torch.float64),
    ("arena: binding device", lambda: _arena().bind("w", 0, torch.zeros(4, device="meta")), ArenaViolation,
     "[arena] wrong binding for arena 'A' view w[m=0] in bind: expected device cpu, found meta",
     "wrong binding", ("w", 0), torch.device("cpu"), torch.device("meta")),
    ("arena: binding data_ptr", lambda: _arena().bind("w", 0, torch.zeros(4)), ArenaViolation,
     r"re:\[arena\] wrong binding for arena 'A' view w\[m=0\] in bind: expected data_ptr 0x[0-9a-f]+, found "
     r"0x[0-9a-f]+", "wrong binding", ("w", 0), None, None),
    ("arena: binding stride", lambda: (lambda a: a.bind("v", 0, a.view("v", 0).t()))(_arena()), ArenaViolation,
     "[arena] wrong binding for arena 'A' view v[m=0] in bind: expected stride (2, 1), found (1, 2)",
     "wrong binding", ("v", 0), (2, 1), (1, 2)),
    ("arena: aliased write", lambda: (lambda a: a.check_write("w", 0, a.view("w", 1)))(_arena()), ArenaViolation,
     "[arena] aliased write for arena 'A' view w[m=0]: expected a write confined to w[m=0], found a destination "
     "overlapping view(s) w[m=1]", "aliased write", ("w", 0), ("w", 0), [("w", 1)]),
    ("arena: duplicate write", lambda: (lambda a: a.check_write("w", 0, a.view("w", 0)))(_written()), ArenaViolation,
     "[arena] duplicate write for arena 'A' view w[m=0]: expected exactly one write in epoch 0, found a second "
     "write", "duplicate write", ("w", 0), 1, 2),
    ("arena: missing writes", lambda: _written().finalize(), ArenaViolation,
     "[arena] missing writes for arena 'A' epoch 0: expected all 4 views written, found 3 missing: w[m=1], v[m=0], "
     "v[m=1]", "missing write", ("w", 1), 4, 1),
    ("arena: sum before finalize", lambda: _written().sum_microbatches("w"), ArenaViolation,
     "[arena] sum before finalize for arena 'A' parameter w: expected a finalized epoch 0, found 3 missing writes",
     "sum before finalize", "w", "finalized", "not finalized"),
    ("arena: advance before finalize", lambda: _written().advance_epoch(), ArenaViolation,
     "[arena] advance before finalize for arena 'A': expected a finalized epoch 0, found 3 missing writes",
     "advance before finalize", None, "finalized", "not finalized"),
    ("arena: aborted (a view)", lambda: (lambda a: a.check_write("w", 1, a.view("w", 1)))(_aborted()),
     ArenaViolation, "[arena] aborted arena for arena 'A' view w[m=1]: expected a usable arena for check_write, "
     "found it aborted in epoch 0; rebuild() it first", "aborted arena", ("w", 1), "usable", "aborted"),
    ("arena: aborted (no view)", lambda: _aborted().finalize(), ArenaViolation,
     "[arena] aborted arena for arena 'A': expected a usable arena for finalize, found it aborted in epoch 0; "
     "rebuild() it first", "aborted arena", None, "usable", "aborted"),
    ("arena: out of order", lambda: (lambda b: b.check_write("w", 1, b.view("w", 1)))(_accumulating()),
     ArenaViolation, "[arena] out-of-order accumulation for arena 'B' view w[m=1]: expected microbatch 0 next (an "
     "accumulating arena adds m = 0, 1, ..., M-1 in order), found 1", "out-of-order accumulation", ("w", 1), 0, 1),
    ("arena: region of a per-microbatch arena", lambda: _arena().region("w"), ValueError,
     "arena 'A' has one view per microbatch, no accumulating region", None, None, None, None),
    ("arena: region unknown", lambda: _accumulating().region("z"), ArenaViolation,
     "[arena] unknown view for arena 'B': expected one of 1 parameters x 3 microbatches, found ('z', 0) in region",
     "unknown view", ("z", 0), ["w"], ("z", 0)),
    ("arena: flush of no group", lambda: _staged().flush("w", 0), ValueError,
     "arena 'C': dW(0) closes no staging group of w (staging 2, 3 microbatches)", None, None, None, None),
    ("arena: gated fold of no group", lambda: _staged().flush_gated("w", 0, torch.zeros((), dtype=torch.int32)),
     ValueError, "arena 'C': dW(0) holds no fold of w (staging 2, 3 microbatches)", None, None, None, None),
    ("arena: fold before the last write", lambda: _staged().storage_views("w"), ArenaViolation,
     "[arena] fold before the last write for arena 'C' view w[m=2]: expected dW(2) written before its deferred "
     "group is folded, found writes [0, 1]", "fold before the last write", ("w", 2), "written", "not written"),
    ("arena: take before finalize", lambda: _staged().take_pending_fold("w"), ArenaViolation,
     "[arena] take_pending_fold before finalize for arena 'C' parameter w: expected a finalized epoch 0, found 1 "
     "missing writes", "take_pending_fold before finalize", "w", "finalized", "not finalized"),
    ("arena: sum after take", lambda: _taken().sum_microbatches("w"), ArenaViolation,
     "[arena] sum after take for arena 'C' parameter w: expected the deferred last group in the region, found it "
     "taken by take_pending_fold in epoch 0 (its consumer has the finished gradient)", "sum after take", "w",
     "folded", "taken"),
    ("arena: prefix of other writes", lambda: _accumulating().prefix_sum("w", 1), ValueError,
     "w: the accumulating arena holds the sum over microbatches [], not 0..1", None, None, None, None),
    ("arena: microbatches", lambda: GradientArena(S, 0), ValueError, "microbatches must be an int >= 1, got 0",
     None, None, None, None),
    ("arena: no specs", lambda: GradientArena({}, 1), ValueError, "GradientArena needs at least one parameter spec",
     None, None, None, None),
    ("arena: staging negative", lambda: GradientArena(S, 1, staging=-1), ValueError,
     "staging must be an int >= 0, got -1", None, None, None, None),
    ("arena: staging without accumulate", lambda: GradientArena(S, 2, staging=1), ValueError,
     "staging needs the accumulating layout (accumulate=True)", None, None, None, None),
    ("arena: spec shape", lambda: GradientArena({"w": ((0,), torch.float32)}, 1), ValueError,
     "arena spec 'w': shape must be positive ints, got (0,)", None, None, None, None),
    ("arena: spec dtype", lambda: GradientArena({"w": ((1,), "f")}, 1), ValueError,
     "arena spec 'w': dtype must be a torch.dtype, got 'f'", None, None, None, None),
    ("arena: staging dtypes", lambda: GradientArena(S, 2, accumulate=True, staging=1,
                                                    staging_dtypes={"q": torch.bfloat16}), ValueError,
     "staging_dtypes names unknown parameters: ['q']", None, None, None, None),
]


@pytest.mark.parametrize(("call", "exc", "message", "relation", "key", "expected", "found"),
                         [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_every_rejection_word_for_word(call, exc, message, relation, key, expected, found) -> None:
    with pytest.raises(exc, match=message[3:] if message.startswith("re:") else re.escape(message)) as info:
        call()
    err = info.value
    assert type(err) is exc
    if message.startswith("re:"):
        assert re.fullmatch(message[3:], str(err)), str(err)
    else:
        assert str(err) == message
    if relation is None:  # a usage error, not a contract violation
        return
    assert err.relation == relation and err.key == key and err.message == str(err)
    if not message.startswith("re:"):
        assert (err.expected, err.found) == (expected, found)
    assert str(err).startswith(f"[{err.family}] ")
