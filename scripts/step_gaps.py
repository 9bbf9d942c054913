"""Where a captured step's GPU waits for the host: each idle gap, and which host phase launched late.

The profile's trace line gives one number for a step's GPU idle time (wall minus the union of device
activity). This splits it: each traced step runs synchronized, as the profile's timed steps do, with
its host phases labelled (each action by kind, and per rank the gradient fold, the optimizer and the
rest of the commit). For every gap in the device timeline it finds the host call that launched the
kernel ending the gap (through the CUPTI correlation id) and the phase that call ran in. A gap whose
launch came after the gap began is time the GPU waited on that phase's host work.

It also lists every kernel's time per step (the profile keeps the top ten only), for the GPU side.

    source .gpu-kit/setup.sh
    python3 scripts/step_gaps.py --config examples/configs/h4096.toml --json $OUT/gaps.json
"""

from __future__ import annotations

import argparse
import bisect
import sys
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from qeffect.cli.common import write_json
from qeffect.config import load_config
from qeffect.graphs.handshake import run_settings, script_provenance
from qeffect.profile.trace import CATEGORIES, _kind, category
from qeffect.runtime.build import build_single_process
from qeffect.verify.state import synthetic_batches

PHASE = "phase::"
STEP = "phase::step"


@contextmanager
def _label(name: str):
    with record_function(PHASE + name):
        yield


def label_phases(pipe) -> None:
    """Wrap each rank's `run`, `_load_grads` and optimizer step in named ranges (this process only)."""
    for r, rank in enumerate(pipe.ranks):
        run, load, opt_step = rank.run, getattr(rank, "_load_grads", None), rank.optimizer.step

        def labelled_run(action, batches, transport, _run=run, _r=r):
            with _label(f"{action.kind.name}.r{_r}"):
                _run(action, batches, transport)

        def labelled_step(*a, _s=opt_step, _r=r, **k):
            with _label(f"adamw.r{_r}"):
                return _s(*a, **k)

        rank.run = labelled_run
        rank.optimizer.step = labelled_step
        if load is not None:
            def labelled_load(*a, _load=load, _r=r, **k):  # the rank passes defer= (a global norm folds first)
                with _label(f"fold.r{_r}"):
                    return _load(*a, **k)
            rank._load_grads = labelled_load
        commit = rank.commit

        def labelled_commit(*a, _c=commit, _r=r, **k):
            with _label(f"commit.r{_r}"):
                return _c(*a, **k)
        rank.commit = labelled_commit


def _union(intervals: list[tuple[int, int]]) -> list[tuple[int, int]]:
    out: list[tuple[int, int]] = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], e))
        else:
            out.append((s, e))
    return out


def _common_ns(a: list[tuple[int, int]], b: list[tuple[int, int]]) -> int:
    """Length of the intersection of two sorted disjoint interval lists."""
    i = j = total = 0
    while i < len(a) and j < len(b):
        total += max(0, min(a[i][1], b[j][1]) - max(a[i][0], b[j][0]))
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def _optimizer_overlap(dev: list, steps: list[tuple[int, int]]) -> dict:
    """Per step: optimizer kernel time, how much of it ran beside other device work (an update on a side
    stream would), and when the first update started against the end of the last other kernel (ms from
    the step's start)."""
    rows = []
    for s0, s1 in steps:
        evs = [d for d in dev if s0 <= d[0] < s1]
        opt = [(ds, de) for ds, de, name, _ in evs if category(name) == "optimizer"]
        other = [(ds, de) for ds, de, name, _ in evs if category(name) != "optimizer"]
        if not opt or not other:
            continue
        uo, ux = _union(opt), _union(other)
        rows.append({"optimizer_ms": sum(e - s for s, e in uo) / 1e6, "beside_other_ms": _common_ns(uo, ux) / 1e6,
                     "first_optimizer_at_ms": (uo[0][0] - s0) / 1e6, "last_other_end_ms": (ux[-1][1] - s0) / 1e6})
    return {"per_step": rows}


