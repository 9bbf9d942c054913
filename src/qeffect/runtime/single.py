"""Single-process executor: every rank's program runs in one valid global order on one device."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from qeffect.runtime.rank import BaseRank, Batch, Observer
from qeffect.runtime.transport import LocalTransport
from qeffect.schedule import Schedule, global_order


class SingleProcessPipeline:
    """Runs all ranks of a schedule in one process (the CPU path and one-GPU verification)."""

    def __init__(self, ranks: Sequence[BaseRank], schedule: Schedule) -> None:
        if len(ranks) != schedule.pp:
            raise ValueError(f"schedule has {schedule.pp} ranks, got {len(ranks)} rank objects")
        self.ranks = list(ranks)
        self.schedule = schedule
        self.order = global_order(schedule)
        self.manager = None  # the GraphManager when the actions are captured
        self.offload = None  # the OffloadManager when captured actions offload their activations

    def run_actions(self, batches: Sequence[Batch], observer: Observer | None = None) -> torch.Tensor:
        """All actions of one step (no commit); returns the step loss."""
        transport = LocalTransport()
        if self.offload is not None:
            self.offload.begin_step()  # groups left live by an aborted step are dropped first
        for rank, action in self.order:
            self.ranks[rank].run(action, batches, transport)
            if observer is not None:
                observer(action, self.ranks[rank])
        if not transport.empty():
            raise RuntimeError("a step ended with activations or gradients nobody consumed")
        last = self.ranks[self.schedule.stage_to_rank[self.schedule.num_stages - 1]]
        loss = last.step_loss()
        assert loss is not None
        return loss

    def commit(self) -> None:
        for r in self.ranks:
            r.commit()

    def step(self, batches: Sequence[Batch], observer: Observer | None = None) -> torch.Tensor:
        loss = self.run_actions(batches, observer)
        self.commit()
        return loss

    def settle(self) -> None:
        """Every rank's parameters and optimizer state up to date, for a reader outside the steps."""
        for r in self.ranks:
            r.settle()
