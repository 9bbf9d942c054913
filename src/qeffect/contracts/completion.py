"""Device completion: record on the producer's stream, wait on the consumer's (the fourth relation).

Host order orders nothing across streams: a kernel the host queued first on stream A may still be
running when one it queued later on stream B reads A's output. The only edge is an event that the
producer records on its stream after queueing the write, and that the consumer's stream waits on before
queueing the read. A ledger names each such edge by a key (``("act", stage, m)`` for a hand-off, a graph's
name for its tail event), so the rule is stated here once:

1. the producer ``record(key, stream)``s after its work is queued on ``stream``;
2. a consumer on another stream ``wait(key, stream)``s before it queues work that reads it;
3. ``use(key, stream)`` is the read: allowed on the producer's own stream (stream order), or on a stream
   that waited on the key's LATEST record. A re-record (a graph replayed again) invalidates earlier waits:
   a wait covers only the record it saw, as ``cudaStreamWaitEvent`` snapshots the event's latest record.

Two modes. :class:`CompletionLedger` (production) makes exactly the event calls the rule needs (create,
record, wait) and keeps one dict entry per live key; ``use`` costs a no-op call. :class:`CheckedCompletionLedger`
also keeps per-key bookkeeping (producer stream, record generation, which streams waited on which record)
and raises :class:`DeviceCompletionViolation` at the first wait or use that breaks the rule, before the
device operation. A wait on a key never recorded (or retired) raises in both modes: CUDA would make it a
no-op, and the consumer would run unordered.

Streams and events are opaque: they go through :class:`EventOps` (torch.cuda in ``runtime.transport``, a
graph backend in ``graphs.manager``, ``offload.streams.StreamOps`` as is, the CPU ``offload.fake.FakeDevice``),
so nothing here imports CUDA and every check runs on a CPU-only machine.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field
from typing import Any, Protocol

from .errors import DeviceCompletionViolation


class EventOps(Protocol):
    """The device operations a ledger needs. ``offload.streams.StreamOps`` has these signatures."""

    def new_event(self, name: str) -> Any: ...
    def record(self, event: Any, stream: Any) -> None: ...
    def wait(self, stream: Any, event: Any) -> None: ...


class CompletionLedger:
    """Production mode: the rule's event calls and nothing else (see the module docstring).

    ``record`` takes the key's own event unless ``event`` is given (a long-lived one, such as a graph's
    tail event, which the ledger then only remembers). A key's own event is made at its first record and
    kept for the ledger's life (a hand-off slot, ``("act", stage, m)``, is recorded again every step): a
    re-record is what a fresh event would be, because a wait snapshots the record it saw
    (``cudaStreamWaitEvent``), so earlier waits keep ordering after the earlier record; it saves the host
    an event creation per hand-off."""

    checked = False

    def __init__(self, ops: EventOps, name: str = "completions") -> None:
        self.ops = ops
        self.name = name
        self._events: dict[Hashable, Any] = {}
        self._own: dict[Hashable, Any] = {}  # each key's reused event (bounded by the keys, e.g. slots)

    def record(self, key: Hashable, stream: Any, event: Any = None) -> Any:
        """Producer side: ``key`` is complete once ``stream`` reaches this point. Returns the event."""
        if event is None:
            event = self._own.get(key)
            if event is None:
                event = self._own[key] = self.ops.new_event(self.name)
        self.ops.record(event, stream)
        self._events[key] = event
        return event

    def fired(self, key: Hashable, stream: Any) -> None:
        """The device recorded ``key``'s event again on ``stream`` with no host call (a captured event node,
        at every replay). Bookkeeping only; production keeps none."""

    def wait(self, key: Hashable, stream: Any) -> None:
        """Consumer side: work queued on ``stream`` from now on runs after ``key``'s latest record."""
        try:
            event = self._events[key]
        except KeyError:
            raise self._unrecorded("wait before record", key, stream) from None
        self.ops.wait(stream, event)

    def use(self, key: Hashable, stream: Any) -> None:
        """Work about to be queued on ``stream`` reads what ``key``'s producer wrote. Checked mode verifies
        the rule; production cannot know and pays nothing."""

    def take(self, key: Hashable, stream: Any) -> None:
        """A one-shot hand-off (a transport's get): wait on ``stream``, use there, forget the key."""
        try:
            event = self._events.pop(key)
        except KeyError:
            raise self._unrecorded("wait before record", key, stream) from None
        self.ops.wait(stream, event)

    def retire(self, key: Hashable) -> None:
        """Forget ``key``: a later wait or use must follow a new record."""
        self._events.pop(key, None)

    def recorded(self, key: Hashable) -> bool:
        return key in self._events

    def snapshot(self) -> tuple:
        """Hashable host-side picture (no device query): the live keys and their events' identities."""
        return (self.name, tuple((k, id(e)) for k, e in self._events.items()))

    def _unrecorded(self, relation: str, key: Hashable, stream: Any) -> DeviceCompletionViolation:
        return DeviceCompletionViolation.build(
            relation, key=key, expected=f"a record on the producer's stream before consumer stream {_label(stream)}",
            found="none (never recorded, or retired: CUDA would not wait at all)", note=f"ledger '{self.name}'")


