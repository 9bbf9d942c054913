"""Hypothesis stateful tests: TapePool and GradientArena against pure-Python models of the rules.

For every random operation the model predicts success or the exact exception class (and, for the
arena, the violated relation); a rejected operation must leave the object's snapshot unchanged.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
    run_state_machine_as_test,
)

from qeffect.contracts import (
    ArenaViolation,
    Consumer,
    ConsumerOrderViolation,
    GradientArena,
    InvocationKey,
    PoolCapacityError,
    TapePool,
    TapeRef,
    TapeViolation,
)

SETTINGS = settings(max_examples=1000, stateful_step_count=30, deadline=None, derandomize=True, database=None,
                    suppress_health_check=[HealthCheck.too_slow])

keys = st.builds(InvocationKey, st.integers(0, 1), st.integers(0, 1), st.integers(0, 2))
consumers = st.sampled_from([Consumer.DI, Consumer.DW])


def outcome(fn, expected_exc):
    """Run ``fn``; require success (``expected_exc is None``) or exactly ``expected_exc``."""
    try:
        result = fn()
    except Exception as exc:  # judged below
        assert expected_exc is not None, f"unexpected {type(exc).__name__}: {exc}"
        assert type(exc) is expected_exc, f"expected {expected_exc.__name__}, got {type(exc).__name__}: {exc}"
        return exc
    assert expected_exc is None, f"expected {expected_exc.__name__}, operation succeeded"
    return result


# ------------------------------------------------------------------------------------------ tape pool
class TapePoolMachine(RuleBasedStateMachine):
    @initialize(capacity=st.integers(1, 4))
    def setup(self, capacity):
        self.pool = TapePool(capacity, "model")
        self.cap = capacity
        self.gens = [0] * capacity
        self.slots: dict[int, list] = {}  # slot -> [key, consumer mask]
        self.peak = 0
        self.refs: list[TapeRef] = []

    # model helpers
    def live(self):
        return {k: s for s, (k, _) in self.slots.items()}

    def predict_resolve(self, ref, expected_key):
        if ref.key != expected_key or not 0 <= ref.slot < self.cap or ref.slot not in self.slots:
            return TapeViolation
        key, _ = self.slots[ref.slot]
        if self.gens[ref.slot] != ref.generation or key != ref.key:
            return TapeViolation
        return None

    def predict_consumer(self, ref, expected_key, consumer):
        err = self.predict_resolve(ref, expected_key)
        if err is not None:
            return err
        mask = self.slots[ref.slot][1]
        if mask & consumer.value:
            return ConsumerOrderViolation
        if consumer is Consumer.DW and not mask & Consumer.DI.value:
            return ConsumerOrderViolation
        return None

    def pick(self, idx, live=False):
        """A reference from the history; with ``live`` one that currently resolves (when there is one)."""
        pool = self.refs
        if live:
            current = [r for r in self.refs if self.predict_resolve(r, r.key) is None]
            pool = current or pool
        return pool[idx % len(pool)]

    def checked(self, op, fn, expected):
        before = self.pool.snapshot()
        result = outcome(fn, expected)
        event(f"pool: {op} -> {'ok' if expected is None else expected.__name__}")
        if expected is not None:
            assert self.pool.snapshot() == before  # a rejected operation mutates nothing
        return result

    # rules
    @rule(key=keys)
    def allocate(self, key):
        free = [s for s in range(self.cap) if s not in self.slots]
        if key in self.live():
            expected = TapeViolation
        elif not free:
            expected = PoolCapacityError
        else:
            expected = None
        ref = self.checked("allocate", lambda: self.pool.allocate(key, {"k": key}), expected)
        if expected is None:
            slot = free[0]
            self.gens[slot] += 1
            self.slots[slot] = [key, 0]
            self.peak = max(self.peak, len(self.slots))
            assert ref == TapeRef(slot, self.gens[slot], key)
            self.refs.append(ref)

    @rule(slot=st.integers(0, 5), generation=st.integers(0, 4), key=keys)
    def fabricate(self, slot, generation, key):
        self.refs.append(TapeRef(slot, generation, key))

    @precondition(lambda self: self.refs)
    @rule(idx=st.integers(0, 63), own=st.booleans(), other=keys)
    def resolve(self, idx, own, other):
        ref = self.pick(idx)
        exp_key = ref.key if own else other
        tape = self.checked("resolve", lambda: self.pool.resolve(ref, exp_key), self.predict_resolve(ref, exp_key))
        if not isinstance(tape, Exception):
            assert tape.key == ref.key and tape.generation == ref.generation and tape.payload == {"k": ref.key}

    @precondition(lambda self: self.refs)
    @rule(idx=st.integers(0, 63), own=st.booleans(), other=keys, consumer=consumers, live=st.booleans())
    def check_consumer(self, idx, own, other, consumer, live):
        ref = self.pick(idx, live)
        exp_key = ref.key if own else other
        before = self.pool.snapshot()
        self.checked("check_consumer", lambda: self.pool.check_consumer(ref, exp_key, consumer),
                     self.predict_consumer(ref, exp_key, consumer))
        assert self.pool.snapshot() == before  # a check never mutates

    def apply_consumed(self, ref, consumer):
        self.slots[ref.slot][1] |= consumer.value
        if self.slots[ref.slot][1] == 3:
            del self.slots[ref.slot]
            return True
        return False

    @precondition(lambda self: self.refs)
    @rule(idx=st.integers(0, 63), consumer=consumers, live=st.booleans())
    def mark_consumed(self, idx, consumer, live):
        ref = self.pick(idx, live)
        expected = self.predict_consumer(ref, ref.key, consumer)
        released = self.checked("mark_consumed", lambda: self.pool.mark_consumed(ref, consumer), expected)
        if expected is None:
            assert released is self.apply_consumed(ref, consumer)

    @precondition(lambda self: self.refs)
    @rule(idx=st.integers(0, 63), own=st.integers(0, 3), other=keys, consumer=consumers,
          fail=st.integers(0, 3), live=st.booleans())
    def consume(self, idx, own, other, consumer, fail, live):
        ref = self.pick(idx, live)
        exp_key = ref.key if own else other  # mostly the reference's own key
        fail = fail == 0  # the action raises one time in four
        expected = self.predict_consumer(ref, exp_key, consumer)
        ran = []

        def body():
            with self.pool.consume(ref, exp_key, consumer) as tape:
                ran.append(tape.key)
                if fail:
                    raise KeyError("action failed")

        if expected is None and fail:
            outcome(body, KeyError)
            event("pool: consume -> action failed, aborted")
            del self.slots[ref.slot]  # aborted
        else:
            self.checked("consume", body, expected)
            if expected is None:
                self.apply_consumed(ref, consumer)
        assert ran == ([ref.key] if expected is None else [])

    @precondition(lambda self: self.refs)
    @rule(idx=st.integers(0, 63))
    def abort(self, idx):
        ref = self.pick(idx)
        expected = self.predict_resolve(ref, ref.key)
        self.checked("abort", lambda: self.pool.abort(ref), expected)
        if expected is None:
            del self.slots[ref.slot]

    @rule(epoch=st.integers(0, 1))
    def purge(self, epoch):
        doomed = sorted(s for s, (k, _) in self.slots.items() if k.e == epoch)
        assert self.pool.purge(epoch) == [self.slots[s][0] for s in doomed]
        for s in doomed:
            del self.slots[s]

    @invariant()
    def state_matches_model(self):
        if not hasattr(self, "pool"):
            return
        assert self.pool.live_keys() == [self.slots[s][0] for s in sorted(self.slots)]
        assert self.pool.live_count == len(self.slots) and self.pool.peak_live == self.peak
        assert [self.pool.generation_of(s) for s in range(self.cap)] == self.gens
        for s, (key, mask) in self.slots.items():
            tape = self.pool.resolve(TapeRef(s, self.gens[s], key), key)
            assert tape.consumers.value == mask


# ---------------------------------------------------------------------------------------------- arena
SPECS = {"a": ((2, 3), torch.float32), "b": ((4,), torch.bfloat16), "c": ((1,), torch.float32)}
names = st.sampled_from(list(SPECS))
kinds = st.sampled_from(["own", "other", "fresh", "reshaped"])


class ArenaMachine(RuleBasedStateMachine):
    @initialize(M=st.integers(1, 3))
    def setup(self, M):
        self.M = M
        self.arena = GradientArena(SPECS, M, name="model")
        self.ptrs = {k: self.arena.view(*k).data_ptr() for k in self.arena.keys()}
        self.written: set = set()
        self.values: dict = {}
        self.usable, self.finalized, self.epoch = True, False, 0

    def dest(self, name, m, kind, other_name):
        shape, dtype = SPECS[name]
        if m >= self.M:
            return torch.zeros(shape, dtype=dtype)
        own = self.arena.view(name, m)
        if kind == "own":
            return own
        if kind == "other":
            if other_name == name:
                return self.arena.view(name, (m + 1) % self.M) if self.M > 1 else self.arena.view(
                    next(n for n in SPECS if n != name), 0)
            return self.arena.view(other_name, min(m, self.M - 1))
        if kind == "fresh":
            return torch.zeros(shape, dtype=dtype)
        return own.view(-1, 1)  # reshaped: same storage, another shape

    def predict(self, op, name=None, m=None, kind="own"):
        """Expected violated relation, or None for success."""
        if not self.usable:
            return "aborted arena"
        if op in ("bind", "record"):
            if m >= self.M:
                return "unknown view"
            if kind != "own":
                return "aliased write" if op == "record" and kind == "other" else "wrong binding"
            if op == "record" and (name, m) in self.written:
                return "duplicate write"
            return None
        if op == "finalize":
            return "missing write" if len(self.written) < len(SPECS) * self.M else None
        if op == "sum":
            return None if self.finalized else "sum before finalize"
        if op == "advance":
            return None if self.finalized else "advance before finalize"
        raise AssertionError(op)

    def checked(self, op, fn, relation):
        before = self.arena.snapshot()
        result = outcome(fn, None if relation is None else ArenaViolation)
        event(f"arena: {op} -> {relation or 'ok'}")
        if relation is not None:
            assert result.relation == relation, (result.relation, relation, str(result))
            assert self.arena.snapshot() == before
        return result

    @rule(name=names, m=st.integers(0, 3), kind=kinds, other=names)
    def bind(self, name, m, kind, other):
        d = self.dest(name, m, kind, other)
        out = self.checked("bind", lambda: self.arena.bind(name, m, d), self.predict("bind", name, m, kind))
        if isinstance(out, torch.Tensor):
            assert out is self.arena.view(name, m)

    @rule(name=names, m=st.integers(0, 3), kind=kinds, other=names, value=st.sampled_from([0.5, -3.0, 1e4, 7.25]))
    def record_write(self, name, m, kind, other, value):
        d = self.dest(name, m, kind, other)
        relation = self.predict("record", name, m, kind)
        if relation is None:
            d.fill_(value)  # the dW's write
        self.checked("record_write", lambda: self.arena.record_write(name, m, d), relation)
        if relation is None:
            self.written.add((name, m))
            self.values[(name, m)] = value

    @precondition(lambda self: self.usable)
    @rule(order=st.randoms(use_true_random=False), value=st.sampled_from([0.1, -2.5, 3e3]))
    def write_remaining(self, order, value):
        """Write every missing view (as a whole epoch of dW would), in a random schedule order."""
        todo = [k for k in self.arena.keys() if k not in self.written]
        order.shuffle(todo)
        for j, (name, m) in enumerate(todo):
            self.record_write(name, m, "own", name, value * (j + 1))

    @rule()
    def finalize(self):
        relation = self.predict("finalize")
        self.checked("finalize", self.arena.finalize, relation)
        if relation is None:
            self.finalized = True

    @rule(name=names)
    def sum_microbatches(self, name):
        out = self.checked("sum", lambda: self.arena.sum_microbatches(name), self.predict("sum"))
        if isinstance(out, torch.Tensor):
            shape, dtype = SPECS[name]
            ref = torch.full(shape, self.values[(name, 0)], dtype=dtype)
            for m in range(1, self.M):
                ref += torch.full(shape, self.values[(name, m)], dtype=dtype)
            assert torch.equal(out, ref)

    @rule()
    def advance_epoch(self):
        relation = self.predict("advance")
        self.checked("advance_epoch", self.arena.advance_epoch, relation)
        if relation is None:
            self.epoch += 1
            self.written.clear()
            self.finalized = False
            assert all(torch.count_nonzero(self.arena.view(*k)) == 0 for k in self.arena.keys())

    @rule()
    def abort(self):
        self.arena.abort()
        self.usable, self.finalized = False, False

    @rule()
    def rebuild(self):
        self.arena.rebuild()
        self.usable, self.finalized = True, False
        self.written.clear()

    @invariant()
    def state_matches_model(self):
        if not hasattr(self, "arena"):
            return
        a = self.arena
        assert (a.usable, a.finalized, a.epoch) == (self.usable, self.finalized, self.epoch)
        assert a.written == self.written
        assert a.missing() == [k for k in a.keys() if k not in self.written]
        assert {k: a.view(*k).data_ptr() for k in a.keys()} == self.ptrs


TestTapePoolModel = TapePoolMachine.TestCase
TestTapePoolModel.settings = SETTINGS
TestArenaModel = ArenaMachine.TestCase
TestArenaModel.settings = SETTINGS


def test_model_catches_a_broken_pool(monkeypatch):
    """The model must be able to fail: a pool that forgets to bump generations is caught."""
    from qeffect.contracts import tape as tape_mod

    orig = tape_mod.TapePool.allocate

    def no_bump(self, key, payload=None):
        ref = orig(self, key, payload)
        if self._generations[ref.slot] > 1:  # undo the bump: reused slots keep generation 1 (ABA)
            self._generations[ref.slot] = 1
            self._slots[ref.slot].generation = 1
            return TapeRef(ref.slot, 1, key)
        return ref

    monkeypatch.setattr(tape_mod.TapePool, "allocate", no_bump)
    with pytest.raises(AssertionError, match=r"generation"):  # the model's generation check fires
        run_state_machine_as_test(TapePoolMachine, settings=settings(SETTINGS, max_examples=200))
