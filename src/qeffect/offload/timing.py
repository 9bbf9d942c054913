"""Resident offload's step time simulated on the CPU, and a search for the bank plan that shortens it.

Why: the greedy colouring (`offload.plan.assign_banks`) picks which groups share a bank without looking at
copy times, and in resident mode that choice decides which groups are copied out, which copies a forward
or a backward waits for, and which restores overlap compute. On the GPU the plans this search finds at
capture ran resident offload markedly faster than the colouring, bitwise equal
(benchmarks/results/offload-bench-*-bank-{plan,tries,six}-*).

How: the real `OffloadManager` (plan, kept groups, chunked copies, look-ahead, every wait) runs over a
`FakeDevice`'s driver and `TimedStreams`, which queue every stream operation; a discrete-event pass then
gives each its start: an action takes its given duration on the compute stream, a copy its bytes over
its stream's bandwidth (one copy engine per direction), a wait starts no earlier than the record it
waits for. The host costs nothing, copies take no memory bandwidth from compute, and the slot copies
inside the forward graphs are left out (F takes as long as without offload; they cost the same for every
plan). So it gives the floor that the dependencies and the copy bandwidth set, not the GPU's step: it
puts resident's step under the GPU's but ranked the plans as the GPU did (scripts/offload_sim.py runs it). The groups'
bytes are simulated divided by `SCALE` (bandwidth too, so every time is the same): a plan costs
milliseconds, not the tens of MiB of fake memory per bank.
"""

from __future__ import annotations

import gc
import random
import time
from collections import defaultdict
from collections.abc import Hashable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from qeffect.config import OffloadConfig
from qeffect.offload.fake import FakeDevice
from qeffect.offload.group import ALIGNMENT, OffloadManager
from qeffect.offload.plan import Event, assign_banks, backward_order, conflicts

MIB = 1 << 20
SCALE = 1024  # simulated bytes per real byte: 1/1024 (a 2 MiB chunk is simulated as 2 KiB)
GRANULARITY = 2 * MIB  # the H200's VMM granularity: a bank maps its largest group rounded up to it
DEFAULT_GBPS = 52.0  # pinned host copies per direction on the H200 (scripts/copy_bandwidth.py: 50-55 GB/s)
# The search's default tries (`offload.search_tries`, config.DEFAULT_SEARCH_TRIES: 400) take about a second
# of the host's time at h2048 (16 groups) and a few at h4096 (32); more found no faster plan in the
# simulation nor on the GPU (`docs/results/2026-12-01-h200-offload.md`).
RESIDENT = OffloadConfig(mode="resident")


@dataclass(eq=False)
class SimEvent:
    name: str
    last: dict | None = None  # the latest record: {"time": ...} once the simulation reaches it


@dataclass(eq=False)
class SimStream:
    name: str
    gbps: float = 0.0  # copies on this stream move this many GB/s (0: not a copy stream)
    queue: list = field(default_factory=list)


class TimedStreams:
    """`StreamOps` that only queue; `run()` then times every queued operation. A copy of `n` simulated
    bytes counts as `n * scale` real bytes."""

    def __init__(self, d2h_gbps: float, h2d_gbps: float, scale: int = 1) -> None:
        self.compute = SimStream("compute")
        self.streams = [self.compute]
        self.gbps = {"d2h": d2h_gbps, "h2d": h2d_gbps}
        self.scale = scale

    def current_stream(self) -> SimStream:
        return self.compute

    def new_stream(self, name: str) -> SimStream:
        s = SimStream(name, gbps=self.gbps.get(name, 0.0))
        self.streams.append(s)
        return s

    def new_event(self, name: str, timing: bool = False) -> SimEvent:
        return SimEvent(name)

    def record(self, event: SimEvent, stream: SimStream) -> None:
        event.last = {"time": None}
        stream.queue.append(("record", event.last, event.name))

    def wait(self, stream: SimStream, event: SimEvent) -> None:
        if event.last is not None:  # never recorded: a no-op, as in CUDA
            stream.queue.append(("wait", event.last, event.name))

    def copy(self, dst: torch.Tensor, src: torch.Tensor, stream: SimStream) -> None:
        nbytes = dst.numel() * dst.element_size() * self.scale
        stream.queue.append(("run", nbytes / (stream.gbps * 1e9) * 1e3, "copy"))

    def launch(self, ms: float, label: str) -> None:
        self.compute.queue.append(("run", ms, label))

    def synchronize_event(self, event: SimEvent) -> None:
        raise RuntimeError("a host wait on the hot path: the simulation assumes resident mode makes none")

    def query(self, event: SimEvent) -> bool:
        raise RuntimeError("an event query on the hot path: the simulation assumes resident mode makes none")

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        return torch.empty(int(nbytes), dtype=torch.uint8)

    def run(self) -> dict[str, Any]:
        """Time every queued operation; returns each stream's end, the compute stream's stalls by kind of
        wait, and the end of every `mark:` launch."""
        now = {s.name: 0.0 for s in self.streams}
        pos = {s.name: 0 for s in self.streams}
        stalls: dict[str, float] = defaultdict(float)
        marks: list[tuple[str, float]] = []
        while any(pos[s.name] < len(s.queue) for s in self.streams):
            progressed = False
            for s in self.streams:
                while pos[s.name] < len(s.queue):
                    kind, arg, label = s.queue[pos[s.name]]
                    if kind == "wait":
                        if arg["time"] is None:
                            break  # its record is not reached yet
                        if s is self.compute and arg["time"] > now[s.name]:
                            stalls[_category(label)] += arg["time"] - now[s.name]
                        now[s.name] = max(now[s.name], arg["time"])
                    elif kind == "record":
                        arg["time"] = now[s.name]
                    else:
                        now[s.name] += arg
                        if label.startswith("mark:"):
                            marks.append((label[5:], now[s.name]))
                    pos[s.name] += 1
                    progressed = True
            if not progressed:
                heads = {s.name: s.queue[pos[s.name]][2] for s in self.streams if pos[s.name] < len(s.queue)}
                raise RuntimeError(f"simulated deadlock: no stream can progress: {heads}")
        return {"end": now, "stalls": dict(stalls), "marks": marks}


