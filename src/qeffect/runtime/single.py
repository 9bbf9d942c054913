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

Inside a step only the pipeline switches streams, so it knows the current one (`StreamSwitch`): it asks
torch once per step and switches with one `torch.cuda.set_stream` per run of a rank's actions, and the
hand-offs take their streams from it. `torch.cuda.stream(...)` and `torch.cuda.current_stream()` look the
device up in Python on every call, which at one switch and one hand-off per action was most of what rank
streams added to the host's queue time of a small step.

The commit applies the training recipe (`runtime.recipe`): each rank sets the schedule's learning rate
itself; with clipping (or `track_grad_norm`) the pipeline first loads every rank's complete gradients,
adds the stages' square sums in stage order into the global norm and hands every rank the clip factor.
That commit runs on the caller's stream after every rank stream (the norm needs every rank's last
gradient), not beside other ranks' remaining actions.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import torch

from qeffect.graphs.stats import HANDOFF, LAUNCH, OPTIMIZER, HostPhases
from qeffect.graphs.step_graph import RecordedStep, check_issued, dry_step, load_batches, record_step
from qeffect.runtime.rank import BaseRank, Batch, Observer
from qeffect.runtime.recipe import clip_factor, global_norm
from qeffect.runtime.transport import LocalTransport, TorchCudaEvents
from qeffect.schedule import Schedule, global_order


def rank_runs(order: Sequence[tuple[int, object]]) -> list[tuple[int, list]]:
    """The global order as runs of consecutive actions of one rank: `[(rank, [action, ...]), ...]`, in order."""
    runs: list[tuple[int, list]] = []
    for rank, action in order:
        if runs and runs[-1][0] == rank:
            runs[-1][1].append(action)
        else:
            runs.append((rank, [action]))
    return runs


class StreamSwitch:
    """The current stream of the pipeline's device while a step runs, kept by the pipeline instead of asked
    of torch: `begin` takes the caller's stream (one query), `use(stream)` switches where it changes and
    back on exit, `end` forgets it. Outside `begin`/`end` it knows nothing (`current` is None) and `use`
    is `torch.cuda.stream`."""

    __slots__ = ("current",)

    def __init__(self) -> None:
        self.current: torch.cuda.Stream | None = None

    def begin(self, device: torch.device) -> torch.cuda.Stream:
        self.current = torch.cuda.current_stream(device)
        return self.current

    def end(self) -> None:
        self.current = None

    def stream(self, device: torch.device) -> torch.cuda.Stream:
        """The current stream: the one kept inside a step, else torch's."""
        cur = self.current
        return torch.cuda.current_stream(device) if cur is None else cur

    def use(self, stream: torch.cuda.Stream) -> AbstractContextManager[Any]:
        return torch.cuda.stream(stream) if self.current is None else _On(self, stream)

    def go(self, stream: torch.cuda.Stream) -> None:
        """Make `stream` current (inside a step), with no way back: the caller restores its own."""
        if stream is not self.current:
            torch.cuda.set_stream(stream)
            self.current = stream


class _On:
    """`StreamSwitch.use` inside a step: `set_stream` only where the stream changes, the previous one restored."""

    __slots__ = ("switch", "stream", "prev")

    def __init__(self, switch: StreamSwitch, stream: torch.cuda.Stream) -> None:
        self.switch, self.stream, self.prev = switch, stream, None

    def __enter__(self) -> None:
        self.prev = self.switch.current
        if self.stream is not self.prev:
            torch.cuda.set_stream(self.stream)
            self.switch.current = self.stream

    def __exit__(self, *exc: object) -> None:
        if self.switch.current is not self.prev:
            torch.cuda.set_stream(self.prev)
            self.switch.current = self.prev


