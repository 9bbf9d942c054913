"""Where resident offload's step time goes: how long the compute stream stalls at each offload wait.

Resident offload makes no driver calls and the copies run at full PCIe speed
(benchmarks/results/copy-bandwidth-*), yet an h2048 step is 18-30 % slower than with offload off. The
compute stream waits on other streams' events at three places: a forward claiming a bank waits for the
previous owner's D2H (`d2h_done`) and the bank's last backward (`consumed`); a backward waits for its
restore (`restore_done`). This times each such wait on the device: an event before and after the
`wait_event`, so the elapsed time between them is how long the stream stood still there. Per category,
per step: the stall in ms and how many waits stalled (> 5 us).

    source .gpu-kit/setup.sh
    python3 scripts/offload_waits.py --modes resident,resident@6 --json $OUT/offload-waits.json
"""

from __future__ import annotations

import re
import sys
from collections import defaultdict
from pathlib import Path

import torch
from offload_host_profile import pipeline_args, warm_pipeline  # scripts/ is sys.path[0] when run as a script

import qeffect.offload.group as group_mod
from qeffect.cli.common import write_json
from qeffect.config import load_config
from qeffect.graphs.handshake import gpu_provenance
from qeffect.offload.streams import DriverCudaStreams, TorchCudaStreams
from qeffect.verify.state import synthetic_batches

RECORDS: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []  # (wait category, event before, event after)
NAMES: dict[int, str] = {}  # id(event) -> its category ("restore_done", "d2h_chunk", ...)


def timed_waits(base: type[TorchCudaStreams]) -> type[TorchCudaStreams]:
    """`base` whose waits on the compute (current) stream are bracketed by timing events (in RECORDS)."""

    class TimedWaits(base):
        def new_event(self, name: str, timing: bool = False) -> torch.cuda.Event:
            ev = super().new_event(name, timing)
            NAMES[id(ev)] = re.sub(r"\d+$", "", name.rsplit(".", 1)[-1])  # d2h_chunk3 -> d2h_chunk
            return ev

        def wait(self, stream: torch.cuda.Stream, event: torch.cuda.Event) -> None:
            if stream != torch.cuda.current_stream(self.device):
                super().wait(stream, event)
                return
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record(stream)
            super().wait(stream, event)
            b.record(stream)
            RECORDS.append((NAMES.get(id(event), "?"), a, b))

    return TimedWaits


def run(cfg, mode: str, warmup: int, steps: int, dev: torch.device) -> dict:
    cfg, pipe = warm_pipeline(cfg, mode, warmup, dev)
    torch.cuda.synchronize(dev)
    RECORDS.clear()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for i in range(steps):
        pipe.step(synthetic_batches(cfg, warmup + i, dev))
        pipe.manager.mark_step()
    end.record()
    torch.cuda.synchronize(dev)
    total = defaultdict(lambda: [0.0, 0, 0])  # category -> [ms, waits, waits that stalled]
    for name, a, b in RECORDS:
        ms = a.elapsed_time(b)
        row = total[name]
        row[0] += ms
        row[1] += 1
        row[2] += ms > 0.005
    if pipe.offload is not None:
        pipe.offload.close()
    del pipe
    return {"mode": mode, "step_ms": start.elapsed_time(end) / steps,
            "stalls": {k: {"ms_per_step": v[0] / steps, "waits_per_step": v[1] / steps,
                           "stalled_per_step": v[2] / steps} for k, v in sorted(total.items())}}


def main() -> int:
    ap = pipeline_args(__doc__, "off,resident,resident@6")
    ap.add_argument("--schedules", default="interleaved,zbv")
    ap.add_argument("--steps", type=int, default=10)
    a = ap.parse_args()
    # the managers built below time their compute-stream waits (either kind of stream operations)
    group_mod.TorchCudaStreams = timed_waits(TorchCudaStreams)
    group_mod.DriverCudaStreams = timed_waits(DriverCudaStreams)
    dev = torch.device("cuda", torch.cuda.current_device())
    results = []
    for schedule in a.schedules.split(","):
        cfg = load_config(a.config).with_overrides(**{"train.device": "cuda", "pipeline.schedule": schedule})
        for mode in a.modes.split(","):
            r = {"schedule": schedule, **run(cfg, mode, a.warmup, a.steps, dev)}
            results.append(r)
            stalls = ", ".join(f"{k} {v['ms_per_step']:.3f} ms ({v['stalled_per_step']:.1f} of "
                               f"{v['waits_per_step']:.1f} waits)" for k, v in r["stalls"].items())
            print(f"{schedule} {mode}: step {r['step_ms']:.2f} ms; compute stalls per step: {stalls or 'none'}",
                  flush=True)
    if a.json:
        write_json(Path(a.json), {**gpu_provenance(dev), "config": a.config, "results": results})
    return 0


if __name__ == "__main__":
    sys.exit(main())
