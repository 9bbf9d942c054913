"""Issue 10 fixed-work scaling: median step time of one pipeline mapping under torchrun.

    # PP=2 (two stages per GPU) and PP=4 (one stage per GPU), the same four-stage h4096 model:
    torchrun --nproc-per-node 2 benchmarks/pipeline_timing.py --config examples/configs/h4096.toml \
        --path captured-direct --out $OUT/timing-pp2.json
    torchrun --nproc-per-node 4 benchmarks/pipeline_timing.py --config examples/configs/h4096-pp4.toml \
        --path captured-direct --out $OUT/timing-pp4.json
    python3 benchmarks/pipeline_timing.py --compare $OUT/timing-pp2.json $OUT/timing-pp4.json

Each step: synthetic batches made before the timer, every rank synchronized (device, then a barrier)
before and after; warm-up steps excluded; rank 0 writes the raw timings with the command, revision,
device and versions. `--compare A B` prints speedup = median(A) / median(B) and strong-scaling
efficiency = speedup / (world(B) / world(A)). A dry run on CPU: `--device cpu` (gloo, eager path).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from qeffect.config import load_config
from qeffect.graphs.handshake import git_revision
from qeffect.profile.distributed import DistributedRunner, sync_all
from qeffect.profile.matrix import ConfigSpec, te_version, time_runner
from qeffect.profile.report import ConfigResult
from qeffect.runtime.distributed import init_from_env


def compare(a_path: str, b_path: str) -> int:
    a, b = json.loads(Path(a_path).read_text()), json.loads(Path(b_path).read_text())
    speedup = a["median_step_seconds"] / b["median_step_seconds"]
    scale = b["world_size"] / a["world_size"]
    print(json.dumps({"a": a_path, "b": b_path, "a_median_ms": a["median_step_seconds"] * 1e3,
                      "b_median_ms": b["median_step_seconds"] * 1e3, "speedup": speedup,
                      "strong_scaling_efficiency": speedup / scale}, indent=1))
    return 0


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
    ap.add_argument("--compare", nargs=2, metavar=("A", "B"), default=None)
    a = ap.parse_args()
    if a.compare:
        return compare(*a.compare)
    if a.warmup < 1:
        ap.error("--warmup must be >= 1 (the first step includes setup work)")
    cfg = load_config(a.config).with_overrides(**{"fp8.backend": a.backend, "train.device": a.device})
    init_from_env(cfg.train.device)
    path = a.path if cfg.train.device == "cuda" and not a.native else "eager"
    spec = ConfigSpec("native-eager" if a.native else path, "pipeline timing", native=a.native, path=path,
                      schedule=None)
    device = torch.device("cuda", torch.cuda.current_device()) if cfg.train.device == "cuda" else torch.device("cpu")
    r = ConfigResult(name=spec.name, description=spec.description, status="ok")
    time_runner(r, lambda: DistributedRunner(cfg, spec), device, steps=a.steps, warmup=a.warmup, sync=sync_all)
    if dist.get_rank() == 0 and a.out:
        report = {"command": " ".join(["torchrun", "--nproc-per-node", str(dist.get_world_size())] + sys.argv),
                  "git_revision": git_revision() or "unknown", "device": torch.cuda.get_device_name(device)
                  if device.type == "cuda" else "cpu", "torch": torch.__version__,
                  "world_size": dist.get_world_size(), "config": a.config, "pipeline": cfg.pipeline.model_dump(),
                  "backend": cfg.fp8.backend, "te": te_version(), "native": a.native, "path": path, "steps": a.steps,
                  "warmup": a.warmup,
                  "setup_seconds": r.build_seconds, "step_seconds": r.step_seconds,
                  "median_step_seconds": r.median_step_seconds}
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(report, indent=1))
        print(f"world {report['world_size']}: median {report['median_step_seconds'] * 1e3:.2f} ms", flush=True)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
