"""What the host pays per CUDA call the captured runtime makes between graph launches, torch's way against
the CUDA driver's (GPU).

A captured step's host queue time is graph launches, input copies, stream waits and event records around
them, and Python bookkeeping (`qeffect profile`'s host phases). Each copy, event and wait goes through
torch's dispatcher; the same operation through `cuda.bindings.driver` skips it. Whether that pays decides
whether the runtime should issue its copies and hand-offs through the driver. One process, every pair of
calls timed in interleaved rounds (torch, driver, torch, driver ...):

- copy: ``dst.copy_(src)`` against ``cuMemcpyDtoDAsync`` (a hand-off's activation, `--numel` bf16);
- record: ``torch.cuda.Event.record(stream)`` against ``cuEventRecord``;
- wait: ``stream.wait_event(event)`` against ``cuStreamWaitEvent``;
- record_stream: ``tensor.record_stream(stream)`` (torch's only);
- stream switch: ``with torch.cuda.stream(s):`` entered and left;
- replay: ``CUDAGraph.replay()`` against ``cuGraphLaunch`` of the same executable graph (one kernel).

Per call: `--calls` back-to-back calls between two device synchronizations (outside the timer), the
median over `--repeats`; a round times every variant once; the report keeps every round's numbers and
the median and min-max over rounds.

    source .gpu-kit/setup.sh
    python3 benchmarks/host_calls.py --out $OUT

The report is `host-calls-<rev>-<device>.json`.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from qeffect.cli.common import write_json
from qeffect.profile.matrix import device_name_of, device_tag, git_revision


def per_call_us(call: Callable[[], None], calls: int, repeats: int) -> float:
    """Median over `repeats` of the host's microseconds per call in `calls` back-to-back calls."""
    per = []
    for _ in range(repeats):
        torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(calls):
            call()
        per.append((time.perf_counter() - t) / calls * 1e6)
        torch.cuda.synchronize()
    return statistics.median(per)


def checked(result: tuple) -> None:
    if int(result[0]) != 0:
        raise RuntimeError(f"driver call failed: {result[0]}")


def variants(numel: int) -> dict[str, Callable[[], None]]:
    from cuda.bindings import driver as cu

    device = torch.device("cuda")
    src = torch.randn(numel, device=device, dtype=torch.bfloat16)
    dst = torch.empty_like(src)
    nbytes = src.numel() * src.element_size()
    stream = torch.cuda.current_stream()
    other = torch.cuda.Stream()
    handle = cu.CUstream(stream.cuda_stream)
    event = torch.cuda.Event()
    event.record(stream)
    raw_event = cu.CUevent(event.cuda_event)
    graph = torch.cuda.CUDAGraph()
    x = torch.zeros(1, device=device)
    side = torch.cuda.Stream()
    side.wait_stream(stream)
    with torch.cuda.stream(side):
        x.add_(1)  # warm the kernel outside the capture
        with torch.cuda.graph(graph, stream=side):
            x.add_(1)
    stream.wait_stream(side)
    exec_handle = cu.CUgraphExec(graph.raw_cuda_graph_exec())
    dst_ptr, src_ptr = dst.data_ptr(), src.data_ptr()

    def switch() -> None:
        with torch.cuda.stream(other):
            pass

    return {
        "copy-torch": lambda: dst.copy_(src),
        "copy-driver": lambda: checked(cu.cuMemcpyDtoDAsync(dst_ptr, src_ptr, nbytes, handle)),
        "record-torch": lambda: event.record(stream),
        "record-driver": lambda: checked(cu.cuEventRecord(raw_event, handle)),
        "wait-torch": lambda: stream.wait_event(event),
        "wait-driver": lambda: checked(cu.cuStreamWaitEvent(handle, raw_event, 0)),
        "record_stream-torch": lambda: src.record_stream(other),
        "stream-switch-torch": switch,
        "current-stream-torch": lambda: torch.cuda.current_stream(),
        "replay-torch": graph.replay,
        "replay-driver": lambda: checked(cu.cuGraphLaunch(exec_handle, handle)),
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--numel", type=int, default=256 * 2048, help="elements of the copied bf16 tensor")
    ap.add_argument("--calls", type=int, default=200, help="back-to-back calls per timing")
    ap.add_argument("--repeats", type=int, default=5, help="timings per variant per round (median)")
    ap.add_argument("--rounds", type=int, default=5, help="interleaved rounds")
    ap.add_argument("--warmup", type=int, default=1, help="rounds run first and not kept")
    ap.add_argument("--out", type=Path, default=Path("benchmarks/results"))
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("host_calls.py needs a CUDA device", file=sys.stderr)
        return 2
    calls = variants(args.numel)
    rounds: list[dict[str, float]] = []
    for r in range(args.warmup + args.rounds):
        row = {name: per_call_us(fn, args.calls, args.repeats) for name, fn in calls.items()}
        if r >= args.warmup:
            rounds.append(row)
    summary = {}
    for name in calls:
        xs = [row[name] for row in rounds]
        summary[name] = {"median_us": statistics.median(xs), "min_us": min(xs), "max_us": max(xs)}
        print(f"{name:22s} {summary[name]['median_us']:7.2f} us  ({min(xs):.2f}-{max(xs):.2f})")
    rev = git_revision()
    device = torch.device("cuda")
    report = {
        "kind": "host-calls", "command": " ".join(sys.argv), "git_revision": rev,
        "created": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "device_name": device_name_of(device), "torch_version": torch.__version__,
        "numel": args.numel, "calls": args.calls, "repeats": args.repeats, "warmup_rounds": args.warmup,
        "rounds": rounds, "summary": summary,
    }
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / f"host-calls-{rev or 'unknown'}-{device_tag(device)}.json"
    write_json(path, report)
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
