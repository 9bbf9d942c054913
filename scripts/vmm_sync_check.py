"""Do the VMM driver calls wait for the device? Each call timed with the GPU idle and with a long kernel queued.

Release offload makes cuMemCreate, cuMemMap, cuMemSetAccess, cuMemUnmap and cuMemRelease between graph
launches while the host runs ahead of the device. A call that waits for queued device work (an implicit
synchronization) would tie the host to the device at every such call, whatever thread makes it. This
queues `--sleep-ms` of `torch.cuda._sleep` on a side stream, makes each call on a slot no kernel touches,
and compares its host time with the same call on an idle device (median of `--repeats`).

    source .gpu-kit/setup.sh; python3 scripts/vmm_sync_check.py --json $OUT/vmm-sync-check-h200.json
"""

from __future__ import annotations

import argparse
import importlib.metadata
import statistics
import sys
import time
from pathlib import Path

import torch

from qeffect.cli.common import write_json
from qeffect.graphs.handshake import script_provenance
from qeffect.offload.driver import VmmDriver

CALLS = ("cuMemCreate", "cuMemMap", "cuMemSetAccess", "cuMemUnmap", "cuMemRelease")


def cycle(drv: VmmDriver, va: int, size: int, busy: float) -> dict[str, float]:
    """One create/map/access/unmap/release cycle; each call's host seconds. `busy`: seconds of sleep kernel
    queued on a side stream first (0: idle device)."""
    side = torch.cuda.Stream()
    if busy:
        cycles = int(busy * torch.cuda.get_device_properties(0).clock_rate * 1e3)  # clock_rate in kHz
        with torch.cuda.stream(side):
            torch.cuda._sleep(cycles)
    t = {}
    t0 = time.perf_counter()
    h = drv.create(size)
    t["cuMemCreate"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    drv.map(va, size, h)
    t["cuMemMap"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    drv.set_access(va, size)
    t["cuMemSetAccess"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    drv.unmap(va, size)
    t["cuMemUnmap"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    drv.release(h)
    t["cuMemRelease"] = time.perf_counter() - t0
    t["kernel_still_running_after"] = float(busy > 0 and not side.query())
    torch.cuda.synchronize()
    return t


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mib", type=int, default=16)
    ap.add_argument("--sleep-ms", type=float, default=50.0)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("vmm_sync_check: no CUDA device", file=sys.stderr)
        return 2
    torch.cuda.init()
    drv = VmmDriver(torch.cuda.current_device())
    size = drv.round_up(a.mib << 20)
    va = drv.reserve(size)
    cycle(drv, va, size, 0.0)  # warm-up
    result = {}
    for label, busy in (("idle", 0.0), ("busy", a.sleep_ms / 1e3)):
        runs = [cycle(drv, va, size, busy) for _ in range(a.repeats)]
        result[label] = {c: 1e3 * statistics.median(r[c] for r in runs) for c in CALLS}
        result[label]["kernel_still_running_after"] = all(r["kernel_still_running_after"] for r in runs)
    drv.free_address(va, size)
    waits = [c for c in CALLS if result["busy"][c] > 0.5 * a.sleep_ms]
    result.update({"sleep_ms": a.sleep_ms, "slot_bytes": size, "calls_that_wait_for_the_device": waits,
                   **script_provenance(),
                   "device": torch.cuda.get_device_name(0), "torch": torch.__version__,
                   "cuda_bindings": importlib.metadata.version("cuda-bindings")})
    for c in CALLS:
        print(f"{c:16s} idle {result['idle'][c]:8.3f} ms   with {a.sleep_ms:.0f} ms queued {result['busy'][c]:8.3f} ms")
    print(f"kernel still running after the cycle: {result['busy']['kernel_still_running_after']}; "
          f"calls that wait for the device: {waits or 'none'}")
    if a.json:
        write_json(Path(a.json), result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
