"""Hand-off buffers between two consecutive stages captured in one process.

Stage s's F output is stage s+1's F input, and stage s+1's dI output (the gradient of that input) is
stage s's dI input. Replayed graphs read fixed addresses, so each of these crossings would cost an input
copy per replay, queued by the host (about 5 us of host time each, and 24 of them per h2048 step). A
`Handoff` gives both stages one buffer per microbatch instead: the producing graph writes its result
into the consuming graph's static input (a device copy inside the graph, no host call) and the consumer
recognizes the buffer it is handed and copies nothing.

The rule that keeps it correct: a buffer is written only by microbatch m's graph of the producer and read
only by microbatch m's graphs of the consumer, so both sides use it only where their graphs serve that one
microbatch (a chain of its own, `GraphPlan.shared` false). Within a step every microbatch is produced once
and consumed after (the schedule's dependencies, which the hand-off's event orders across rank streams);
the next write is the next step's, after every read of this one. Where either side shares a chain, that
side keeps its own buffer and the hand-off is the usual copy.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class Handoff:
    """The buffers between stage `stage` and stage `stage + 1`, made on first use (outside any capture)."""

    stage: int
    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device
    _acts: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)
    _views: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)
    _grads: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)

    def act(self, m: int) -> torch.Tensor:
        """Stage+1's F input for microbatch m: a leaf that requires grad (its dI takes the gradient of it)."""
        t = self._acts.get(m)
        if t is None:
            t = self._acts[m] = torch.zeros(self.shape, dtype=self.dtype, device=self.device, requires_grad=True)
            self._views[m] = t.detach()
        return t

    def act_view(self, m: int) -> torch.Tensor:
        """The same buffer without autograd: what the producer's F graph writes and hands on (one object
        per microbatch, so that the consumer recognizes it by identity)."""
        self.act(m)
        return self._views[m]

    def grad(self, m: int) -> torch.Tensor:
        """Stage's dI input for microbatch m (the gradient of its F output), written by stage+1's dI graph."""
        t = self._grads.get(m)
        if t is None:
            t = self._grads[m] = torch.zeros(self.shape, dtype=self.dtype, device=self.device)
        return t

    def check(self, what: str, t: torch.Tensor) -> None:
        """A graph body's result must fit the buffer it is written into."""
        if tuple(t.shape) != self.shape or t.dtype != self.dtype:
            raise RuntimeError(f"hand-off after stage {self.stage}: {what} is {t.dtype}{tuple(t.shape)}, the "
                               f"buffer {self.dtype}{self.shape}")
