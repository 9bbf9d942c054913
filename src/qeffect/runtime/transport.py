"""How activations and input gradients move between stages, always between actions (never inside one).

`LocalTransport` keeps them in a dict for the single-process executor; the torch.distributed
executor supplies point-to-point transports with the same interface.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from qeffect.contracts import CompletionLedger, EventOps, completion_ledger
from qeffect.graphs.stats import HANDOFF, HostPhases


class Transport(Protocol):
    def put(self, kind: str, stage: int, m: int, tensor: torch.Tensor) -> None:
        """Publish `tensor` produced by `stage` for microbatch `m` (kind: "act" or "grad")."""

    def get(self, kind: str, stage: int, m: int) -> torch.Tensor:
        """Take the tensor that `stage` produced for microbatch `m`."""


class TransportEvents(EventOps, Protocol):
    """The completion contract's event operations, plus the current stream of a tensor's device."""

    def current_stream(self, device: torch.device) -> Any: ...

    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None:
        """Tell the memory allocator that `stream` uses `tensor` (its block is not reused before that)."""


class TorchCudaEvents:
    """torch.cuda's calls: a `torch.cuda.Event()` per hand-off slot (made once, recorded again each step: the
    ledger's rule), recorded on the producer's current stream, waited on by the consumer's (`Stream.wait_event`)."""

    __slots__ = ()

    def current_stream(self, device: torch.device) -> torch.cuda.Stream:
        return torch.cuda.current_stream(device)

    def new_event(self, name: str) -> torch.cuda.Event:
        return torch.cuda.Event()

    def record(self, event: torch.cuda.Event, stream: torch.cuda.Stream) -> None:
        event.record(stream)

    def wait(self, stream: torch.cuda.Stream, event: torch.cuda.Event) -> None:
        stream.wait_event(event)

    def record_stream(self, tensor: torch.Tensor, stream: torch.cuda.Stream) -> None:
        tensor.record_stream(stream)


class LocalTransport:
    """In-process hand-off: every rank lives in this process and runs in one global order.

    `events=True` (ranks on their own CUDA streams, `SingleProcessPipeline.rank_streams`): each hand-off
    is a device completion (`qeffect.contracts.completion`) keyed `(kind, stage, m)`: `put` records it on
    the producer's current stream and `get` makes the consumer's current stream wait on it, so a consumer
    reads a tensor only after the producer's stream has written it (host order alone orders nothing across
    streams). `ops`: the streams and events (default torch.cuda's; `offload.fake.FakeDevice` on a CPU);
    `checked`: a checked ledger (`completions`); `host`: the clock its event work is timed on while that is on."""

    def __init__(self, *, events: bool = False, ops: TransportEvents | None = None, checked: bool = False,
                 host: HostPhases | None = None) -> None:
        self._slots: dict[tuple[str, int, int], torch.Tensor] = {}
        self.events = events
        self.checked = checked
        self.host = host if host is not None else HostPhases()
        self._ops: TransportEvents = ops if ops is not None else TorchCudaEvents()
        self.completions: CompletionLedger | None = (
            completion_ledger(self._ops, checked=checked, name="transport") if events else None)

    def put(self, kind: str, stage: int, m: int, tensor: torch.Tensor) -> None:
        key = (kind, stage, m)
        if key in self._slots:
            raise RuntimeError(f"{kind} of stage {stage} microbatch {m} published twice")
        if self.completions is not None:  # on the producer's stream
            self.host.call(HANDOFF, self.completions.record, key, self._ops.current_stream(tensor.device))
        self._slots[key] = tensor

    def get(self, kind: str, stage: int, m: int) -> torch.Tensor:
        key = (kind, stage, m)
        try:
            tensor = self._slots.pop(key)
        except KeyError:
            raise RuntimeError(f"{kind} of stage {stage} microbatch {m} is not available yet") from None
        if self.completions is not None:
            self.host.call(HANDOFF, self._take, key, tensor)
        return tensor

    def _take(self, key: tuple[str, int, int], tensor: torch.Tensor) -> None:
        """The consumer's stream after the producer's record of `key`, and `tensor` kept for it."""
        consumer = self._ops.current_stream(tensor.device)
        self.completions.take(key, consumer)
        # The consumer reads on its own stream; a tensor allocated on the producer's stream (a hand-off
        # copied out of a graph that serves several microbatches) is freed after this hand-off, and the
        # caching allocator would give its block to the producer's stream again without waiting for
        # that read. Recording the use keeps the block until the consumer's stream has passed it.
        self._ops.record_stream(tensor, consumer)

    def empty(self) -> bool:
        return not self._slots
