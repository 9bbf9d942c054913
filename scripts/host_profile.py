"""Where a captured step spends its host time: cProfile over a few steps of one configuration.

When a captured step is host-bound (the profile's trace line says so), the GPU waits on Python: this
prints the functions with the most own time and the most cumulative time, per step.

    source .gpu-kit/setup.sh
    python3 scripts/host_profile.py --config examples/configs/h2048.toml --path captured-direct --steps 10
    python3 scripts/host_profile.py --config examples/configs/h2048.toml --offload resident --top 25
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import time

import torch

from qeffect.config import load_config
from qeffect.runtime.build import build_single_process
from qeffect.verify.state import synthetic_batches


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=None)
    ap.add_argument("--path", default="captured-direct")
    ap.add_argument("--schedule", default=None)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--top", type=int, default=35)
    ap.add_argument("--offload", default=None, help="train.offload: off, release or resident")
    ap.add_argument("--offload-banks", type=int, default=None, help="train.offload_banks (resident)")
    args = ap.parse_args()
    cfg = load_config(args.config).with_overrides(**{
        "pipeline.schedule": args.schedule, "train.offload": args.offload, "train.offload_banks": args.offload_banks})
    device = torch.device(cfg.train.device)
    pipe = build_single_process(cfg, native=False, device=device, path=args.path)
    data = [synthetic_batches(cfg, i, device) for i in range(args.steps + 3)]
    for i in range(3):
        pipe.step(data[i])
    torch.cuda.synchronize(device)
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    for i in range(3, 3 + args.steps):
        pipe.step(data[i])
    prof.disable()
    host = (time.perf_counter() - t0) / args.steps
    torch.cuda.synchronize(device)
    wall = (time.perf_counter() - t0) / args.steps
    print(f"per step: host (profiled) {host * 1e3:.2f} ms, wall {wall * 1e3:.2f} ms")
    for key in ("tottime", "cumulative"):
        out = io.StringIO()
        pstats.Stats(prof, stream=out).sort_stats(key).print_stats(args.top)
        print(out.getvalue())


if __name__ == "__main__":
    main()
