"""What stays alive after a captured pipeline is torn down, per offload mode (GPU diagnostic).

The offload benchmark found that after a `release` or `resident` pipeline is deleted in one process,
about 2.3 GiB of CUDA memory stays allocated (`off` leaves ~0). This builds one pipeline per mode in
turn, runs two steps, tears it down the way the benchmark does, and prints what survived: the bytes
still allocated, qeffect / torch objects still alive (pipelines, stage actions, offload groups and
managers, CUDA graphs), and for the largest surviving CUDA tensors the chain of referrers.

    source .gpu-kit/setup.sh
    python3 scripts/offload_leak.py --config examples/configs/h2048.toml --modes off,release,resident
"""

from __future__ import annotations

import argparse
import gc
import sys
from collections import Counter

import torch

from qeffect.config import load_config
from qeffect.runtime.build import build_single_process
from qeffect.verify.state import synthetic_batches

WATCH = ("SingleProcessPipeline", "CapturedStageActions", "OffloadGroup", "OffloadManager", "GraphManager",
         "CUDAGraph", "Chunk", "GradientArena")


def _alive() -> Counter:
    """Instances of the watched classes that gc can see."""
    return Counter(type(o).__name__ for o in gc.get_objects() if type(o).__name__ in WATCH)


def _cuda_tensors() -> dict[int, torch.Tensor]:
    out = {}
    for o in gc.get_objects():
        try:
            if isinstance(o, torch.Tensor) and o.is_cuda:
                out[id(o)] = o
        except Exception:  # noqa: BLE001 - some objects raise on isinstance checks
            continue
    return out


def _describe(o: object) -> str:
    if isinstance(o, dict):
        return f"dict({len(o)} keys: {list(o)[:4]})"
    if isinstance(o, (list, tuple)):
        return f"{type(o).__name__}(len {len(o)})"
    return type(o).__qualname__


def _chain(t: torch.Tensor, depth: int = 4) -> list[str]:
    """One referrer path upwards (the first referrer that is not this function's own frame)."""
    lines, obj, seen = [], t, {id(t)}
    for _ in range(depth):
        refs = [r for r in gc.get_referrers(obj) if id(r) not in seen and not isinstance(r, type(sys._getframe()))]
        if not refs:
            lines.append("(no Python referrer: held from C++, e.g. an autograd node or a CUDA graph)")
            break
        obj = refs[0]
        seen.add(id(obj))
        lines.append(_describe(obj))
    return lines


def run(cfg, mode: str, dev: torch.device) -> None:
    gc.collect()
    torch.cuda.empty_cache()
    before_bytes = torch.cuda.memory_allocated(dev)
    before = set(_cuda_tensors())
    pipe = build_single_process(cfg.with_overrides(**{"train.offload": mode}), native=False, device=dev,
                                path="captured-direct")
    for i in range(2):
        pipe.step(synthetic_batches(cfg, i, dev))
    torch.cuda.synchronize(dev)
    mgr = pipe.offload
    del pipe
    if mgr is not None:
        mgr.close()
    del mgr
    gc.collect()
    torch.cuda.synchronize(dev)
    torch.cuda.empty_cache()
    after = _cuda_tensors()
    new = [t for k, t in after.items() if k not in before]
    left = torch.cuda.memory_allocated(dev) - before_bytes
    print(f"== {mode}: {left / 2**30:.3f} GiB more allocated than before the build; "
          f"{len(new)} new CUDA tensors visible to gc ({sum(t.untyped_storage().nbytes() for t in new) / 2**30:.3f} GiB "
          f"of storage); alive: {dict(_alive())}")
    for t in sorted(new, key=lambda t: -t.untyped_storage().nbytes())[:5]:
        print(f"   {tuple(t.shape)} {t.dtype} {t.untyped_storage().nbytes() / 2**20:.1f} MiB <- "
              + " <- ".join(_chain(t)))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="examples/configs/h2048.toml")
    ap.add_argument("--modes", default="off,release,resident")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("offload_leak.py needs a CUDA device", file=sys.stderr)
        return 2
    dev = torch.device("cuda", torch.cuda.current_device())
    cfg = load_config(a.config).with_overrides(**{"train.device": "cuda"})
    for mode in a.modes.split(","):
        run(cfg, mode, dev)
    return 0


if __name__ == "__main__":
    sys.exit(main())
