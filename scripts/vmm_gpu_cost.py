"""Do VMM driver calls slow the GPU down? Queued kernels timed with and without remaps on the host meanwhile.

Release offload at h2048 is ~1.3 ms per step slower than no offload, yet its compute stream stalls only
~0.1-0.2 ms at its offload waits (`offload_waits.py`) and the host queues the step well ahead of the device
(the optimizer step is a graph). Each step makes 12 create/map/access/unmap/release cycles. If mapping or
unmapping invalidates the GPU's translations (a device-wide stall), kernels already running pay for every
call. This queues `--kernels` bf16 matmuls (tens of ms), then makes `--ops` driver cycles of one kind on a
slot no kernel touches while they run, and compares the kernels' device time (CUDA events) with a run
without calls. Kinds: ``cycle`` (create, map, access, unmap, release: what release offload does),
``map`` (handle kept: map, access, unmap), ``create`` (create, release, never mapped), ``access`` (one
mapping, access granted again and again). Alternating repeats; medians; per call, the extra device ms.

    source .gpu-kit/setup.sh; python3 scripts/vmm_gpu_cost.py --json $OUT/vmm-gpu-cost-h200.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

from qeffect.cli.common import write_json
from qeffect.graphs.handshake import gpu_provenance
from qeffect.offload.driver import VmmDriver

KINDS = ("none", "cycle", "map", "create", "access")


def ops(drv: VmmDriver, kind: str, va: int, size: int, count: int, kept) -> None:
    """`count` driver operations of `kind` on the slot at `va` (`kept`: its handle, mapped for "access")."""
    for _ in range(count if kind != "none" else 0):
        if kind == "cycle":
            h = drv.create(size)
            drv.map(va, size, h)
            drv.set_access(va, size)
            drv.unmap(va, size)
            drv.release(h)
        elif kind == "map":
            drv.map(va, size, kept)
            drv.set_access(va, size)
            drv.unmap(va, size)
        elif kind == "create":
            drv.release(drv.create(size))
        elif kind == "access":
            drv.set_access(va + size, size)


def timed_kernels(a: torch.Tensor, b: torch.Tensor, n: int, during) -> float:
    """Device ms of `n` matmuls queued back to back, with `during()` run on the host while they execute."""
    out = torch.empty_like(a)
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(n):
        torch.matmul(a, b, out=out)
    end.record()
    during()
    end.synchronize()
    return start.elapsed_time(end)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kernels", type=int, default=300, help="bf16 4096^3 matmuls queued per timing")
    ap.add_argument("--ops", type=int, default=24, help="driver operations made while they run")
    ap.add_argument("--mib", type=int, default=20, help="slot size (h2048's groups: 18 MiB)")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    dev = torch.device("cuda", torch.cuda.current_device())
    drv = VmmDriver(dev.index)
    size = drv.round_up(a.mib << 20)
    va = drv.reserve(2 * size)
    kept = drv.create(size)
    access_handle = drv.create(size)
    drv.map(va + size, size, access_handle)
    drv.set_access(va + size, size)
    x = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16)
    y = torch.randn(4096, 4096, device=dev, dtype=torch.bfloat16)
    for kind in KINDS:  # warm-up: kernels, and each kind's calls once
        timed_kernels(x, y, 20, lambda kind=kind: ops(drv, kind, va, size, 2, kept))
    times: dict[str, list[float]] = {k: [] for k in KINDS}
    for _ in range(a.repeats):
        for kind in KINDS:
            times[kind].append(timed_kernels(x, y, a.kernels, lambda kind=kind: ops(drv, kind, va, size, a.ops, kept)))
    med = {k: statistics.median(v) for k, v in times.items()}
    per_op = {k: (med[k] - med["none"]) / a.ops for k in KINDS if k != "none"}
    print(f"{a.kernels} matmuls: {med['none']:.3f} ms alone")
    for k in KINDS[1:]:
        print(f"  with {a.ops} x {k:7s}: {med[k]:.3f} ms, {1e3 * per_op[k]:+.1f} us of device time per operation")
    drv.unmap(va + size, size)
    drv.release(access_handle)
    drv.release(kept)
    drv.free_address(va, 2 * size)
    if a.json:
        write_json(Path(a.json), {**gpu_provenance(dev), "kernels": a.kernels, "ops": a.ops, "slot_bytes": size,
                                  "repeats": a.repeats, "median_ms": med, "raw_ms": times,
                                  "extra_device_ms_per_op": per_op})
    return 0


if __name__ == "__main__":
    sys.exit(main())