def _category(event_name: str) -> str:
    """`g1.d2h_chunk3` -> `d2h_chunk`: stalls summed per kind of wait."""
    return event_name.rsplit(".", 1)[-1].rstrip("0123456789")


@dataclass(frozen=True)
class StepCosts:
    """What the simulation needs of one step: per group, its saved bytes and the durations (ms) of its
    forward, input gradient and weight gradient; the step's other device work (optimizer, embedding...)."""

    nbytes: Mapping[Hashable, int]
    action_ms: Mapping[Hashable, tuple[float, float, float]]
    tail_ms: float
    gbps: float = DEFAULT_GBPS

    @property
    def off_ms(self) -> float:
        """The step without offload: every action and the tail, nothing waited for."""
        return sum(sum(t) for t in self.action_ms.values()) + self.tail_ms


@dataclass(frozen=True)
class SimResult:
    step_ms: float  # the last simulated step's time (steady state)
    off_ms: float
    banks: int
    mapped_bytes: int  # the banks' device memory (each its largest group, rounded up to GRANULARITY)
    kept: int  # groups the plan keeps in their bank (no D2H)
    d2h_bytes: int  # per step
    h2d_bytes: int  # per step
    stall_ms: dict[str, float]  # the compute stream's waits per step, by kind
    plan: tuple[int, ...]  # each group's bank, in backward order

    @property
    def ratio(self) -> float:
        return self.step_ms / self.off_ms


