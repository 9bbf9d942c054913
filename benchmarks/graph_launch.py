"""What one CUDA graph launch costs the host, against the number of kernels in the graph (GPU).

A captured step is one `CUDAGraph.replay()` per action, and the host's queue time of a small step goes
mostly to them (`qeffect profile`'s host phases: "graph launches"). Whether a launch costs the host per
graph or per kernel in it decides which cut pays: fewer graphs (one graph for a dI and the dW that follows
it) or fewer kernels per graph. Three parts, one process:

1. Synthetic: graphs of N one-element kernels (`--kernels`), captured on one stream (a straight line),
   and the same with every other kernel on a second stream (a fork and a join per pair).
2. The pipeline's own graphs: `--path` of `--config`, built and warmed up as `qeffect profile` builds it;
   each graph replayed on its own.
3. Nested (`--nested G,K`): whether a step's graph launches can become one graph. G graphs of K kernels
   each (h2048's step: 48 graphs of 8-41 operations) are launched one by one, or captured into one outer
   graph launched once; the host's time per step for both, and whether both leave the same values (each
   kernel adds 1). Three ways: torch's `CUDAGraph.replay()` under the capture (torch refuses it before
   CUDA is asked), the driver's `cuGraphLaunch` (CUDA refuses a launch into a capturing stream), and each
   graph (kept with `CUDAGraph(keep_graph=True)`) added to the capture as a child-graph node after what the
   stream captured so far (`cuStreamGetCaptureInfo`, `cuGraphAddChildGraphNode`,
   `cuStreamUpdateCaptureDependencies`).

Per graph: its device operations (kernels, copies, sets) counted from a profiler trace of one replay, and
the host's time per replay: `--replays` back-to-back replays between two device synchronizations, the
median over `--repeats`. Then a least-squares line, microseconds per launch = a + b x kernels, for each
part. Replaying a pipeline graph outside its step rewrites the step's buffers and FP8 state with the same
kind of values: fine for timing, and nothing is trained afterwards.

    source .gpu-kit/setup.sh
    python3 benchmarks/graph_launch.py --out $OUT

The report is `graph-launch-<config>-<backend>-<rev>-<device>.json`.
"""

from __future__ import annotations

import argparse
import ctypes
import datetime as _dt
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from qeffect.cli.common import write_json
from qeffect.config import load_config
from qeffect.graphs.cuda_driver import CaptureInserter
from qeffect.profile.matrix import device_name_of, device_tag, git_revision, release_memory
from qeffect.runtime.build import build_single_process
from qeffect.verify.state import synthetic_batches

ROOT = Path(__file__).resolve().parent.parent


def fit_line(points: list[tuple[float, float]]) -> dict[str, float] | None:
    """Least squares `y = intercept + slope * x` over `(x, y)` points; None with fewer than two distinct x."""
    if len({x for x, _ in points}) < 2:
        return None
    slope, intercept = statistics.linear_regression([x for x, _ in points], [y for _, y in points])
    return {"intercept": intercept, "slope": slope}


def host_us_per_replay(replay: Callable[[], None], sync: Callable[[], None], replays: int, repeats: int) -> float:
    """Median over `repeats` of the host's time per call in `replays` back-to-back calls of `replay` (the
    device synchronized before and after each batch, outside the timer)."""
    per = []
    for _ in range(repeats):
        sync()
        t = time.perf_counter()
        for _ in range(replays):
            replay()
        per.append((time.perf_counter() - t) / replays * 1e6)
        sync()
    return statistics.median(per)


def device_ops(replay: Callable[[], None], sync: Callable[[], None]) -> int:
    """The device operations (kernels, memory copies and sets) of one `replay`, from a profiler trace."""
    from torch.profiler import ProfilerActivity, profile

    sync()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        replay()
        sync()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def synthetic_graph(kernels: int, fork: bool, device: torch.device,
                    out: torch.Tensor | None = None, keep_graph: bool = False) -> torch.cuda.CUDAGraph:
    """A graph of `kernels` one-element additions; `fork`: every other one on a second stream. `out`: the
    element the straight kernels add to (default: a new one). The graph keeps the tensors it writes alive
    (`graph.tensors`): a replay must not write memory handed to someone else."""
    x = torch.zeros(1, device=device) if out is None else out
    y = torch.zeros(1, device=device)
    side = torch.cuda.Stream(device)
    graph = torch.cuda.CUDAGraph(keep_graph=keep_graph)
    torch.cuda.synchronize(device)
    with torch.cuda.graph(graph):
        main = torch.cuda.current_stream(device)
        for k in range(kernels):
            if fork and k % 2:
                side.wait_stream(main)
                with torch.cuda.stream(side):
                    y.add_(1.0)
                main.wait_stream(side)
            else:
                x.add_(1.0)
    graph.tensors = (x, y)
    if keep_graph:
        graph.instantiate()
    return graph


