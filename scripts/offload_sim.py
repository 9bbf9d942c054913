"""Issue 7 on the CPU: the step time that resident offload's stream dependencies allow, with a host of zero cost.

    python3 scripts/offload_sim.py --schedule interleaved --json $OUT/offload-sim-h2048.json
    python3 scripts/offload_sim.py --schedule zbv --banks 2,3,4,6 --lookahead 1,2
    python3 scripts/offload_sim.py --banks 3,4 --search 300   # also look for better bank assignments
    python3 scripts/offload_sim.py --plan interleaved=0:3:0:1:0:3:2:1:0:1:0:3:2:1:0:3  # time these banks

The real `OffloadManager` (bank plan, kept groups, chunked copies, look-ahead, every wait) drives
`TimedStreams`: each operation goes into its stream's queue, and a discrete-event pass then gives each
one its start: an action takes its given duration on the compute stream, a copy its bytes over the
bandwidth of its own stream (one copy engine per direction), a wait starts no earlier than the record it
waits for. The host costs nothing, the copies take no memory bandwidth from the compute, and the slot
copies inside the forward graphs are part of F's duration: what it reports is the floor that the
dependencies and the copy bandwidth set, not the GPU's step. Its durations are inputs (`--f-ms` etc.;
the defaults split h2048's measured 9.75 ms step without offload), and so are its answers.
"""

from __future__ import annotations

import argparse
import json
import random
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from qeffect.graphs.handshake import script_provenance
from qeffect.offload import OffloadManager
from qeffect.offload.fake import FakeDevice
from qeffect.offload.plan import assign_banks, backward_order, conflicts, explicit_banks
from qeffect.schedule.adapter import build_schedule
from qeffect.schedule.ir import ActionKind
from qeffect.schedule.order import global_order

MIB = 1 << 20


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
    """`StreamOps` that only queue; `simulate()` then times every queued operation."""

    def __init__(self, d2h_gbps: float, h2d_gbps: float) -> None:
        self.compute = SimStream("compute")
        self.streams = [self.compute]
        self.gbps = {"d2h": d2h_gbps, "h2d": h2d_gbps}

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
        nbytes = dst.numel() * dst.element_size()
        stream.queue.append(("run", nbytes / (stream.gbps * 1e9) * 1e3, "copy"))

    def launch(self, ms: float, label: str) -> None:
        self.compute.queue.append(("run", ms, label))

    def synchronize_event(self, event: SimEvent) -> None:
        raise RuntimeError("a host wait on the hot path: the simulation assumes resident mode makes none")

    def query(self, event: SimEvent) -> bool:
        raise RuntimeError("an event query on the hot path: the simulation assumes resident mode makes none")

    def host_buffer(self, nbytes: int) -> torch.Tensor:
        return torch.empty(int(nbytes), dtype=torch.uint8)

    def simulate(self) -> dict[str, Any]:
        """Time every queued operation; returns each stream's end and the compute stream's stalls by wait."""
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
    """`s1.m2.d2h_chunk3` -> `d2h_chunk`: stalls summed per kind of wait."""
    return event_name.rsplit(".", 1)[-1].rstrip("0123456789")


# h2048 (offload_bench at 3b60f78): stages 0-2 save 9.8 MiB per microbatch, the last stage (head and loss:
# the logits) 43 MiB; the last stage's actions take about twice a layer's (its head GEMM is as large as the
# layer's), and 7.1 of the 9.75 ms step without offload are the actions (the rest: optimizer, embedding)
H2048_GROUP_MIB = (9.8, 9.8, 9.8, 43.0)
H2048_STAGE_WEIGHT = (1.0, 1.0, 1.0, 2.0)