def simulated_config(config: OffloadConfig) -> OffloadConfig:
    """The simulated manager's config: `config`'s resident knobs (look-ahead, chunks, kept groups, launch
    order, futile restores), its chunks scaled down with the bytes (`SCALE`; rounded as the real manager
    rounds them). Every group is offloaded (`min_window` 0): the costs give short-window groups no bytes."""
    chunk = -(-int(config.copy_chunk_mib * MIB) // ALIGNMENT) * ALIGNMENT
    return config.model_copy(update={"mode": "resident", "banks": 2, "min_window": 0,
                                     "copy_chunk_mib": -(-chunk // SCALE) / MIB})


def simulate(events: Sequence[Event], costs: StepCosts, banks: Sequence[int] | None = None,
             config: OffloadConfig = RESIDENT, *, steps: int = 4) -> SimResult:
    """Resident offload of one step's `events` (run `steps` times) with `banks` (one per group in backward
    order; default `assign_banks(events, config.banks)`), the manager's knobs from `config`
    (`simulated_config`)."""
    order = backward_order(events)
    if banks is None:
        colour = assign_banks(events, min_banks=config.banks)
        banks = [colour[g] for g in order]
    if len(banks) != len(order):
        raise ValueError(f"banks: expected one per group ({len(order)}), got {len(banks)}")
    streams = TimedStreams(costs.gbps, costs.gbps, scale=SCALE)
    fake = FakeDevice(0, total=1 << 40, granularity=GRANULARITY // SCALE)
    mgr = OffloadManager(simulated_config(config), device="cpu", driver=fake.driver(), streams=streams)
    sim = {}
    for kind, g in events:
        if kind == "F":
            sim[g] = mgr.group(f"g{len(sim)}")
            if costs.nbytes[g]:
                sim[g].discover(torch.empty(-(-costs.nbytes[g] // SCALE), dtype=torch.uint8))
    sim_events = [(kind, sim[g]) for kind, g in events]
    mgr.allocate([sim[g] for g in order], banks=list(banks), events=sim_events)
    try:
        for step in range(steps):
            mgr.begin_step()
            for kind, g in events:
                s, (f_ms, i_ms, w_ms) = sim[g], costs.action_ms[g]
                if kind == "F":
                    s.before_forward()
                    streams.launch(f_ms, "F")
                    s.after_forward()
                elif kind == "B":
                    s.before_backward()
                    streams.launch(i_ms, "I")
                    s.backward_launched()  # the runtime's order (captured.py): look-ahead after the dI launch
                else:
                    streams.launch(w_ms, "W")
                    s.after_backward()
            streams.launch(costs.tail_ms, f"mark:{step}")  # the optimizer and the rest: no offload work
        res = streams.run()
        # each bank maps its largest group in pages of GRANULARITY / SCALE: times SCALE, the real mapping
        kept, stats, mapped, nbanks = len(mgr.kept), mgr.stats, mgr.mapped_bytes() * SCALE, len(mgr.banks)
    finally:
        mgr.close()  # the fake memory goes now, not at a later garbage collection (a search runs hundreds)
    ends = [t for _, t in res["marks"]]
    return SimResult(
        step_ms=ends[-1] - (ends[-2] if len(ends) > 1 else 0.0), off_ms=costs.off_ms, banks=nbanks,
        mapped_bytes=mapped,
        kept=kept, d2h_bytes=stats.d2h_bytes * SCALE // steps, h2d_bytes=stats.h2d_bytes * SCALE // steps,
        stall_ms={k: v / steps for k, v in sorted(res["stalls"].items())}, plan=tuple(int(b) for b in banks))


@dataclass(frozen=True)
class SearchResult:
    best: SimResult
    colour: SimResult  # assign_banks' plan for the same number of banks: the budget and the start
    budget_bytes: int
    tried: int  # distinct plans simulated
    seconds: float = 0.0  # the search's host time


def search_banks(events: Sequence[Event], costs: StepCosts, config: OffloadConfig = RESIDENT, *,
                 seed: int = 0) -> SearchResult:
    """A local search, `config.search_tries` plans, for the bank plan with the shortest simulated step, with
    no more bank memory than `assign_banks(events, config.search_banks)` maps (ties broken by
    `config.search_prefer`); every plan it tries is valid (no two conflicting groups share a bank,
    `offload.plan.conflicts`) and is simulated with `config`'s knobs. Half the tries start from the
    colouring (so it finds nothing worse), half from first fit (a local search stops at local optima);
    each try moves one or two groups to another allowed bank. Deterministic for a given `seed`.
    `search_prefer`: among plans as fast, the one with less bank memory ("memory"), or with fewer bytes
    copied to and from the host, then less memory ("copies", the default: steps within 0.1 us count as
    ties); the copies' share of memory bandwidth and their host work are outside the model, so fewer may
    run faster. 0 tries: the colouring with `search_banks` banks."""
    enabled, t0 = gc.isenabled(), time.perf_counter()
    gc.disable()  # each plan builds a manager full of reference cycles: collections would take 2/3 of the time
    try:
        return replace(_search(events, costs, config, seed), seconds=time.perf_counter() - t0)
    finally:
        if enabled:
            gc.enable()


def _search(events: Sequence[Event], costs: StepCosts, config: OffloadConfig, seed: int) -> SearchResult:
    max_banks, tries, prefer = config.search_banks, config.search_tries, config.search_prefer
    rng = random.Random(seed)
    groups = backward_order(events)
    edges = conflicts(events)
    index = {g: i for i, g in enumerate(groups)}
    near = [[index[h] for h in edges[g]] for g in groups]
    colour = assign_banks(events, min_banks=max_banks)
    first_fit: list[int] = []
    for i in range(len(groups)):
        used = {first_fit[j] for j in near[i] if j < i}
        first_fit.append(min(b for b in range(len(groups)) if b not in used))
    seen: dict[tuple[int, ...], SimResult] = {}

    def run(plan: Sequence[int]) -> SimResult:
        key = tuple(plan)
        if key not in seen:
            seen[key] = simulate(events, costs, key, config)
        return seen[key]

    start = run([colour[g] for g in groups])
    budget = start.mapped_bytes
    if tries <= 0:
        return SearchResult(best=start, colour=start, budget_bytes=budget, tried=len(seen))
    width = max(max_banks, max(start.plan, default=0) + 1, max(first_fit, default=0) + 1)

    def better(r: SimResult, than: SimResult, ties: bool = False) -> bool:
        """Within the budget and faster (`ties`: or as fast: the search may move along a plateau)."""
        a, b = key(r), key(than)
        return r.mapped_bytes <= budget and (a <= b if ties else a < b)

    def key(r: SimResult) -> tuple[float, ...]:
        if prefer == "copies":
            return round(r.step_ms, 4), r.d2h_bytes + r.h2d_bytes, r.mapped_bytes
        return r.step_ms, r.mapped_bytes

    best = start
    for first in (start.plan, first_fit):
        here = run(first)
        for _ in range(tries // 2):
            plan = list(here.plan)
            for _ in range(rng.randint(1, 2)):
                i = rng.randrange(len(groups))
                allowed = [b for b in range(width) if all(plan[j] != b for j in near[i])]
                if allowed:
                    plan[i] = rng.choice(allowed)
            r = run(plan)
            if better(r, here, ties=True):
                here = r
        if better(here, best):
            best = here
    return SearchResult(best=best, colour=start, budget_bytes=budget, tried=len(seen))