def analyse(prof, walls: list[float], hosts: list[float], min_gap_us: float) -> dict:
    cpu, dev, launches = [], [], {}
    for ev in prof.profiler.kineto_results.events():
        name = ev.name()
        if ev.device_type() == torch.autograd.DeviceType.CPU:
            if name.startswith(PHASE):
                cpu.append((ev.start_ns(), ev.end_ns(), name[len(PHASE):]))
            elif name.startswith("cu"):  # runtime/driver calls: the launches
                launches[ev.correlation_id()] = (ev.start_ns(), name)
        elif _kind(ev) in ("kernel", "memcpy", "memset"):  # the profile's own classification of device events
            dev.append((ev.start_ns(), ev.end_ns(), name, ev.correlation_id()))
    steps = sorted((s, e) for s, e, n in cpu if n == "step")
    phases = sorted(((s, e, n) for s, e, n in cpu if n != "step"), key=lambda p: (p[0], -p[1]))
    starts = [p[0] for p in phases]

    def phase_at(t: int) -> str:
        """The innermost labelled phase running at host time t."""
        for i in range(bisect.bisect_right(starts, t) - 1, -1, -1):  # latest start first: innermost
            s, e, n = phases[i]
            if t < e:
                return n
        return "outside phases"

    dev.sort()
    overlap = _optimizer_overlap(dev, steps)
    kernels: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    by_phase: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0])  # gaps, idle us, host-late us
    gaps = []
    busy_total = 0.0
    for s0, s1 in steps:
        evs = [d for d in dev if s0 <= d[0] < s1]
        if not evs:
            continue
        cursor, prev = s0, "step start"
        for ds, de, name, corr in evs:
            kernels[name][0] += 1
            kernels[name][1] += (de - ds) / 1e3
            if ds > cursor:
                gap = (ds - cursor) / 1e3
                launch = launches.get(corr)
                ph = phase_at(launch[0]) if launch else "unknown"
                late = max(0.0, (launch[0] - cursor) / 1e3) if launch else 0.0
                if gap >= min_gap_us:
                    gaps.append({"at_us": (cursor - s0) / 1e3, "gap_us": gap, "host_late_us": min(late, gap),
                                 "phase": ph, "after": prev[:80], "before": name[:80],
                                 "launch": launch[1] if launch else None})
                row = by_phase[ph.split(".")[0] if ph[0] in "FDB" else ph]
                row[0] += 1
                row[1] += gap
                row[2] += min(late, gap)
            busy_total += (max(de, cursor) - max(ds, cursor)) / 1e3
            cursor, prev = max(cursor, de), name
        tail = (s1 - cursor) / 1e3
        by_phase["step end (sync)"][0] += 1
        by_phase["step end (sync)"][1] += tail
    n = max(len(steps), 1)
    return {
        "steps": len(steps),
        "wall_ms": [w * 1e3 for w in walls],
        "host_ms": [h * 1e3 for h in hosts],
        "gpu_busy_ms_per_step": busy_total / 1e3 / n,
        "idle_by_phase_ms_per_step": {k: {"gaps": v[0] / n, "idle_ms": v[1] / 1e3 / n, "host_late_ms": v[2] / 1e3 / n}
                                      for k, v in sorted(by_phase.items(), key=lambda kv: -kv[1][1])},
        "optimizer_overlap": overlap,
        "largest_gaps": sorted(gaps, key=lambda g: -g["gap_us"])[:40],
        "kernels": [{"name": k, "category": category(k), "calls_per_step": v[0] / n, "ms_per_step": v[1] / 1e3 / n}
                    for k, v in sorted(kernels.items(), key=lambda kv: -kv[1][1])],
        "categories": sorted({c for c, _ in CATEGORIES} | {"other"}),
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="examples/configs/h4096.toml")
    ap.add_argument("--backend", default=None, help="fp8.backend instead of the config's: te or reference")
    ap.add_argument("--path", default="captured-direct")
    ap.add_argument("--schedule", default=None)
    ap.add_argument("--offload", default=None, help="offload.mode: off, release or resident")
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--min-gap-us", type=float, default=5.0)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    # each action's launch is labelled by its phase, so every action is launched by the host (no step graph)
    cfg = load_config(a.config).with_overrides(**{"train.device": dev.type, "pipeline.schedule": a.schedule,
                                                  "offload.mode": a.offload, "fp8.backend": a.backend,
                                                  "runtime.step_graph": False})

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize(dev)

    pipe = build_single_process(cfg, native=False, device=dev, path=a.path)
    data = [synthetic_batches(cfg, i, dev) for i in range(a.warmup + a.steps)]
    for i in range(a.warmup):
        pipe.step(data[i])
    label_phases(pipe)
    untimed = []
    for i in range(a.warmup):  # unprofiled, synchronized like the profile's timed steps
        sync()
        t = time.perf_counter()
        pipe.step(data[i])
        h = time.perf_counter() - t
        sync()
        untimed.append((h * 1e3, (time.perf_counter() - t) * 1e3))
    walls, hosts = [], []
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(a.warmup, a.warmup + a.steps):
            sync()
            t = time.perf_counter()
            with record_function(STEP):
                pipe.step(data[i])
                hosts.append(time.perf_counter() - t)
                sync()
            walls.append(time.perf_counter() - t)
    out = analyse(prof, walls, hosts, a.min_gap_us)
    out["unprofiled_host_and_wall_ms"] = untimed
    print("unprofiled steps (host returns, wall) ms: " + ", ".join(f"({h:.2f}, {w:.2f})" for h, w in untimed))
    print(f"profiled: walls {', '.join(f'{w:.2f}' for w in out['wall_ms'])} ms; host returns at "
          f"{', '.join(f'{h:.2f}' for h in out['host_ms'])} ms; GPU busy {out['gpu_busy_ms_per_step']:.2f} ms/step")
    for row in out["optimizer_overlap"]["per_step"]:
        print(f"optimizer: {row['optimizer_ms']:.3f} ms, {row['beside_other_ms']:.3f} ms beside other work; first at "
              f"{row['first_optimizer_at_ms']:.3f} ms, other work ends at {row['last_other_end_ms']:.3f} ms")
    print("GPU idle per step by the host phase that launched the kernel ending each gap:")
    for k, v in out["idle_by_phase_ms_per_step"].items():
        print(f"  {k:22s} {v['gaps']:7.1f} gaps {v['idle_ms']:7.3f} ms idle, {v['host_late_ms']:7.3f} ms launched late")
    print("largest gaps:")
    for g in out["largest_gaps"][:15]:
        print(f"  at {g['at_us'] / 1e3:7.3f} ms: {g['gap_us']:7.1f} us (late {g['host_late_us']:6.1f}) {g['phase']:12s}"
              f" {g['after'][:40]} -> {g['before'][:40]}")
    print("kernels by time per step:")
    for k in out["kernels"][:30]:
        print(f"  {k['ms_per_step']:7.3f} ms {k['calls_per_step']:6.0f}x [{k['category']}] {k['name'][:90]}")
    if a.json:
        write_json(Path(a.json), {**script_provenance(), "settings": run_settings(cfg),
                                  "device": torch.cuda.get_device_name(dev) if cuda else "cpu",
                                  "torch": torch.__version__, "config": a.config, "path": a.path, **out})
    return 0


if __name__ == "__main__":
    sys.exit(main())
