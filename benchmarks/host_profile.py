"""Where the host's time goes when it queues a captured step on the GPU (cProfile, a runtime switch on and
off: `--field`, rank streams by default, or another switch of `rank_streams_ab.py`).

`host_overhead.py` measures the runtime's Python on a CPU with the device taken away; on the GPU the host
also pays for each graph launch, input copy, stream switch, event and `record_stream`, which only a CUDA
build shows. This benchmark builds captured-direct exactly as `qeffect profile` does, warms it up, times
the host's queue of `--steps` steps (device synchronized around each step, nothing profiled), then
profiles the queue of as many more steps with cProfile (enabled from the step's call to its return, the
synchronization outside). Built-in calls (`replay`, `copy_`, `record_event`, ...) appear with their own
time, which is what the host spends in CUDA and in torch's C++ for them.

    source .gpu-kit/setup.sh
    python3 benchmarks/host_profile.py --out $OUT --steps 20

The report (`host-profile-<config>-<backend>-<rev>-<device>.json`) has, per variant, the unprofiled host
queue time per step and the top functions by own time, per step. cProfile slows Python functions; the
unprofiled time is the number to compare against the GPU step. The whole profile of each variant is
written beside it (`host-profile-<config>-<variant>.prof`, for `pstats`).
"""

from __future__ import annotations

import argparse
import cProfile
import datetime as _dt
import pstats
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
from rank_streams_ab import VARIANTS  # the switches and their variants, (on, off) by field

from qeffect.config import load_config
from qeffect.profile.matrix import (
    ConfigSpec,
    PipelineRunner,
    device_name_of,
    device_tag,
    git_revision,
    release_memory,
    time_runner,
)
from qeffect.profile.report import ConfigResult
from qeffect.profile.trace import sync_device

ROOT = Path(__file__).resolve().parent.parent


def top_functions(prof: cProfile.Profile, steps: int, top: int) -> list[dict[str, Any]]:
    """The `top` functions by own time, per step."""
    stats = pstats.Stats(prof).stats  # (file, line, name) -> (primitive calls, calls, own, cumulative, callers)
    rows = sorted(stats.items(), key=lambda kv: kv[1][2], reverse=True)[:top]
    out = []
    for (file, line, name), (_cc, nc, tt, ct, _callers) in rows:
        where = name if file == "~" else f"{Path(file).name}:{line}({name})"
        out.append({"function": where, "calls_per_step": nc / steps, "own_us_per_step": tt / steps * 1e6,
                    "cumulative_us_per_step": ct / steps * 1e6})
    return out


def profile_variant(cfg, device: torch.device, *, path: str, schedule: str, steps: int, warmup: int,
                    top: int, dump: Path | None = None) -> dict[str, Any]:
    # the profile's runner sets runtime.step_graph from its spec, whatever the config says
    spec = ConfigSpec(path, path, path=path, schedule=schedule, step_graph=cfg.runtime.step_graph)
    built: list[PipelineRunner] = []

    def make() -> PipelineRunner:  # kept: the profiled steps run on the runner the timer built
        built.append(PipelineRunner(cfg, device, spec))
        return built[0]

    timed = ConfigResult(name=path, description=path, status="ok", schedule=schedule, path=path)
    # the profile's own timer: device synchronized around each step, the host's queue time taken before
    time_runner(timed, make, device, steps=steps, warmup=warmup)
    runner = built.pop()
    host, step_s = timed.host_seconds, timed.step_seconds
    prof = cProfile.Profile()
    profiled: list[float] = []
    for i in range(warmup + steps, warmup + 2 * steps):
        data = runner.data(i)
        sync_device(device)
        t = time.perf_counter()
        prof.enable()
        runner.step(data)
        prof.disable()
        profiled.append(time.perf_counter() - t)
        sync_device(device)
    if dump is not None:  # the whole profile, for `pstats` (callers and callees)
        prof.dump_stats(dump)
    replays, handoffs = runner.counters()
    del runner
    release_memory(device)
    return {"host_seconds": host, "host_median_seconds": statistics.median(host), "step_seconds": step_s,
            "median_step_seconds": statistics.median(step_s),
            "host_gpu_step_ratio": statistics.median(host) / statistics.median(step_s),
            "profiled_host_median_seconds": statistics.median(profiled),
            "replays_total": replays, "handoffs_total": handoffs, "top": top_functions(prof, steps, top)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tomls", default=str(ROOT / "examples/configs/h2048.toml"), help="comma-separated configs")
    ap.add_argument("--backend", default="te")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--path", default="captured-direct", help="captured-direct or captured-copy (eager on a CPU)")
    ap.add_argument("--schedule", default="interleaved")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--top", type=int, default=30)
    ap.add_argument("--field", default="runtime.rank_streams", choices=sorted(VARIANTS),
                    help="the runtime switch profiled on and off")
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results"))
    a = ap.parse_args(argv)
    from qeffect.cli.common import write_json

    device = torch.device(a.device)
    for toml in a.tomls.split(","):
        stem = Path(toml).stem
        cfg = load_config(toml).with_overrides(**{"fp8.backend": a.backend, "train.device": a.device})
        variants = {}
        for name, on in VARIANTS[a.field]:
            c = cfg.with_overrides(**{a.field: on})
            variants[name] = profile_variant(c, device, path=a.path, schedule=a.schedule, steps=a.steps,
                                             warmup=a.warmup, top=a.top,
                                             dump=Path(a.out) / f"host-profile-{stem}-{name}.prof")
            v = variants[name]
            print(f"[{stem}] {name}: host {v['host_median_seconds'] * 1e3:.2f} ms, step "
                  f"{v['median_step_seconds'] * 1e3:.2f} ms (host/step {v['host_gpu_step_ratio']:.2f}); "
                  f"profiled host {v['profiled_host_median_seconds'] * 1e3:.2f} ms", flush=True)
            for row in v["top"][:15]:
                print(f"    {row['own_us_per_step']:8.0f} us {row['calls_per_step']:7.1f}x  {row['function']}")
        rev = git_revision()
        kind = "host-profile" + ("" if a.field == "runtime.rank_streams"
                                 else "-" + a.field.split(".")[1].replace("_", "-"))
        out = Path(a.out) / f"{kind}-{stem}-{a.backend}-{rev}-{device_tag(device)}.json"
        write_json(out, {
            "kind": kind, "command": " ".join([Path(sys.argv[0]).name, *(argv or sys.argv[1:])]),
            "git_revision": rev, "device": device.type, "device_name": device_name_of(device),
            "torch_version": torch.__version__, "created": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
            "config": cfg.model_dump(), "path": a.path, "schedule": a.schedule, "steps": a.steps,
            "warmup": a.warmup, "field": a.field, "variants": variants})
        print(f"-> {out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
