"""Memory accounting of one profiled configuration: its peak split by what holds the bytes.

Why: pipeline users run out of memory first, and "captured costs 1.7x native eager" says nothing about
what to remove. The split names where a configuration's peak goes, so the next step is clear.

What is measured (CUDA, `torch.cuda` allocator counters; `time_runner` samples them):

- ``baseline``: allocated before the configuration was built (not its bytes);
- ``peak``: the allocator's peak since then (build, capture and every step), ``peak_reserved`` likewise;
- ``steady``: allocated after the timed steps, above the baseline: what the configuration keeps;
- ``transient = peak - baseline - steady``: what exists only inside a step.

The steady bytes are attributed by walking the objects that own them, each storage counted once, in
this order: ``parameters`` (every chunk's parameters), ``optimizer_state`` (the optimizers' state
tensors), ``gradients`` (the arena's regions, views and staging slots, the captured dI graphs' fixed
non-matrix gradient buffers and the token table's row accumulator, any ``.grad`` still set), ``fp8``
(the FP8 scaling state and every cached FP8 weight), then the CUDA graphs' memory pools by the blocks
in use in each pool's segments, from the allocator's snapshot, less those backing a storage already
counted (``activations`` for the F graphs, whose pools hold what the forward saves for backward;
``graph_pools`` for dI and dW, which hold the retained dW work and the outputs). Without a snapshot (a
fake backend) a pool is counted by what its captures added to the allocated bytes; that net figure
misleads where a capture frees memory allocated before it (a warm-up's tapes). The
transient bytes go to ``activations`` on a path without graphs (autograd's saved tensors), less the
gradients such a path allocates per step (native eager's ``.grad`` of every parameter, counted under
``gradients``; they exist from a stage's first backward to the commit, so at the peak of a 1F1B step),
and to ``other`` on a captured path (temporaries outside the pools: hand-off copies, the commit's).

``unattributed`` is what no object accounts for in the steady state (static graph inputs, hand-off
buffers, library workspaces). The split is accepted when the named categories sum to the measured
peak within 5% (``|unattributed| <= 5%`` of the configuration's own peak); the ratio to native eager's
peak is filled in once both ran (`add_native_ratios`).

`split_peak` is the arithmetic (CPU-tested with fakes); `count_steady` walks a pipeline.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
from pydantic import BaseModel, Field

CATEGORIES: tuple[str, ...] = ("parameters", "optimizer_state", "gradients", "activations", "graph_pools",
                               "fp8", "other")
TOLERANCE = 0.05  # the named categories must explain the peak to within this fraction


class MemorySplit(BaseModel):
    """One configuration's peak by category (bytes; see the module docstring for each)."""

    peak_allocated_bytes: int
    peak_reserved_bytes: int | None = None
    baseline_bytes: int
    steady_bytes: int
    transient_bytes: int
    categories: dict[str, int] = Field(default_factory=dict)
    graph_pools_reserved_bytes: int = 0  # the graphs' pools by the reserved bytes their captures added
    unattributed_bytes: int
    within_tolerance: bool
    ratio_to_native: float | None = None  # peak allocated over native eager's (same report)

    @property
    def own_peak_bytes(self) -> int:
        return self.peak_allocated_bytes - self.baseline_bytes

    def line(self) -> str:
        """"peak 29.4 GB = parameters 3.6 + ... (+ unattributed 0.2)" for the console."""
        gb = 1e9
        parts = " + ".join(f"{k} {v / gb:.2f}" for k, v in self.categories.items() if v)
        return (f"peak {self.own_peak_bytes / gb:.2f} GB = {parts} (unattributed {self.unattributed_bytes / gb:.2f}"
                f"{'' if self.within_tolerance else ', over 5%'})")


