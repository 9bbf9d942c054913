"""Device completion (record on the producer's stream, wait on the consumer's) on fake streams: the ledger
in both modes, the in-process transport and the graph manager's handshake through it."""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch

import qeffect.contracts.completion as completion
from qeffect.contracts import (
    CheckedCompletionLedger,
    CompletionLedger,
    DeviceCompletionViolation,
    completion_ledger,
)
from qeffect.graphs import GraphManager
from qeffect.offload.fake import FakeDevice
from qeffect.runtime.transport import LocalTransport


class Stream:
    def __init__(self, name: str) -> None:
        self.name = name


class Event:
    def __init__(self, n: int) -> None:
        self.n = n


class TraceOps:
    """`EventOps` on the host: every device call appended to `trace` as (op, stream, event number)."""

    def __init__(self) -> None:
        self.trace: list[tuple[str, str, int]] = []
        self.events = 0

    def new_event(self, name: str) -> Event:
        self.events += 1
        self.trace.append(("new", name, self.events))
        return Event(self.events)

    def record(self, event: Event, stream: Stream) -> None:
        self.trace.append(("record", stream.name, event.n))

    def wait(self, stream: Stream, event: Event) -> None:
        self.trace.append(("wait", stream.name, event.n))


P, C, D = Stream("producer"), Stream("consumer"), Stream("other")


def _checked() -> tuple[CheckedCompletionLedger, TraceOps]:
    ops = TraceOps()
    return CheckedCompletionLedger(ops, "test"), ops


# ----------------------------------------------------------------------------------------- ledger
def test_contract_module_imports_no_torch() -> None:
    assert not hasattr(completion, "torch")  # no CUDA: it works on opaque streams and events only


def test_factory_picks_the_mode() -> None:
    ops = TraceOps()
    assert type(completion_ledger(ops)) is CompletionLedger and not completion_ledger(ops).checked
    assert type(completion_ledger(ops, checked=True)) is CheckedCompletionLedger


def test_record_wait_use_in_both_modes_makes_the_same_device_calls() -> None:
    traces = []
    for checked in (False, True):
        ops = TraceOps()
        led = completion_ledger(ops, checked=checked, name="t")
        key = ("act", 0, 0)
        led.record(key, P)
        led.wait(key, C)
        led.use(key, C)
        led.use(key, P)  # the producer's own stream: stream order, no wait needed
        led.take(key, C)
        assert not led.recorded(key)
        traces.append(ops.trace)
    assert traces[0] == traces[1] == [("new", "t", 1), ("record", "producer", 1), ("wait", "consumer", 1),
                                      ("wait", "consumer", 1)]


def test_a_given_event_is_recorded_not_created() -> None:
    led, ops = _checked()
    ev = Event(99)
    assert led.record("tail", P, event=ev) is ev
    led.wait("tail", C)
    led.use("tail", C)
    assert ops.trace == [("record", "producer", 99), ("wait", "consumer", 99)]


@pytest.mark.parametrize("checked", [False, True])
def test_wait_before_record_raises_in_both_modes(checked: bool) -> None:
    ops = TraceOps()
    led = completion_ledger(ops, checked=checked, name="t")
    with pytest.raises(DeviceCompletionViolation,
                       match=r"wait before record for \('grad', 1, 0\): expected a record on the producer's "
                             r"stream before consumer stream 'consumer'.*CUDA would not wait at all\); ledger 't'"):
        led.wait(("grad", 1, 0), C)
    with pytest.raises(DeviceCompletionViolation, match=r"^\[device-completion\] wait before record"):
        led.take(("grad", 1, 0), C)
    assert ops.trace == []  # rejected before any device call


def test_use_without_wait_is_rejected_first_and_changes_nothing() -> None:
    led, ops = _checked()
    led.record("a", P)
    led.wait("a", C)
    led.use("a", C)  # valid
    led.record("b", P)
    before, calls = led.snapshot(), list(ops.trace)
    with pytest.raises(DeviceCompletionViolation,
                       match=r"use without wait for b: expected consumer stream 'consumer' to wait on the record "
                             r"on producer stream 'producer', found no wait on 'consumer'; ledger 'test'") as ei:
        led.use("b", C)
    assert (ei.value.family, ei.value.relation, ei.value.key) == ("device-completion", "use without wait", "b")
    assert led.snapshot() == before and ops.trace == calls
    with pytest.raises(DeviceCompletionViolation, match="use without wait for a: .*'other'"):
        led.use("a", D)  # a wait on one consumer stream orders no other
    led.wait("b", C)
    led.use("b", C)


