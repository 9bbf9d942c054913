"""How activations and input gradients move between stages, always between actions (never inside one).

`LocalTransport` keeps them in a dict for the single-process executor; the torch.distributed
executor supplies point-to-point transports with the same interface.
"""

from __future__ import annotations

from typing import Protocol

import torch


class Transport(Protocol):
    def put(self, kind: str, stage: int, m: int, tensor: torch.Tensor) -> None:
        """Publish `tensor` produced by `stage` for microbatch `m` (kind: "act" or "grad")."""

    def get(self, kind: str, stage: int, m: int) -> torch.Tensor:
        """Take the tensor that `stage` produced for microbatch `m`."""


class LocalTransport:
    """In-process hand-off: every rank lives in this process and runs in one global order.

    `events=True` (ranks on their own CUDA streams, `SingleProcessPipeline.rank_streams`): `put` records
    an event on the producer's current stream and `get` makes the consumer's current stream wait on it,
    so a consumer reads a tensor only after the producer's stream has written it (host order alone
    orders nothing across streams)."""

    def __init__(self, *, events: bool = False) -> None:
        self._slots: dict[tuple[str, int, int], tuple[torch.Tensor, torch.cuda.Event | None]] = {}
        self.events = events

    def put(self, kind: str, stage: int, m: int, tensor: torch.Tensor) -> None:
        key = (kind, stage, m)
        if key in self._slots:
            raise RuntimeError(f"{kind} of stage {stage} microbatch {m} published twice")
        written = None
        if self.events:
            written = torch.cuda.Event()
            written.record(torch.cuda.current_stream(tensor.device))  # the producer's stream
        self._slots[key] = (tensor, written)

    def get(self, kind: str, stage: int, m: int) -> torch.Tensor:
        try:
            tensor, written = self._slots.pop((kind, stage, m))
        except KeyError:
            raise RuntimeError(f"{kind} of stage {stage} microbatch {m} is not available yet") from None
        if written is not None:
            torch.cuda.current_stream(tensor.device).wait_event(written)
        return tensor

    def empty(self) -> bool:
        return not self._slots
