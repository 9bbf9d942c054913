"""Where a captured step's host time goes in Python: cProfile over timed steps, per offload mode.

`offload_host_profile.py` names the CUDA API calls; this names the Python functions around them (the
offload hooks, the driver wrappers, the optimizer's launches, the contract checks), so that host work
that makes a host-bound step (h2048, release offload) slower shows by function. Each mode: the
captured-direct pipeline warmed up, then `--steps` steps under cProfile (each synchronized, as the
offload benchmark times them), and the same number unprofiled for the host and step time without the
profiler's overhead.

    source .gpu-kit/setup.sh
    python3 scripts/host_python_profile.py --modes off,release --json $OUT/host-python.json
"""

from __future__ import annotations

import cProfile
import io
import pstats
import sys
import time
from pathlib import Path

import torch
from offload_host_profile import pipeline_args, warm_pipeline  # scripts/ is sys.path[0] when this runs

from qeffect.cli.common import write_json
from qeffect.config import load_config
from qeffect.graphs.handshake import gpu_provenance
from qeffect.verify.state import synthetic_batches


def timed_steps(cfg, pipe, first: int, count: int, dev: torch.device, prof: cProfile.Profile | None):
    """(host seconds, step seconds) of `count` steps from batch `first`, each synchronized before and after."""
    host, total = [], []
    for i in range(first, first + count):
        batches = synthetic_batches(cfg, i, dev)
        torch.cuda.synchronize(dev)
        t = time.perf_counter()
        if prof is not None:
            prof.enable()
        pipe.step(batches)
        pipe.manager.mark_step()
        if prof is not None:
            prof.disable()
        host.append(time.perf_counter() - t)
        torch.cuda.synchronize(dev)
        total.append(time.perf_counter() - t)
    return host, total


def top_rows(prof: cProfile.Profile, steps: int, key: str, top: int) -> list[dict]:
    """The `top` functions by `key` ("tottime" or "cumtime"), per step, in milliseconds."""
    stats = pstats.Stats(prof, stream=io.StringIO())
    rows = []
    for (file, line, name), (_calls, nc, tt, ct, _callers) in stats.stats.items():
        rows.append({"function": f"{Path(file).name}:{line}({name})", "calls_per_step": nc / steps,
                     "tottime_ms": 1e3 * tt / steps, "cumtime_ms": 1e3 * ct / steps})
    rows.sort(key=lambda r: -r[f"{key}_ms"])
    return rows[:top]


def main() -> int:
    ap = pipeline_args(__doc__, "off,release")
    ap.add_argument("--schedule", default="interleaved")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--top", type=int, default=40)
    a = ap.parse_args()
    dev = torch.device("cuda", torch.cuda.current_device())
    cfg = load_config(a.config).with_overrides(**{"train.device": "cuda", "pipeline.schedule": a.schedule})
    results = []
    for mode in a.modes.split(","):
        mcfg, pipe = warm_pipeline(cfg, mode, a.warmup, dev)
        host, total = timed_steps(mcfg, pipe, a.warmup, a.steps, dev, None)
        prof = cProfile.Profile()
        p_host, p_total = timed_steps(mcfg, pipe, a.warmup + a.steps, a.steps, dev, prof)
        med = sorted(host)[len(host) // 2], sorted(total)[len(total) // 2]
        res = {"mode": mode, "host_ms": 1e3 * med[0], "step_ms": 1e3 * med[1],
               "profiled_host_ms": 1e3 * sorted(p_host)[len(p_host) // 2],
               "by_tottime": top_rows(prof, a.steps, "tottime", a.top),
               "by_cumtime": top_rows(prof, a.steps, "cumtime", a.top)}
        results.append(res)
        print(f"== {mode}: host {res['host_ms']:.2f} ms, step {res['step_ms']:.2f} ms "
              f"(profiled host {res['profiled_host_ms']:.2f} ms); per step:")
        for key in ("tottime", "cumtime"):
            print(f"  by {key}:")
            for r in res[f"by_{key}"][:a.top]:
                print(f"    {r['tottime_ms']:8.3f} {r['cumtime_ms']:8.3f} ms {r['calls_per_step']:7.1f}x  {r['function']}")
        if pipe.offload is not None:
            pipe.offload.close()
        del pipe
        torch.cuda.empty_cache()
    if a.json:
        write_json(Path(a.json), {**gpu_provenance(dev), "schedule": a.schedule, "steps": a.steps,
                                  "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
