"""CUDA graph manager: one graph stream, one memory pool, and the two-way handshake at every replay.

Why two-way (paper, Fig. 2): GraphPP launched a replay on its graph stream and handed control straight
back (one-way). Nothing ordered the graph after the caller's writes of its inputs, and nothing ordered
the caller's reads of the outputs after the graph: stale reads in 600 of 600 producer-consumer checks.
Here every replay is

1. graph stream waits on the caller's current stream (caller -> graph edge),
2. dynamic inputs are copied into the static input buffers ON the graph stream, after that edge,
3. the graph is replayed on the graph stream,
4. the caller's stream waits on an external event recorded at the graph tail during capture.

No host synchronization anywhere on that path. `protocol="one-way"` drops steps 1 and 4 on purpose, to
reproduce GraphPP's defect (`qeffect.graphs.handshake` measures both). Step 4 is a device completion of
`qeffect.contracts.completion` keyed by the graph's name: the tail event, recorded once at capture, fires
again on every replay; `GraphManager(checked_completion=True)` names the one-way defect on a CPU
(`check_use` after a replay the caller did not wait for raises `DeviceCompletionViolation`).

`protocol="stream-ordered"` gives the same two guarantees with no edge at all: the graph is captured on
the graph stream but replayed on the caller's stream (a CUDA graph launches into any stream), after the
input copies on that same stream. Caller writes -> copies -> graph -> caller reads is then plain stream
order, so there is nothing to hand off; it saves the two cross-stream waits per replay. Each graph's
memory is in its own private pool (`capture(private_pool=True)`, what stage actions use), so which
stream replays it does not matter to the allocator.

Every CUDA call goes through a `GraphBackend`, so the bookkeeping and the exact order of handshake
operations are testable on a CPU-only machine with fakes; importing this module touches no CUDA.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Callable, Hashable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, get_args

import torch
from torch import Tensor
from torch.autograd.graph import increment_version

from qeffect.contracts import completion_ledger
from qeffect.graphs.cuda_driver import CaptureInserter
from qeffect.graphs.stats import COPY, LAUNCH, GraphStats, HostPhases

HandshakeProtocol = Literal["two-way", "one-way", "stream-ordered"]
PROTOCOLS: tuple[str, ...] = get_args(HandshakeProtocol)
StepMode = Literal["launch", "record", "dry"]  # `GraphManager.mode`


class GraphBackend(Protocol):
    """The CUDA operations the manager needs. Streams must offer `wait_stream(s)` and `wait_event(e)`,
    graphs `replay()`, events `record()`."""

    def new_stream(self) -> Any: ...
    def current_stream(self) -> Any: ...
    def use_stream(self, stream: Any) -> AbstractContextManager[Any]: ...
    def graph_pool_handle(self) -> Any: ...
    def new_graph(self) -> Any: ...
    def capture(self, graph: Any, pool: Any, stream: Any) -> AbstractContextManager[Any]: ...
    def new_external_event(self) -> Any: ...
    def copy_(self, dst: Tensor, src: Tensor) -> None: ...  # `dst` requires no grad (a detached buffer)
    def add_to_capture(self, graph: Any) -> None: ...  # a step graph's record (`GraphManager.mode`)
    def record_stream(self, tensor: Tensor, stream: Any) -> None: ...
    def memory_allocated(self) -> int: ...
    def memory_reserved(self) -> int: ...
    def synchronize(self) -> None: ...


@contextmanager
def collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off for the duration (as it was before, after).

    Why, around a capture: torch no longer collects before one (`torch.compiler.config.force_cudagraph_gc`
    is off by default), so a collection that allocations inside a capture trigger can free dead cycles
    left by earlier work, whose finalizers call CUDA (graphs, events, mapped memory); some such calls are
    not allowed while a stream captures in global mode, and one would invalidate the capture. Deferring
    the collection to after the capture removes that chance; nothing else changes. (A guard, not a
    measured fix: see the CHANGELOG.)"""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