def test_a_re_record_invalidates_earlier_waits() -> None:
    led, _ = _checked()
    led.record("x", P)
    led.wait("x", C)
    led.use("x", C)
    led.record("x", P)  # the producer wrote again
    with pytest.raises(DeviceCompletionViolation,
                       match=r"stale wait for x: expected consumer stream 'consumer' to wait on record 2 \(the "
                             r"latest, on producer stream 'producer'\), found its wait covers record 1 only"):
        led.use("x", C)
    led.use("x", P)
    led.wait("x", C)
    led.use("x", C)


def test_a_fired_record_moves_the_producer_and_invalidates_waits() -> None:
    led, ops = _checked()
    led.record("g", P, event=Event(7))
    led.fired("g", P)
    led.wait("g", C)
    led.use("g", C)
    led.fired("g", C)  # replayed on the consumer's stream itself: stream order
    led.use("g", C)
    led.fired("g", P)
    with pytest.raises(DeviceCompletionViolation, match=r"stale wait for g: .*record 4.*covers record 2 only"):
        led.use("g", C)
    assert ops.trace == [("record", "producer", 7), ("wait", "consumer", 7)]  # fired makes no device call
    with pytest.raises(DeviceCompletionViolation, match=r"fired before record for h: .*stream 'producer'"):
        led.fired("h", P)


def test_use_before_record_and_after_retire() -> None:
    led, _ = _checked()
    with pytest.raises(DeviceCompletionViolation, match=r"use before record for k: .*consumer stream 'consumer'"):
        led.use("k", C)
    led.record("k", P)
    led.take("k", C)
    with pytest.raises(DeviceCompletionViolation, match=r"use before record for k: .*or retired"):
        led.use("k", C)
    with pytest.raises(DeviceCompletionViolation, match=r"wait before record for k: .*or retired"):
        led.wait("k", C)
    led.retire("never")  # retiring an unknown key is harmless


def test_production_use_is_free() -> None:
    ops = TraceOps()
    led = CompletionLedger(ops)
    led.record("b", P)
    led.use("b", C)  # unchecked: nothing is verified, nothing is called
    led.fired("b", P)
    assert ops.trace == [("new", "completions", 1), ("record", "producer", 1)]


# -------------------------------------------------------------------------------------- transport
def _handoff(dev: FakeDevice, transport: LocalTransport) -> float:
    """Producer stream writes x (after a slow op) and publishes it; the consumer takes it on its own stream
    and copies it at once. Returns what the consumer's copy saw."""
    prod, cons = dev.new_stream("rank0"), dev.new_stream("rank1")
    x, seen = torch.zeros(4), torch.full((4,), -1.0)
    with dev.use(prod):
        for _ in range(3):
            dev.launch(prod, lambda: None, "other work")
        dev.launch(prod, lambda: x.fill_(1.0), "write x")
        transport.put("act", 0, 0, x)
    with dev.use(cons):
        got = transport.get("act", 0, 0)
        dev.launch(cons, lambda: seen.copy_(got), "read x")
    dev.synchronize()
    return float(seen[0])


@pytest.mark.parametrize("checked", [False, True])
def test_transport_events_order_every_interleaving(checked: bool) -> None:
    for seed in range(40):
        dev = FakeDevice(seed, progress=1)
        transport = LocalTransport(events=True, ops=dev, checked=checked)
        assert _handoff(dev, transport) == 1.0, seed
        assert transport.empty() and transport.completions is not None
        assert transport.completions.checked is checked and not transport.completions.recorded(("act", 0, 0))
        events = [t for t in dev.trace if t[0] in ("record", "wait", "wait-unrecorded")]
        assert events == [("record", "rank0", "transport"), ("wait", "rank1", "transport")]


def test_transport_without_events_can_read_before_the_write() -> None:
    """The fault the events prevent: host order alone lets some interleaving read the old value."""
    seen = set()
    for seed in range(40):
        dev = FakeDevice(seed, progress=1)
        seen.add(_handoff(dev, LocalTransport(ops=dev)))
        assert not any(t[0] in ("record", "wait") for t in dev.trace)
    assert seen == {0.0, 1.0}


