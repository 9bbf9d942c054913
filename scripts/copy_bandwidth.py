"""How fast do offload's copies run? Pinned host <-> VMM slot or caching-allocator memory, idle and beside GEMMs.

Why: resident offload adds 14-34 % to an h2048 step (benchmarks/results/offload-bench-*), even with six
banks, and offload-check timed 4 MiB restores under a backward at about 6 GB/s where PCIe Gen5 moves
about 50 GB/s. If the copies themselves are slow (VMM memory, a small copy size, contention with the
GEMMs), the bank plan is not what bounds resident mode. This measures, on one device:

- D2H, H2D, and both directions at once (two copy streams), for each size;
- from/to a VMM slot (`qeffect.offload.vmm.VmmSlot`) and from/to caching-allocator memory;
- idle, and while a bf16 GEMM loop runs on the compute stream.

Each cell: `--repeats` back-to-back copies on a copy stream, timed by events around the batch
(GB/s over the batch) and per copy (median ms). JSON with the command, revision, device and versions.

    source .gpu-kit/setup.sh
    python3 scripts/copy_bandwidth.py --json $OUT/copy-bandwidth-h200.json
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
from qeffect.offload.vmm import VmmSlot

MiB = 2**20


def timed_copies(pairs: list[tuple[torch.Tensor, torch.Tensor, torch.cuda.Stream]], repeats: int) -> dict:
    """Run `repeats` copies of every (dst, src, stream) pair; streams run concurrently. Per-pair timings."""
    out = []
    marks = []
    for _dst, _src, stream in pairs:
        evs = [torch.cuda.Event(enable_timing=True) for _ in range(repeats + 1)]
        with torch.cuda.stream(stream):
            evs[0].record(stream)
        marks.append(evs)
    for i in range(repeats):
        for (dst, src, stream), evs in zip(pairs, marks, strict=True):
            with torch.cuda.stream(stream):
                dst.copy_(src, non_blocking=True)
                evs[i + 1].record(stream)
    torch.cuda.synchronize()
    for (dst, _src, _stream), evs in zip(pairs, marks, strict=True):
        per = [evs[i].elapsed_time(evs[i + 1]) for i in range(repeats)]
        total_ms = evs[0].elapsed_time(evs[-1])
        nbytes = dst.numel() * dst.element_size()
        out.append({"total_ms": total_ms, "gb_per_s": nbytes * repeats / (total_ms * 1e-3) / 1e9,
                    "median_copy_ms": statistics.median(per), "max_copy_ms": max(per), "copy_ms": per})
    return out


def gemm_load(dev: torch.device) -> tuple[torch.cuda.Stream, tuple[torch.Tensor, torch.Tensor], float]:
    """A stream, the operands of an 8192^3 bf16 GEMM, and the GEMM's time in ms (warmed up)."""
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    s = torch.cuda.Stream(dev)
    with torch.cuda.stream(s):
        for _ in range(3):
            a @ b
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record(s)
        for _ in range(10):
            a @ b
        e1.record(s)
    torch.cuda.synchronize()
    return s, (a, b), e0.elapsed_time(e1) / 10


def start_gemms(stream: torch.cuda.Stream, operands: tuple[torch.Tensor, torch.Tensor], iterations: int) -> None:
    a, b = operands
    with torch.cuda.stream(stream):
        for _ in range(iterations):
            a @ b


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes-mib", default="4,14,64")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    dev = torch.device("cuda", torch.cuda.current_device())
    driver = VmmDriver(dev.index)
    sizes = [int(x) for x in a.sizes_mib.split(",")]
    d2h_stream, h2d_stream = torch.cuda.Stream(dev), torch.cuda.Stream(dev)
    gemm_stream, operands, gemm_ms = gemm_load(dev)
    cells = []
    for mib in sizes:
        nbytes = mib * MiB
        host_out = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        host_in = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True).fill_(7)
        slots = [VmmSlot(driver, nbytes, name=f"bw{mib}-{i}") for i in range(2)]
        memories = {"vmm": [s.bytes(nbytes) for s in slots],
                    "caching": [torch.empty(nbytes, dtype=torch.uint8, device=dev) for _ in range(2)]}
        for mem, (src_dev, dst_dev) in memories.items():
            src_dev.fill_(3)
            setups = {"d2h": [(host_out, src_dev, d2h_stream)],
                      "h2d": [(dst_dev, host_in, h2d_stream)],
                      "both": [(host_out, src_dev, d2h_stream), (dst_dev, host_in, h2d_stream)]}
            for load in ("idle", "gemm"):
                for direction, pairs in setups.items():
                    timed_copies(pairs, 2)  # warm-up
                    if load == "gemm":
                        # the GEMMs must outlast the copies: estimate at 10 GB/s, the slow case
                        start_gemms(gemm_stream, operands, int(nbytes * a.repeats / 10e9 * 1e3 / gemm_ms) + 4)
                    res = timed_copies(pairs, a.repeats)
                    torch.cuda.synchronize()
                    for (dst, _s, _st), r in zip(pairs, res, strict=True):
                        kind = "d2h" if dst.device.type == "cpu" else "h2d"
                        cells.append({"mib": mib, "memory": mem, "load": load, "setup": direction, "copy": kind,
                                      **r})
                        print(f"{mib:4d} MiB {mem:8s} {load:5s} {direction:5s} {kind}: "
                              f"{r['gb_per_s']:6.1f} GB/s, median copy {r['median_copy_ms']:.3f} ms "
                              f"(max {r['max_copy_ms']:.3f})", flush=True)
        for s in slots:
            s.close()
    driver.close()
    if a.json:
        write_json(Path(a.json), {**gpu_provenance(dev), "gemm_ms": gemm_ms, "repeats": a.repeats,
                                  "cells": cells})
    return 0


if __name__ == "__main__":
    sys.exit(main())
