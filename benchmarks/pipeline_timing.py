"""Issue 10 fixed-work scaling: median step time of one pipeline mapping under torchrun.

    # PP=2 (two stages per GPU) and PP=4 (one stage per GPU), the same four-stage h4096 model:
    torchrun --nproc-per-node 2 benchmarks/pipeline_timing.py --config examples/configs/h4096.toml \
        --path captured-direct --out $OUT/timing-pp2.json
    torchrun --nproc-per-node 4 benchmarks/pipeline_timing.py --config examples/configs/h4096-pp4.toml \
        --path captured-direct --out $OUT/timing-pp4.json
    python3 benchmarks/pipeline_timing.py --compare $OUT/timing-pp2.json $OUT/timing-pp4.json

    # ZB-V (two chunks per rank) at the same work: eight one-layer stages, as PP=2 x 2 chunks of two
    # layers and as PP=4 x 2 chunks of one (both 8 layers, so not the Interleaved pair's model)
    torchrun --nproc-per-node 2 benchmarks/pipeline_timing.py --config examples/configs/h4096.toml \
        --set pipeline.schedule=zbv --set model.layers_per_chunk=2 --out $OUT/timing-pp2-zbv.json
    torchrun --nproc-per-node 4 benchmarks/pipeline_timing.py --config examples/configs/h4096-pp4.toml \
        --set pipeline.schedule=zbv --set pipeline.chunks_per_rank=2 --out $OUT/timing-pp4-zbv.json

    # where each rank's step goes, and the same config in one process on one GPU (same machine)
    torchrun --nproc-per-node 2 benchmarks/pipeline_timing.py --config examples/configs/h4096.toml \
        --path captured-direct --breakdown 5 --one-gpu --out $OUT/timing-pp2.json

Each step: synthetic batches made before the timer, every rank synchronized (device, then a barrier)
before and after; warm-up steps excluded; rank 0 writes the raw timings with the command, revision,
device and versions. `--compare A B` prints speedup = median(A) / median(B) and strong-scaling
efficiency = speedup / (world(B) / world(A)), each side's per-rank breakdown and its ratio to one GPU
where the reports have them. A dry run on CPU: `--device cpu` (gloo, eager path).

`--breakdown N`: N more steps after the timed ones, each cut into synchronised laps per rank (compute,
receive waits, sends, loss and data-parallel reductions, optimizer, step-end barrier; see
`qeffect.runtime.step_timing`). Synchronising every lap costs the overlap of launch and execution, so
these steps are slower than the unperturbed ones: the report keeps them apart (`breakdown`, with their own
median wall time and its ratio to `median_step_seconds`), and the headline step time never includes them.

`--one-gpu`: then rank 0 alone times the same config in one process on its own device (every pipeline
rank in one process: `build_single_process`, with the config's rank streams), the other ranks waiting;
the report carries `one_gpu_step_seconds` and `multi_over_one_gpu` = median_step_seconds / that, both
measured on this machine in this run. Data-parallel configs are refused (one process runs one replica).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from qeffect.config import apply_sets, load_config
from qeffect.graphs.handshake import git_revision
from qeffect.profile.distributed import DistributedRunner, breakdown_by_rank, sync_all
from qeffect.profile.matrix import ConfigSpec, PipelineRunner, release_memory, te_version, time_runner
from qeffect.profile.report import ConfigResult
from qeffect.runtime.distributed import init_from_env
from qeffect.runtime.step_timing import CATEGORIES, SUM_TOLERANCE_FRACTION, SUM_TOLERANCE_SECONDS

# The one-process timing can take minutes (build, capture, steps) while the other ranks wait; they wait on
# a gloo group with this timeout rather than on the default group, whose NCCL watchdog is shorter.
ONE_GPU_WAIT = timedelta(hours=1)


def breakdown_table(report: dict[str, Any]) -> list[dict[str, Any]] | None:
    """Per rank: the median milliseconds of each category, `idle` and the breakdown steps' wall time."""
    b = report.get("breakdown")
    if not b:
        return None
    return [{"rank": r["rank"], "pp_rank": r["pp_rank"], "dp_rank": r["dp_rank"],
             **{f"{k}_ms": v * 1e3 for k, v in r["median"].items()}} for r in b["by_rank"]]