def test_checked_transport_hands_over_once() -> None:
    dev = FakeDevice(0)
    t = LocalTransport(events=True, ops=dev, checked=True)
    x = torch.ones(2)
    t.put("grad", 1, 0, x)
    with pytest.raises(RuntimeError, match="published twice"):
        t.put("grad", 1, 0, x)
    assert t.get("grad", 1, 0) is x
    with pytest.raises(RuntimeError, match="not available yet"):
        t.get("grad", 1, 0)
    assert t.completions is not None and t.completions.snapshot() == ("transport", (), ())


# ---------------------------------------------------------------------------------- graph manager
class _GStream:
    def __init__(self, name: str, log: list) -> None:
        self.name, self.log = name, log

    def wait_stream(self, other: _GStream) -> None:
        self.log.append(("wait_stream", self.name, other.name))

    def wait_event(self, event: _GEvent) -> None:
        self.log.append(("wait_event", self.name, event.name))


class _GEvent:
    def __init__(self, backend: _GBackend, name: str) -> None:
        self.backend, self.name = backend, name

    def record(self) -> None:
        self.backend.log.append(("record", self.backend.current.name, self.name))


class _GGraph:
    def __init__(self, backend: _GBackend) -> None:
        self.backend = backend

    def replay(self) -> None:
        self.backend.log.append(("replay", self.backend.current.name))


class _GBackend:
    """The smallest `GraphBackend`: logs stream and event calls with the stream they were issued on."""

    def __init__(self) -> None:
        self.log: list[tuple] = []
        self.caller = self.current = _GStream("caller", self.log)

    def new_stream(self) -> _GStream:
        return _GStream("graph", self.log)

    def current_stream(self) -> _GStream:
        return self.current

    @contextmanager
    def use_stream(self, stream: _GStream):
        prev, self.current = self.current, stream
        try:
            yield
        finally:
            self.current = prev

    capture = lambda self, graph, pool, stream: self.use_stream(stream)  # noqa: E731

    def graph_pool_handle(self) -> str:
        return "pool"

    def new_graph(self) -> _GGraph:
        return _GGraph(self)

    def new_external_event(self) -> _GEvent:
        return _GEvent(self, "tail")

    def copy_(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)

    def record_stream(self, tensor: torch.Tensor, stream: _GStream) -> None:
        pass

    def memory_allocated(self) -> int:
        return 0

    def memory_reserved(self) -> int:
        return 0


def _graph(protocol: str, checked: bool):
    be = _GBackend()
    mgr = GraphManager("cuda", protocol=protocol, backend=be, checked_completion=checked)  # type: ignore[arg-type]
    a = torch.zeros(2)
    return mgr, be, mgr.capture("s0.F0", lambda: a + 1, static_inputs={"a": a}, warmup=0)


def test_graph_handshake_device_calls_are_the_same_checked_or_not() -> None:
    logs = []
    for checked in (False, True):
        mgr, be, action = _graph("two-way", checked)
        mgr.replay(action)
        mgr.check_use(action)
        logs.append(be.log)
    assert logs[0] == logs[1] == [("record", "graph", "tail"), ("wait_stream", "graph", "caller"),
                                  ("replay", "graph"), ("wait_event", "caller", "tail")]


def test_two_way_and_stream_ordered_outputs_are_safe_to_read() -> None:
    for protocol in ("two-way", "stream-ordered"):
        mgr, be, action = _graph(protocol, True)
        for _ in range(3):
            mgr.replay(action)
            mgr.check_use(action)  # the current (caller's) stream
            mgr.check_use(action, be.caller)


def test_one_way_replay_is_a_completion_violation() -> None:
    mgr, be, action = _graph("one-way", True)
    mgr.replay(action)
    with pytest.raises(DeviceCompletionViolation,
                       match=r"use without wait for s0.F0: expected consumer stream 'caller' to wait on the "
                             r"record on producer stream 'graph', found no wait on 'caller'; ledger 'graph tails'"):
        mgr.check_use(action)
    mgr.protocol = "two-way"
    mgr.replay(action)
    mgr.check_use(action)
    mgr.protocol = "one-way"  # a later replay the caller does not wait for: its earlier wait is stale
    mgr.replay(action)
    with pytest.raises(DeviceCompletionViolation, match=r"stale wait for s0.F0: .*record 4 .*covers record 3 only"):
        mgr.check_use(action)


def test_production_manager_does_not_check() -> None:
    mgr, _, action = _graph("one-way", False)
    mgr.replay(action)
    mgr.check_use(action)  # the deliberate defect stays measurable on a GPU (graphs.handshake)
    assert not mgr.completions.checked
