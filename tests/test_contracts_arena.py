"""Gradient arena: fixed views, binding checks, write accounting, fixed-order sum, abort/rebuild."""

from __future__ import annotations

import random

import pytest
import torch

from qeffect.contracts import ALIGN_BYTES, ArenaViolation, GradientArena
from qeffect.contracts.arena import sequential_reduce

SPECS = {"w1": ((3, 4), torch.float32), "w2": ((5,), torch.bfloat16), "w3": ((2, 2), torch.float32)}


def make(M=3):
    return GradientArena(SPECS, microbatches=M, name="g")


def write_all(arena, order=None):
    keys = list(arena.keys()) if order is None else order
    for k in keys:
        arena.record_write(*k, arena.view(*k))


def test_layout_fixed_aligned_disjoint():
    a = make()
    keys = list(a.keys())
    assert keys == [(n, m) for n in SPECS for m in range(3)]
    spans = []
    for n, m in keys:
        v = a.view(n, m)
        shape, dtype = SPECS[n]
        assert tuple(v.shape) == shape and v.dtype == dtype and v.is_contiguous()
        assert v.data_ptr() % ALIGN_BYTES == a.view(n, 0).data_ptr() % ALIGN_BYTES
        spans.append((v.data_ptr(), v.data_ptr() + v.numel() * v.element_size()))
        assert torch.count_nonzero(v) == 0
    spans.sort()
    assert all(hi <= lo2 for (_, hi), (lo2, _) in zip(spans, spans[1:], strict=False))
    assert a.view("w1", 1).data_ptr() - a.view("w1", 0).data_ptr() == ALIGN_BYTES  # 48 bytes, padded
    assert a.nbytes >= sum(torch.Size(s).numel() * d.itemsize * 3 for s, d in SPECS.values())
    assert a.view("w1", 2) is a.view("w1", 2)


def test_bind_checks_each_property():
    a = make()
    v = a.view("w1", 0)
    assert a.bind("w1", 0, v) is v
    assert a.bind("w1", 0, v.view(3, 4)) is v  # another tensor object on the same storage is fine
    cases = {
        "shape": v.view(4, 3),
        "dtype": v.view(torch.int32),
        "device": torch.empty(3, 4, device="meta"),
        "data_ptr": torch.zeros(3, 4),
        "stride": v.as_strided((3, 4), (1, 3)),
        "type": [[0.0] * 4] * 3,
    }
    before = a.snapshot()
    for prop, dest in cases.items():
        with pytest.raises(ArenaViolation, match=f"wrong binding .* expected {prop}") as ei:
            a.bind("w1", 0, dest)
        assert ei.value.relation == "wrong binding" and ei.value.key == ("w1", 0)
    with pytest.raises(ArenaViolation, match="unknown view"):
        a.bind("w1", 3, v)
    with pytest.raises(ArenaViolation, match="unknown view"):
        a.view("nope", 0)
    assert a.snapshot() == before


def test_record_write_rejections_preserve_state():
    a = make()
    a.record_write("w1", 0, a.view("w1", 0))
    before = a.snapshot()
    with pytest.raises(ArenaViolation, match="duplicate write"):
        a.record_write("w1", 0, a.view("w1", 0))
    with pytest.raises(ArenaViolation, match=r"aliased write .* w1\[m=1\]") as ei:
        a.record_write("w1", 2, a.view("w1", 1))
    assert ei.value.found == [("w1", 1)]
    # a destination spanning two views names both
    flat = a.view("w3", 0).view(-1)
    span = torch.as_strided(flat, (8,), (1,))  # w3 m=0 has 4 elements; 8 reaches into padding only
    assert not [k for k in a._overlapping(span) if k != ("w3", 0)]
    big = torch.as_strided(flat, (2, 4), (64, 1))  # rows at w3 m=0 and w3 m=1
    with pytest.raises(ArenaViolation, match=r"aliased write .*w3\[m=1\]"):
        a.record_write("w3", 0, big)
    with pytest.raises(ArenaViolation, match=r"aliased write .*w3\[m=0\], w3\[m=1\]"):
        a.record_write("w3", 2, big)
    with pytest.raises(ArenaViolation, match="wrong binding .* data_ptr"):
        a.record_write("w1", 1, torch.zeros(3, 4))
    with pytest.raises(ArenaViolation, match="unknown view"):
        a.record_write("w9", 0, torch.zeros(1))
    assert a.snapshot() == before and a.written == {("w1", 0)}
    a.check_write("w1", 1, a.view("w1", 1))
    assert a.snapshot() == before  # check_write records nothing
    with pytest.raises(ArenaViolation, match="duplicate write"):
        a.check_write("w1", 0, a.view("w1", 0))


