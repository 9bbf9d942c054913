"""A profiler trace summary of a configuration's step: where its time goes, GPU-bound or host-bound.

After a configuration's timed steps, `trace_runner` runs a few more steps of the same runner under
`torch.profiler` (same data generation and synchronization as the timed steps; these steps are not
part of the timings) and `summarize` reduces the raw Kineto events to a `TraceSummary`:

- each traced step runs inside a `record_function(WINDOW)` range that also covers the closing
  synchronization, so only the step's own events count: the next step's data is made outside it;
- on CUDA the device's time is the union of its kernel, memcpy and memset intervals (concurrent
  streams are not double counted); wall minus that is the time the GPU waited on the host;
- on the host, "aten op" time is the union of `aten::` op intervals, i.e. time spent inside
  top-level ATen ops; the rest of the wall is Python, framework and synchronization overhead;
- on CPU, where there is no device timeline, the per-name rows and the categories use the aten ops'
  self time (time in the op minus time in its nested aten ops), so they do not double count.

The raw Kineto events (`prof.profiler.kineto_results.events()`) are read directly, not through
`prof.events()`: the latter builds Python `FunctionEvent` trees, ~20x slower on large traces.
"""

from __future__ import annotations

import bisect
import re
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

import torch

from qeffect.profile.report import TraceRow, TraceSummary

WINDOW = "qeffect::trace_step"
TOP = 10
TOP_PER_CATEGORY = 5
NAME_CHARS = 120
GPU_BOUND_IDLE = 0.10  # a step whose GPU idles less than this fraction of the wall is GPU-bound

# Coarse buckets for device kernels (CPU: aten ops) by name, matched case-insensitively; the FIRST
# match wins, so the order matters: GEMM kernel names carry dtype tags (e4m3), so "gemm" comes before
# "fp8-cast/amax"; FP8 casts are elementwise/copy kernels templated on Float8 types, so that bucket comes
# before "copy" and "elementwise"; "vectorized_layer_norm_kernel" is a norm, not an elementwise kernel;
# torch's copies run inside "vectorized_elementwise_kernel<..., direct_copy_kernel...>", so "copy" is
# tried before "elementwise". `(?<!broad)(?<!With)cast` keeps "broadcast" and torch's dtype-converting
# loaders ("memory::LoadWithCast", "StoreWithCast": a bf16 -> fp32 add or copy) out of the cast bucket. The aten names
# in "gemm" are for CPU traces, whose ops are not kernels.
CATEGORIES: tuple[tuple[str, re.Pattern[str]], ...] = tuple((name, re.compile(rx, re.IGNORECASE)) for name, rx in (
    ("gemm", r"gemm|cutlass|sm90_xmma|nvjet|gemv|_scaled_mm|cublas|^aten::(mm|addmm|bmm|baddbmm|matmul|linear)$"),
    ("fp8-cast/amax", r"fp8|float8|amax|(?<!broad)(?<!With)cast|quantiz|e4m3|e5m2"),
    ("norm/softmax/attention", r"norm|softmax|flash|attention|fmha"),
    ("optimizer", r"adam|multi_tensor|foreach"),
    ("reduction", r"reduce"),
    ("memset", r"memset"),
    ("copy", r"memcpy|copy"),
    ("elementwise", r"elementwise|vectorized|unrolled"),
))
OTHER = "other"
CATEGORY_NAMES: tuple[str, ...] = (*(name for name, _ in CATEGORIES), OTHER)

Kind = Literal["window", "op", "kernel", "memcpy", "memset", "skip"]


@dataclass(frozen=True)
class Event:
    """One profiler event, reduced to what the summary needs (times in ns on one clock)."""

    name: str
    kind: Kind
    start: int
    end: int
    thread: int = 0


def category(name: str) -> str:
    return next((cat for cat, rx in CATEGORIES if rx.search(name)), OTHER)


