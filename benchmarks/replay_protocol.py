"""Replay protocol A/B in one process: the two-way handshake (graph stream, two cross-stream waits per
replay) against stream-ordered replay (graphs launched on the caller's stream), on the same model and data.

    source .gpu-kit/setup.sh
    QEFFECT_GIT_REVISION=<rev> python3 benchmarks/replay_protocol.py --config examples/configs/h2048.toml \
        --backend reference --out $OUT/replay-protocol-h2048-reference-h200.json

Two pipelines are built from the same config, one per protocol, and stepped alternately on the same
batches (so clocks and thermals hit both alike). Per protocol: the median step time (warm-up excluded),
the host time to enqueue a step (`step()` returning, before the synchronization: close to the wall
when the host is the bottleneck) and, from a short profiler trace, the GPU's busy time and its idle
gaps (count, total, the kernels right after the longest ones: where the device waited). The losses of
every step and every parameter at the end must be bitwise equal across protocols (exit 1 otherwise).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import Counter

import torch

from qeffect.checkpoint.state import local_view, tensor_state
from qeffect.cli.common import write_json
from qeffect.config import load_config
from qeffect.graphs.handshake import git_revision
from qeffect.profile.matrix import device_name_of, te_version
from qeffect.profile.trace import kineto_events, merge_intervals
from qeffect.runtime.build import build_single_process
from qeffect.verify.state import bitwise_equal, synthetic_batches

PROTOCOLS = ("two-way", "stream-ordered")


def gap_summary(prof: torch.profiler.profile, steps: int, windows: list[tuple[int, int]]) -> dict:
    """GPU busy time and idle gaps inside the traced steps' windows (host ns), per step."""
    dev = [e for e in kineto_events(prof) if e.kind in ("kernel", "memcpy", "memset")]
    dev.sort(key=lambda e: e.start)
    busy = merge_intervals((e.start, e.end) for e in dev)
    gaps, after = [], Counter()
    for (_, e0), (s1, _) in zip(busy, busy[1:], strict=False):
        if any(ws <= e0 and s1 <= we for ws, we in windows) and s1 > e0:
            gaps.append(s1 - e0)
            if s1 - e0 > 20_000:  # > 20 us: name what the device started next
                nxt = next(e for e in dev if e.start >= s1)
                after[nxt.name[:80]] += 1
    busy_ns = sum(min(e, we) - max(s, ws) for s, e in busy for ws, we in windows if min(e, we) > max(s, ws))
    gaps.sort(reverse=True)
    return {"busy_seconds_per_step": busy_ns / steps * 1e-9,
            "idle_gap_seconds_per_step": sum(gaps) / steps * 1e-9,
            "gaps_per_step": len(gaps) / steps,
            "gaps_over_5us_per_step": sum(g > 5_000 for g in gaps) / steps,
            "gaps_over_20us_per_step": sum(g > 20_000 for g in gaps) / steps,
            "largest_gaps_us": [g / 1e3 for g in gaps[:10]],
            "after_gaps_over_20us": dict(after.most_common(8))}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=None)
    ap.add_argument("--backend", default=None)
    ap.add_argument("--schedule", default=None)
    ap.add_argument("--path", default="captured-direct")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--trace-steps", type=int, default=2)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    # the protocols order per-action replays: every action launched by the host, no step graph
    cfg = load_config(args.config).with_overrides(**{"fp8.backend": args.backend, "pipeline.schedule": args.schedule,
                                                     "runtime.step_graph": False})
    device = torch.device(cfg.train.device)
    pipes = {}
    for p in PROTOCOLS:
        pipes[p] = build_single_process(cfg, native=False, device=device, path=args.path)
        pipes[p].manager.protocol = p
    total = args.warmup + args.steps
    wall = {p: [] for p in PROTOCOLS}
    host = {p: [] for p in PROTOCOLS}
    losses = {p: [] for p in PROTOCOLS}
    for i in range(total):
        data = synthetic_batches(cfg, i, device)
        for p in PROTOCOLS if i % 2 == 0 else reversed(PROTOCOLS):  # alternate who goes first
            torch.cuda.synchronize(device)
            t0 = time.perf_counter()
            loss = pipes[p].step(data)
            t1 = time.perf_counter()
            torch.cuda.synchronize(device)
            t2 = time.perf_counter()
            losses[p].append(loss.item())
            if i >= args.warmup:
                host[p].append(t1 - t0)
                wall[p].append(t2 - t0)
    traces = {}
    from torch.profiler import ProfilerActivity, profile

    for p in PROTOCOLS:
        windows = []
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for i in range(total, total + args.trace_steps):
                data = synthetic_batches(cfg, i, device)
                torch.cuda.synchronize(device)
                t0 = time.perf_counter_ns()
                pipes[p].step(data)
                torch.cuda.synchronize(device)
                windows.append((t0, time.perf_counter_ns()))
        # Kineto's clock and perf_counter_ns differ by an offset: take the windows from the device events
        # instead (each traced step's first to last device event), which is what the gaps need
        evs = sorted((e for e in kineto_events(prof) if e.kind in ("kernel", "memcpy", "memset")),
                     key=lambda e: e.start)
        bounds, cut = [], len(evs) // args.trace_steps
        for k in range(args.trace_steps):
            part = evs[k * cut:(k + 1) * cut] if k < args.trace_steps - 1 else evs[k * cut:]
            bounds.append((part[0].start, max(e.end for e in part)))
        traces[p] = gap_summary(prof, args.trace_steps, bounds)
        traces[p]["traced_seconds_per_step"] = statistics.median((b - a) * 1e-9 for a, b in windows)
    state = {p: tensor_state(local_view(pipes[p])) for p in PROTOCOLS}  # parameters, optimizer, FP8 state
    a, b = PROTOCOLS
    same_losses = losses[a] == losses[b]
    differ = sum(not bitwise_equal(v, state[b][k]) for k, v in state[a].items())
    rows = {p: {"median_step_seconds": statistics.median(wall[p]), "median_host_seconds": statistics.median(host[p]),
                "step_seconds": wall[p], "host_seconds": host[p], "losses": losses[p], "trace": traces[p],
                "replays_per_step": pipes[p].manager.stats.replay_count / (total + args.trace_steps),
                "handoffs_per_step": pipes[p].manager.stats.handoffs / (total + args.trace_steps)}
            for p in PROTOCOLS}
    ratio = rows[b]["median_step_seconds"] / rows[a]["median_step_seconds"]
    for p in PROTOCOLS:
        r, t = rows[p], rows[p]["trace"]
        print(f"{p}: median {r['median_step_seconds'] * 1e3:.2f} ms, host enqueue {r['median_host_seconds'] * 1e3:.2f} ms, "
              f"GPU busy {t['busy_seconds_per_step'] * 1e3:.2f} ms, idle gaps {t['idle_gap_seconds_per_step'] * 1e3:.2f} ms "
              f"({t['gaps_over_5us_per_step']:.0f} > 5 us, {t['gaps_over_20us_per_step']:.0f} > 20 us per step), "
              f"largest {[round(g) for g in t['largest_gaps_us'][:5]]} us, after: {t['after_gaps_over_20us']}")
    print(f"ratios: {b} / {a} = x{ratio:.3f}; bitwise: losses {same_losses}, {differ}/{len(state[a])} tensors differ")
    report = {"kind": "replay-protocol", "command": " ".join(sys.argv), "git_revision": git_revision(),
              "device": device_name_of(device), "torch_version": torch.__version__, "te_version": te_version(),
              "config_path": args.config, "backend": cfg.fp8.backend, "path": args.path,
              "schedule": cfg.pipeline.schedule, "steps": args.steps, "warmup": args.warmup, "protocols": rows,
              "ratio_stream_ordered_vs_two_way": ratio, "losses_equal": same_losses, "tensors_differ": differ}
    if args.out:
        write_json(args.out, report)
    return 0 if same_losses and differ == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
