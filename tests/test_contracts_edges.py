"""Edges of the contracts that the behavioural tests pass by: defaults, argument validation, layout
alignment, overlap bounds, the host snapshots' fields, the operation each rejection names. Each test here
kills mutants that `scripts/mutation.sh` found surviving (docs/results/2026-12-05-mutation.md)."""

from __future__ import annotations

import enum
import re

import pytest
import torch

from qeffect.contracts import (
    ALIGN_BYTES,
    ArenaViolation,
    CheckedCompletionLedger,
    CommitBarrier,
    CompletionLedger,
    Consumer,
    ContractViolation,
    EffectLedger,
    EpochClock,
    GradientArena,
    InvocationKey,
    ReductionTracker,
    TapePool,
    TapeRef,
    TapeViolation,
    completion_ledger,
)
from qeffect.verify.state import _Tally, bitwise_equal

K0, K1 = InvocationKey(0, 0, 0), InvocationKey(0, 0, 1)


# ------------------------------------------------------------------------------------------------ arena
def _staged(defer: bool = True) -> GradientArena:
    return GradientArena({"w": ((4,), torch.float32)}, 3, name="C", accumulate=True, staging=2, defer_last_fold=defer)


def _aborted(arena: GradientArena) -> GradientArena:
    arena.abort()
    return arena


@pytest.mark.parametrize("bad", [True, 1.5, 2.0, "2"])
def test_arena_microbatches_and_staging_must_be_ints(bad) -> None:
    with pytest.raises(ValueError, match=r"microbatches must be an int >= 1, got "):
        GradientArena({"w": ((2,), torch.float32)}, bad)
    with pytest.raises(ValueError, match=r"staging must be an int >= 0, got "):
        GradientArena({"w": ((2,), torch.float32)}, 2, accumulate=True, staging=bad)


def test_every_view_and_staging_slot_starts_aligned() -> None:
    """Offsets from each buffer's start are multiples of ALIGN_BYTES (the first one included)."""
    specs = {"a": ((3,), torch.float32), "b": ((5,), torch.bfloat16), "c": ((7,), torch.float32)}
    for kw in ({}, {"accumulate": True}, {"accumulate": True, "staging": 2,
                                            "staging_dtypes": {"a": torch.bfloat16, "c": torch.bfloat16}}):
        a = GradientArena(specs, 3, **kw)
        bases = {b.dtype: b.data_ptr() for (kind, _), b in a._buffers.items() if kind != "staging"}
        staging = {b.dtype: b.data_ptr() for (kind, _), b in a._buffers.items() if kind == "staging"}
        for name, m in a.keys():
            v = a.view(name, m)
            base = (staging if kw.get("staging") else bases)[v.dtype]
            assert (v.data_ptr() - base) % ALIGN_BYTES == 0, (kw, name, m)
        for name in a.specs if kw.get("accumulate") else ():
            assert (a.region(name).data_ptr() - bases[a.region(name).dtype]) % ALIGN_BYTES == 0


def test_arena_lives_on_its_device() -> None:
    for kw in ({}, {"accumulate": True, "staging": 2}):
        a = GradientArena({"w": ((4,), torch.float32)}, 2, device="meta", **kw)
        assert a.device == torch.device("meta") and all(b.device.type == "meta" for b in a._buffers.values())
        assert a.view("w", 1).device.type == "meta"


def test_overlap_bounds_are_byte_exact() -> None:
    """A destination straddling two views overlaps both; one touching a view's end overlaps none of it; a
    one-element destination inside another view is an alias."""
    a = GradientArena({"w": ((64,), torch.float32)}, 2, name="A")  # 256 bytes each: w[m=0] then w[m=1]
    buf = a._buffers[("views", torch.float32)]
    with pytest.raises(ArenaViolation, match=r"aliased write") as e:
        a.check_write("w", 1, buf[32:96])  # the second half of w[m=0] and the first of w[m=1]
    assert e.value.found == [("w", 0)]  # its own view aside
    with pytest.raises(ArenaViolation, match=r"overlapping view\(s\) w\[m=1\]") as e:
        a.check_write("w", 0, a.view("w", 1)[:1])
    assert e.value.found == [("w", 1)]
    b = GradientArena({"p": ((64,), torch.float32), "q": ((64,), torch.float32), "r": ((64,), torch.float32)}, 1,
                      name="B")
    with pytest.raises(ArenaViolation, match=r"overlapping view\(s\) r\[m=0\]$") as e:
        b.check_write("p", 0, b.view("r", 0))  # starts exactly where q ends: q is not touched
    assert e.value.found == [("r", 0)]
    s = _staged()
    block = s._blocks["w"]
    with pytest.raises(ArenaViolation, match=r"wrong binding"):
        s.check_write("w", 0, block[1, :4])  # its own slot 1: not dW(0)'s, and not another parameter's
    t = GradientArena({"w": ((64,), torch.float32), "v": ((64,), torch.float32)}, 3, accumulate=True, staging=2)
    with pytest.raises(ArenaViolation, match=r"aliased write .*overlapping view\(s\) v\[m=1\]") as e:
        t.check_write("w", 0, t._blocks["v"][1, 60:124])  # the tail of v's slot 1 only
    assert e.value.found == [("v", 1)]