def compare(a_path: str, b_path: str) -> int:
    a, b = json.loads(Path(a_path).read_text()), json.loads(Path(b_path).read_text())
    if a.get("layers") != b.get("layers"):  # fixed work: the same model on both mappings
        print(f"not the same work: {a.get('layers')} layers in {a_path}, {b.get('layers')} in {b_path}",
              file=sys.stderr)
        return 1
    speedup = a["median_step_seconds"] / b["median_step_seconds"]
    scale = b["world_size"] / a["world_size"]
    out: dict[str, Any] = {"a": a_path, "b": b_path, "a_median_ms": a["median_step_seconds"] * 1e3,
                           "b_median_ms": b["median_step_seconds"] * 1e3, "speedup": speedup,
                           "strong_scaling_efficiency": speedup / scale}
    for side, r in (("a", a), ("b", b)):
        if r.get("one_gpu_step_seconds") is not None:
            out[f"{side}_one_gpu_ms"] = r["one_gpu_step_seconds"] * 1e3
            out[f"{side}_multi_over_one_gpu"] = r["multi_over_one_gpu"]
        table = breakdown_table(r)
        if table is not None:
            out[f"{side}_breakdown_overhead"] = r["breakdown"]["overhead"]
            out[f"{side}_breakdown_by_rank"] = table
    print(json.dumps(out, indent=1))
    return 0