def test_record_checked_records_once_and_refuses_a_duplicate_or_an_aborted_arena():
    a = make()
    a.check_write("w1", 0, a.view("w1", 0))
    a.record_checked("w1", 0)
    assert a.written == {("w1", 0)}
    before = a.snapshot()
    with pytest.raises(ArenaViolation, match="duplicate write"):
        a.record_checked("w1", 0)
    assert a.snapshot() == before
    a.abort()
    with pytest.raises(ArenaViolation, match="aborted arena"):
        a.record_checked("w1", 1)


def test_finalize_missing_then_complete():
    a = make(2)
    a.record_write("w2", 1, a.view("w2", 1))
    with pytest.raises(ArenaViolation, match="missing write") as ei:
        a.finalize()
    assert "w1[m=0]" in str(ei.value) and "w2[m=0]" in str(ei.value) and "w2[m=1]" not in str(ei.value)
    assert a.missing() == [("w1", 0), ("w1", 1), ("w2", 0), ("w3", 0), ("w3", 1)] and not a.finalized
    with pytest.raises(ArenaViolation, match="sum before finalize"):
        a.sum_microbatches("w1")
    with pytest.raises(ArenaViolation, match="advance before finalize"):
        a.advance_epoch()
    write_all(a, [k for k in a.keys() if k != ("w2", 1)])
    assert a.finalize() is None and a.finalized and a.missing() == []


def test_sum_fixed_order_bitwise_any_write_order():
    M = 5
    gen = torch.Generator().manual_seed(0)
    # magnitudes spread over many binades so that the summation order changes the bits
    grads = [(torch.randn(3, 4, generator=gen) * 10.0 ** (3 * m - 6)).float() for m in range(M)]
    ref = grads[0].clone()
    for g in grads[1:]:
        ref += g  # the reference accumulates microbatch by microbatch
    rev = grads[-1].clone()
    for g in reversed(grads[:-1]):
        rev += g
    assert not torch.equal(ref, rev)  # the data is order-sensitive, so this test can fail

    for seed in range(4):
        a = GradientArena({"w": ((3, 4), torch.float32)}, microbatches=M)
        order = list(range(M))
        random.Random(seed).shuffle(order)
        for m in order:  # dW in an arbitrary (non-LIFO) schedule order
            d = a.bind("w", m, a.view("w", m))
            d.add_(grads[m])
            a.record_write("w", m, d)
        a.finalize()
        out = a.sum_microbatches("w")
        assert torch.equal(out, ref)
        assert out.data_ptr() != a.view("w", 0).data_ptr()  # a clone: views stay intact
        assert torch.equal(a.view("w", 0), grads[0])


def test_advance_epoch_clears_and_zeroes_keeping_addresses():
    a = make(2)
    ptrs = {k: a.view(*k).data_ptr() for k in a.keys()}
    for k in a.keys():
        a.view(*k).fill_(1)
    write_all(a)
    a.finalize()
    assert a.advance_epoch() == 1 and a.epoch == 1
    assert a.written == frozenset() and not a.finalized and len(a.missing()) == 6
    assert all(torch.count_nonzero(a.view(*k)) == 0 for k in a.keys())
    assert {k: a.view(*k).data_ptr() for k in a.keys()} == ptrs
    write_all(a)  # each view can be written again in the new epoch
    a.finalize()
    a.view("w1", 0).fill_(2)
    a.advance_epoch(zero=False)
    assert torch.all(a.view("w1", 0) == 2)


