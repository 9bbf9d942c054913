"""Invocation keys and the violation hierarchy."""

from __future__ import annotations

import dataclasses

import pytest

from qeffect.contracts import (
    FAMILIES,
    ArenaViolation,
    CacheEpochViolation,
    CommitViolation,
    ConsumerOrderViolation,
    ContractViolation,
    DeviceCompletionViolation,
    EffectTokenViolation,
    InvocationKey,
    PoolCapacityError,
    TapeViolation,
)


def test_key_str_defaults_and_order():
    k = InvocationKey(0, 1, 2)
    assert str(k) == "K(e=0,s=1,m=2,u=0,i=0)"
    assert (k.u, k.i) == (0, 0)
    assert InvocationKey(0, 1, 2) == k and hash(InvocationKey(0, 1, 2)) == hash(k)
    assert sorted([InvocationKey(1, 0, 0), InvocationKey(0, 2, 0), InvocationKey(0, 1, 5)]) == [
        InvocationKey(0, 1, 5), InvocationKey(0, 2, 0), InvocationKey(1, 0, 0)]
    assert len({k, InvocationKey(0, 1, 2, 0, 0), InvocationKey(0, 1, 2, 1)}) == 2


def test_key_is_frozen():
    k = InvocationKey(0, 0, 0)
    with pytest.raises(dataclasses.FrozenInstanceError, match=r"cannot assign to field 'e'"):
        k.e = 1  # type: ignore[misc]


@pytest.mark.parametrize("field,value", [("e", -1), ("s", True), ("m", 1.0), ("u", "0"), ("i", None), ("m", -3)])
def test_key_validation_names_the_field(field, value):
    args = {"e": 0, "s": 0, "m": 0, "u": 0, "i": 0, field: value}
    with pytest.raises(ValueError, match=f"InvocationKey.{field}"):
        InvocationKey(**args)


def test_violation_message_and_attributes():
    k = InvocationKey(0, 1, 2)
    exc = TapeViolation.build("stale generation", key=k, what="generation", expected=3, found=2)
    assert str(exc) == "[tape-reference] stale generation for K(e=0,s=1,m=2,u=0,i=0): expected generation 3, found 2"
    assert (exc.family, exc.relation, exc.key, exc.expected, exc.found) == ("tape-reference", "stale generation",
                                                                            k, 3, 2)
    plain = ContractViolation("x broke", relation="r")
    assert str(plain) == "[contract] x broke" and plain.key is None
    # an already-prefixed message is not prefixed twice
    assert str(ArenaViolation("[arena] y", relation="r")) == "[arena] y"


def test_hierarchy_and_families():
    classes = [TapeViolation, ConsumerOrderViolation, EffectTokenViolation, CacheEpochViolation, ArenaViolation,
               CommitViolation, DeviceCompletionViolation]
    assert [c.family for c in classes] == ["tape-reference", "consumer-order", "effect-token", "cache-epoch",
                                          "arena", "commit", "device-completion"]
    assert list(FAMILIES) == [c.family for c in classes]
    assert all(issubclass(c, ContractViolation) for c in classes)
    assert issubclass(PoolCapacityError, TapeViolation) and PoolCapacityError.family == "tape-reference"
