"""Host time of the captured runtime per step, with the device work taken away (a CPU benchmark).

A captured step's host side is the contracts, the ledger, the tape pool, the arena's checks, the hand-offs
and one graph replay per action. On the GPU the host queues a step while the device runs the previous
one, so when the host is slower than the device the step is host-bound (`qeffect profile` reports the
host/GPU ratio). This benchmark isolates the host side on a CPU: the pipeline of a config (its ranks,
stages, microbatches and parameters; the hidden sizes shrunk, since no tensor work runs) is built with the
real graph manager on a backend whose capture runs the body once and whose graphs replay nothing. The optimizer step is left out (on the GPU it is one graph replay). The step
time is then the runtime's host cost; `--phases N` times N more steps by phase (input copies, launches,
hand-offs, commit, the rest), `--profile N` prints the functions it goes to (cProfile). `--step-graph`
times steps as `runtime.step_graph` runs them from the fourth on: batch copies, one launch, the dry
bookkeeping and its check, the commit.

    python3 benchmarks/host_overhead.py --config examples/configs/h2048.toml --steps 50 --profile 25 \
        --out benchmarks/results/host-overhead-h2048-cpu.json

The numbers are this CPU's; compare variants in one run, not across machines.
"""

from __future__ import annotations

import argparse
import cProfile
import datetime as _dt
import io
import platform
import pstats
import statistics
import sys
import time
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import torch

from qeffect.cli.common import write_json
from qeffect.config import apply_sets, load_config
from qeffect.graphs.handshake import git_revision
from qeffect.graphs.manager import GraphManager
from qeffect.graphs.step_graph import RecordedStep, recording
from qeffect.profile.matrix import time_phases
from qeffect.profile.report import ConfigResult
from qeffect.runtime import single as single_mod
from qeffect.runtime.build import (
    STEP_GRAPH_AFTER,
    build_chunks_for,
    build_rank,
    capture_ranks,
    link_stages,
    schedule_of,
)
from qeffect.runtime.single import SingleProcessPipeline
from qeffect.verify.state import synthetic_batches

SHRINK = {"model.hidden": 64, "model.ffn": 128, "model.heads": 2, "model.vocab_size": 256, "model.seq_len": 16,
          "model.microbatch_size": 1}


class _Null:
    """A stream, event or graph of `NullGraphBackend`: every operation does nothing."""

    def wait_stream(self, other: Any) -> None:
        pass

    def wait_event(self, event: Any) -> None:
        pass

    def record(self, *args: Any) -> None:
        pass

    def replay(self) -> None:
        pass


