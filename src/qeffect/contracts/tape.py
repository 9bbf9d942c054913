"""Bounded tape pool with generation-checked references (retained-work ownership).

A tape is the retained state of one forward action. It lives in a fixed slot because captured graphs
cannot allocate; slots are therefore reused, and a reused slot must never be mistaken for the old
tape (ABA). Each allocation bumps the slot's monotonically increasing generation, and every consumer
presents ``TapeRef(slot, generation, key)`` *and* the key it expects, so a stale or foreign reference
can never match.

Protocol: a check precedes its physical action (``check_consumer``), and the transition is recorded
only after the action succeeded (``mark_consumed``). ``consume`` bundles both. Every check raises
before any mutation, so a rejected reference leaves the live tape untouched.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from .errors import ConsumerOrderViolation, PoolCapacityError, TapeViolation
from .keys import InvocationKey


class Consumer(enum.Flag):
    """Consumers of a tape. A tape is released only when both have completed."""

    DI = 1
    DW = 2

    @property
    def label(self) -> str:
        """``"dI"``, ``"dW"``, ``"dI|dW"`` or ``"none"``: the project's spelling of the actions."""
        names = [n for flag, n in ((Consumer.DI, "dI"), (Consumer.DW, "dW")) if flag in self]
        return "|".join(names) if names else "none"

    def __str__(self) -> str:
        return self.label


NO_CONSUMER = Consumer(0)
BOTH_CONSUMERS = Consumer.DI | Consumer.DW


@dataclass(frozen=True, slots=True)
class TapeRef:
    """``(slot, generation, key)``: what a consumer must present to reach a tape."""

    slot: int
    generation: int
    key: InvocationKey

    def __str__(self) -> str:
        return f"TapeRef(slot={self.slot}, generation={self.generation}, key={self.key})"


@dataclass(slots=True, eq=False)
class Tape:
    """Retained state of one forward action. Mutable: consumers and payload change over its life."""

    key: InvocationKey
    slot: int
    generation: int
    payload: dict[str, Any] = field(default_factory=dict)
    consumers: Consumer = NO_CONSUMER
    live: bool = True

    @property
    def ref(self) -> TapeRef:
        return TapeRef(self.slot, self.generation, self.key)