def one_gpu(cfg: Any, spec: ConfigSpec, device: torch.device, *, steps: int, warmup: int) -> ConfigResult | None:
    """Rank 0 times `cfg` in one process on its device (every pipeline rank there), the others wait; rank 0
    returns the result, the others None. Every rank calls it (the waiting group is created collectively)."""
    waiting = dist.new_group(backend="gloo", timeout=ONE_GPU_WAIT)
    result = None
    if dist.get_rank() == 0:
        result = ConfigResult(name=f"{spec.name}-one-process", description="the same config in one process",
                              status="ok")
        time_runner(result, lambda: PipelineRunner(cfg, device, spec), device, steps=steps, warmup=warmup)
        release_memory(device)
    dist.barrier(group=waiting)
    dist.destroy_process_group(waiting)
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=None)
    ap.add_argument("--path", default="captured-direct")
    ap.add_argument("--native", action="store_true", help="time native eager (full autograd backward) instead")
    ap.add_argument("--backend", default=None)
    ap.add_argument("--device", default=None)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--out", default=None)
    ap.add_argument("--set", dest="sets", action="append", default=None, metavar="SECTION.FIELD=VALUE",
                    help="override one config field (repeatable), e.g. pipeline.schedule=zbv")
    ap.add_argument("--breakdown", type=int, default=0, metavar="N",
                    help="N more synchronised steps, each rank's time by category (reported apart)")
    ap.add_argument("--one-gpu", action="store_true",
                    help="then time the same config in one process on rank 0's device (the ratio multi / one)")
    ap.add_argument("--compare", nargs=2, metavar=("A", "B"), default=None)
    a = ap.parse_args()
    if a.compare:
        return compare(*a.compare)
    if a.warmup < 1:
        ap.error("--warmup must be >= 1 (the first step includes setup work)")
    if a.breakdown < 0:
        ap.error("--breakdown must be >= 0 (steps)")
    cfg = apply_sets(load_config(a.config).with_overrides(**{"fp8.backend": a.backend, "train.device": a.device}),
                     a.sets)
    if a.one_gpu and cfg.pipeline.dp != 1:
        ap.error(f"--one-gpu: pipeline.dp = {cfg.pipeline.dp}; one process runs one replica (use dp = 1)")
    init_from_env(cfg.train.device)
    path = a.path if cfg.train.device == "cuda" and not a.native else "eager"
    spec = ConfigSpec("native-eager" if a.native else path, "pipeline timing", native=a.native, path=path,
                      schedule=None)
    device = torch.device("cuda", torch.cuda.current_device()) if cfg.train.device == "cuda" else torch.device("cpu")
    r = ConfigResult(name=spec.name, description=spec.description, status="ok")
    held: list[DistributedRunner] = []  # the runner outlives time_runner for the breakdown steps

    def make() -> DistributedRunner:
        held.append(DistributedRunner(cfg, spec))
        return held[-1]

    time_runner(r, make, device, steps=a.steps, warmup=a.warmup, sync=sync_all)
    by_rank = breakdown_by_rank(held[0], a.breakdown, a.warmup + a.steps) if a.breakdown else None
    held.clear()
    release_memory(device)
    one = one_gpu(cfg, spec, device, steps=a.steps, warmup=a.warmup) if a.one_gpu else None
    if dist.get_rank() == 0:
        report = {"command": " ".join(["torchrun", "--nproc-per-node", str(dist.get_world_size())] + sys.argv),
                  "git_revision": git_revision() or "unknown", "device": torch.cuda.get_device_name(device)
                  if device.type == "cuda" else "cpu", "torch": torch.__version__,
                  "world_size": dist.get_world_size(), "config": a.config, "pipeline": cfg.pipeline.model_dump(),
                  "layers": cfg.model.layers_per_chunk * cfg.pipeline.num_stages,
                  "backend": cfg.fp8.backend, "te": te_version(), "native": a.native, "path": path, "steps": a.steps,
                  "warmup": a.warmup,
                  "setup_seconds": r.build_seconds, "step_seconds": r.step_seconds,
                  "median_step_seconds": r.median_step_seconds}
        if by_rank is not None:
            wall = statistics.median(s["wall_seconds"] for s in by_rank[0]["steps"])
            report["breakdown"] = {
                "steps": a.breakdown, "categories": list(CATEGORIES),
                "tolerance": f"categories sum to wall_seconds within {SUM_TOLERANCE_SECONDS * 1e3:g} ms + "
                             f"{SUM_TOLERANCE_FRACTION:.0%}",
                "note": "synchronised laps (qeffect.runtime.step_timing): slower than the unperturbed steps, "
                        "reported apart",
                "median_wall_seconds": wall, "overhead": wall / r.median_step_seconds, "by_rank": by_rank}
        if one is not None:
            report["one_gpu"] = {"name": one.name, "device": report["device"], "setup_seconds": one.build_seconds,
                                 "step_seconds": one.step_seconds, "losses": one.losses}
            report["one_gpu_step_seconds"] = one.median_step_seconds
            report["multi_over_one_gpu"] = r.median_step_seconds / one.median_step_seconds
            # the same work: one process computes the pipeline's losses bit for bit (floats of the same tensors)
            report["one_gpu_same_losses"] = one.losses == r.losses
        if a.out:
            Path(a.out).parent.mkdir(parents=True, exist_ok=True)
            Path(a.out).write_text(json.dumps(report, indent=1))
        print(f"world {report['world_size']}: median {report['median_step_seconds'] * 1e3:.2f} ms", flush=True)
        if one is not None:
            print(f"one process: median {report['one_gpu_step_seconds'] * 1e3:.2f} ms, "
                  f"multi / one = {report['multi_over_one_gpu']:.3f}", flush=True)
        for row in breakdown_table(report) or []:
            print("rank {rank}: ".format(**row) + ", ".join(f"{k[:-3]} {v:.2f}" for k, v in row.items()
                                                           if k.endswith("_ms")) + " ms (median)", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
