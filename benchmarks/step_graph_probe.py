"""One step's actions as one CUDA graph: do the bits hold, and what does it save (GPU)?

`graph_launch.py --nested` showed that graphs added to a stream capture as child-graph nodes make one outer
graph (48 synthetic graphs: 7.7 us of host for one launch instead of about 0.4 ms). This probe does the
same with the pipeline's own step, as the first experiment towards replaying a whole step with one launch:

1. Two captured-direct pipelines, A and B, from the same seed. B's action graphs are kept
   (`CUDAGraph(keep_graph=True)`), so they can become child-graph nodes.
2. Both train `--steps` steps on the same synthetic batches. At step `--record-step`, B does not launch its
   actions: its `run_actions` runs under one outer capture (on a side stream; the rank streams join it
   through their fork and join events), with each action graph's launch replaced by a child-graph node
   (`graph_launch.Driver.add_to_capture`); its input copies, hand-off events and the loss sum are captured as
   they come. B then replays the outer graph once and commits as usual. Every other step is an ordinary
   step on both.
3. Bits: each step's loss and, at the end, every parameter of A and B compared with `torch.equal`.
4. Time: the actions of one step, A's launched one by one (`run_actions`, host queue time and GPU time
   between two events) against B's outer graph replayed (its state drifts; nothing is checked after).

B's host bookkeeping runs once, while recording; the probe does not yet replay a step whose bookkeeping
runs without launches (what a step graph in the runtime needs). The optimizer step stays outside.

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
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from graph_launch import Driver

from qeffect.cli.common import write_json
from qeffect.config import load_config
from qeffect.graphs.handshake import gpu_provenance
from qeffect.graphs.manager import TorchCudaBackend
from qeffect.profile.matrix import device_tag
from qeffect.runtime.build import build_single_process
from qeffect.verify.state import synthetic_batches

ROOT = Path(__file__).resolve().parent.parent


@contextmanager
def kept_graphs() -> Iterator[None]:
    """Pipelines built inside keep each action's `cudaGraph_t` (instantiated right after its capture)."""
    new_graph, capture = TorchCudaBackend.new_graph, TorchCudaBackend.capture

    def kept_new_graph(self) -> torch.cuda.CUDAGraph:
        return torch.cuda.CUDAGraph(keep_graph=True)

    @contextmanager
    def kept_capture(self, graph, pool, stream):
        with capture(self, graph, pool, stream):
            yield
        graph.instantiate()

    TorchCudaBackend.new_graph, TorchCudaBackend.capture = kept_new_graph, kept_capture
    try:
        yield
    finally:
        TorchCudaBackend.new_graph, TorchCudaBackend.capture = new_graph, capture


@contextmanager
def launches_as_child_nodes(pipe: Any, driver: Driver, device: torch.device) -> Iterator[None]:
    """While inside, the pipeline's graph manager adds each action graph to the capture under way on the
    current stream (after its input copies) instead of launching it."""
    manager = pipe.manager

    def child_launch(action, dynamic, stream) -> None:
        if dynamic:
            manager._copy_inputs(action, dynamic, stream)
        driver.add_to_capture(torch.cuda.current_stream(device).cuda_stream, action.graph.raw_cuda_graph())

    manager._launch = child_launch
    try:
        yield
    finally:
        del manager._launch  # the class's method again


def record_actions(pipe: Any, batches: list, driver: Driver, device: torch.device
                   ) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
    """The outer graph of one step's actions (nothing runs) and its loss tensor (valid after a replay)."""
    outer = torch.cuda.CUDAGraph()
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with launches_as_child_nodes(pipe, driver, device), torch.cuda.graph(outer, stream=side):
        loss = pipe.run_actions(batches)
    torch.cuda.current_stream(device).wait_stream(side)
    return outer, loss


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
    return {"host_s": host, "gpu_s": gpu, "host_median_s": statistics.median(host),
            "gpu_median_s": statistics.median(gpu)}


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
    driver = Driver()
    pipe_a = build_single_process(cfg, native=False, device=device, path="captured-direct")
    with kept_graphs():
        pipe_b = build_single_process(cfg, native=False, device=device, path="captured-direct")
    report: dict[str, Any] = {"record_step": a.record_step, "error": None}
    losses_a, losses_b, outer, batches = [], [], None, None
    for i in range(a.steps):
        batches = synthetic_batches(cfg, i, device)
        losses_a.append(pipe_a.step(batches).clone())
        if i != a.record_step:
            losses_b.append(pipe_b.step(batches).clone())
            continue
        try:
            outer, loss = record_actions(pipe_b, batches, driver, device)
        except RuntimeError as err:  # the capture refused something: say what, and stop
            report["error"] = str(err).splitlines()[0][:400]
            print(f"recording step {i} failed: {report['error']}", flush=True)
            break
        outer.replay()
        pipe_b.commit()
        losses_b.append(loss.clone())
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
        # time: A's actions launched one by one (then its commit, untimed) against B's outer graph
        actions = []

        def a_actions() -> None:
            actions.append(pipe_a.run_actions(batches))

        one_by_one = []
        for _ in range(a.reps):
            one_by_one.append(timed(a_actions, device, 1))
            pipe_a.commit()
        as_one = timed(outer.replay, device, a.reps)
        report["one_by_one"] = {k: [r[k][0] for r in one_by_one] for k in ("host_s", "gpu_s")}
        report["as_one_graph"] = {k: as_one[k] for k in ("host_s", "gpu_s")}
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