class TorchCudaBackend:
    """The real backend: torch.cuda on one device. Constructed only when a manager is built.

    `keep_graphs`: each graph keeps its `cudaGraph_t` beside its executable (`CUDAGraph(keep_graph=True)`,
    instantiated right after its capture), so a step graph can add it to its capture as a child node."""

    def __init__(self, device: torch.device | str = "cuda", *, keep_graphs: bool = False) -> None:
        self.keep_graphs = keep_graphs
        self._inserter: CaptureInserter | None = None
        self.device = torch.device(device)
        if self.device.type != "cuda":
            raise ValueError(f"GraphManager needs a CUDA device, got {self.device}")
        if self.device.index is None:  # an indexed device skips torch's current-device query per call
            self.device = torch.device("cuda", torch.cuda.current_device())

    def new_stream(self) -> torch.cuda.Stream:
        return torch.cuda.Stream(self.device)

    def current_stream(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream(self.device)

    def use_stream(self, stream: torch.cuda.Stream) -> AbstractContextManager[Any]:
        return torch.cuda.stream(stream)

    def graph_pool_handle(self) -> Any:
        with torch.cuda.device(self.device):
            return torch.cuda.graph_pool_handle()

    def new_graph(self) -> torch.cuda.CUDAGraph:
        return torch.cuda.CUDAGraph(keep_graph=True) if self.keep_graphs else torch.cuda.CUDAGraph()

    @contextmanager
    def capture(self, graph: torch.cuda.CUDAGraph, pool: Any, stream: torch.cuda.Stream) -> Iterator[None]:
        with collector_paused(), torch.cuda.graph(graph, pool=pool, stream=stream):
            yield
        if self.keep_graphs:
            graph.instantiate()

    def add_to_capture(self, graph: torch.cuda.CUDAGraph) -> None:
        """`graph` as a child node of the capture under way on the current stream (`keep_graphs` only)."""
        if self._inserter is None:
            self._inserter = CaptureInserter()
        self._inserter.add(torch.cuda.current_stream(self.device).cuda_stream, graph.raw_cuda_graph())

    def new_external_event(self) -> torch.cuda.Event:
        # external=True: the record inside the capture becomes a graph node that fires on every replay,
        # so a wait on it after a replay orders the caller behind that replay's tail.
        return torch.cuda.Event(external=True)

    def copy_(self, dst: Tensor, src: Tensor) -> None:
        dst.copy_(src, non_blocking=True)  # `dst` requires no grad: the manager copies into detached buffers

    def record_stream(self, tensor: Tensor, stream: torch.cuda.Stream) -> None:
        if tensor.is_cuda:
            tensor.record_stream(stream)

    def memory_allocated(self) -> int:
        return torch.cuda.memory_allocated(self.device)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def memory_reserved(self) -> int:
        return torch.cuda.memory_reserved(self.device)


class _BackendEvents:
    """The completion contract's event operations on a `GraphBackend` (its events record on the current
    stream: inside a capture, the graph stream, so the record becomes the graph's tail node)."""

    __slots__ = ("backend",)

    def __init__(self, backend: GraphBackend) -> None:
        self.backend = backend

    def new_event(self, name: str) -> Any:
        return self.backend.new_external_event()

    def record(self, event: Any, stream: Any) -> None:
        event.record()  # the current stream is `stream`: the ledger records only inside `capture`

    def wait(self, stream: Any, event: Any) -> None:
        stream.wait_event(event)


class HeldInputs:
    """Which constant source each static input buffer still holds, so that a replay copies it only once.

    A constant (`mark`) is made once and only ever read afterwards: a loss seed, a fold's mode word, a
    microbatch index. A buffer holds the constant of its last copy while neither version counter moved
    (torch counts every in-place write made through a tensor or a view of it) and the graph does not write
    the buffer itself (a capture that moved the buffer's version: `CapturedAction.written_inputs`). Sources
    a graph writes (its static outputs) change without a version step: they are never constants. A kernel
    that writes through a raw pointer (Triton's) moves no version either: a static input that such a kernel
    writes must not take a constant."""

    __slots__ = ("constants", "buffers")

    def __init__(self) -> None:
        self.constants: dict[int, Tensor] = {}  # id -> the constant (kept alive: its id is never reused)
        self.buffers: dict[int, tuple[Tensor, Tensor, int, int]] = {}  # id(dst) -> (dst, src, versions)

    def mark(self, *tensors: Tensor) -> None:
        for t in tensors:
            self.constants[id(t)] = t

    def is_constant(self, src: Tensor) -> bool:
        return self.constants.get(id(src)) is src

    def holds(self, dst: Tensor, src: Tensor) -> bool:
        """Whether `dst` still holds constant `src` from an earlier copy (the graph must not write `dst`)."""
        h = self.buffers.get(id(dst))
        return h is not None and h[0] is dst and h[1] is src and h[2] == src._version and h[3] == dst._version

    def copied(self, dst: Tensor, src: Tensor) -> None:
        """Constant `src` was just copied into `dst` (its version step is part of what the buffer holds)."""
        self.buffers[id(dst)] = (dst, src, src._version, dst._version)


class PoolOrderViolation(RuntimeError):
    """A graph of a shared memory pool replayed out of its pool's capture order (`PoolCycle`)."""


@dataclass
class PoolCycle:
    """One memory pool shared by several graphs, and the rule that makes the sharing safe.

    A capture may take blocks that earlier captures into the pool freed (their temporaries) for tensors
    it keeps live past its own end (saved activations, retained work, outputs). Those blocks are then
    written by the earlier graphs at their replays too. This is safe when the graphs replay in the order
    they were captured and a graph's live tensors are consumed before the cycle comes back to the earlier
    graphs: the rule torch states for graphs sharing a pool. The caller picks pools whose cycle is that
    (`graphs.captured`); `advance` checks every replay against it, before the replay issues anything, and
    `restart` begins a new cycle (a new step, after an aborted one too: what it left is dead).
    """

    name: str
    handle: Any  # the backend's pool handle (`graph_pool_handle`)
    members: list[str] = field(default_factory=list)  # graph names, in capture order
    next: int = 0  # the member whose replay comes next

    def join(self, action: CapturedAction) -> None:
        """`action`, just captured into this pool, as its next member."""
        action.cycle, action.cycle_index = self, len(self.members)
        self.members.append(action.name)

    def advance(self, action: CapturedAction) -> None:
        """`action` replays now: refused unless it is the member whose turn it is."""
        if action.cycle_index != self.next:
            raise PoolOrderViolation(
                f"graph {action.name} replayed out of its memory pool's capture order (pool {self.name}: "
                f"{' -> '.join(self.members)}); expected {self.members[self.next]}. A graph sharing a pool "
                "may overwrite what a later-captured graph still holds; runtime.graph_pools = \"private\" "
                "gives each graph its own pool")
        self.next = action.cycle_index + 1 if action.cycle_index + 1 < len(self.members) else 0

    def restart(self) -> None:
        self.next = 0


@dataclass
class CapturedAction:
    """One captured graph: its static input buffers (fixed addresses), static outputs and tail event.

    `outputs` are the tensors `fn` returned at capture; every replay overwrites them in place, so a
    caller that keeps a result across replays must clone it (on its own stream, after `replay`).
    """

    name: str
    graph: Any
    static_inputs: dict[str, Tensor]
    outputs: Any
    tail_event: Any
    capture_seconds: float
    memory_allocated_before: int
    memory_allocated_after: int
    memory_reserved_before: int
    memory_reserved_after: int
    pool: Any = None  # the memory pool its capture allocated from (private or the manager's shared one)
    replays: int = field(default=0)
    cycle: PoolCycle | None = None  # the shared pool whose capture order every replay must follow
    cycle_index: int = -1  # this graph's place in `cycle.members`
    # static inputs the captured body wrote in place (their version moved during capture): every replay
    # may write them again, so their content is never taken as still holding the last copy
    written_inputs: frozenset[str] = frozenset()
    # each static input detached (same storage and version counter): what a replay copies into, with no
    # gradient-mode switch per copy although a buffer may be a leaf that requires grad (a stage's input)
    copy_targets: dict[str, Tensor] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.copy_targets = {k: t.detach() for k, t in self.static_inputs.items()}


class GraphManager:
    """Owns the graph stream and the shared graph memory pool; captures and replays stage actions."""

    def __init__(self, device: torch.device | str = "cuda", *, protocol: HandshakeProtocol = "two-way",
                 backend: GraphBackend | None = None, checked_completion: bool = False,
                 keep_graphs: bool = False) -> None:
        if protocol not in PROTOCOLS:
            raise ValueError(f"protocol must be one of {', '.join(PROTOCOLS)}, got {protocol!r}")
        self.protocol: HandshakeProtocol = protocol
        # whether each graph keeps its `cudaGraph_t`, which a step graph's child nodes need
        self.keep_graphs = keep_graphs
        self.backend: GraphBackend = (backend if backend is not None
                                      else TorchCudaBackend(device, keep_graphs=keep_graphs))
        self.stream = self.backend.new_stream()
        self.pool = self.backend.graph_pool_handle()
        self.actions: dict[str, CapturedAction] = {}
        self.stats = GraphStats(protocol=protocol)
        # each graph's tail: recorded at capture, fired by every replay, waited on by the caller (two-way)
        self.completions = completion_ledger(_BackendEvents(self.backend), checked=checked_completion,
                                             name="graph tails")
        self.held = HeldInputs()  # constant sources the static buffers still hold (`mark_constant`)
        self.host = HostPhases()  # the host's time in input copies and graph launches, while on (profiling)
        # A step graph (`graphs.step_graph`): "record" adds each replay's graph to the step's capture as a
        # child node (its input copies captured as they come), "dry" issues nothing and only keeps the
        # bookkeeping; both list what each replay issued (`issued`) and keep the step's other results
        # (`step_tensor`) under the same keys, so a dry step can be checked against the recorded one.
        self.mode: StepMode = "launch"
        self.issued: list[tuple[str, tuple[tuple[str, int], ...]]] = []
        self._step_tensors: dict[Hashable, Tensor] = {}

    def mark_constant(self, *tensors: Tensor) -> None:
        """Declare `tensors` constant inputs (`HeldInputs.mark`): a replay copies one into a static buffer
        only where the buffer does not still hold it."""
        self.held.mark(*tensors)

    # ------------------------------------------------------------------------------------ capture
    @contextmanager
    def capturing_on(self, stream: Any) -> Iterator[None]:
        """Warm-ups and captures inside run on `stream` instead of the graph stream.

        Why: a captured GEMM keeps the cuBLAS workspace of the stream it was captured on (torch keys the
        workspace by stream), so graphs captured on one stream share one workspace. Graphs that may replay
        at the same time on different streams (`SingleProcessPipeline.rank_streams`) must be captured on
        different streams."""
        saved, self.stream = self.stream, stream
        try:
            yield
        finally:
            self.stream = saved

    def pool_cycle(self, name: str) -> PoolCycle:
        """A new memory pool for graphs captured with `cycle=` it, checked to replay in capture order."""
        return PoolCycle(name, self.backend.graph_pool_handle())

    def capture(self, name: str, fn: Callable[[], Any], *, static_inputs: dict[str, Tensor],
                warmup: int = 2, private_pool: bool = False, cycle: PoolCycle | None = None) -> CapturedAction:
        """Warm `fn` up `warmup` times on the graph stream, then capture it into one graph.

        Warm-up runs execute the body FOR REAL: any state `fn` mutates (FP8 amax histories and scales,
        the effect token, optimizer state, counters) advances `warmup` extra times, and the capture
        itself records without executing. Callers with such state must snapshot it before and restore
        it after `capture`, or pass `warmup=0` when the body needs no warm-up (no lazy
        initialization, no cuBLAS workspace or autotuning to settle).

        `fn` must read its inputs only from `static_inputs` (the buffers replay copies into) and
        must not synchronize the host. Capture itself synchronizes the device once (setup, not the
        hot path).

        By default graphs share one memory pool. A block that one capture frees (a temporary) can then
        back another graph's output, so a shared pool is safe only when graphs replay in capture order
        or free nothing that others keep. `private_pool=True` gives the graph its own pool: any replay
        order is safe (what stage actions need: schedules reorder F, dI and dW). `cycle`: the graph joins
        that shared pool as its next member, and each replay is checked to follow the pool's capture
        order (`PoolCycle`).
        """
        if name in self.actions:
            raise ValueError(f"a graph named {name!r} is already captured")
        if cycle is not None and private_pool:
            raise ValueError(f"graph {name!r}: a private pool or a shared pool cycle, not both")
        be = self.backend
        allocated_before, reserved_before = be.memory_allocated(), be.memory_reserved()
        t0 = time.perf_counter()
        caller = be.current_stream()
        if warmup > 0:
            self.stream.wait_stream(caller)
            with be.use_stream(self.stream):
                for _ in range(warmup):
                    fn()
            caller.wait_stream(self.stream)
        graph = be.new_graph()
        tail = be.new_external_event()
        pool = cycle.handle if cycle is not None else be.graph_pool_handle() if private_pool else self.pool
        versions = {k: t._version for k, t in static_inputs.items()}
        with be.capture(graph, pool, self.stream):
            outputs = fn()
            self.completions.record(name, self.stream, event=tail)  # inside the capture: a node of the graph
        written = frozenset(k for k, t in static_inputs.items() if t._version != versions[k])
        seconds = time.perf_counter() - t0
        allocated_after, reserved_after = be.memory_allocated(), be.memory_reserved()
        action = CapturedAction(name=name, graph=graph, static_inputs=dict(static_inputs), outputs=outputs,
                                tail_event=tail, capture_seconds=seconds,
                                memory_allocated_before=allocated_before, memory_allocated_after=allocated_after,
                                memory_reserved_before=reserved_before, memory_reserved_after=reserved_after,
                                pool=pool, written_inputs=written)
        if cycle is not None:
            cycle.join(action)
        self.actions[name] = action
        self.stats.record_capture(name, seconds, allocated_before, reserved_before, allocated_after, reserved_after)
        return action

    def dry_capture(self, fn: Callable[[], Any]) -> Any:
        """Capture `fn` into a throwaway graph on the graph stream: never replayed, never counted, nothing
        executed. For work that must see exactly what the real capture will see: offload discovery
        records the tensors autograd saves, and under capture some ops save different ones than eagerly
        (SDPA's memory-efficient kernel keeps its RNG seed and offset on the device, not on the host)."""
        graph = self.backend.new_graph()
        with self.backend.capture(graph, self.backend.graph_pool_handle(), self.stream):
            out = fn()
        del graph
        return out

    # ------------------------------------------------------------------------------------- replay
    def replay(self, action: CapturedAction, dynamic: dict[str, Tensor] | None = None) -> Any:
        """Replay `action` with the handshake of `self.protocol`; returns its static outputs.

        Two-way: the returned outputs are safe to read on the caller's current stream right away;
        dynamic inputs may be freed by the caller right away (record_stream keeps their memory alive
        until the graph stream's copy is done). One-way (the defect) gives neither guarantee.
        """
        if action.cycle is not None:  # before anything is issued
            action.cycle.advance(action)
        be = self.backend
        if self.protocol == "stream-ordered":  # copies and graph on the caller's stream: stream order
            self._launch(action, dynamic, None)
            if self.completions.checked:  # the tail fires on the caller's stream (production skips the query)
                self.completions.fired(action.name, be.current_stream())
            action.replays += 1
            self.stats.record_replay(0)
            return action.outputs
        caller = be.current_stream()
        two_way = self.protocol == "two-way"
        if two_way:
            self.stream.wait_stream(caller)  # (1) caller -> graph edge
        with be.use_stream(self.stream):
            self._launch(action, dynamic, self.stream)  # (2) after the edge, on the graph stream; (3)
        self.completions.fired(action.name, self.stream)  # the tail node fired again, on the graph stream
        if two_way:
            self.completions.wait(action.name, caller)  # (4) graph tail -> caller
        action.replays += 1
        self.stats.record_replay(2 if two_way else 0)
        return action.outputs

    def _launch(self, action: CapturedAction, dynamic: dict[str, Tensor] | None, stream: Any) -> None:
        """The input copies and the graph launch of one replay on the current stream (`stream`: see
        `_copy_inputs`), each timed into `host` while that is on (profiling)."""
        if self.mode != "launch":
            self._issue(action, dynamic, stream)
            return
        host = self.host
        if not host.on:
            if dynamic:
                self._copy_inputs(action, dynamic, stream)
            action.graph.replay()
            return
        clock = time.perf_counter
        if dynamic:
            t = clock()
            copied = self._copy_inputs(action, dynamic, stream)
            host.add(COPY, t, clock(), copied)
        t = clock()
        action.graph.replay()
        host.add(LAUNCH, t, clock())

    def _issue(self, action: CapturedAction, dynamic: dict[str, Tensor] | None, stream: Any) -> None:
        """A replay while a step graph records (its copies captured, its graph a child node) or runs dry
        (nothing issued, the held inputs kept as if copied): what it copied, from where, listed."""
        keys: list[tuple[str, int]] = []
        if dynamic:
            self._copy_inputs(action, dynamic, stream, keys=keys)
        if self.mode == "record":
            self.backend.add_to_capture(action.graph)
        self.issued.append((action.name, tuple(keys)))

    def set_step_mode(self, mode: StepMode) -> None:
        """Start recording a step graph ("record": the list of what was issued and the step tensors start
        anew) or a dry step ("dry": the list starts anew); "launch" ends either and keeps the list."""
        if mode != "launch":
            self.issued = []
        if mode == "record":
            self._step_tensors = {}
        self.mode = mode

    def step_tensor(self, key: Hashable, make: Callable[[], Tensor]) -> Tensor:
        """A step's result made outside any action graph (a clone a later action or the caller reads):
        `make()` when launching; recorded under `key` as well while a step graph records; the recorded one
        while a step runs dry (its value is what the step graph's next replay writes)."""
        if self.mode == "launch":
            return make()
        if self.mode == "record":
            t = self._step_tensors[key] = make()
            return t
        try:
            return self._step_tensors[key]
        except KeyError:
            raise RuntimeError(f"a dry step asked for {key!r}, which the recorded step did not make") from None

    def check_use(self, action: CapturedAction, stream: Any = None) -> None:
        """Checked completion: raise `DeviceCompletionViolation` if work queued on `stream` (default: the
        current one) now could read `action`'s outputs before its latest replay finished (one-way, or a
        replay after the wait). Without `checked_completion`: nothing."""
        if self.completions.checked:
            self.completions.use(action.name, self.backend.current_stream() if stream is None else stream)

    def _copy_inputs(self, action: CapturedAction, dynamic: dict[str, Tensor], stream: Any,
                     keys: list[tuple[str, int]] | None = None) -> int:
        """Copy each dynamic input into its static buffer on the current stream; `stream` (the graph
        stream, when it is not the caller's) keeps each source's memory alive until its copy is done.
        A constant source the buffer still holds is not copied again (`HeldInputs`). Returns the copies made.
        `keys` (a step graph's record or dry run): each copy's input name and source address is appended;
        a dry run copies nothing and keeps the held inputs as if it had, the buffer's version step included:
        buffers that share one version counter (views of one tensor, such as a stage's fold mode word that
        each of its dW graphs reads) must see the write, or a later dry step would take a buffer another
        graph's copy overwrote for one that still holds its constant, and skip a copy the recorded step made."""
        be, held = self.backend, self.held
        dry = self.mode == "dry"
        copied = 0
        for key, src in dynamic.items():
            try:
                dst = action.copy_targets[key]
            except KeyError:
                raise KeyError(f"graph {action.name!r} has no static input {key!r}") from None
            if dst.shape != src.shape or dst.dtype != src.dtype:
                raise ValueError(f"graph {action.name!r}: dynamic input {key!r} is {src.dtype}"
                                 f"{tuple(src.shape)}, its static buffer {dst.dtype}{tuple(dst.shape)}")
            constant = held.is_constant(src) and key not in action.written_inputs
            if constant and held.holds(dst, src):
                self.stats.input_copies_skipped += 1
                continue
            if keys is not None:
                keys.append((key, src.data_ptr()))
            if not dry:
                be.copy_(dst, src)
                if stream is not None:
                    be.record_stream(src, stream)
            else:  # the step graph's replay makes this copy: count its write as the copy would have
                increment_version(dst)
            copied += 1
            if constant:
                held.copied(dst, src)
        return copied

    # -------------------------------------------------------------------------------------- stats
    def mark_step(self) -> int:
        """Sample allocated memory at the end of a step (for persistent-growth accounting)."""
        allocated = self.backend.memory_allocated()
        self.stats.mark_step(allocated)
        return allocated

    def persistent_growth_per_step(self) -> float:
        return self.stats.persistent_growth_per_step()
