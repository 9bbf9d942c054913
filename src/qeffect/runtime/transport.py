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
    """In-process hand-off: every rank lives in this process and runs in one global order."""

    def __init__(self) -> None:
        self._slots: dict[tuple[str, int, int], torch.Tensor] = {}

    def put(self, kind: str, stage: int, m: int, tensor: torch.Tensor) -> None:
        key = (kind, stage, m)
        if key in self._slots:
            raise RuntimeError(f"{kind} of stage {stage} microbatch {m} published twice")
        self._slots[key] = tensor

    def get(self, kind: str, stage: int, m: int) -> torch.Tensor:
        try:
            return self._slots.pop((kind, stage, m))
        except KeyError:
            raise RuntimeError(f"{kind} of stage {stage} microbatch {m} is not available yet") from None

    def empty(self) -> bool:
        return not self._slots