def test_check_write_refuses_a_non_tensor_as_a_wrong_binding() -> None:
    a = GradientArena({"w": ((4,), torch.float32)}, 1, name="A")
    with pytest.raises(ArenaViolation, match=r"wrong binding for arena 'A' view w\[m=0\] in check_write: expected "
                                             r"type torch.Tensor, found str"):
        a.check_write("w", 0, "x")
    with pytest.raises(ArenaViolation, match=r"wrong binding .* expected device cpu, found meta"):
        a.check_write("w", 0, torch.zeros(4, device="meta"))


def test_flags_are_booleans_through_every_transition() -> None:
    a = GradientArena({"w": ((2,), torch.float32)}, 1)
    assert a.finalized is False and a.usable is True
    a.record_write("w", 0, a.view("w", 0))
    a.finalize()
    assert a.finalized is True
    a.advance_epoch()
    assert a.finalized is False and a.epoch == 1
    a.record_write("w", 0, a.view("w", 0))
    a.finalize()
    a.abort()
    assert a.usable is False and a.finalized is False
    a.rebuild()
    assert a.usable is True and a.finalized is False and a.written == frozenset()


OPS = [  # (arena, call, message, key): the operation an aborted arena names, and where
    ("views", lambda a: a.bind("w", 0, a.view("w", 0)), "aborted arena for arena 'A' view w[m=0]: expected a "
     "usable arena for bind, found it aborted in epoch 0; rebuild() it first", ("w", 0)),
    ("views", lambda a: a.advance_epoch(), "aborted arena for arena 'A': expected a usable arena for advance_epoch",
     None),
    ("views", lambda a: a.sum_microbatches("w"), "aborted arena for arena 'A': expected a usable arena for "
     "sum_microbatches", ("w", None)),
    ("staged", lambda a: a.flush("w", 1), "aborted arena for arena 'C' view w[m=1]: expected a usable arena for "
     "flush", ("w", 1)),
    ("staged", lambda a: a.storage_views("w"), "aborted arena for arena 'C': expected a usable arena for fold",
     ("w", None)),
    ("staged", lambda a: a.take_pending_fold("w"), "aborted arena for arena 'C': expected a usable arena for "
     "take_pending_fold", ("w", None)),
]


@pytest.mark.parametrize(("kind", "call", "message", "key"), OPS, ids=[m.split(" for ")[-1][:24] for *_, m, _ in OPS])
def test_an_aborted_arena_names_the_operation(kind, call, message, key) -> None:
    a = _aborted(GradientArena({"w": ((4,), torch.float32)}, 2, name="A") if kind == "views" else _staged())
    with pytest.raises(ArenaViolation, match="^" + re.escape(f"[arena] {message}")) as e:
        call(a)
    assert str(e.value).startswith(f"[arena] {message}") and e.value.key == key


LOOKUPS = [
    ("bind", lambda a: a.bind("z", 0, torch.zeros(4))),
    ("check_write", lambda a: a.check_write("z", 0, torch.zeros(4))),
    ("record_write", lambda a: a.record_write("z", 0, torch.zeros(4))),
    ("storage_views", lambda a: a.storage_views("z")),
    ("prefix_sum", lambda a: a.prefix_sum("w", 2)),  # w[m=2] of 2 microbatches
]


@pytest.mark.parametrize(("op", "call"), LOOKUPS, ids=[op for op, _ in LOOKUPS])
def test_an_unknown_view_names_the_operation(op, call) -> None:
    a = GradientArena({"w": ((4,), torch.float32)}, 2, name="A")
    with pytest.raises(ArenaViolation, match=rf"unknown view for arena 'A': .* in {op}$"):
        call(a)


