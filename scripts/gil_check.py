"""Do VMM driver calls release the GIL? The question a driver thread for release offload hangs on.

Release mode spends 2-3 ms of host time per h2048 step in driver calls (cuMemCreate, cuMemMap,
cuMemSetAccess, cuMemUnmap, cuMemRelease; `offload_bench.py` reports them). A second thread could
make them while the main thread launches graphs, but only if `cuda.bindings` releases the GIL inside
each call. This measures it: the main thread counts through a pure-Python loop for `--seconds`, alone
and then while a worker thread maps and unmaps one slot as fast as it can. If the calls release the GIL,
the main thread keeps most of its rate while the worker spends most of its time in the driver; if they
hold it, both threads share one interpreter and the main thread's rate drops to about half.

    source .gpu-kit/setup.sh; python3 scripts/gil_check.py            # the real driver (GPU)
    python3 scripts/gil_check.py --control                             # the worker in pure Python: holds it

`--control` is the measurement's own check: a worker that only runs Python must bring the main thread
to about half its rate. (`--fake` runs the CPU fake driver, whose map and unmap are torch copies, which
release the GIL: it reads as "releases", correctly for the fake.)
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from pathlib import Path

import torch

from qeffect.cli.common import write_json
from qeffect.graphs.handshake import script_provenance
from qeffect.offload.driver import VmmDriver
from qeffect.offload.vmm import VmmSlot


def count_for(seconds: float) -> int:
    """Iterations of a pure-Python loop in `seconds` (the main thread's share of the interpreter)."""
    n, end = 0, time.perf_counter() + seconds
    while time.perf_counter() < end:
        n += 1
    return n


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fake", action="store_true", help="the CPU fake driver instead of cuda.bindings")
    ap.add_argument("--control", action="store_true",
                    help="the worker runs a pure-Python loop, no driver calls (must read as holding the GIL)")
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--mib", type=int, default=16, help="slot size")
    ap.add_argument("--json", default=None, help="also write the result here")
    a = ap.parse_args()
    if a.fake or a.control:
        from qeffect.offload.fake import FakeDevice

        dev = FakeDevice(0, granularity=2 << 20, total=4 * a.mib << 20)
        driver, device = dev.driver(), "cpu"
    else:
        if not torch.cuda.is_available():
            print("gil_check: no CUDA device (use --fake for the CPU fake)", file=sys.stderr)
            return 2
        torch.cuda.init()
        driver, device = VmmDriver(torch.cuda.current_device()), "cuda"
    slot = VmmSlot(driver, a.mib << 20, device=device, name="gil-check")
    alone = count_for(a.seconds)
    stop = threading.Event()
    cycles = [0]
    busy = [0.0]

    def worker() -> None:
        t0 = time.perf_counter()
        while not stop.is_set():
            if a.control:
                x = 0
                for _ in range(10_000):  # Python only
                    x += 1
            else:
                slot.unmap(wait=lambda: None)  # nothing queued on the slot: no wait needed
                slot.map()
            cycles[0] += 1
        busy[0] = time.perf_counter() - t0

    before = sum(driver.call_seconds.values())
    th = threading.Thread(target=worker, daemon=True)
    th.start()
    shared = count_for(a.seconds)
    stop.set()
    th.join()
    in_driver = sum(driver.call_seconds.values()) - before
    slot.close(wait=lambda: None)
    result = {
        "driver": "python control" if a.control else "fake" if a.fake else "cuda.bindings",
        "main_rate_ratio": shared / alone,
        "worker_cycles": cycles[0],
        "worker_driver_fraction": in_driver / busy[0] if busy[0] else None,
        "driver_calls_per_cycle": 0 if a.control else 5,
        **script_provenance(),
        "device": device if device == "cpu" else torch.cuda.get_device_name(), "torch": torch.__version__,
        "verdict": ("the worker leaves the interpreter to the main thread (its calls release the GIL)"
                    if shared / alone > 0.75 else "the worker holds the GIL"),
    }
    print(f"{result['driver']}: main thread {result['main_rate_ratio']:.2f} of its rate alone; worker: {cycles[0]} "
          f"cycles, {result['worker_driver_fraction']:.2f} of its time inside driver calls -> {result['verdict']}")
    if a.json:
        write_json(Path(a.json), result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