def test_abort_unusable_until_rebuild():
    a = make(2)
    ptrs = {k: a.view(*k).data_ptr() for k in a.keys()}
    a.record_write("w1", 0, a.view("w1", 0))
    a.view("w1", 0).fill_(3)
    a.abort()
    assert not a.usable
    before = a.snapshot()
    for call in (lambda: a.bind("w1", 1, a.view("w1", 1)), lambda: a.record_write("w1", 1, a.view("w1", 1)),
                 a.finalize, lambda: a.sum_microbatches("w1"), a.advance_epoch,
                 lambda: a.check_write("w1", 1, a.view("w1", 1))):
        with pytest.raises(ArenaViolation, match="aborted arena"):
            call()
    assert a.snapshot() == before
    a.rebuild()
    assert a.usable and a.written == frozenset() and a.epoch == 0
    assert torch.count_nonzero(a.view("w1", 0)) == 0
    assert {k: a.view(*k).data_ptr() for k in a.keys()} == ptrs
    write_all(a)
    a.finalize()
    a.abort()
    a.rebuild(epoch=4)
    assert a.epoch == 4 and a.usable


def test_constructor_validation():
    with pytest.raises(ValueError, match=r"microbatches must be an int >= 1, got 0"):
        GradientArena(SPECS, microbatches=0)
    with pytest.raises(ValueError, match=r"GradientArena needs at least one parameter spec"):
        GradientArena({}, microbatches=1)
    with pytest.raises(ValueError, match=r"arena spec 'w': shape must be positive ints, got \(0, 3\)"):
        GradientArena({"w": ((0, 3), torch.float32)}, microbatches=1)
    with pytest.raises(ValueError, match=r"arena spec 'w': dtype must be a torch\.dtype, got 'float32'"):
        GradientArena({"w": ((2,), "float32")}, microbatches=1)  # type: ignore[dict-item]


# ------------------------------------------------------------------ accumulating layout
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

FP32 = {"w": ((64,), torch.float32), "v": ((8, 8), torch.float32)}  # 256-byte regions: no padding