def simulate(schedule: str, *, pp: int = 2, chunks: int = 2, microbatches: int = 4,
             group_mib: tuple[float, ...] = H2048_GROUP_MIB, stage_weight: tuple[float, ...] = H2048_STAGE_WEIGHT,
             banks: int = 2, lookahead: int = 1, chunk_mib: float = 2.0, gbps: float = 52.0, f_ms: float = 0.118,
             i_ms: float = 0.118, w_ms: float = 0.118, tail_ms: float = 2.65, steps: int = 4,
             mode: str = "resident", assign: Any = assign_banks) -> dict[str, Any]:
    """One configuration: the last step's time with `mode` and without offload (the sum of the durations).
    An action of stage s takes its kind's duration times `stage_weight[s]`; its group saves `group_mib[s]`.
    `assign(events, min_banks)` gives the banks (default: `offload.plan.assign_banks`)."""
    step_events = _events(schedule, microbatches, pp, chunks)  # named (stage, microbatch)
    streams = TimedStreams(gbps, gbps)
    fake = FakeDevice(0, total=1 << 40)
    chunk_bytes = int(chunk_mib * MIB)
    mgr = OffloadManager(mode, device="cpu", driver=fake.driver(), streams=streams, num_banks=banks,
                         lookahead=lookahead, copy_chunk_bytes=chunk_bytes)
    groups = {}
    for _, (stage, m) in step_events:
        if (stage, m) not in groups:
            groups[stage, m] = g = mgr.group(f"s{stage}.m{m}")
            g.discover(torch.empty(int(group_mib[stage] * MIB), dtype=torch.uint8))
    events = [(kind, groups[key]) for kind, key in step_events]
    backward = backward_order(events)
    plan = assign(events, min_banks=banks) if mode == "resident" else None
    mgr.allocate(backward, banks=[plan[g] for g in backward] if plan else None, events=events)
    # F: the forward; B: dI (the backward starts); E: dW (its last reader), as the captured stage runs them
    ms = {"F": f_ms, "B": i_ms, "E": w_ms}
    for step in range(steps):
        mgr.begin_step()
        for kind, (stage, m) in step_events:
            g, duration = groups[stage, m], ms[kind] * stage_weight[stage]
            if kind == "F":
                g.before_forward()
                streams.launch(duration, "F")
                g.after_forward()
            elif kind == "B":
                g.before_backward()
                streams.launch(duration, "I")
            else:
                streams.launch(duration, "W")
                g.after_backward()
        streams.launch(tail_ms, f"mark:{step}")  # the optimizer and the rest of the step: no offload work
    res = streams.simulate()
    mapped = mgr.mapped_bytes()
    mgr.close()  # the fake device's memory goes now, not at a later garbage collection (a search runs hundreds)
    ends = [t for _, t in res["marks"]]
    off = sum(ms[kind] * stage_weight[stage] for kind, (stage, _) in step_events) + tail_ms
    step_ms = ends[-1] - ends[-2]
    stalls = {k: v / steps for k, v in sorted(res["stalls"].items())}  # the average per step
    live, peak = 0, 0  # without offload: the saved bytes alive at once (F to the last reader)
    for kind, g in events:
        live += g.nbytes if kind == "F" else -g.nbytes if kind == "E" else 0
        peak = max(peak, live)
    return {"schedule": schedule, "mode": mode, "banks": mgr.num_banks, "lookahead": lookahead,
            "mapped_mib": mapped / MIB, "off_peak_saved_mib": peak / MIB,
            "chunk_mib": chunk_mib, "step_ms": step_ms, "off_ms": off, "ratio": step_ms / off,
            "kept": len(mgr.kept), "d2h_mib_per_step": mgr.stats.d2h_bytes / MIB / steps,
            "h2d_mib_per_step": mgr.stats.h2d_bytes / MIB / steps, "compute_stall_ms_per_step": stalls}