def split_peak(*, peak: int, baseline: int, steady: int, counted: dict[str, int], captured: bool,
               transient_grads: int = 0, peak_reserved: int | None = None, pools_reserved: int = 0) -> MemorySplit:
    """The split from the measured counters and the steady bytes `counted` by category.

    `captured`: the step's transient bytes are temporaries (`other`), not saved activations.
    `transient_grads`: gradients a path without graphs allocates per step (moved from the transient
    activations to `gradients`, at most the transient bytes)."""
    unknown = sorted(set(counted) - set(CATEGORIES))
    if unknown:
        raise ValueError(f"unknown memory categories {unknown}; expected some of {list(CATEGORIES)}")
    if peak < baseline or steady < 0 or steady > peak - baseline:
        raise ValueError(f"inconsistent counters: peak {peak}, baseline {baseline}, steady {steady}")
    cats = {c: int(counted.get(c, 0)) for c in CATEGORIES}
    transient = peak - baseline - steady
    if captured:
        cats["other"] += transient
    else:
        grads = min(max(transient_grads, 0), transient)
        cats["gradients"] += grads
        cats["activations"] += transient - grads
    unattributed = steady - sum(int(counted.get(c, 0)) for c in CATEGORIES)
    own = peak - baseline
    return MemorySplit(peak_allocated_bytes=peak, peak_reserved_bytes=peak_reserved, baseline_bytes=baseline,
                       steady_bytes=steady, transient_bytes=transient, categories=cats,
                       graph_pools_reserved_bytes=pools_reserved, unattributed_bytes=unattributed,
                       within_tolerance=abs(unattributed) <= TOLERANCE * max(own, 1))


class StorageCounter:
    """Bytes of distinct storages, by category, in the order categories are filled (first one wins)."""

    def __init__(self) -> None:
        self.seen: set[tuple[str, int]] = set()  # (device, storage address)
        self.bytes: dict[str, int] = {}

    def add(self, category: str, tensors: Iterable[Any]) -> None:
        total = self.bytes.setdefault(category, 0)
        for t in tensors:
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            storage = t.untyped_storage()
            key = (str(t.device), storage.data_ptr())
            if key in self.seen or storage.data_ptr() == 0:
                continue
            self.seen.add(key)
            total += storage.nbytes()
        self.bytes[category] = total


def _optimizer_tensors(opt: Any) -> list[torch.Tensor]:
    out = []
    for state in getattr(opt, "state", {}).values():
        out.extend(v for v in state.values() if isinstance(v, torch.Tensor))
    return out


def graph_pool_bytes(actions: Iterable[Any]) -> tuple[int, int, int]:
    """(F graphs' allocated bytes, dI and dW graphs' allocated bytes, all graphs' reserved bytes): what
    each capture added (`CapturedAction.memory_*`). Graph names end in `.F<n>`, `.dI<n>`, `.dW<n>`."""
    forward = backward = reserved = 0
    for a in actions:
        grew = a.memory_allocated_after - a.memory_allocated_before
        reserved += a.memory_reserved_after - a.memory_reserved_before
        if pool_category(a.name) == "activations":
            forward += grew
        else:
            backward += grew
    return forward, backward, reserved


def pool_category(name: str) -> str:
    """`activations` for a forward graph (names end in `.F<n>`), `graph_pools` for any other."""
    return "activations" if name.rsplit(".", 1)[-1].startswith("F") else "graph_pools"


def pool_bytes_from_segments(segments: Iterable[dict], pools: dict[tuple[int, int], str],
                             counted: set[int]) -> dict[str, int]:
    """Bytes in use in the graphs' pools by category, from an allocator snapshot (`segments`, as
    `torch.cuda.memory_snapshot()` gives them): every allocated block of a segment that a pool in `pools`
    owns, except blocks at an address in `counted` (a storage another category already holds)."""
    out: dict[str, int] = {}
    for seg in segments:
        category = pools.get(tuple(seg.get("segment_pool_id", ())))
        if category is None:
            continue
        for block in seg.get("blocks", ()):
            if block.get("state") == "active_allocated" and block.get("address") not in counted:
                out[category] = out.get(category, 0) + int(block["size"])
    return out


def graph_pools(actions: Iterable[Any]) -> dict[tuple[int, int], str]:
    """Each capture's pool and its category; a pool shared by forward and other graphs is `graph_pools`."""
    pools: dict[tuple[int, int], str] = {}
    for a in actions:
        pool = getattr(a, "pool", None)
        if not isinstance(pool, tuple):  # torch's pool handles are (int, int); a fake backend's are not
            continue
        key, category = pool, pool_category(a.name)
        pools[key] = category if pools.get(key, category) == category else "graph_pools"
    return pools


def _allocator_segments(manager: Any) -> list[dict] | None:
    """The allocator's snapshot of the manager's CUDA device; None for a backend off CUDA (a fake)."""
    device = getattr(manager.backend, "device", None)
    if not isinstance(device, torch.device) or device.type != "cuda":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    return [seg for seg in torch.cuda.memory_snapshot() if seg.get("device", index) == index]