class Driver:
    """The driver's `cuGraphLaunch` (refused under a capture) through ctypes, beside the library's way of
    adding a graph to a capture (`qeffect.graphs.cuda_driver.CaptureInserter`)."""

    def __init__(self) -> None:
        self.launch = ctypes.CDLL("libcuda.so.1").cuGraphLaunch  # (exec, stream)
        self.launch.argtypes, self.launch.restype = [ctypes.c_void_p, ctypes.c_void_p], ctypes.c_int
        self.inserter = CaptureInserter()

    @staticmethod
    def check(rc: int, call: str) -> None:
        if rc != 0:
            raise RuntimeError(f"{call} returned CUresult {rc}")


def nested_way(launch_all: Callable[[], None], x: torch.Tensor, device: torch.device, sync: Callable[[], None],
               replays: int, repeats: int) -> dict[str, Any]:
    """`launch_all` (every inner graph launched once, on the current stream) timed one by one, then captured
    into one outer graph: whether the capture is accepted, the host's microseconds per step both ways, and
    whether one step of each adds the same to `x`."""
    launch_all()  # uploaded before anything is timed
    row: dict[str, Any] = {"one_by_one_host_us": host_us_per_replay(launch_all, sync, replays, repeats)}
    outer = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    first: list[str] = []
    try:  # not `torch.cuda.graph`: a refused capture must still give the caller its stream back
        with torch.cuda.stream(stream):
            outer.capture_begin()
            try:
                launch_all()
            except RuntimeError as err:  # the launch's own error, before capture_end reports the capture broken
                first.append(str(err).splitlines()[0][:300])
                raise
            finally:
                outer.capture_end()
    except RuntimeError as err:
        row.update(supported=False, error=(first or [str(err).splitlines()[0][:300]])[0])
        sync()
        return row
    torch.cuda.current_stream(device).wait_stream(stream)
    before = x.clone()
    outer.replay()
    sync()
    after_outer = x.clone()
    launch_all()
    sync()
    row.update(supported=True, error=None,
               same_values=bool(torch.equal(after_outer - before, x - after_outer)),
               added_per_step=float((after_outer - before).sum()),
               nested_host_us=host_us_per_replay(outer.replay, sync, replays, repeats))
    return row


def nested(graphs: int, kernels: int, device: torch.device, sync: Callable[[], None], replays: int,
           repeats: int) -> dict[str, Any]:
    """`graphs` graphs of `kernels` additions each (every kernel adds 1 to one element), launched one by one
    against captured into one outer graph, three ways: torch's `replay()`, the driver's `cuGraphLaunch` on
    each graph's executable (`raw_cuda_graph_exec()`), and each graph added as a child-graph node."""
    x = torch.zeros(graphs, device=device)
    inner = [synthetic_graph(kernels, False, device, x[g : g + 1]) for g in range(graphs)]

    def torch_replays() -> None:
        for graph in inner:
            graph.replay()

    driver = Driver()
    execs = [graph.raw_cuda_graph_exec() for graph in inner]

    def driver_launches() -> None:
        stream = torch.cuda.current_stream(device).cuda_stream
        for e in execs:
            driver.check(driver.launch(e, stream), "cuGraphLaunch")

    kept = [synthetic_graph(kernels, False, device, x[g : g + 1], keep_graph=True) for g in range(graphs)]
    children = [graph.raw_cuda_graph() for graph in kept]
    kept_execs = [graph.raw_cuda_graph_exec() for graph in kept]

    def child_nodes() -> None:  # eagerly: the driver's launches; under a capture: one child node per graph
        stream = torch.cuda.current_stream(device).cuda_stream
        if torch.cuda.is_current_stream_capturing():
            for child in children:
                driver.inserter.add(stream, child)
        else:
            for e in kept_execs:
                driver.check(driver.launch(e, stream), "cuGraphLaunch")

    return {"graphs": graphs, "kernels": kernels,
            "torch_replay": nested_way(torch_replays, x, device, sync, replays, repeats),
            "driver_launch": nested_way(driver_launches, x, device, sync, replays, repeats),
            "child_nodes": nested_way(child_nodes, x, device, sync, replays, repeats)}