def test_sum_of_an_unknown_parameter_names_sum_microbatches() -> None:
    a = GradientArena({"w": ((4,), torch.float32)}, 2, name="A")
    for m in range(2):
        a.record_write("w", m, a.view("w", m))
    a.finalize()
    with pytest.raises(ArenaViolation, match=r"unknown view for arena 'A': .*\('z', 0\) in sum_microbatches$"):
        a.sum_microbatches("z")


def test_prefix_sum_of_per_microbatch_views_is_the_ordered_sum() -> None:
    a = GradientArena({"w": ((3,), torch.float32)}, 3)
    for m, x in enumerate((1e8, 1.0, -1e8)):
        a.view("w", m).fill_(x)
    assert torch.equal(a.prefix_sum("w", 0), torch.full((3,), 1e8))
    assert torch.equal(a.prefix_sum("w", 2), (torch.full((3,), 1e8) + 1.0) - 1e8)  # m order: 0.0, not 1.0
    assert a.prefix_sum("w", 1).data_ptr() != a.view("w", 0).data_ptr()


def test_flushes_is_false_without_staging() -> None:
    for kw in ({}, {"accumulate": True}):
        a = GradientArena({"w": ((2,), torch.float32)}, 3, **kw)
        assert [a.flushes(m) for m in range(3)] == [False] * 3
    assert [_staged(defer=False).flushes(m) for m in range(3)] == [False, True, True]
    assert [_staged().flushes(m) for m in range(3)] == [False, True, False]


def test_arena_snapshot_fields() -> None:
    a = GradientArena({"w": ((2,), torch.float32), "h": ((2,), torch.bfloat16)}, 1, name="A")
    a.record_write("w", 0, a.view("w", 0))
    name, epoch, usable, finalized, written, buffers = a.snapshot()
    assert (name, epoch, usable, finalized, written) == ("A", 0, True, False, (("w", 0),))
    assert buffers == tuple((kind, str(dt), b.data_ptr()) for (kind, dt), b in a._buffers.items())
    assert {dt for _, dt, _ in buffers} == {"torch.float32", "torch.bfloat16"}


# ----------------------------------------------------------------------------------------------- commit
def test_reasons_list_every_arena_and_every_item() -> None:
    pool = TapePool(2, "P")
    pool.allocate(K0)
    pool.allocate(K1)
    bad, partial = (GradientArena({"w": ((2,), torch.float32)}, 2, name=n) for n in ("bad", "part"))
    bad.abort()
    red = ReductionTracker("R")
    red.start("a")
    red.start("b")
    barrier = CommitBarrier(EpochClock(), [pool], [bad, partial], red)
    assert barrier.reasons() == [
        "pool 'P' has 2 live tape(s) [K(e=0,s=0,m=0,u=0,i=0), K(e=0,s=0,m=1,u=0,i=0)]",
        "arena 'bad' is aborted (rebuild() it)",
        "arena 'part' has 2 missing write(s) [w[m=0], w[m=1]]",
        "tracker 'R' has 2 pending reduction(s) [a, b]"]
    for m in range(2):
        partial.record_write("w", m, partial.view("w", m))
    assert barrier.reasons("checkpoint")[2] == "arena 'part' has writes in flight [w[m=0], w[m=1]]"


def test_reduction_handles_count_from_zero() -> None:
    red = ReductionTracker()
    assert red.name == "reductions" and red.snapshot() == ("reductions", 0, ())
    assert [red.start(n) for n in "abc"] == [0, 1, 2]
    assert red.snapshot() == ("reductions", 0, ((0, "a"), (1, "b"), (2, "c")))
    red.finish(1)
    assert red.pending() == ["a", "c"] and red.start("d") == 3


# ------------------------------------------------------------------------------------------- completion
class _Ops:
    def new_event(self, name):
        return object()

    def record(self, event, stream):
        pass

    def wait(self, stream, event):
        pass


def test_completion_defaults_and_snapshots() -> None:
    assert completion_ledger(_Ops()).name == "completions" and not completion_ledger(_Ops()).checked
    assert completion_ledger(_Ops(), checked=True).name == "completions"
    assert CheckedCompletionLedger(_Ops()).name == "completions" and CompletionLedger(_Ops()).name == "completions"
    for led in (CompletionLedger(_Ops(), "L"), CheckedCompletionLedger(_Ops(), "L")):
        ev = led.record("k", "p")
        snap = led.snapshot()
        assert snap[:2] == ("L", (("k", id(ev)),))
        if led.checked:
            led.wait("k", "c")
            assert led.snapshot()[2] == (("k", id(ev), "'p'", 1, (("'c'", 1),)),)


