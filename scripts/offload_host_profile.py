"""Where release offload's host time goes: CUDA API calls of one h2048 step per offload mode, compared.

The offload benchmark shows the host queues a release step in 9 to 15 ms against 4.3 ms with offload off,
more than the driver calls (2 to 3 ms) explain. This profiles one step (after warm-up) of each mode with
the torch profiler and sums the host time of each CUDA runtime and driver API call (cudaGraphLaunch,
cudaMemcpyAsync, cudaEventSynchronize, ...), so a call that got slower, or a wait, shows by name.

    source .gpu-kit/setup.sh
    python3 scripts/offload_host_profile.py --modes off,resident,release --json $OUT/host-profile.json
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

from qeffect.cli.common import write_json
from qeffect.config import load_config
from qeffect.graphs.handshake import gpu_provenance
from qeffect.profile.trace import Event, kineto_events, union_length
from qeffect.runtime.build import build_single_process
from qeffect.verify.state import synthetic_batches


def api_times(events: list[Event]) -> dict[str, dict[str, float]]:
    """Host time (ms) and count of each CUDA API call (host events named cuda* or cu*) among `events`
    (`qeffect.profile.trace.kineto_events`); calls made by a thread other than the one that launches the
    graphs are marked so."""
    out: dict[str, dict[str, float]] = defaultdict(lambda: {"ms": 0.0, "count": 0, "max_ms": 0.0})
    calls = [e for e in events if e.kind == "op" and e.name.startswith("cu")]
    launchers = Counter(e.thread for e in calls if e.name == "cudaGraphLaunch")
    main_thread = launchers.most_common(1)[0][0] if launchers else None
    for e in calls:
        ms = (e.end - e.start) / 1e6
        row = out[e.name if e.thread == main_thread else f"{e.name} [other thread]"]
        row["ms"] += ms
        row["count"] += 1
        row["max_ms"] = max(row["max_ms"], ms)
    return dict(out)


def device_copies(events: list[Event]) -> dict:
    """The device side of the profiled step: each memcpy kind's count, time and median duration, and the
    kernels' busy time (union), so slow copies or a compute stream left waiting on them show."""
    copies: dict[str, list[float]] = defaultdict(list)
    for e in events:
        if e.kind == "memcpy":
            copies[e.name].append((e.end - e.start) / 1e6)
    kernels = [(e.start, e.end) for e in events if e.kind == "kernel"]
    busy = union_length(kernels)
    span = (max(b for _, b in kernels) - min(a for a, _ in kernels)) / 1e6 if kernels else 0.0
    return {"kernel_busy_ms": busy / 1e6, "kernel_span_ms": span,
            "memcpy": {n: {"count": len(v), "ms": sum(v), "median_ms": sorted(v)[len(v) // 2], "max_ms": max(v)}
                       for n, v in copies.items()}}


def bench_mode_config(cfg, label: str):
    """(train.offload, `cfg` with the overrides an offload mode label stands for): `benchmarks/offload_bench.py`'s
    labels ("resident@6", "release/la2", "resident-colour", ...), one grammar for the benchmark and these
    scripts."""
    bench = str(Path(__file__).resolve().parents[1] / "benchmarks")
    if bench not in sys.path:
        sys.path.insert(0, bench)
    from offload_bench import mode_config

    return mode_config(cfg, label)


def warm_pipeline(cfg, mode: str, warmup: int, dev: torch.device):
    """The captured-direct pipeline of `cfg` with offload `mode` (an `offload_bench.py` mode label:
    `bench_mode_config`), after `warmup` steps. Returns (its config, the pipeline)."""
    _, cfg = bench_mode_config(cfg, mode)
    pipe = build_single_process(cfg, native=False, device=dev, path="captured-direct")
    for i in range(warmup):
        pipe.step(synthetic_batches(cfg, i, dev))
        pipe.manager.mark_step()
    return cfg, pipe


def run(cfg, mode: str, warmup: int, dev: torch.device) -> dict:
    cfg, pipe = warm_pipeline(cfg, mode, warmup, dev)
    batches = synthetic_batches(cfg, warmup, dev)
    torch.cuda.synchronize(dev)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t = time.perf_counter()
        pipe.step(batches)
        host = time.perf_counter() - t
        torch.cuda.synchronize(dev)
        total = time.perf_counter() - t
    events = kineto_events(prof)
    apis = api_times(events)
    copies = device_copies(events)
    if pipe.offload is not None:
        pipe.offload.close()
    del pipe
    return {"mode": mode, "host_ms": host * 1e3, "step_ms": total * 1e3, "apis": apis, **copies}


def pipeline_args(doc: str, modes: str) -> argparse.ArgumentParser:
    """The options every offload script over `warm_pipeline` takes: --config, --modes, --warmup, --json."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--config", default="examples/configs/h2048.toml")
    ap.add_argument("--modes", default=modes, help="comma-separated: off, release, resident, resident@K")
    ap.add_argument("--warmup", type=int, default=4)
    ap.add_argument("--json", default=None)
    return ap


def main() -> int:
    ap = pipeline_args(__doc__, "off,resident,release")
    ap.add_argument("--schedule", default="zbv")
    ap.add_argument("--top", type=int, default=14)
    a = ap.parse_args()
    dev = torch.device("cuda", torch.cuda.current_device())
    cfg = load_config(a.config).with_overrides(**{"train.device": "cuda", "pipeline.schedule": a.schedule})
    results = [run(cfg, m, a.warmup, dev) for m in a.modes.split(",")]
    names = sorted({n for r in results for n in r["apis"]}, key=lambda n: -max(r["apis"].get(n, {"ms": 0})["ms"]
                                                                               for r in results))
    print("host ms per step (profiled): " + ", ".join(f"{r['mode']} {r['host_ms']:.2f} (step {r['step_ms']:.2f})"
                                                    for r in results))
    print(f"{'call':32s}" + "".join(f"{r['mode']:>26s}" for r in results))
    for n in names[:a.top]:
        cells = []
        for r in results:
            row = r["apis"].get(n)
            cells.append(f"{row['ms']:8.2f} ms {int(row['count']):5d}x {1e3 * row['ms'] / row['count']:5.0f}us"
                         if row else f"{'-':>26s}")
        print(f"{n[:32]:32s}" + "".join(f"{c:>26s}" for c in cells))
    for r in results:
        print(f"{r['mode']}: kernels busy {r['kernel_busy_ms']:.2f} ms of a {r['kernel_span_ms']:.2f} ms span")
        for n, c in r["memcpy"].items():
            print(f"  {n[:40]:40s} {c['count']:4d}x {c['ms']:8.2f} ms, median {c['median_ms']:.3f} ms, "
                  f"max {c['max_ms']:.3f} ms")
    if a.json:
        write_json(Path(a.json), {**gpu_provenance(dev), "schedule": a.schedule, "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