class NullGraphBackend:
    """`graphs.manager.GraphBackend` on a CPU with no device work: a capture runs the body once (its outputs
    become the graph's static outputs) and a replay runs nothing. The real `GraphManager` runs on it, so
    its replay bookkeeping and input copies are part of what is timed."""

    def new_stream(self) -> _Null:
        return _Null()

    def current_stream(self) -> _Null:
        return _Null()

    def use_stream(self, stream: Any):
        return nullcontext()

    def graph_pool_handle(self) -> None:
        return None

    def new_graph(self) -> _Null:
        return _Null()

    def capture(self, graph: Any, pool: Any, stream: Any):
        return nullcontext()

    def new_external_event(self) -> _Null:
        return _Null()

    def copy_(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        dst.copy_(src)  # as the real backend: the manager copies into detached buffers

    def record_stream(self, tensor: torch.Tensor, stream: Any) -> None:
        pass

    def memory_allocated(self) -> int:
        return 0

    def memory_reserved(self) -> int:
        return 0

    def synchronize(self) -> None:
        pass

    def add_to_capture(self, graph: Any) -> None:
        pass


def null_record_step(manager: GraphManager, device: Any, batches: list, run: Any) -> RecordedStep:
    """`graphs.step_graph.record_step` on `NullGraphBackend`: the step's bookkeeping in record mode, and an
    outer graph that replays nothing (`--step-graph`)."""
    with recording(manager):
        loss = run(batches)
    return RecordedStep(_Null(), list(batches), loss, list(manager.issued))


def build(cfg, *, step_graph: bool = False) -> SingleProcessPipeline:
    """The captured-direct pipeline of `cfg` on the CPU, its graph manager on `NullGraphBackend`, the
    optimizer's update taken out (the commit's bookkeeping stays). `step_graph`: its third step recorded
    (`null_record_step`) and every later one replayed as a step graph's: the batch copies, the launch, the
    dry bookkeeping and its check, the commit."""
    mgr = GraphManager("cpu", protocol="stream-ordered", backend=NullGraphBackend())
    schedule = schedule_of(cfg)
    chunks = build_chunks_for(cfg, "cpu")
    ranks = [build_rank(cfg, schedule, r, chunks, native=False, direct=True, manager=mgr) for r in range(schedule.pp)]
    for r in ranks:  # the FP8 weight cast is the CUDA optimizer's pass
        for act in r.actions.values():
            act.weight_cast = False
        r.optimizer.step = lambda *a, **k: None  # noqa: ARG005 - the update is one graph replay on the GPU
    pipe = SingleProcessPipeline(ranks, schedule)
    pipe.manager = mgr
    link_stages(ranks)  # as `runtime.build.capture_graphs` does
    capture_ranks(ranks, pipe.order, None, cfg.model.microbatch_size, cfg.model.seq_len)
    if step_graph:
        pipe.step_graph_after = STEP_GRAPH_AFTER
    return pipe


class _Steps:
    """The pipeline and its prepared batches behind the profile's `Runner` calls that `time_phases` makes."""

    def __init__(self, pipe: SingleProcessPipeline, data: list) -> None:
        self.pipe, self._data = pipe, data

    def data(self, step: int) -> list:
        return self._data[step]

    def step(self, batches: list) -> torch.Tensor:
        return self.pipe.step(batches)


def phase_steps(pipe: SingleProcessPipeline, data: list, indices: range) -> dict[str, Any]:
    """The steps `indices` of `data` with the host's phases timed, as `qeffect profile` times them: seconds per
    step of each phase ("runtime": the rest of the step) and calls per step."""
    r = ConfigResult(name="captured-direct", description="host overhead", status="ok")
    time_phases(r, _Steps(pipe, data), pipe.time_host_phases(), indices, torch.device("cpu"), lambda _d: None)
    return {"seconds": r.host_phase_seconds, "calls_per_step": r.host_phase_calls}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default=None)
    ap.add_argument("--set", action="append", default=[], help="section.field=value (after the shrink)")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--phases", type=int, default=0,
                    help="steps after the timed ones with the host's phases timed (graphs.stats.HostPhases; 0: none)")
    ap.add_argument("--profile", type=int, default=0, help="profiled steps after the timed ones (0: none)")
    ap.add_argument("--top", type=int, default=25)
    ap.add_argument("--sort", default="tottime", help="pstats order of --profile's table (tottime, cumulative, ...)")
    ap.add_argument("--step-graph", action="store_true",
                    help="steps after the third replayed as a step graph's (runtime.step_graph): dry bookkeeping")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    cfg = load_config(a.config).with_overrides(**{**SHRINK, "train.device": "cpu", "fp8.backend": "reference"})
    cfg = apply_sets(cfg, a.set)
    saved = single_mod.record_step
    if a.step_graph:  # the library's recording needs CUDA: this one runs the bookkeeping only
        single_mod.record_step = null_record_step
    try:
        return _run(a, cfg, argv)
    finally:
        single_mod.record_step = saved


def _run(a: argparse.Namespace, cfg, argv: list[str] | None) -> int:
    torch.manual_seed(0)
    pipe = build(cfg, step_graph=a.step_graph)
    actions = 3 * cfg.pipeline.microbatches * cfg.pipeline.num_stages
    data = [synthetic_batches(cfg, i, "cpu") for i in range(a.warmup + a.steps + a.phases + a.profile)]
    times = []
    for i in range(a.warmup + a.steps):
        t = time.perf_counter()
        pipe.step(data[i])
        if i >= a.warmup:
            times.append(time.perf_counter() - t)
    med = statistics.median(times)
    print(f"{Path(a.config or 'tiny').stem}: {actions} actions per step; host {med * 1e3:.2f} ms per step "
          f"(min {min(times) * 1e3:.2f}, max {max(times) * 1e3:.2f}), {med / actions * 1e6:.1f} us per action")
    phased = range(a.warmup + a.steps, a.warmup + a.steps + a.phases)
    phases = phase_steps(pipe, data, phased) if a.phases else None
    if phases:
        print("by phase (medians per step): " + ", ".join(f"{k} {statistics.median(v) * 1e3:.3f} ms"
                                                          for k, v in phases["seconds"].items()))
    top = None
    first = a.warmup + a.steps + a.phases
    if a.profile:
        prof = cProfile.Profile()
        prof.enable()
        for i in range(first, first + a.profile):
            pipe.step(data[i])
        prof.disable()
        buf = io.StringIO()
        pstats.Stats(prof, stream=buf).sort_stats(a.sort).print_stats(a.top)
        top = buf.getvalue()
        print(top)
    if a.out:
        write_json(Path(a.out), {
            "kind": "host-overhead", "command": " ".join([Path(sys.argv[0]).name, *(argv or sys.argv[1:])]),
            "git_revision": git_revision(), "device": "cpu", "cpu": platform.processor() or platform.machine(),
            "python": platform.python_version(), "torch_version": torch.__version__,
            "created": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"), "config": cfg.model_dump(),
            "step_graph": a.step_graph, "actions_per_step": actions, "warmup": a.warmup, "step_seconds": times, "median_step_seconds": med,
            "host_phases": phases, "profile_top": top})
    return 0


if __name__ == "__main__":
    sys.exit(main())