# ------------------------------------------------------------------------------------- errors and keys
def test_build_without_a_key_and_the_exception_args() -> None:
    err = ContractViolation.build("rule", expected=1, found=2)
    assert str(err) == "[contract] rule: expected 1, found 2" and err.key is None
    assert err.args == ("[contract] rule: expected 1, found 2",)
    assert str(ContractViolation.build("rule", key="k", expected=1, found=2, what="n", note="x")) == (
        "[contract] rule for k: expected n 1, found 2; x")


class _Small(enum.IntEnum):
    ZERO = 0
    ONE = 1


def test_keys_take_ints_and_int_subclasses_but_no_bools_or_floats() -> None:
    k = InvocationKey(_Small.ZERO, _Small.ONE, 0)
    assert (k.e, k.s) == (0, 1)
    with pytest.raises(ValueError, match=r"^InvocationKey\.e must be an int, got float 0\.5$"):
        InvocationKey(0.5, 0, 0)
    with pytest.raises(ValueError, match=r"^InvocationKey\.m must be an int, got bool True$"):
        InvocationKey(0, 0, True)
    with pytest.raises(ValueError, match=r"^InvocationKey\.u must be >= 0, got -1$"):
        InvocationKey(0, 0, 0, -1)


# ------------------------------------------------------------------------------------------------- tape
def test_pool_defaults_and_fresh_state() -> None:
    pool = TapePool(2)
    assert pool.name == "tapes" and pool.peak_live == 0 and pool.live_count == 0
    assert pool.snapshot() == ("tapes", 2, (0, 0), (None, None), 0)


def test_released_tapes_are_dead_and_non_refs_are_refused() -> None:
    pool = TapePool(1, "P")
    ref = pool.allocate(K0)
    with pool.consume(ref, K0, Consumer.DI) as tape:
        pass
    assert tape.live is True
    with pool.consume(ref, K0, Consumer.DW):
        pass
    assert tape.live is False and tape.payload == {}
    for call in (lambda: pool.abort("x"), lambda: pool.mark_consumed("x", Consumer.DI)):
        with pytest.raises(TapeViolation, match=r"^\[tape-reference\] not a tape reference: expected TapeRef, found str$"):
            call()
    with pytest.raises(TapeViolation, match=r"slot out of range .*expected slot in \[0, 1\), found 1"):
        pool.resolve(TapeRef(1, 1, K0), K0)


def test_pool_snapshot_sees_payload_identity() -> None:
    pool = TapePool(1)
    ref = pool.allocate(K0, {"a": torch.zeros(1)})
    tape = pool.resolve(ref, K0)
    before = pool.snapshot()
    tape.payload = dict(tape.payload)  # the same entries in another dict
    assert pool.snapshot() != before
    before = pool.snapshot()
    tape.payload["a"] = tape.payload["a"].clone()  # another value object
    assert pool.snapshot() != before


# ------------------------------------------------------------------------------------------------ token
def test_ledger_device_history_and_given_values() -> None:
    led = EffectLedger("L")
    assert led.device == torch.device("cpu") and led.current.value.device.type == "cpu"
    meta = EffectLedger("M", "meta")
    assert meta.device == torch.device("meta") and meta.current.value.device.type == "meta"
    assert meta.snapshot() == ("M", "meta", 0, id(meta.current), ())
    tok = led.current
    for i in range(70):
        tok = led.consume(tok, f"a{i}")
    assert len(led.history) == 64 and led.history[0] == (6, "a6")
    given = torch.tensor(41)
    nxt = led.consume(tok, "g", value=given)
    assert nxt.value is given and nxt.seq == 71
    assert int(led.consume(nxt, "h").value) == 42


# ------------------------------------------------------------------------------------------- comparison
def test_tally_counts_each_mismatch() -> None:
    t = _Tally()
    t.compare((0, "F", 0, 0), "activations", {"a": torch.tensor(1.0), "b": torch.tensor(2.0)},
              {"a": torch.tensor(-1.0), "b": torch.tensor(-2.0)})
    assert t.mismatches["activations"] == 2


def test_a_comparison_across_devices_moves_the_second_tensor() -> None:
    with pytest.raises(NotImplementedError, match=r"Cannot copy out of meta tensor"):
        bitwise_equal(torch.zeros(2), torch.zeros(2, device="meta"))  # b.to(a.device): a copy out of meta