def search_banks(schedule: str, max_banks: int, iters: int, seed: int = 0, **kw: Any) -> dict[str, Any]:
    """A local search over bank assignments with at most `max_banks` banks (each valid: no two conflicting
    groups share a bank, `offload.plan.conflicts`) and no more bank memory than `assign_banks` maps for
    `max_banks`, for the shortest simulated step (the smaller banks on a tie). Half the tries start from
    `assign_banks`' plan (so it finds nothing worse), half from first fit; each try moves one or two groups
    to another allowed bank."""
    rng = random.Random(seed)
    events = _events(schedule, kw.get("microbatches", 4), kw.get("pp", 2), kw.get("chunks", 2))
    groups = backward_order(events)
    edges = conflicts(events)
    near = [[groups.index(h) for h in edges[g]] for g in groups]
    default = assign_banks(events, min_banks=max_banks)
    first_fit: list[int] = []
    for i in range(len(groups)):
        used = {first_fit[j] for j in near[i] if j < i}
        first_fit.append(min(b for b in range(len(groups)) if b not in used))
    budget = simulate(schedule, banks=max_banks, **kw)["mapped_mib"]  # what assign_banks maps when asked for these
    max_banks = max(max_banks, max(default.values()) + 1, max(first_fit) + 1)
    seen: dict[tuple[int, ...], dict[str, Any]] = {}

    def run(plan: list[int]) -> dict[str, Any]:
        key = tuple(plan)
        if key not in seen:
            def fixed(ev: Any, min_banks: int) -> dict[Any, int]:  # ev: the same order, over the manager's groups
                return dict(zip(backward_order(ev), plan, strict=True))

            seen[key] = simulate(schedule, banks=2, assign=fixed, **kw) | {"plan": plan}
        return seen[key]

    def better(r: dict[str, Any], than: dict[str, Any]) -> bool:
        return r["mapped_mib"] <= budget and (r["step_ms"], r["mapped_mib"]) <= (than["step_ms"], than["mapped_mib"])

    results = []
    for start in ([default[g] for g in groups], first_fit):  # two starts: a local search stops at local optima
        best = run(start)
        for _ in range(iters // 2):
            plan = list(best["plan"])
            for _ in range(rng.randint(1, 2)):
                i = rng.randrange(len(groups))
                plan[i] = rng.choice([b for b in range(max_banks) if all(plan[j] != b for j in near[i])])
            r = run(plan)
            if better(r, best):
                best = r
        results.append(best)
    best = results[0] if better(results[0], results[1]) or results[1]["mapped_mib"] > budget else results[1]
    return best | {"searched": len(seen), "max_banks": max_banks}


def _events(schedule: str, microbatches: int, pp: int = 2, chunks: int = 2) -> list[tuple[str, tuple[int, int]]]:
    """One step's offload events, the groups named (stage, microbatch)."""
    kinds = {ActionKind.F: "F", ActionKind.DI: "B", ActionKind.DW: "E"}
    order = global_order(build_schedule(schedule, pp, chunks, microbatches))
    return [(kinds[a.kind], (a.stage, a.microbatch)) for _, a in order]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--schedule", default="interleaved,zbv", help="comma-separated: interleaved, zbv")
    ap.add_argument("--banks", default="2,3,4,6", help="comma-separated offload_banks to try")
    ap.add_argument("--lookahead", default="1,2", help="comma-separated look-ahead depths to try")
    ap.add_argument("--microbatches", type=int, default=4)
    ap.add_argument("--chunk-mib", type=float, default=2.0)
    ap.add_argument("--group-mib", default=",".join(map(str, H2048_GROUP_MIB)), help="MiB a group saves, per stage")
    ap.add_argument("--stage-weight", default=",".join(map(str, H2048_STAGE_WEIGHT)),
                    help="per stage: its actions' durations relative to --f-ms, --i-ms, --w-ms")
    ap.add_argument("--gbps", type=float, default=52.0, help="copy bandwidth per direction (H200: 50-55 GB/s)")
    ap.add_argument("--f-ms", type=float, default=0.118)
    ap.add_argument("--i-ms", type=float, default=0.118)
    ap.add_argument("--w-ms", type=float, default=0.118)
    ap.add_argument("--tail-ms", type=float, default=2.65, help="per step, outside the actions: the optimizer and the rest")
    ap.add_argument("--search", type=int, default=0, metavar="N",
                    help="also search N tries for a better assignment with at most each --banks banks")
    ap.add_argument("--plan", action="append", default=[], metavar="SCHEDULE=B0:B1:...",
                    help="time these banks (one per group in backward order, as QEFFECT_OFFLOAD_BANKS) instead of "
                         "--banks; repeatable")
    ap.add_argument("--json", type=Path)
    a = ap.parse_args()
    rows = []
    kw = {"microbatches": a.microbatches, "chunk_mib": a.chunk_mib, "gbps": a.gbps, "f_ms": a.f_ms, "i_ms": a.i_ms,
          "w_ms": a.w_ms, "tail_ms": a.tail_ms, "group_mib": tuple(float(x) for x in a.group_mib.split(",")),
          "stage_weight": tuple(float(x) for x in a.stage_weight.split(","))}
    for spec in a.plan:
        sched, _, text = spec.rpartition("=")
        try:
            banks = explicit_banks(_events(sched, a.microbatches), text, f"--plan {sched}")
        except ValueError as err:  # an unknown schedule, or banks that do not fit it
            ap.error(str(err))

        def given(ev: Any, min_banks: int, banks: list[int] = banks) -> dict[Any, int]:
            return dict(zip(backward_order(ev), banks, strict=True))

        rows.append(simulate(sched, assign=given, **kw) | {"plan": banks})
        _print(rows[-1], f"{sched:11s} banks {text}")
    for sched in ([] if a.plan else a.schedule.split(",")):
        for banks in (int(b) for b in a.banks.split(",")):
            for la in (int(x) for x in a.lookahead.split(",")):
                r = simulate(sched, banks=banks, lookahead=la, **kw)
                rows.append(r)
                _print(r, f"{sched:11s} banks {r['banks']} (asked {banks}) look-ahead {la}")
                if a.search:
                    best = search_banks(sched, banks, a.search, **kw, lookahead=la)
                    rows.append(best)
                    _print(best, f"{sched:11s} searched, at most {best['max_banks']} banks, look-ahead {la}")
                    print(f"    QEFFECT_OFFLOAD_BANKS={':'.join(map(str, best['plan']))}")
    if a.json:
        a.json.parent.mkdir(parents=True, exist_ok=True)
        a.json.write_text(json.dumps(script_provenance() | {
            "kind": "simulation on the CPU: a host of zero cost, the durations and bandwidth given", "device": "none",
            "torch": torch.__version__, "args": vars(a) | {"json": str(a.json)}, "results": rows}, indent=1))
    return 0


def _print(r: dict[str, Any], head: str) -> None:
    stall = ", ".join(f"{k} {v:.3f}" for k, v in r["compute_stall_ms_per_step"].items()) or "none"
    print(f"{head}: step {r['step_ms']:.2f} ms, x{r['ratio']:.3f} of {r['off_ms']:.2f}; banks {r['mapped_mib']:.0f} "
          f"MiB (off: {r['off_peak_saved_mib']:.0f} MiB saved at once); kept {r['kept']}, D2H "
          f"{r['d2h_mib_per_step']:.0f} MiB/step; compute stalls (ms/step): {stall}")


if __name__ == "__main__":
    raise SystemExit(main())
