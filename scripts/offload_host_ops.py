"""Host cost of the stream operations offload makes per copy: torch's against the driver's (issue 7).

Resident offload with chunked copies (`QEFFECT_OFFLOAD_CHUNK_MIB`) removes most of the compute stream's
wait for restores, but it issues several copies and event records per group where one copy did, and the
timed steps then find the host queueing the step almost as slowly as the device runs it. This measures,
on the GPU, the host microseconds per operation of each way to issue them:

- `torch`: `with torch.cuda.stream(s): dst.copy_(src, non_blocking=True)`, then `event.record(s)` (what
  `TorchCudaStreams` does per copy);
- `torch-stream-once`: the same inside one `torch.cuda.stream(s)` block for the whole batch;
- `driver`: `cuMemcpyAsync` and `cuEventRecord` from `cuda.bindings.driver` on the raw handles;
- waits: `stream.wait_event(e)` against `cuStreamWaitEvent`;
- the current stream: `torch.cuda.current_stream(device)` against `DriverCudaStreams.current_stream` (the
  raw handle as a `RawStream`, what the offload hooks call), and an event query: `event.query()` (what
  they call) against `cuEventQuery` on the raw handle.

Copies are small (64 KiB, pinned host <-> device) so that the device keeps up and the queue never
blocks the host; the device is synchronized every `--batch` operations, outside the timed region.
Medians over `--repeats` batches, in microseconds per operation; JSON with `--json`.

    source .gpu-kit/setup.sh; python3 scripts/offload_host_ops.py --json $OUT/offload-host-ops-h200.json
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from qeffect.cli.common import write_json
from qeffect.graphs.handshake import gpu_provenance


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--batch", type=int, default=200)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--kib", type=int, default=64)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    from cuda.bindings import driver as cu

    n = a.kib << 10
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")
    host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    s = torch.cuda.Stream()
    ev = torch.cuda.Event()
    ev.record(s)  # torch creates the CUDA event at its first record
    raw_s, raw_e = cu.CUstream(s.cuda_stream), cu.CUevent(ev.cuda_event)
    ok = cu.CUresult.CUDA_SUCCESS

    def check(ret: tuple) -> None:
        if ret[0] != ok:
            raise RuntimeError(f"driver call failed: {ret[0]}")

    def torch_ops() -> None:
        for _ in range(a.batch):
            with torch.cuda.stream(s):
                host.copy_(dev, non_blocking=True)
            ev.record(s)

    def torch_stream_once() -> None:
        with torch.cuda.stream(s):
            for _ in range(a.batch):
                host.copy_(dev, non_blocking=True)
                ev.record()

    def driver_ops() -> None:
        hp, dp = host.data_ptr(), dev.data_ptr()
        for _ in range(a.batch):
            check(cu.cuMemcpyAsync(hp, dp, n, raw_s))
            check(cu.cuEventRecord(raw_e, raw_s))

    def torch_wait() -> None:
        cur = torch.cuda.current_stream()
        for _ in range(a.batch):
            cur.wait_event(ev)

    def driver_wait() -> None:
        cur = cu.CUstream(torch.cuda.current_stream().cuda_stream)
        for _ in range(a.batch):
            check(cu.cuStreamWaitEvent(cur, raw_e, 0))

    from qeffect.offload.streams import DriverCudaStreams

    ops = DriverCudaStreams(torch.device("cuda", torch.cuda.current_device()))

    def torch_current() -> None:
        for _ in range(a.batch):
            torch.cuda.current_stream(ops.device)

    def raw_current() -> None:
        for _ in range(a.batch):
            ops.current_stream()

    def torch_query() -> None:
        for _ in range(a.batch):
            ev.query()

    def driver_query() -> None:
        not_ready = cu.CUresult.CUDA_ERROR_NOT_READY
        for _ in range(a.batch):
            ret = cu.cuEventQuery(raw_e)
            if ret[0] != not_ready:
                check(ret)

    variants = {"torch": torch_ops, "torch-stream-once": torch_stream_once, "driver": driver_ops,
                "torch-wait": torch_wait, "driver-wait": driver_wait, "torch-current-stream": torch_current,
                "raw-current-stream": raw_current, "torch-query": torch_query, "driver-query": driver_query}
    samples: dict[str, list[float]] = {k: [] for k in variants}
    for fn in variants.values():  # warm-up
        fn()
    torch.cuda.synchronize()
    for _ in range(a.repeats):
        for name, fn in variants.items():  # alternating, so host noise hits every variant alike
            t0 = time.perf_counter()
            fn()
            samples[name].append((time.perf_counter() - t0) / a.batch * 1e6)
            torch.cuda.synchronize()
    result = {**gpu_provenance(), "batch": a.batch, "repeats": a.repeats, "copy_bytes": n,
              "median_us_per_op": {k: statistics.median(v) for k, v in samples.items()},
              "samples_us_per_op": samples}
    for k, v in result["median_us_per_op"].items():
        what = next((w for w in ("wait", "current-stream", "query") if k.endswith(w)), "copy + event record")
        print(f"{k}: {v:.2f} us per {what}")
    if a.json:
        write_json(Path(a.json), result)


if __name__ == "__main__":
    main()