class _SwitchEvents(TorchCudaEvents):
    """The transport's event operations with the current stream from the pipeline's `StreamSwitch`."""

    __slots__ = ("switch",)

    def __init__(self, switch: StreamSwitch) -> None:
        self.switch = switch

    def current_stream(self, device: torch.device) -> torch.cuda.Stream:
        return self.switch.stream(device)


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
        # the global gradient norm every commit, also without clipping (`qeffect train` with nonfinite = skip)
        self.track_grad_norm = False
        self.last_grad_norm: torch.Tensor | None = None  # float64 0-dim, on the device: the last commit's norm
        self.last_lr: float | None = None  # the last commit's learning rate
        self._prepared: tuple[torch.Tensor, torch.Tensor | None] | None = None  # (norm, clip factor)
        self._transport: LocalTransport | None = None  # kept between steps: its hand-off events are reused
        self._runs: tuple[list, list[tuple[int, list]]] | None = None  # (order, `rank_runs(order)`)
        self._switch = StreamSwitch()  # the current stream while a step runs on rank streams
        self.host = HostPhases()  # the host's time per phase of a step, while on (`time_host_phases`)
        # `runtime.step_graph`: after this many ordinary steps the next one is recorded as one graph, and
        # every later step runs its bookkeeping dry and launches that graph once (`graphs.step_graph`)
        self.step_graph_after: int | None = None
        self.recorded: RecordedStep | None = None
        self._steps_run = 0
        self._dry_transport: LocalTransport | None = None

    @property
    def _dry(self) -> bool:
        """A step's bookkeeping with nothing issued (the graph manager's dry mode): no events, no switches."""
        return self.manager is not None and self.manager.mode == "dry"

    def time_host_phases(self) -> HostPhases:
        """Time the host's phases of the steps that follow (`graphs.stats.HostPhases`): the graph manager's
        input copies and launches, stream switches and hand-off events, the commit. Returns the clock."""
        self.host.on = True
        if self.manager is not None:
            self.manager.host = self.host
        self._transport = None  # the next step's transport takes the clock
        return self.host

    def on_rank_stream(self, rank: int):
        """The context rank `rank`'s work is launched in: its stream, or the caller's without rank streams."""
        if self.rank_streams is None or self._dry:  # a dry step switches no streams
            return nullcontext()
        return self._switch.use(self.rank_streams[rank])

    @contextmanager
    def _fork_join(self, after: Sequence[torch.cuda.Event] | None = None) -> Iterator[None]:
        """Rank streams after the caller's stream at the start, the caller's after all of them at the end.
        `after`: each rank stream starts after its own event instead (a step graph's, recorded after that
        rank's last work in the graph, which itself comes after all the caller queued before it)."""
        if self.rank_streams is None:
            yield
            return
        self.host.call(HANDOFF, self._fork, after)
        try:
            yield
        finally:
            try:
                self.host.call(HANDOFF, self._after_rank_streams)
            finally:
                self._switch.end()

    def _fork(self, after: Sequence[torch.cuda.Event] | None = None) -> None:
        """Every rank stream after the caller's (the step's start), or after its event of `after`."""
        caller = self._switch.begin(self.rank_streams[0].device)
        if after is None:
            for s in self.rank_streams:
                s.wait_stream(caller)
        else:
            for s, event in zip(self.rank_streams, after, strict=True):
                s.wait_event(event)

    def _step_transport(self) -> LocalTransport:
        """The transport of a step: the last step's (its events are reused per hand-off slot) unless that
        one was left non-empty by an aborted step or the settings changed."""
        events = self.rank_streams is not None
        t = self._transport
        if t is None or not t.empty() or t.events != events or t.checked != self.checked_completion:
            t = self._transport = LocalTransport(events=events, ops=_SwitchEvents(self._switch),
                                                 checked=self.checked_completion, host=self.host)
        return t

    def _rank_runs(self) -> list[tuple[int, list]]:
        if self._runs is None or self._runs[0] is not self.order:  # `order` may be replaced (verification)
            self._runs = (self.order, rank_runs(self.order))
        return self._runs[1]

    def _actions(self, batches: Sequence[Batch], observer: Observer | None) -> torch.Tensor:
        """Launch every action of one step (each on its rank's stream); the step loss, on the last rank's.

        The stream is switched only where the rank changes (a run of one rank's consecutive actions shares
        one stream context): every action is still queued on its rank's stream, in the same host order, so
        the device work and its bits are the same; the host saves a context switch per action."""
        dry = self._dry
        transport = self._step_transport() if not dry else self._transport_of_dry_steps()
        if self.offload is not None:
            self.offload.begin_step()  # groups left live by an aborted step are dropped first
        streams, switch, host = (self.rank_streams if not dry else None), self._switch, self.host
        caller = switch.current
        try:
            for rank, actions in self._rank_runs():
                r = self.ranks[rank]
                if streams is not None:  # straight from one rank's stream to the next: one switch per run
                    host.call(HANDOFF, switch.go, streams[rank])
                for action in actions:
                    r.run(action, batches, transport)
                    if observer is not None:  # stream-ordered after the action (and before the rank's next)
                        observer(action, r)
        finally:
            if streams is not None:
                switch.go(caller)
        if not transport.empty():
            raise RuntimeError("a step ended with activations or gradients nobody consumed")
        last_rank = self.schedule.stage_to_rank[self.schedule.num_stages - 1]
        with self.on_rank_stream(last_rank):
            step_loss = self.ranks[last_rank].step_loss_of_losses()
            loss = step_loss() if self.manager is None else self.manager.step_tensor("step loss", step_loss)
        assert loss is not None
        if self.rank_streams is not None and not dry:  # made on the last rank's stream, read on the caller's
            loss.record_stream(self._caller_stream())
        return loss

    def _transport_of_dry_steps(self) -> LocalTransport:
        """A dry step's hand-offs: the same bookkeeping, no events (nothing is issued)."""
        t = self._dry_transport
        if t is None or not t.empty():
            t = self._dry_transport = LocalTransport(events=False, host=self.host)
        return t

    def run_actions(self, batches: Sequence[Batch], observer: Observer | None = None) -> torch.Tensor:
        """All actions of one step (no commit); returns the step loss."""
        with self._fork_join():
            return self._actions(batches, observer)

    def _wants_norm(self) -> bool:
        return self.track_grad_norm or self.ranks[0].recipe.clip > 0

    def _caller_stream(self) -> torch.cuda.Stream:
        """The current stream: the caller's between the rank runs of a step (known), else torch's."""
        return self._switch.stream(self.rank_streams[0].device)

    def _after_rank_streams(self) -> None:
        """The caller's stream after every rank stream (the work that follows reads every rank's results)."""
        if self.rank_streams is not None:
            caller = self._caller_stream()
            for s in self.rank_streams:
                caller.wait_stream(s)

    def grad_norm(self) -> torch.Tensor | None:
        """The global gradient norm of the step (`runtime.recipe`: stages added in stage order), once its
        actions ran and before its commit; None when neither clipping nor `track_grad_norm` asks for it.
        Loads every rank's gradients (`BaseRank.gradient_square_sums`); the commit then uses them."""
        if self._prepared is None:
            if not self._wants_norm():
                return None
            self._after_rank_streams()
            sums: dict[int, torch.Tensor] = {}
            for r in self.ranks:
                sums.update(r.gradient_square_sums())
            norm = global_norm([sums[s] for s in range(self.schedule.num_stages)])
            clip = self.ranks[0].recipe.clip
            self._prepared = (norm, clip_factor(norm, clip) if clip > 0 else None)
        return self._prepared[0]

    def _commit_ranks(self, before_step: Callable[[BaseRank], None] | None = None, skip: bool = False) -> None:
        self.host.call(OPTIMIZER, self._commit_each, before_step, skip)

    def _commit_each(self, before_step: Callable[[BaseRank], None] | None, skip: bool) -> None:
        def hook(r: BaseRank) -> Callable[[], None] | None:
            return None if before_step is None else (lambda: before_step(r))

        if self._prepared is None and not self._wants_norm():  # no norm: each rank on its stream, as it comes
            for rank, r in enumerate(self.ranks):
                with self.on_rank_stream(rank):
                    r.commit(hook(r), skip=skip)
            self.last_grad_norm = None
        else:
            try:
                norm = self.grad_norm()
                factor = self._prepared[1]
                for r in self.ranks:  # on the caller's stream, after every rank stream (`grad_norm`)
                    r.commit(hook(r), factor=factor, skip=skip)
            finally:
                self._prepared = None
            self.last_grad_norm = norm
        self.last_lr = self.ranks[0].last_lr

    def commit(self, before_step: Callable[[BaseRank], None] | None = None, *, skip: bool = False) -> None:
        """Every rank's commit (`before_step(rank)` just before its AdamW step). `skip`: every rank
        skips its optimizer step (`BaseRank.commit`)."""
        with self._fork_join():
            self._commit_ranks(before_step, skip)

    def step(self, batches: Sequence[Batch], observer: Observer | None = None) -> torch.Tensor:
        """One step: the actions, then each rank's commit on its stream (a rank whose last action is done
        commits beside the others' remaining actions), then the join. With a step graph
        (`step_graph_after`), the actions of a step after the first ones are recorded as one graph, and
        later steps launch that graph once after their bookkeeping (`graphs.step_graph`); an observer
        (verification, after every action) gets ordinary steps."""
        if self.step_graph_after is None or observer is not None:
            return self._launched_step(batches, observer)
        if self.recorded is not None:
            loss = self._replayed_step(batches)
        elif self._steps_run < self.step_graph_after:
            loss = self._launched_step(batches, None)
        else:
            loss = self._recorded_step(batches)
        self._steps_run += 1
        return loss

    def _launched_step(self, batches: Sequence[Batch], observer: Observer | None) -> torch.Tensor:
        with self._fork_join():
            loss = self._actions(batches, observer)
            self._commit_ranks()
        return loss

    def _recorded_step(self, batches: Sequence[Batch]) -> torch.Tensor:
        """This step's actions recorded as one graph, which then runs them; the commit as usual."""
        device = self.rank_streams[0].device if self.rank_streams is not None else batches[0][0].device
        done: list[torch.cuda.Event] = []
        self.recorded = record_step(self.manager, device, list(batches), lambda b: self._record_actions(b, done))
        self.recorded.rank_done = done or None
        return self._launch_recorded()

    def _record_actions(self, batches: Sequence[Batch], done: list[torch.cuda.Event]) -> torch.Tensor:
        """`run_actions` under the step graph's capture. With rank streams, an external event is recorded on
        each rank's stream after that rank's last work (an event-record node of the graph), appended to
        `done`: its commit waits for that event, not for the whole graph."""
        with self._fork_join():
            loss = self._actions(batches, None)
            for s in self.rank_streams or ():
                event = torch.cuda.Event(external=True)
                event.record(s)
                done.append(event)
        return loss

    def _replayed_step(self, batches: Sequence[Batch]) -> torch.Tensor:
        """The batches into the recorded step's inputs; stale FP8 weight caches cast; one launch of its
        graph; then, while the device runs it, the step's bookkeeping with nothing issued, checked to issue
        what the recorded step did; the commit as usual once the check passed.

        The launch comes first so that the device does not wait for the bookkeeping (the step is timed from
        the host's first call to the device's last kernel). The check still gates the commit: a step whose
        bookkeeping is refused, or issues other work, raises before any parameter or optimizer state takes
        it; its actions' device writes (activations, staged gradients, FP8 amax histories) are the recorded
        step's on this step's batches."""
        rec = self.recorded
        load_batches(rec, batches)
        for r in self.ranks:  # what each stage's first F does, before the graph that reads the caches
            r.cast_stale_weights()
        self._launch(rec)
        with dry_step(self.manager):
            self._actions(rec.batches, None)
        check_issued(rec, self.manager.issued)
        return self._commit_recorded(rec)

    def _launch_recorded(self) -> torch.Tensor:
        rec = self.recorded
        self._launch(rec)
        return self._commit_recorded(rec)

    def _launch(self, rec: RecordedStep) -> None:
        self.host.call(LAUNCH, rec.graph.replay)
        rec.replays += 1

    def _commit_recorded(self, rec: RecordedStep) -> torch.Tensor:
        """The commit after a step graph's launch. With rank streams and no global norm, each rank commits
        on its stream once the graph's event for that rank has fired, beside the other ranks' remaining
        actions, as in an ordinary step; a global norm needs every rank's gradients first (the whole graph)."""
        with self._fork_join(after=None if self._wants_norm() else rec.rank_done):
            self._commit_ranks()
        return rec.loss.clone()  # the next replay rewrites it

    def settle(self) -> None:
        """Every rank's parameters and optimizer state up to date, for a reader outside the steps."""
        for r in self.ranks:
            r.settle()