class TapePool:
    """A bounded pool of tape slots with an injective live mapping ``key -> slot``.

    Never preempts: a full pool raises :class:`PoolCapacityError`. Generations are per slot, start at
    0 (never allocated) and only grow, so a released slot's old references stay stale forever.
    """

    def __init__(self, capacity: int, name: str = "tapes") -> None:
        if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 1:
            raise ValueError(f"TapePool capacity must be an int >= 1, got {capacity!r}")
        self.name = name
        self._capacity = capacity
        self._slots: list[Tape | None] = [None] * capacity
        self._generations: list[int] = [0] * capacity
        self._live: dict[InvocationKey, int] = {}
        self._peak = 0

    # ----------------------------------------------------------------- queries
    @property
    def capacity(self) -> int:
        return self._capacity

    @property
    def live_count(self) -> int:
        return len(self._live)

    @property
    def peak_live(self) -> int:
        """Maximum number of simultaneously live tapes ever seen (schedule pressure, not capacity)."""
        return self._peak

    def live_keys(self) -> list[InvocationKey]:
        """Live keys in slot order."""
        return [t.key for t in self._slots if t is not None]

    def generation_of(self, slot: int) -> int:
        return self._generations[slot]

    def snapshot(self) -> tuple:
        """Hashable picture of the whole pool, including payload identity.

        Two equal snapshots mean: same generations, same live tapes with the same consumers, the same
        payload dict objects holding the same value objects. Used to show "state preserved".
        """
        slots = tuple(
            None
            if t is None
            else (
                t.key,
                t.generation,
                t.consumers.value,
                id(t),
                id(t.payload),
                tuple((k, id(v)) for k, v in t.payload.items()),
            )
            for t in self._slots
        )
        return (self.name, self._capacity, tuple(self._generations), slots, self._peak)

    # ------------------------------------------------------------- allocation
    def allocate(self, key: InvocationKey, payload: dict[str, Any] | None = None, *,
                 slot: int | None = None) -> TapeRef:
        """Place a new tape for ``key`` and bump that slot's generation: in the lowest free slot, or in
        ``slot`` exactly (a slot that captured graphs are bound to), which must be free (`check_slot_free`)."""
        if not isinstance(key, InvocationKey):
            raise TypeError(f"allocate needs an InvocationKey, got {type(key).__name__}")
        if key in self._live:
            held = self._live[key]
            raise TapeViolation.build(
                "duplicate live key",
                key=key,
                expected="no live tape",
                found=f"live tape in slot {held} generation {self._generations[held]}",
                note=f"pool '{self.name}'",
            )
        if slot is not None:
            self.check_slot_free(slot, key)
            free: int | None = slot
        else:
            free = next((p for p, t in enumerate(self._slots) if t is None), None)
        if free is None:
            live = ", ".join(str(k) for k in self.live_keys())
            raise PoolCapacityError(
                f"pool '{self.name}' is full for {key}: capacity {self._capacity}, live keys [{live}]",
                relation="capacity",
                key=key,
                expected=f"a free slot (capacity {self._capacity})",
                found=self.live_keys(),
            )
        self._generations[free] += 1
        tape = Tape(key=key, slot=free, generation=self._generations[free],
                    payload={} if payload is None else payload)
        self._slots[free] = tape
        self._live[key] = free
        self._peak = max(self._peak, len(self._live))
        return tape.ref

    # ---------------------------------------------------------------- checking
    def check_slot_free(self, slot: int, key: InvocationKey) -> None:
        """Refuse to bind ``key`` to ``slot`` while the slot's previous generation is not fully consumed.

        Why: graphs bound to a slot keep their tape's state at fixed addresses, so a new tape there
        overwrites whatever the previous one's dI or dW still has to read. Mutates nothing."""
        if isinstance(slot, bool) or not isinstance(slot, int) or not 0 <= slot < self._capacity:
            raise TapeViolation.build("slot out of range", key=key, expected=f"slot in [0, {self._capacity})",
                                      found=slot, note=f"pool '{self.name}'")
        held = self._slots[slot]
        if held is not None:
            raise TapeViolation.build(
                "premature slot reuse", key=key, expected=f"slot {slot} fully consumed",
                found=f"{held.key} generation {held.generation} still live (completed consumers "
                      f"{held.consumers.label})",
                note=f"pool '{self.name}'")

    def resolve(self, ref: TapeRef, expected_key: InvocationKey) -> Tape:
        """Return the live tape named by ``ref`` if and only if it is exactly the one expected."""
        if not isinstance(ref, TapeRef):
            raise TapeViolation.build("not a tape reference", key=expected_key, expected="TapeRef",
                                      found=type(ref).__name__)
        if ref.key is not expected_key and ref.key != expected_key:  # keys are made once an epoch: mostly the same
            raise TapeViolation.build("foreign reference", key=expected_key, expected="key " + str(expected_key),
                                      found=f"reference for {ref.key}")
        if not 0 <= ref.slot < self._capacity:
            raise TapeViolation.build("slot out of range", key=ref.key, expected=f"slot in [0, {self._capacity})",
                                      found=ref.slot, note=f"pool '{self.name}'")
        tape = self._slots[ref.slot]
        if tape is None:
            raise TapeViolation.build(
                "free slot", key=ref.key, what="live generation", expected=ref.generation,
                found=f"slot {ref.slot} free (current generation {self._generations[ref.slot]})",
                note=f"pool '{self.name}'")
        if tape.generation != ref.generation:
            raise TapeViolation.build(
                "stale generation", key=ref.key, what="generation", expected=tape.generation,
                found=ref.generation,
                note=f"slot {ref.slot} of pool '{self.name}' now holds {tape.key}")
        if tape.key is not ref.key and tape.key != ref.key:
            raise TapeViolation.build("foreign reference", key=ref.key, expected=f"slot holding {ref.key}",
                                      found=f"slot {ref.slot} holding {tape.key}")
        return tape

    def check_consumer(self, ref: TapeRef, expected_key: InvocationKey, consumer: Consumer) -> Tape:
        """Resolve ``ref`` and check that ``consumer`` may run now. Mutates nothing."""
        _check_single(consumer)
        tape = self.resolve(ref, expected_key)
        if consumer in tape.consumers:
            raise ConsumerOrderViolation.build(
                f"duplicate {consumer.label}", key=tape.key, expected=f"{consumer.label} not yet completed",
                found=f"completed consumers {tape.consumers.label}")
        if consumer is Consumer.DW and Consumer.DI not in tape.consumers:
            raise ConsumerOrderViolation.build(
                "dW before dI", key=tape.key, expected="completed consumers dI",
                found=f"completed consumers {tape.consumers.label}")
        return tape

    # ------------------------------------------------------------- transitions
    def mark_consumed(self, ref: TapeRef, consumer: Consumer) -> bool:
        """Record that ``consumer`` completed; release the slot once dI and dW are both done.

        Re-checks the reference and order first, so a misuse cannot corrupt the bitmask. Returns True
        if the slot was released.
        """
        tape = self.check_consumer(ref, ref.key if isinstance(ref, TapeRef) else None, consumer)
        tape.consumers |= consumer
        if tape.consumers == BOTH_CONSUMERS:
            self._release(tape)
            return True
        return False

    @contextmanager
    def consume(self, ref: TapeRef, expected_key: InvocationKey, consumer: Consumer) -> Iterator[Tape]:
        """Check, run the block (the physical action), then record completion.

        If the block raises, the tape is aborted (its retained work is no longer trustworthy) and the
        exception propagates.
        """
        tape = self.check_consumer(ref, expected_key, consumer)
        try:
            yield tape
        except BaseException:
            try:
                self.abort(ref)
            except TapeViolation:
                pass  # already released or replaced inside the block: the original error matters more
            raise
        self.mark_consumed(ref, consumer)

    def abort(self, ref: TapeRef) -> None:
        """Drop the payload of the tape ``ref`` names and free its slot.

        A stale reference raises :class:`TapeViolation` and leaves the live tape untouched.
        """
        tape = self.resolve(ref, ref.key if isinstance(ref, TapeRef) else None)
        self._release(tape)

    def purge(self, epoch: int) -> list[InvocationKey]:
        """Abort every live tape of optimizer epoch ``epoch`` (after an aborted step); return their keys."""
        doomed = [t for t in self._slots if t is not None and t.key.e == epoch]
        for tape in doomed:
            self._release(tape)
        return [t.key for t in doomed]

    def _release(self, tape: Tape) -> None:
        # The generation is NOT reset or reused: the next allocate of this slot bumps it again.
        self._slots[tape.slot] = None
        del self._live[tape.key]
        tape.payload = {}
        tape.live = False


def _check_single(consumer: Consumer) -> None:
    if consumer not in (Consumer.DI, Consumer.DW):
        raise ValueError(f"consumer must be Consumer.DI or Consumer.DW, got {consumer!r}")
