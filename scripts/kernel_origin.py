"""Which host op launches a given kernel: one eager step of the reference pipeline under the profiler.

Why: a captured step's kernels come from graph replays, so the profiler cannot name the op or the Python
line behind one; the eager path (`path="eager"`) launches the same kernels from their ops. For every
kernel whose name contains `--kernel`, prints the op that launched it, its input shapes and the
innermost frames of its Python stack and the ops it ran inside, with counts.

    source .gpu-kit/setup.sh
    python3 scripts/kernel_origin.py --config examples/configs/h2048.toml --kernel unrolled_elementwise
"""

from __future__ import annotations

import argparse
from collections import Counter

import torch
from torch.profiler import ProfilerActivity, profile

from qeffect.config import load_config
from qeffect.runtime.build import build_single_process
from qeffect.verify.state import synthetic_batches


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="examples/configs/h2048.toml")
    ap.add_argument("--backend", default="reference")
    ap.add_argument("--kernel", required=True, help="a substring of the kernel's name")
    ap.add_argument("--frames", type=int, default=6)
    args = ap.parse_args()
    cfg = load_config(args.config).with_overrides(**{"fp8.backend": args.backend, "train.device": "cuda"})
    pipe = build_single_process(cfg, native=False, device="cuda", path="eager")
    for s in range(2):  # warm-up: compiles, first-step work
        pipe.step(synthetic_batches(cfg, s, "cuda"))
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True, with_stack=True) as prof:
        pipe.step(synthetic_batches(cfg, 2, "cuda"))
        torch.cuda.synchronize()
    seen: Counter[str] = Counter()
    for ev in prof.events():
        kernels = [k for k in ev.kernels if args.kernel in k.name]
        if not kernels or ev.name.startswith("cuda"):
            continue
        parents, up = [], ev.cpu_parent
        while up is not None and len(parents) < args.frames:
            parents.append(up.name)
            up = up.cpu_parent
        stack = " <- ".join(f for f in ev.stack[: args.frames] if "torch/" not in f) if ev.stack else "-"
        seen[f"{ev.name} {ev.input_shapes} [{len(kernels)} kernel(s)]\n    ops: {' <- '.join(parents) or '-'}"
             f"\n    python: {stack}"] += 1
    for text, count in seen.most_common(20):
        print(f"{count:4d} x {text}")


if __name__ == "__main__":
    main()