def merge_intervals(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """Overlapping or touching intervals merged into disjoint ones, sorted (empty ones dropped)."""
    out: list[tuple[float, float]] = []
    for s, e in sorted(i for i in intervals if i[1] > i[0]):
        if out and s <= out[-1][1]:
            if e > out[-1][1]:
                out[-1] = (out[-1][0], e)
        else:
            out.append((s, e))
    return out


def union_length(intervals: Iterable[tuple[float, float]]) -> float:
    """Total length covered by the intervals, overlaps counted once."""
    return sum(e - s for s, e in merge_intervals(intervals))


def clip_to_windows(start: float, end: float, windows: Sequence[tuple[float, float]]) -> list[tuple[float, float]]:
    """The parts of [start, end) inside `windows` (disjoint and sorted)."""
    i = max(bisect.bisect_right([w[0] for w in windows], start) - 1, 0)
    out = []
    for ws, we in windows[i:]:
        if ws >= end:
            break
        s, e = max(start, ws), min(end, we)
        if e > s:
            out.append((s, e))
    return out


def _aten_self_times(ops: list[Event]) -> tuple[list[tuple[Event, int]], int]:
    """Self time of each aten op (minus its nested aten ops, per thread) and the count of top-level ones."""
    by_thread: dict[int, list[Event]] = defaultdict(list)
    for ev in ops:
        by_thread[ev.thread].append(ev)
    out, top_level = [], 0
    for evs in by_thread.values():
        evs.sort(key=lambda e: (e.start, -e.end))
        stack: list[list[Any]] = []  # [event, time in nested ops]
        done: list[list[Any]] = []
        for ev in evs:
            while stack and stack[-1][0].end <= ev.start:
                done.append(stack.pop())
            if stack:
                stack[-1][1] += min(ev.end, stack[-1][0].end) - ev.start
            else:
                top_level += 1
            stack.append([ev, 0])
        done.extend(stack)
        out.extend((ev, max(ev.end - ev.start - nested, 0)) for ev, nested in done)
    return out, top_level


def _rows(totals: dict[str, list[float]], steps: int, busy: float, limit: int = TOP) -> list[TraceRow]:
    top = sorted(totals.items(), key=lambda kv: (-kv[1][1], kv[0]))[:limit]  # ties by name: deterministic
    return [TraceRow(name=name[:NAME_CHARS], calls_per_step=calls / steps, seconds_per_step=ns / steps * 1e-9,
                     fraction=ns / busy if busy > 0 else 0.0) for name, (calls, ns) in top]


def summarize(events: Iterable[Event], walls: Sequence[float], *, cuda: bool) -> TraceSummary:
    """Reduce the traced steps' events to a `TraceSummary` (pure: tests feed it hand-made events)."""
    events = list(events)
    steps = len(walls)
    if steps < 1:
        raise ValueError("no traced steps")
    windows = merge_intervals((e.start, e.end) for e in events if e.kind == "window")
    if not windows:  # no step ranges recorded: take everything
        windows = [(min(e.start for e in events), max(e.end for e in events))] if events else []
    starts = [w[0] for w in windows]

    def inside(t: int) -> tuple[int, int] | None:
        i = bisect.bisect_right(starts, t) - 1
        return windows[i] if i >= 0 and t < windows[i][1] else None

    ops = []
    for e in events:
        if e.kind == "op" and e.name.startswith("aten::") and (w := inside(e.start)) is not None:
            ops.append(Event(e.name, "op", e.start, min(e.end, w[1]), e.thread))
    self_times, top_level = _aten_self_times(ops)
    cpu_op_ns = union_length((e.start, e.end) for e in ops)
    totals: dict[str, list[float]] = defaultdict(lambda: [0, 0])
    categories = dict.fromkeys(CATEGORY_NAMES, 0.0)
    wall = sum(walls) / steps
    summary: dict[str, Any] = dict(steps=steps, wall_seconds_per_step=wall, cpu_op_seconds_per_step=cpu_op_ns / steps * 1e-9,
                                   cpu_ops_per_step=top_level / steps)
    if cuda:
        device: list[tuple[Event, list[tuple[float, float]]]] = []
        for e in events:
            if e.kind in ("kernel", "memcpy", "memset") and (parts := clip_to_windows(e.start, e.end, windows)):
                device.append((e, parts))
        busy = union_length(p for _, parts in device for p in parts)
        by_kind = dict.fromkeys(("kernel", "memcpy", "memset"), 0.0)
        kernels = 0
        for e, parts in device:
            ns = sum(b - a for a, b in parts)
            by_kind[e.kind] += ns
            kernels += e.kind == "kernel"
            totals[e.name][0] += 1
            totals[e.name][1] += ns
        idle = 1.0 - busy / steps * 1e-9 / wall if wall > 0 else 0.0
        summary.update(gpu_kernel_seconds_per_step=by_kind["kernel"] / steps * 1e-9,
                       gpu_busy_seconds_per_step=busy / steps * 1e-9, gpu_idle_fraction=idle,
                       kernels_per_step=kernels / steps, memcpy_seconds_per_step=by_kind["memcpy"] / steps * 1e-9,
                       memset_seconds_per_step=by_kind["memset"] / steps * 1e-9,
                       bound="gpu" if idle < GPU_BOUND_IDLE else "host")
    else:
        busy = cpu_op_ns
        for e, ns in self_times:
            totals[e.name][0] += 1
            totals[e.name][1] += ns
    by_category: dict[str, dict[str, list[float]]] = defaultdict(dict)
    for name, (calls, ns) in totals.items():
        cat = category(name)
        categories[cat] += ns / steps * 1e-9
        by_category[cat][name] = [calls, ns]
    top_by_category = {cat: _rows(by_category[cat], steps, busy, TOP_PER_CATEGORY)
                       for cat in CATEGORY_NAMES if by_category.get(cat)}
    return TraceSummary(**summary, top_kernels=_rows(totals, steps, busy), categories=categories,
                        top_by_category=top_by_category)


def _kind(ev: Any) -> Kind:
    """Classify a Kineto event; `activity_type` where this torch has it, names otherwise."""
    name = ev.name()
    if name.startswith("["):  # "[memory]" and other bookkeeping records
        return "skip"
    activity = getattr(ev, "activity_type", lambda: None)()
    annotation = getattr(ev, "is_user_annotation", lambda: False)()
    if ev.device_type() == torch.autograd.DeviceType.CPU:
        if name == WINDOW:
            return "window"
        return "skip" if annotation or ev.is_async() else "op"
    if activity == "gpu_memcpy" or (activity is None and name.startswith("Memcpy")):
        return "memcpy"
    if activity == "gpu_memset" or (activity is None and name.startswith("Memset")):
        return "memset"
    if activity == "kernel" or (activity is None and not annotation and name != WINDOW):
        return "kernel"
    return "skip"  # GPU-side user annotations, sync records, ...


def kineto_events(prof: torch.profiler.profile) -> list[Event]:
    out = []
    for ev in prof.profiler.kineto_results.events():
        kind = _kind(ev)
        if kind != "skip":
            out.append(Event(ev.name(), kind, ev.start_ns(), ev.end_ns(), ev.start_thread_id()))
    return out


def sync_device(device: torch.device) -> None:
    """Wait for the device (a no-op on CPU): timed and traced steps start and end synchronized."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def trace_runner(runner: Any, device: torch.device, *, steps: int, first_step: int,
                 sync: Callable[[torch.device], None] = sync_device) -> TraceSummary:
    """Run `steps` more steps of `runner` (data steps `first_step`...) under the profiler and summarize them.

    `sync`: what "synchronized" means around each step, as for the timed steps (under torchrun: this
    device, then a barrier of every rank, so each rank's traced wall is the pipeline step's)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    walls = []
    with profile(activities=activities) as prof:
        for i in range(first_step, first_step + steps):
            data = runner.data(i)  # made before the step's range starts, as for the timed steps
            sync(device)
            t = time.perf_counter()
            with record_function(WINDOW):
                runner.step(data)
                sync(device)
            walls.append(time.perf_counter() - t)
    return summarize(kineto_events(prof), walls, cuda=cuda)


def _ms(seconds: float) -> str:
    ms = seconds * 1e3
    return f"{ms:.0f}" if ms >= 100 else f"{ms:.1f}" if ms >= 10 else f"{ms:.2f}" if ms >= 1 else f"{ms:.3g}"


def trace_line(t: TraceSummary, categories: int = 5) -> str:
    """One line: wall, device busy/idle (CUDA) or aten op time (CPU), and the largest categories."""
    parts = [f"wall {_ms(t.wall_seconds_per_step)} ms"]
    if t.gpu_busy_seconds_per_step is not None:
        parts.append(f"GPU busy {_ms(t.gpu_busy_seconds_per_step)} ms (idle {t.gpu_idle_fraction:.0%}, "
                     f"{t.bound}-bound)")
        parts.append(f"{t.kernels_per_step:,.0f} kernels/step")
    parts.append(f"host aten ops {_ms(t.cpu_op_seconds_per_step)} ms ({t.cpu_ops_per_step:,.0f}/step)")
    top = sorted(((v, k) for k, v in t.categories.items() if v > 0), reverse=True)[:categories]
    line = "trace: " + ", ".join(parts)
    return line + ("; top: " + ", ".join(f"{k} {_ms(v)} ms" for v, k in top) if top else "")