@dataclass(slots=True, eq=False)
class _Record:
    """The latest record of one key, and which streams waited on which record (generation) of it."""

    event: Any
    producer: Any
    generation: int
    waits: list[tuple[Any, int]] = field(default_factory=list)


class CheckedCompletionLedger(CompletionLedger):
    """Checked mode: the same device calls as :class:`CompletionLedger`, plus host bookkeeping that raises
    :class:`DeviceCompletionViolation` before the first wait or use that breaks the rule; a rejected call
    changes nothing. Streams are compared with ``==`` (torch makes a new object per ``current_stream()``)."""

    checked = True

    def __init__(self, ops: EventOps, name: str = "completions") -> None:
        super().__init__(ops, name)
        self._records: dict[Hashable, _Record] = {}

    def record(self, key: Hashable, stream: Any, event: Any = None) -> Any:
        event = super().record(key, stream, event)
        rec = self._records.get(key)
        if rec is None:
            self._records[key] = _Record(event, stream, 1)
        else:  # a re-record: earlier waits covered the old record only
            rec.event, rec.producer, rec.generation = event, stream, rec.generation + 1
        return event

    def fired(self, key: Hashable, stream: Any) -> None:
        rec = self._require("fired before record", key, stream)
        rec.producer, rec.generation = stream, rec.generation + 1

    def wait(self, key: Hashable, stream: Any) -> None:
        rec = self._require("wait before record", key, stream)
        super().wait(key, stream)
        rec.waits = [(s, g) for s, g in rec.waits if s != stream] + [(stream, rec.generation)]

    def use(self, key: Hashable, stream: Any) -> None:
        rec = self._require("use before record", key, stream)
        if stream == rec.producer:  # stream order: the read is queued after the write
            return
        waited = next((g for s, g in rec.waits if s == stream), None)
        producer, consumer = _label(rec.producer), _label(stream)
        if waited is None:
            raise DeviceCompletionViolation.build(
                "use without wait", key=key,
                expected=f"consumer stream {consumer} to wait on the record on producer stream {producer}",
                found=f"no wait on {consumer}", note=f"ledger '{self.name}'")
        if waited != rec.generation:
            raise DeviceCompletionViolation.build(
                "stale wait", key=key,
                expected=f"consumer stream {consumer} to wait on record {rec.generation} (the latest, on "
                f"producer stream {producer})", found=f"its wait covers record {waited} only (re-recorded "
                "after the wait)", note=f"ledger '{self.name}'")

    def take(self, key: Hashable, stream: Any) -> None:
        self.wait(key, stream)
        self.use(key, stream)
        self.retire(key)

    def retire(self, key: Hashable) -> None:
        super().retire(key)
        self._records.pop(key, None)

    def snapshot(self) -> tuple:
        recs = tuple((k, id(r.event), _label(r.producer), r.generation,
                      tuple((_label(s), g) for s, g in r.waits)) for k, r in self._records.items())
        return (*super().snapshot(), recs)

    def _require(self, relation: str, key: Hashable, stream: Any) -> _Record:
        rec = self._records.get(key)
        if rec is None:
            raise self._unrecorded(relation, key, stream)
        return rec


def completion_ledger(ops: EventOps, *, checked: bool = False, name: str = "completions") -> CompletionLedger:
    """A production ledger, or a checked one (CPU tests with fake streams, debugging on a GPU)."""
    return (CheckedCompletionLedger if checked else CompletionLedger)(ops, name)


def _label(stream: Any) -> str:
    """A stream's name for messages: fakes have ``name``; torch streams print their handle."""
    name = getattr(stream, "name", None)
    return repr(name) if isinstance(name, str) else repr(stream)