def _grads(M, shape, seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    # wide exponents, so that a different association would change the bits
    return [(torch.randn(shape, generator=g) * 10.0 ** torch.randint(-4, 5, shape, generator=g)).to(dtype)
            for _ in range(M)]


def _accumulate(arena, name, grads):
    for m, gm in enumerate(grads):
        dest = arena.view(name, m)
        arena.check_write(name, m, dest)
        if arena.overwrites(m):
            dest.copy_(gm)
        else:
            dest.add_(gm)
        arena.record_write(name, m, dest)


def test_accumulating_layout_one_region_per_parameter():
    a = GradientArena(FP32, microbatches=4, accumulate=True)
    b = GradientArena(FP32, microbatches=4)
    assert a.nbytes * 4 == b.nbytes
    for n in FP32:
        ptrs = {a.view(n, m).data_ptr() for m in range(4)}
        assert len(ptrs) == 1 and len(a.storage_views(n)) == 1 and len(b.storage_views(n)) == 4
    assert [a.overwrites(m) for m in range(3)] == [True, False, False]
    assert [b.overwrites(m) for m in range(3)] == [True, True, True]


@settings(max_examples=25, deadline=None)
@given(M=st.integers(1, 6), seed=st.integers(0, 2**31 - 1), bf16=st.booleans())
def test_accumulating_sum_has_the_fixed_order_bits(M, seed, bf16):
    """copy(g0); add(g1); ... in the region == the per-microbatch views summed in order m = 0..M-1.
    With bf16 gradients (TE's wgrad) the mixed-dtype add is the exact cast-then-add."""
    grads = _grads(M, (64,), seed, torch.bfloat16 if bf16 else torch.float32)
    per_m = GradientArena({"w": ((64,), torch.float32)}, microbatches=M)
    for m, gm in enumerate(grads):
        per_m.view("w", m).copy_(gm)
        per_m.record_write("w", m, per_m.view("w", m))
    per_m.finalize()
    acc = GradientArena({"w": ((64,), torch.float32)}, microbatches=M, accumulate=True)
    _accumulate(acc, "w", grads)
    acc.finalize()
    assert torch.equal(acc.sum_microbatches("w"), per_m.sum_microbatches("w"))
    cast_then_add = grads[0].float().clone()
    for gm in grads[1:]:
        cast_then_add += gm.float()
    assert torch.equal(acc.sum_microbatches("w"), cast_then_add)


def test_reversed_association_changes_bits():
    """The oracle above can fail: the same gradients added in another order give other bits."""
    grads = _grads(6, (64,), 3)
    fwd, rev = grads[0].clone(), grads[-1].clone()
    for gm in grads[1:]:
        fwd += gm
    for gm in reversed(grads[:-1]):
        rev += gm
    assert not torch.equal(fwd, rev)


def test_accumulating_out_of_order_write_is_refused_before_it_lands():
    a = GradientArena(FP32, microbatches=3, accumulate=True)
    _accumulate(a, "w", _grads(1, (64,), 0))
    before = a.view("w", 0).clone()
    with pytest.raises(ArenaViolation,
                       match=r"out-of-order accumulation for arena 'arena' view w\[m=2\]: expected microba"
                             r"tch 1 next") as e:
        a.check_write("w", 2, a.view("w", 2))
    assert e.value.relation == "out-of-order accumulation" and (e.value.expected, e.value.found) == (1, 2)
    assert torch.equal(a.view("w", 0), before) and a.written == {("w", 0)}
    with pytest.raises(ArenaViolation,
                       match=r"duplicate write for arena 'arena' view w\[m=0\]: expected exactly one write"
                             r" in epoch 0") as e:  # and a second dW(0) is a duplicate, as in the default layout
        a.check_write("w", 0, a.view("w", 0))
    assert e.value.relation == "duplicate write"


def test_accumulating_write_into_another_parameter_is_aliased():
    a = GradientArena(FP32, microbatches=2, accumulate=True)
    with pytest.raises(ArenaViolation,
                       match=r"aliased write for arena 'arena' view w\[m=0\]: expected a write confined to"
                             r" w\[m=0\], found a destination overlapping view\(s\) v\[m=0\]") as e:
        a.record_write("w", 0, a.view("v", 0))
    assert e.value.relation in ("aliased write", "wrong binding")
    with pytest.raises(ArenaViolation,
                       match=r"wrong binding for arena 'arena' view w\[m=0\] in record_write: expected sha"
                             r"pe \(64,\), found \(32,\)") as e:  # a slice of w's own region is not w's view either
        a.record_write("w", 0, a.view("w", 0)[:32])
    assert e.value.relation == "wrong binding"


def test_accumulating_epochs_overwrite_without_zeroing():
    a = GradientArena({"w": ((64,), torch.float32)}, microbatches=2, accumulate=True)
    first = _grads(2, (64,), 1)
    _accumulate(a, "w", first)
    a.finalize()
    a.advance_epoch()
    assert torch.equal(a.view("w", 0), first[0] + first[1])  # not zeroed: dW(0) overwrites
    second = _grads(2, (64,), 2)
    _accumulate(a, "w", second)
    a.finalize()
    assert torch.equal(a.sum_microbatches("w"), second[0] + second[1])
    with pytest.raises(ArenaViolation,
                       match=r"sum before finalize for arena 'arena' parameter w: expected a finalized epo"
                             r"ch 0, found 2 missing writes") as e:
        GradientArena({"w": ((64,), torch.float32)}, 2, accumulate=True).sum_microbatches("w")
    assert e.value.relation == "sum before finalize"


# ---------------------------------------------------------------- staged accumulation
def _stage_all(arena, name, grads, check_prefix=None, start=0):
    """The staged dW protocol: write slot m (the GEMM's own dtype), fold on a group's last microbatch."""
    for m, gm in enumerate(grads[start:], start):
        dest = arena.view(name, m)
        arena.check_write(name, m, dest)
        assert arena.overwrites(m)
        dest.copy_(gm)
        if arena.flushes(m):
            arena.flush(name, m)
        arena.record_write(name, m, dest)
        if check_prefix is not None:
            check_prefix(m, arena.prefix_sum(name, m))


def _grads_and_prefixes(M, seed, bf16):
    """M microbatch gradients and the fp32 running sums an in-order accumulation gives after each."""
    grads = _grads(M, (64,), seed, torch.bfloat16 if bf16 else torch.float32)
    expect = [grads[0].float().clone()]
    for gm in grads[1:]:
        expect.append(expect[-1] + gm.float())
    return grads, expect


def test_staged_layout_slots_in_the_gemm_dtype():
    a = GradientArena(FP32, microbatches=6, accumulate=True, staging=4, staging_dtypes={"w": torch.bfloat16})
    assert a.staging == 4
    assert [a.flushes(m) for m in range(6)] == [False, False, False, True, False, True]
    assert all(a.overwrites(m) for m in range(6))
    w, v = a.view("w", 0), a.view("v", 0)
    assert w.dtype == torch.bfloat16 and v.dtype == torch.float32  # per-parameter staging dtype
    assert a.view("w", 4).data_ptr() == w.data_ptr()  # slot m % 4
    slots = {a.view("w", m).data_ptr() for m in range(4)}
    assert len(slots) == 4 and w.data_ptr() not in {a.region(n).data_ptr() for n in FP32}
    assert a.storage_views("w") == [a.region("w")] and a.region("w").dtype == torch.float32
    plain = GradientArena(FP32, microbatches=6, accumulate=True)
    assert a.nbytes > plain.nbytes and GradientArena(FP32, 2, accumulate=True, staging=4).staging == 2
    with pytest.raises(ValueError, match="accumulating layout"):
        GradientArena(FP32, 2, staging=2)
    with pytest.raises(ValueError, match="unknown parameters"):
        GradientArena(FP32, 2, accumulate=True, staging=2, staging_dtypes={"x": torch.bfloat16})
    with pytest.raises(ValueError, match="closes no staging group"):
        a.flush("w", 0)


@settings(max_examples=30, deadline=None)
@given(M=st.integers(1, 7), G=st.integers(1, 5), seed=st.integers(0, 2**31 - 1), bf16=st.booleans())
def test_staged_fold_has_the_bits_of_adding_as_it_comes(M, G, seed, bf16):
    """Groups folded in one pass == copy(g0); add(g1); ... in order, at the end and at every prefix
    (what verify-state compares after each dW), for full and partial last groups."""
    grads, expect = _grads_and_prefixes(M, seed, bf16)
    a = GradientArena({"w": ((64,), torch.float32)}, microbatches=M, accumulate=True, staging=G,
                      staging_dtypes={"w": grads[0].dtype})
    seen = []

    def check(m, prefix):
        assert prefix.dtype == torch.float32 and torch.equal(prefix, expect[m])
        seen.append(m)

    _stage_all(a, "w", grads, check)
    assert seen == list(range(M))
    a.finalize()
    assert torch.equal(a.sum_microbatches("w"), expect[-1])
    a.advance_epoch()  # the next epoch's first group overwrites the region
    second = _grads(M, (64,), seed + 1, grads[0].dtype)
    _stage_all(a, "w", second)
    a.finalize()
    again = second[0].float().clone()
    for gm in second[1:]:
        again += gm.float()
    assert torch.equal(a.sum_microbatches("w"), again)


def test_staged_fold_reduce_is_pluggable_and_called_per_group():
    calls = []

    def spy(region, block, count, init):
        calls.append((tuple(block.shape), count, init))
        sequential_reduce(region, block, count, init)

    a = GradientArena({"w": ((10,), torch.float32)}, microbatches=5, accumulate=True, staging=2, reduce=spy)
    _stage_all(a, "w", _grads(5, (10,), 4))
    assert [c[1:] for c in calls] == [(2, True), (2, False), (1, False)]
    assert calls[0][0][0] == 2 and calls[0][0][1] >= 10 and calls[0][0][1] * 4 % ALIGN_BYTES == 0


def test_staged_out_of_order_and_misbound_writes_are_refused():
    a = GradientArena(FP32, microbatches=4, accumulate=True, staging=2)
    with pytest.raises(ArenaViolation,
                       match=r"out-of-order accumulation for arena 'arena' view w\[m=1\]: expected microba"
                             r"tch 0 next") as e:
        a.check_write("w", 1, a.view("w", 1))
    assert e.value.relation == "out-of-order accumulation"
    with pytest.raises(ArenaViolation,
                       match=r"wrong binding for arena 'arena' view w\[m=0\] in check_write: expected data"
                             r"_ptr") as e:  # slot 1 is not dW(0)'s destination
        a.check_write("w", 0, a.view("w", 1))
    assert e.value.relation == "wrong binding"
    with pytest.raises(ArenaViolation,
                       match=r"wrong binding for arena 'arena' view w\[m=0\] in check_write: expected data"
                             r"_ptr") as e:  # nor is the region
        a.check_write("w", 0, a.region("w"))
    assert e.value.relation == "wrong binding"
    with pytest.raises(ArenaViolation,
                       match=r"aliased write for arena 'arena' view w\[m=0\]: .* overlapping view\(s\) v\["
                             r"m=0\]") as e:  # another parameter's slot
        a.check_write("w", 0, a.view("v", 0))
    assert e.value.relation in ("aliased write", "wrong binding")
    with pytest.raises(ValueError, match="holds the sum over microbatches"):
        a.prefix_sum("w", 0)


@settings(max_examples=30, deadline=None)
@given(M=st.integers(1, 7), G=st.integers(1, 5), seed=st.integers(0, 2**31 - 1), bf16=st.booleans(),
       take=st.booleans())
def test_deferred_last_fold_has_the_bits_of_adding_as_it_comes(M, G, seed, bf16, take):
    """`defer_last_fold`: no dW folds the last group; every prefix, the sum (folded once, however often it
    is asked for) and a taken pending fold finished by its consumer all keep the in-order bits."""
    grads, expect = _grads_and_prefixes(M, seed, bf16)
    a = GradientArena({"w": ((64,), torch.float32)}, microbatches=M, accumulate=True, staging=G,
                      staging_dtypes={"w": grads[0].dtype}, defer_last_fold=True)
    assert not a.flushes(M - 1)
    prefixes = []
    _stage_all(a, "w", grads, lambda m, prefix: prefixes.append(torch.equal(prefix, expect[m])))
    assert prefixes == [True] * M
    a.finalize()
    if take:
        region, block, count, init = a.take_pending_fold("w")
        first = (M - 1) - (M - 1) % min(G, M)
        assert region.data_ptr() == a.region("w").data_ptr() and (count, init) == (M - first, first == 0)
        finished = region.clone()
        sequential_reduce(finished, block, count, init)  # what the consumer (the optimizer's pass) adds
        assert torch.equal(finished, expect[-1]) and a.take_pending_fold("w") is None
        for read in (lambda: a.sum_microbatches("w"), lambda: a.storage_views("w"), lambda: a.prefix_sum("w", M - 1)):
            with pytest.raises(ArenaViolation,
                               match=r"sum after take for arena 'arena' parameter w: expected the deferred"
                                     r" last group in the region") as e:  # the region lacks the group its consumer adds
                read()
            assert e.value.relation == "sum after take"
    else:
        assert torch.equal(a.sum_microbatches("w"), expect[-1])
        assert torch.equal(a.sum_microbatches("w"), expect[-1])  # not folded twice
        assert torch.equal(a.prefix_sum("w", M - 1), expect[-1])
        assert a.take_pending_fold("w") is None  # folded already: nothing left to take
    a.advance_epoch()  # deferred again in the next epoch
    _stage_all(a, "w", grads)
    a.finalize()
    assert a.take_pending_fold("w") is not None


@pytest.mark.parametrize("M,G", [(1, 1), (3, 3), (3, 8), (4, 2), (4, 3)])
def test_lazy_regions_are_made_only_when_a_sum_is_asked_for(M, G):
    """Where every group is the deferred last one (depth M), no region exists until a summed gradient is asked
    for: staged writes, finalize and a taken fold (no region: its consumer starts from slot 0) need none; a sum
    makes all of them, zeroed, at fixed addresses, with the in-order bits. Any other depth makes them at once."""
    specs = {"w": ((64,), torch.float32), "v": ((10,), torch.float32)}
    grads = {n: _grads(M, specs[n][0], seed=i, dtype=torch.bfloat16) for i, n in enumerate(specs)}

    def arena():
        a = GradientArena(specs, microbatches=M, accumulate=True, staging=G,
                          staging_dtypes={n: torch.bfloat16 for n in specs}, defer_last_fold=True)
        for n in specs:
            _stage_all(a, n, grads[n])
        a.finalize()
        return a

    lazy = min(G, M) == M
    a = arena()
    assert a.lazy_regions is lazy and a.regions_made is not lazy
    assert {kind for kind, _ in a._buffers} == ({"staging"} if lazy else {"region", "staging"})
    if lazy:
        staging = a.nbytes
        region, block, count, init = a.take_pending_fold("w")
        assert region is None and (count, init) == (M, True) and not a.regions_made
        with pytest.raises(ValueError, match="deferred last one"):
            a.flush_gated("v", M - 1, torch.zeros((), dtype=torch.int32))
        finished = torch.empty(64)
        sequential_reduce(finished, block, count, init)  # what the consumer's pass adds
        assert torch.equal(finished, _sum_in_order(grads["w"]))
        assert torch.equal(a.sum_microbatches("v"), _sum_in_order(grads["v"]))  # makes every region
        assert a.regions_made and a.nbytes > staging
        held = a.region("w").data_ptr()
        a.advance_epoch()
        for n in specs:
            _stage_all(a, n, grads[n])
        a.finalize()
        assert a.take_pending_fold("w")[0].data_ptr() == held  # made once, at a fixed address
    b = arena()
    assert torch.equal(b.sum_microbatches("w"), _sum_in_order(grads["w"]))


def _sum_in_order(grads):
    acc = grads[0].float().clone()
    for g in grads[1:]:
        acc += g.float()
    return acc


def test_deferred_fold_is_refused_before_its_writes():
    a = GradientArena({"w": ((10,), torch.float32)}, microbatches=3, accumulate=True, staging=2,
                      defer_last_fold=True)
    assert [a.flushes(m) for m in range(3)] == [False, True, False]
    grads = _grads(3, (10,), 1)
    _stage_all(a, "w", grads[:2])
    with pytest.raises(ArenaViolation,
                       match=r"fold before the last write for arena 'arena' view w\[m=2\]: expected dW\(2"
                             r"\) written") as e:  # the data-parallel reduce reads the storage before finalize
        a.storage_views("w")
    assert e.value.relation == "fold before the last write"
    with pytest.raises(ArenaViolation,
                       match=r"take_pending_fold before finalize for arena 'arena' parameter w: expected a"
                             r" finalized epoch 0") as e:
        a.take_pending_fold("w")
    assert e.value.relation == "take_pending_fold before finalize"
    _stage_all(a, "w", grads, start=2)
    (region,) = a.storage_views("w")  # folded now, before finalize: what an all-reduce needs
    expect = grads[0].float() + grads[1].float() + grads[2].float()
    assert torch.equal(region, expect)
    a.finalize()
    assert a.take_pending_fold("w") is None and torch.equal(a.sum_microbatches("w"), expect)
    assert GradientArena({"w": ((10,), torch.float32)}, 3, accumulate=True, defer_last_fold=True).defer_last_fold is False