def measure(graph: torch.cuda.CUDAGraph, sync: Callable[[], None], replays: int, repeats: int) -> dict[str, Any]:
    graph.replay()  # uploaded before anything is timed
    return {"device_ops": device_ops(graph.replay, sync),
            "host_us_per_replay": host_us_per_replay(graph.replay, sync, replays, repeats)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=str(ROOT / "examples/configs/h2048.toml"))
    ap.add_argument("--backend", default="te")
    ap.add_argument("--path", default="captured-direct")
    ap.add_argument("--schedule", default="interleaved")
    ap.add_argument("--warmup", type=int, default=3, help="pipeline steps before its graphs are timed")
    ap.add_argument("--kernels", default="1,4,16,64,256", help="kernels per synthetic graph")
    ap.add_argument("--nested", default="48,20",
                    help="G,K: G graphs of K kernels, launched one by one against one outer graph ('' skips)")
    ap.add_argument("--replays", type=int, default=20)
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--out", default=str(ROOT / "benchmarks/results"))
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("graph_launch.py needs a CUDA device", file=sys.stderr)
        return 2
    device = torch.device("cuda", torch.cuda.current_device())

    def sync() -> None:
        torch.cuda.synchronize(device)

    synthetic = []
    for n in (int(k) for k in a.kernels.split(",")):
        for fork in (False, True):
            row = {"kernels": n, "fork": fork, **measure(synthetic_graph(n, fork, device), sync, a.replays, a.repeats)}
            synthetic.append(row)
            print(f"synthetic {n:4d} kernels{' forked' if fork else '':7s}: {row['device_ops']:4d} device ops, "
                  f"{row['host_us_per_replay']:7.1f} us per launch", flush=True)
    stem = Path(a.config).stem
    # the action graphs as the host launches them one by one (no step graph)
    cfg = load_config(a.config).with_overrides(**{"fp8.backend": a.backend, "train.device": "cuda",
                                                  "pipeline.schedule": a.schedule, "runtime.step_graph": False})
    pipe = build_single_process(cfg, native=False, device=device, path=a.path)
    for i in range(a.warmup):
        pipe.step(synthetic_batches(cfg, i, device))
    sync()
    per_step = {name: action.replays / a.warmup for name, action in pipe.manager.actions.items()}
    graphs = []
    for name, action in pipe.manager.actions.items():
        row = {"name": name, "replays_per_step": per_step[name], **measure(action.graph, sync, a.replays, a.repeats)}
        graphs.append(row)
        print(f"{name:10s}: {row['device_ops']:4d} device ops, {row['host_us_per_replay']:7.1f} us per launch",
              flush=True)
    del pipe
    release_memory(device)
    fits = {"synthetic-straight": fit_line([(r["kernels"], r["host_us_per_replay"]) for r in synthetic if not r["fork"]]),
            "synthetic-forked": fit_line([(r["kernels"], r["host_us_per_replay"]) for r in synthetic if r["fork"]]),
            "pipeline": fit_line([(r["device_ops"], r["host_us_per_replay"]) for r in graphs])}
    for k, f in fits.items():
        if f is not None:
            print(f"{k}: {f['intercept']:.1f} us + {f['slope']:.3f} us per kernel", flush=True)
    launches = sum(r["replays_per_step"] * r["host_us_per_replay"] for r in graphs)
    print(f"the step's launches, each timed on its own: {launches / 1e3:.2f} ms of host a step "
          f"({sum(per_step.values()):.0f} replays)", flush=True)
    nest = None
    if a.nested:  # last: a refused capture is the part most likely to leave the device in a poor state
        g, k = (int(v) for v in a.nested.split(","))
        nest = nested(g, k, device, sync, a.replays, a.repeats)
        for way in ("torch_replay", "driver_launch", "child_nodes"):
            r = nest[way]
            if r["supported"]:
                print(f"nested ({way}): {g} graphs of {k} kernels: {r['one_by_one_host_us']:.1f} us one by one, "
                      f"{r['nested_host_us']:.1f} us as one outer graph; same values: {r['same_values']}", flush=True)
            else:
                print(f"nested ({way}): a graph launch inside a capture was refused: {r['error']}", flush=True)
    rev = git_revision()
    out = Path(a.out) / f"graph-launch-{stem}-{a.backend}-{rev}-{device_tag(device)}.json"
    write_json(out, {
        "kind": "graph-launch", "command": " ".join([Path(sys.argv[0]).name, *(argv or sys.argv[1:])]),
        "git_revision": rev, "device": device.type, "device_name": device_name_of(device),
        "torch_version": torch.__version__, "cuda_version": torch.version.cuda,
        "created": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"), "config": cfg.model_dump(),
        "path": a.path, "schedule": a.schedule, "replays": a.replays, "repeats": a.repeats,
        "synthetic": synthetic, "graphs": graphs, "fits": fits, "nested": nest,
        "replays_per_step": sum(per_step.values()), "launch_host_ms_per_step": launches / 1e3})
    print(f"-> {out}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