def count_steady(ranks: Sequence[Any], manager: Any | None) -> tuple[dict[str, int], int]:
    """(steady bytes by category, graphs' reserved bytes) of a pipeline's ranks and graph manager."""
    c = StorageCounter()
    chunks = [chunk for r in ranks for chunk in getattr(r, "chunks", {}).values()]
    c.add("parameters", (p for chunk in chunks for p in chunk.parameters()))
    c.add("optimizer_state", (t for r in ranks for t in _optimizer_tensors(getattr(r, "optimizer", None))))
    grads: list[torch.Tensor] = []
    for r in ranks:
        arena = getattr(r, "arena", None)
        if arena is not None:
            grads.extend(arena.buffers())
        for act in getattr(r, "actions", {}).values():
            grads.extend(getattr(act, "_ngrad", {}).values())
            token = getattr(act, "_token_grad", None)
            if token is not None:
                grads.append(token.buffer)
    grads.extend(p.grad for chunk in chunks for p in chunk.parameters() if p.grad is not None)
    grads.extend(_main_grads(chunks))  # fused accumulation: native eager's kept gradient buffers
    c.add("gradients", grads)
    fp8: list[torch.Tensor] = []
    for chunk in chunks:
        fp8.extend(chunk.fp8_state().values())
        for lin in chunk.matrix_linears().values():  # valid or not: an invalid cache is still allocated
            fp8.extend(lin.cache_storage() if hasattr(lin, "cache_storage") else [])
    c.add("fp8", fp8)
    counted = dict(c.bytes)
    reserved = 0
    if manager is not None:
        forward, backward, reserved = graph_pool_bytes(manager.actions.values())
        segments = _allocator_segments(manager)
        pools = graph_pools(manager.actions.values())
        if segments is not None and pools:
            by_pool = pool_bytes_from_segments(segments, pools, {ptr for _, ptr in c.seen})
            forward, backward = by_pool.get("activations", 0), by_pool.get("graph_pools", 0)
        counted["activations"] = counted.get("activations", 0) + forward
        counted["graph_pools"] = counted.get("graph_pools", 0) + backward
    return counted, reserved


def _main_grads(chunks: Iterable[Any]) -> list[torch.Tensor]:
    """The `main_grad` buffers fused wgrad accumulation keeps (a split path's placeholder holds 4 bytes)."""
    return [g for chunk in chunks for p in chunk.parameters() if (g := getattr(p, "main_grad", None)) is not None]


def transient_grad_bytes(ranks: Sequence[Any], native: bool) -> int:
    """Native eager's per-step `.grad` bytes: every parameter's gradient, in the parameter's dtype, except
    the fused-accumulation weights', whose buffer is kept (`count_steady`)."""
    if not native:
        return 0
    return sum(p.numel() * p.element_size() for r in ranks for chunk in r.chunks.values() for p in chunk.parameters()
               if getattr(p, "main_grad", None) is None)


def measure_split(pipe: Any, *, peak: int, baseline: int, steady: int, peak_reserved: int | None,
                  native: bool) -> MemorySplit:
    """The split of a pipeline after its timed steps (counters from `time_runner`): every rank of a
    `SingleProcessPipeline`, or this process's rank of a `DistributedPipeline` (a split per rank)."""
    ranks = list(getattr(pipe, "ranks", None) or [pipe.rank])
    counted, pools_reserved = count_steady(ranks, pipe.manager)
    return split_peak(peak=peak, baseline=baseline, steady=steady, counted=counted,
                      captured=pipe.manager is not None, transient_grads=transient_grad_bytes(ranks, native),
                      peak_reserved=peak_reserved, pools_reserved=pools_reserved)


def add_native_ratios(results: Sequence[Any], native: str = "native-eager") -> None:
    """Each split's peak over native eager's peak (both measured in this report)."""
    ref = next((r for r in results if r.name == native and getattr(r, "memory_split", None) is not None), None)
    for r in results:
        split = getattr(r, "memory_split", None)
        if split is not None and ref is not None and ref.memory_split.peak_allocated_bytes > 0:
            split.ratio_to_native = split.peak_allocated_bytes / ref.memory_split.peak_allocated_bytes
