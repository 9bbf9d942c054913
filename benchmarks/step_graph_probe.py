"""`runtime.step_graph` on the real pipeline: do the bits hold, and what does it save (GPU)?

`graph_launch.py --nested` showed that graphs added to a stream capture as child-graph nodes make one outer
graph (48 synthetic graphs: 7.7 us of host for one launch instead of about 0.4 ms). The runtime's step graph
(`qeffect.graphs.step_graph`) records a step's actions that way and launches them once per later step after
dry bookkeeping. This probe checks it in the smallest form:

1. Two captured-direct pipelines, A and B, from the same seed; B with `runtime.step_graph`, recording at
   step `--record-step` (`SingleProcessPipeline.step_graph_after`) and replaying every step after it.
2. Both train `--steps` steps on the same synthetic batches.
3. Bits: each step's loss and, at the end, every parameter of A and B compared with `torch.equal`.
4. Time: the actions of one step, A's launched one by one (`run_actions`, host queue time and GPU time
   between two events) against B's recorded graph replayed alone (its state drifts; nothing is checked
   after).

    source .gpu-kit/setup.sh
    python3 benchmarks/step_graph_probe.py --out $OUT

The report is `step-graph-probe-<config>-<backend>-<rev>-<device>.json`.
"""

from __future__ import annotations

import argparse
import datetime as _dt
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

from qeffect.cli.common import write_json
from qeffect.config import load_config
from qeffect.graphs.handshake import gpu_provenance
from qeffect.profile.matrix import device_tag
from qeffect.runtime.build import build_single_process
from qeffect.verify.state import synthetic_batches

ROOT = Path(__file__).resolve().parent.parent


def parameters(pipe: Any) -> list[torch.Tensor]:
    pipe.settle()
    return [p.detach() for r in pipe.ranks for c in r.chunks.values() for p in c.parameters()]


def timed(fn, device: torch.device, reps: int) -> dict[str, Any]:
    """Host seconds to queue `fn` and device seconds between events around it, each rep synchronized."""
    host, gpu = [], []
    for _ in range(reps):
        torch.cuda.synchronize(device)
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record()
        t = time.perf_counter()
        fn()
        host.append(time.perf_counter() - t)
        e1.record()
        torch.cuda.synchronize(device)
        gpu.append(e0.elapsed_time(e1) / 1e3)
    return {"host_s": host, "gpu_s": gpu}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(ROOT / "examples/configs/h2048.toml"))
    ap.add_argument("--backend", default="te")
    ap.add_argument("--schedule", default="interleaved")
    ap.add_argument("--steps", type=int, default=6, help="steps of both pipelines, compared bitwise")
    ap.add_argument("--record-step", type=int, default=3, help="the step B runs as one recorded outer graph")
    ap.add_argument("--reps", type=int, default=20, help="timed repetitions of one step's actions, each way")
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results"))
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("step_graph_probe.py needs a CUDA device", file=sys.stderr)
        return 2
    if not 0 < a.record_step < a.steps:
        ap.error("--record-step must lie after the first step (warm-up and captures) and before the last")
    device = torch.device("cuda", torch.cuda.current_device())
    cfg = load_config(a.config).with_overrides(**{"fp8.backend": a.backend, "train.device": "cuda",
                                                  "pipeline.schedule": a.schedule})
    pipe_a = build_single_process(cfg.with_overrides(**{"runtime.step_graph": False}), native=False, device=device,
                                  path="captured-direct")
    pipe_b = build_single_process(cfg.with_overrides(**{"runtime.step_graph": True}), native=False, device=device,
                                  path="captured-direct")
    pipe_b.step_graph_after = a.record_step
    report: dict[str, Any] = {"record_step": a.record_step, "error": None}
    losses_a, losses_b, batches = [], [], None
    for i in range(a.steps):
        batches = synthetic_batches(cfg, i, device)
        losses_a.append(pipe_a.step(batches).clone())
        try:
            losses_b.append(pipe_b.step(batches).clone())
        except RuntimeError as err:  # the capture refused something, or a dry step differed: say what, and stop
            report["error"] = str(err).splitlines()[0][:400]
            print(f"step {i} of the step-graph pipeline failed: {report['error']}", flush=True)
            break
    torch.cuda.synchronize(device)
    if report["error"] is None:
        same_losses = [bool(torch.equal(x, y)) for x, y in zip(losses_a, losses_b, strict=True)]
        params_a, params_b = parameters(pipe_a), parameters(pipe_b)
        differing = sum(not torch.equal(x, y) for x, y in zip(params_a, params_b, strict=True))
        report.update(losses_a=[float(x) for x in losses_a], losses_b=[float(x) for x in losses_b],
                      same_losses=same_losses, parameters=len(params_a), parameters_differing=differing,
                      bitwise=all(same_losses) and differing == 0)
        print(f"losses equal per step: {same_losses}; parameters differing: {differing} of {len(params_a)} "
              f"-> {'bitwise equal' if report['bitwise'] else 'NOT bitwise equal'}", flush=True)
        # time: A's actions launched one by one (then its commit, untimed) against B's recorded graph
        one_by_one = []
        for _ in range(a.reps):
            one_by_one.append(timed(lambda: pipe_a.run_actions(batches), device, 1))
            pipe_a.commit()
        report["one_by_one"] = {k: [r[k][0] for r in one_by_one] for k in ("host_s", "gpu_s")}
        report["as_one_graph"] = timed(pipe_b.recorded.graph.replay, device, a.reps)
        for name, row in (("one_by_one", report["one_by_one"]), ("as_one_graph", report["as_one_graph"])):
            row["host_median_s"] = statistics.median(row["host_s"])
            row["gpu_median_s"] = statistics.median(row["gpu_s"])
            print(f"{name}: host {row['host_median_s'] * 1e3:.3f} ms, GPU {row['gpu_median_s'] * 1e3:.3f} ms "
                  "per step's actions (medians)", flush=True)
    head = gpu_provenance(device)
    out = Path(a.out) / (f"step-graph-probe-{Path(a.config).stem}-{a.backend}-{head['git_revision']}-"
                         f"{device_tag(device)}.json")
    created = _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds")
    write_json(out, {"kind": "step-graph-probe", **head, "cuda_version": torch.version.cuda, "created": created,
                     "config": cfg.model_dump(), "schedule": a.schedule, "steps": a.steps, "reps": a.reps, **report})
    print(f"-> {out}", flush=True)
    return 0 if report["error"] is None and report.get("bitwise") else 1


if __name__ == "__main__":
    sys.exit(main())
