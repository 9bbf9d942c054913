"""Single-process executor: every rank's program runs in one valid global order on one device.

With `rank_streams` (captured paths on a GPU, see `runtime.build.rank_streams_for`) each rank's actions
and its optimizer commit are launched on that rank's own CUDA stream, as on a pipeline of one GPU per
rank: the host still issues the global order, but the device runs one rank's work beside the other's
wherever the schedule lets it (the handoffs between ranks are the only edges: `LocalTransport(events=
True)`, device completions of `qeffect.contracts.completion`). A step starts with every rank stream
waiting on the caller's stream and ends with the caller's stream waiting on every rank stream, so what a
step returns or leaves behind is ordered on the caller's stream as before (whole-stream edges: `wait_stream`
records an event on the stream it waits for, the same rule with an event nobody needs to name). The
arithmetic of every action is the same: only which kernels may overlap changes.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext

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
        self.rank_streams: list[torch.cuda.Stream] | None = None  # one per rank: see the module docstring
        self.keep_alive: list[torch.Tensor] = []  # what captured graphs use by address only (workspaces)
        self.checked_completion = False  # check each hand-off between rank streams (host bookkeeping: debugging)

    def on_rank_stream(self, rank: int):
        """The context rank `rank`'s work is launched in: its stream, or the caller's without rank streams."""
        return torch.cuda.stream(self.rank_streams[rank]) if self.rank_streams is not None else nullcontext()

    @contextmanager
    def _fork_join(self) -> Iterator[None]:
        """Rank streams after the caller's stream at the start, the caller's after all of them at the end."""
        if self.rank_streams is None:
            yield
            return
        caller = torch.cuda.current_stream(self.rank_streams[0].device)
        for s in self.rank_streams:
            s.wait_stream(caller)
        try:
            yield
        finally:
            for s in self.rank_streams:
                caller.wait_stream(s)

    def _actions(self, batches: Sequence[Batch], observer: Observer | None) -> torch.Tensor:
        """Launch every action of one step (each on its rank's stream); the step loss, on the last rank's."""
        transport = LocalTransport(events=self.rank_streams is not None, checked=self.checked_completion)
        if self.offload is not None:
            self.offload.begin_step()  # groups left live by an aborted step are dropped first
        for rank, action in self.order:
            with self.on_rank_stream(rank):
                self.ranks[rank].run(action, batches, transport)
                if observer is not None:  # stream-ordered after the action (and before the rank's next)
                    observer(action, self.ranks[rank])
        if not transport.empty():
            raise RuntimeError("a step ended with activations or gradients nobody consumed")
        last_rank = self.schedule.stage_to_rank[self.schedule.num_stages - 1]
        with self.on_rank_stream(last_rank):
            loss = self.ranks[last_rank].step_loss()
        assert loss is not None
        if self.rank_streams is not None:  # made on the last rank's stream, read on the caller's
            loss.record_stream(torch.cuda.current_stream(loss.device))
        return loss

    def run_actions(self, batches: Sequence[Batch], observer: Observer | None = None) -> torch.Tensor:
        """All actions of one step (no commit); returns the step loss."""
        with self._fork_join():
            return self._actions(batches, observer)

    def _commit_ranks(self) -> None:
        for rank, r in enumerate(self.ranks):
            with self.on_rank_stream(rank):
                r.commit()

    def commit(self) -> None:
        with self._fork_join():
            self._commit_ranks()

    def step(self, batches: Sequence[Batch], observer: Observer | None = None) -> torch.Tensor:
        """One step: the actions, then each rank's commit on its stream (a rank whose last action is done
        commits beside the others' remaining actions), then the join."""
        with self._fork_join():
            loss = self._actions(batches, observer)
            self._commit_ranks()
        return loss

    def settle(self) -> None:
        """Every rank's parameters and optimizer state up to date, for a reader outside the steps."""
        for r in self.ranks:
            r.settle()
