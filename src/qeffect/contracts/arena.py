"""Gradient arena: preallocated, fixed-address weight-gradient destinations ("direct placement").

Captured ``dW`` graphs write matrix gradients straight into fixed views instead of returning fresh
tensors, so the arena must prove what autograd would otherwise guarantee: each destination is exactly
the view it claims to be (shape, dtype, device, stride and data_ptr), no write lands in another
view's storage, and every ``(param, microbatch)`` view is written exactly once per optimizer epoch
before the commit.

Layout: one flat zero-initialized buffer per dtype; inside it, for each parameter (in spec order) the
``M`` microbatch views follow each other, each starting at a multiple of 256 bytes from the buffer
start (CUDA allocations are themselves 512-byte aligned). Addresses never change for the life of the
arena (``abort``/``rebuild`` keep the buffers), which is what graph capture needs.

Bitwise order: with one view per microbatch the schedule may run ``dW`` in any order (non-LIFO, ZB-V),
yet :meth:`GradientArena.sum_microbatches` always sums in the fixed order ``m = 0, 1, ..., M-1``
(``acc = view(0).clone(); acc += view(1); ...``). That is the order in which a reference that
accumulates gradients microbatch by microbatch adds them, so every schedule order is bitwise equal to
the reference.

Accumulating layout (``accumulate=True``): one region per parameter; ``view(name, m)`` is that region
for every ``m``. ``dW(0)`` overwrites it and ``dW(m > 0)`` adds into it, so the region holds the sum of
the microbatch gradients so far, in the order they were written. The arena therefore requires that
order to be ``m = 0, 1, ..., M-1`` per parameter (an out-of-order write is refused before it lands):
the same bits as the fixed-order sum, with one region instead of ``M``, no sum pass, no zeroing and
no per-step gradient allocation. A schedule whose ``dW`` order is not ascending uses the default
layout. :meth:`GradientArena.overwrites` tells a ``dW`` whether to write or add.

Staged accumulation (``accumulate=True, staging=G``): adding every microbatch's gradient into the fp32
region as it comes reads and writes the whole region ``M - 1`` times, and at small microbatches (a
weight-gradient GEMM over a few hundred tokens) those passes cost more than the GEMMs. So ``dW(m)``
writes the GEMM's own output (bf16 for Transformer Engine) into staging slot ``m % G`` of its
parameter, and the ``dW`` that closes a group of ``G`` microbatches (or the last one) folds the group
into the region in one pass (:meth:`GradientArena.flush`): ``r = s0; r += s1; ...`` for the first
group, ``r += s0; r += s1; ...`` for later ones, element by element in fp32 in microbatch order -- the
same additions, so the same bits, as adding each microbatch as it comes. ``reduce`` is that pass; the
default runs it as ``copy_``/``add_``, and the runtime passes a fused kernel on the GPU.

Staging depth per parameter (``staging={name: G}``): a captured ``dW`` graph bakes in its destination, so
one graph serves several microbatches only where they write the same slot. A chunk whose graphs are
bounded by liveness (``K`` chains, `graphs.binding`) therefore stages with ``G <= K`` of its own, so that
``m % G`` follows the chain; the depth of one parameter is free of the others', and bits do not depend on it.

Gated fold (:meth:`GradientArena.flush_gated`): whether the fold that closes a group overwrites the region
(the first group), adds to it (later groups) or is skipped (the deferred last group) is the only thing
that still differs between microbatches of one slot. The fold therefore reads it at run time from a device
word (`FoldMode`) that the caller sets before the replay (:meth:`GradientArena.fold_mode`), so one graph
holds the fold of every group of its slot.

Deferred last fold (``defer_last_fold=True``, staged layout): the group that ``dW(M-1)`` closes is not
folded by a ``dW`` at all. The optimizer reads the slots anyway, so its update can fold them on the way
(:meth:`GradientArena.take_pending_fold`: 8 bytes per element less, the fp32 gradient is never written
and read back). Whoever needs the summed gradient as a tensor gets it folded first
(:meth:`GradientArena.sum_microbatches`, :meth:`GradientArena.storage_views`): the same additions in the
same order, so the same bits either way. Once a consumer took the group, the region is never completed
in that epoch, and reading a sum from it is an :class:`ArenaViolation` ("sum after take").

Lazy regions (``lazy_regions``, decided by the arena): where every parameter's depth is ``M`` the only group
is the deferred last one, so no ``dW`` folds into a region and a consumer that folds the group itself
starts the sum from slot 0 without reading one. The fp32 regions, as large as the parameters, are then
allocated only when a summed gradient is asked for as a tensor (:meth:`GradientArena.region`): until then
`take_pending_fold` hands out no region.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator

import torch

from .errors import ArenaViolation

ALIGN_BYTES = 256


class FoldMode:
    """What a gated fold does, read from a device word at run time: nothing, overwrite, or add."""

    SKIP = 0
    INIT = 1
    ADD = 2

Spec = tuple[tuple[int, ...], torch.dtype]
Reduce = Callable[[torch.Tensor, torch.Tensor, int, bool], None]
"""``reduce(region, block, count, init)``: fold slots ``block[0:count, :region.numel()]`` into ``region``
in slot order (``init``: the first slot is copied, not added)."""


GatedReduce = Callable[[torch.Tensor, torch.Tensor, int, torch.Tensor], None]
"""``reduce_gated(region, block, count, mode)``: `Reduce` with ``init`` read from the device word ``mode``
(`FoldMode`; SKIP leaves the region as it is). No host synchronization: it runs inside captured graphs."""


def sequential_reduce(region: torch.Tensor, block: torch.Tensor, count: int, init: bool) -> None:
    """The staged fold as plain tensor ops: one ``copy_``/``add_`` per slot, in slot order."""
    n = region.numel()
    for j in range(count):
        slot = block[j, :n].view(region.shape)
        if j == 0 and init:
            region.copy_(slot)
        else:
            region.add_(slot)


def gated_sequential_reduce(region: torch.Tensor, block: torch.Tensor, count: int, mode: torch.Tensor) -> None:
    """The gated fold as plain tensor ops (no host read of `mode`): the additions of `sequential_reduce`, each
    rounded to the region's dtype as ``add_`` rounds, then selected by the mode."""
    n = region.numel()
    first = block[0, :n].view(region.shape).to(region.dtype)
    acc = torch.where(mode == FoldMode.INIT, first, (region + first).to(region.dtype))
    for j in range(1, count):
        acc = (acc + block[j, :n].view(region.shape)).to(region.dtype)
    region.copy_(torch.where(mode == FoldMode.SKIP, region, acc))


def _vk(name: str, m: int) -> str:
    return f"{name}[m={m}]"


class GradientArena:
    """Fixed views ``view(name, m)`` for every matrix parameter ``name`` and microbatch slot ``m``."""

    def __init__(
        self,
        specs: dict[str, Spec],
        microbatches: int,
        device: str | torch.device = "cpu",
        name: str = "arena",
        accumulate: bool = False,
        staging: int | dict[str, int] = 0,
        staging_dtypes: dict[str, torch.dtype] | None = None,
        reduce: Reduce | None = None,
        defer_last_fold: bool = False,
        reduce_gated: GatedReduce | None = None,
    ) -> None:
        if not isinstance(microbatches, int) or isinstance(microbatches, bool) or microbatches < 1:
            raise ValueError(f"microbatches must be an int >= 1, got {microbatches!r}")
        if not specs:
            raise ValueError("GradientArena needs at least one parameter spec")
        depths = staging if isinstance(staging, dict) else {n: staging for n in specs}
        if isinstance(staging, dict):
            if set(staging) != set(specs):
                raise ValueError(f"staging names {sorted(set(staging) ^ set(specs))} not matching the specs: one "
                                 "depth per parameter")
            if any(g == 0 for g in staging.values()) and any(g != 0 for g in staging.values()):
                raise ValueError("staging depths must be all 0 or all >= 1 (one accumulating layout per arena)")
        for g in depths.values():
            if not isinstance(g, int) or isinstance(g, bool) or g < 0:
                raise ValueError(f"staging must be an int >= 0, got {g!r}")
        self.name = name
        self.accumulate = accumulate
        # per parameter: its group size G (at most M); 0 for every parameter when not staged
        self._depth: dict[str, int] = {n: min(g, microbatches) for n, g in depths.items()}
        self.staging = max(self._depth.values(), default=0)  # the deepest group (0: not staged)
        if self.staging and not accumulate:
            raise ValueError("staging needs the accumulating layout (accumulate=True)")
        self.defer_last_fold = bool(defer_last_fold and self.staging)
        self._last_folded: set[str] = set()  # names whose deferred last group is folded into the region
        self._taken: set[str] = set()  # names whose deferred last group a consumer took (the region lacks it)
        self._reduce: Reduce = reduce or sequential_reduce
        self._reduce_gated: GatedReduce = reduce_gated or gated_sequential_reduce
        self.device = torch.device(device)
        self.microbatches = microbatches
        self.specs: dict[str, Spec] = {}
        for pname, spec in specs.items():
            shape, dtype = spec
            shape = tuple(shape)
            if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 1 for d in shape):
                raise ValueError(f"arena spec {pname!r}: shape must be positive ints, got {shape!r}")
            if not isinstance(dtype, torch.dtype):
                raise ValueError(f"arena spec {pname!r}: dtype must be a torch.dtype, got {dtype!r}")
            self.specs[pname] = (shape, dtype)

        # Plan offsets per dtype, then allocate one buffer per dtype.
        offsets: dict[tuple[str, int], tuple[torch.dtype, int, int]] = {}
        sizes: dict[torch.dtype, int] = {}
        for pname, (shape, dtype) in self.specs.items():
            itemsize = dtype.itemsize
            align = max(1, ALIGN_BYTES // itemsize)
            numel = math.prod(shape)
            off = sizes.get(dtype, 0)
            for m in range(1 if accumulate else microbatches):
                off = -(-off // align) * align
                offsets[(pname, m)] = (dtype, off, numel)
                off += numel
            sizes[dtype] = off
        # Staging: per parameter G slots of one aligned stride each (a [G, stride] block), in the dtype
        # its dW GEMM writes; in their own buffers, after the regions.
        stage_dtypes = dict(staging_dtypes or {})
        unknown = sorted(set(stage_dtypes) - set(self.specs))
        if unknown:
            raise ValueError(f"staging_dtypes names unknown parameters: {unknown}")
        stage_plan: dict[str, tuple[torch.dtype, int, int]] = {}
        stage_sizes: dict[torch.dtype, int] = {}
        for pname, (shape, dtype) in self.specs.items() if self.staging else ():
            sdt = stage_dtypes.get(pname, dtype)
            align = max(1, ALIGN_BYTES // sdt.itemsize)
            stride = -(-math.prod(shape) // align) * align
            off = stage_sizes.get(sdt, 0)
            stage_plan[pname] = (sdt, off, stride)
            stage_sizes[sdt] = off + stride * self._depth[pname]
        # Lazy regions: where every parameter's only group is the deferred last one (depth M), no dW folds
        # into a region and the optimizer's pass folds the slots itself without reading one, so the fp32
        # regions (4 bytes per parameter, what native keeps as its gradient) are made only when something
        # asks for a summed gradient as a tensor (`region`: clipping's norm, verification, data parallelism).
        self.lazy_regions = self.defer_last_fold and all(g == microbatches for g in self._depth.values())
        self._region_plan = (offsets, sizes)
        self._buffers: dict[tuple[str, torch.dtype], torch.Tensor] = {}
        self._views: dict[tuple[str, int], torch.Tensor] = {}
        self._regions: dict[str, torch.Tensor] = {}
        self._blocks: dict[str, torch.Tensor] = {}
        self._ranges: list[tuple[int, int, tuple[str, int]]] = []
        if not self.lazy_regions:
            self._make_regions()
        for dt, n in stage_sizes.items():
            self._buffers[("staging", dt)] = torch.zeros(n, dtype=dt, device=self.device)
        # The buffers' own device (``"cuda"`` becomes ``cuda:0``) is what tensors are compared with.
        self.device = next(iter(self._buffers.values())).device
        for pname, (sdt, off, stride) in stage_plan.items():
            shape = self.specs[pname][0]
            numel = math.prod(shape)
            g = self._depth[pname]
            block = self._buffers[("staging", sdt)][off : off + stride * g].view(g, stride)
            self._blocks[pname] = block
            for j in range(g):
                slot = block[j, :numel].view(shape)
                start = slot.data_ptr()
                self._ranges.append((start, start + numel * slot.element_size(), (pname, j)))
            for m in range(microbatches):  # dW(m) writes slot m % G
                self._views[(pname, m)] = block[m % g, :numel].view(shape)

        self._written: set[tuple[str, int]] = set()
        self._epoch = 0
        self._usable = True
        self._finalized = False

    def _make_regions(self) -> None:
        """Allocate the regions (or per-microbatch views) and their views, zeroed, at fixed addresses."""
        offsets, sizes = self._region_plan
        kind = "region" if self.accumulate else "views"
        for dt, n in sizes.items():
            self._buffers[(kind, dt)] = torch.zeros(n, dtype=dt, device=self.device)
        for (pname, m), (dt, off, numel) in offsets.items():
            v = self._buffers[(kind, dt)][off : off + numel].view(self.specs[pname][0])
            start = v.data_ptr()
            self._ranges.append((start, start + numel * v.element_size(), (pname, m)))
            if self.accumulate:
                self._regions[pname] = v
            if not self._depth[pname]:  # a staged parameter's dW writes its staging slots
                for k in range(self.microbatches) if self.accumulate else (m,):
                    self._views[(pname, k)] = v

    # ----------------------------------------------------------------- queries
    @property
    def regions_made(self) -> bool:
        """Whether the regions exist (always, unless `lazy_regions` and nothing asked for one yet)."""
        return not self.lazy_regions or bool(self._regions)

    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def usable(self) -> bool:
        return self._usable

    @property
    def finalized(self) -> bool:
        return self._finalized

    @property
    def written(self) -> frozenset[tuple[str, int]]:
        return frozenset(self._written)

    @property
    def nbytes(self) -> int:
        """Reserved bytes (including alignment padding)."""
        return sum(b.numel() * b.element_size() for b in self._buffers.values())

    def buffers(self) -> list[torch.Tensor]:
        """The flat buffers every view, region and staging slot lives in (memory accounting)."""
        return list(self._buffers.values())

    def keys(self) -> Iterator[tuple[str, int]]:
        """All ``(name, m)`` in layout order."""
        return iter(self._views)

    def view(self, name: str, m: int) -> torch.Tensor:
        """The fixed destination of ``dW`` for parameter ``name``, microbatch slot ``m``."""
        return self._lookup(name, m, "view")

    def overwrites(self, m: int) -> bool:
        """Whether ``dW(m)`` overwrites its view (True) or adds into it (accumulating layout without
        staging, m > 0). A staged ``dW`` always overwrites its staging slot."""
        return not self.accumulate or self.staging > 0 or m == 0

    def depth(self, name: str) -> int:
        """The staging group size G of parameter ``name`` (0: not staged)."""
        if name not in self._depth:
            self._lookup(name, 0, "depth")  # raises the unknown-view error
        return self._depth[name]

    def flushes(self, m: int, name: str | None = None) -> bool:
        """Whether ``dW(m)`` closes a staging group of ``name`` and must :meth:`flush` it (staged layout
        only; with ``defer_last_fold`` the last group is left to the commit). ``name`` may be left out
        when every parameter has the same depth."""
        g = self._uniform_depth("flushes") if name is None else self.depth(name)
        last = m == self.microbatches - 1
        return g > 0 and (m % g == g - 1 or last) and not (last and self.defer_last_fold)

    def fold_count(self, m: int, name: str) -> int:
        """How many slots the fold captured into ``dW(m)``'s graph reads (0: its graph has no fold): a
        whole group where ``m`` ends one, whatever the mode at run time; the last, partial group where it
        is not deferred."""
        g = self.depth(name)
        if not g:
            return 0
        if m % g == g - 1:
            return g
        return m % g + 1 if m == self.microbatches - 1 and not self.defer_last_fold else 0

    def fold_mode(self, m: int, name: str) -> int:
        """The `FoldMode` the gated fold of ``dW(m)`` must run with: INIT for the group that starts at
        microbatch 0, ADD for later ones, SKIP where ``dW(m)`` closes no group (the deferred last one)."""
        if not self.flushes(m, name):
            return FoldMode.SKIP
        return FoldMode.INIT if m < self.depth(name) else FoldMode.ADD

    def write_signature(self, m: int, names: list[str] | None = None) -> tuple:
        """Everything about ``dW(m)``'s arena writes of ``names`` (None: every parameter) that a captured
        graph bakes in: two microbatches with equal signatures write the same memory with the same
        operations, so one captured ``dW`` graph (with the gated fold) serves both. One view per
        microbatch: ``m`` itself; accumulating: whether it overwrites; staged: per depth, the slot and the
        slots its fold reads (the mode, overwrite, add or skip, is read at run time)."""
        if not 0 <= m < self.microbatches:
            raise ValueError(f"arena '{self.name}': microbatch {m} outside 0..{self.microbatches - 1}")
        if not self.accumulate:
            return ("view", m)
        if not self.staging:
            return ("region", self.overwrites(m))
        names = list(self._depth) if names is None else names
        firsts = {self.depth(n): n for n in names}  # one parameter per depth stands for its depth
        return ("staging", *sorted((g, m % g, self.fold_count(m, n)) for g, n in firsts.items()))

    def region(self, name: str) -> torch.Tensor:
        """The accumulating region of ``name`` (the running sum of its microbatch gradients)."""
        region = self._regions.get(name)
        if region is None:
            if not self.accumulate:
                raise ValueError(f"arena '{self.name}' has one view per microbatch, no accumulating region")
            self._lookup(name, 0, "region")  # raises the unknown-view error
            self._make_regions()  # lazy regions: the first sum asked for makes them all
            region = self._regions[name]
        return region

    def flush(self, name: str, m: int) -> None:
        """Fold the staging group that ``dW(m)`` closes into ``name``'s region, in microbatch order.

        A device computation with no bookkeeping: it is captured into the ``dW(m)`` graph, so it runs at
        replay; :meth:`record_write` after the replay checks the write order."""
        self._require_usable("flush", name, m)
        if not self.flushes(m, name):
            raise ValueError(f"arena '{self.name}': dW({m}) closes no staging group of {name} (staging "
                             f"{self.depth(name)}, {self.microbatches} microbatches)")
        self._reduce(self.region(name), *self._group_upto(name, m))

    def flush_gated(self, name: str, m: int, mode: torch.Tensor) -> None:
        """The fold captured into ``dW(m)``'s graph (:meth:`fold_count` slots of ``m``'s group), its mode
        read from the device word ``mode`` when it runs: the caller sets it to :meth:`fold_mode` of the
        microbatch it replays the graph for. A device computation with no bookkeeping, like :meth:`flush`."""
        self._require_usable("flush", name, m)
        if self.lazy_regions:  # it would make the regions, perhaps inside a capture
            raise ValueError(f"arena '{self.name}': dW({m}) holds no fold of {name}: its only group is the deferred "
                             "last one (lazy regions)")
        count = self.fold_count(m, name)
        if not count:
            raise ValueError(f"arena '{self.name}': dW({m}) holds no fold of {name} (staging {self.depth(name)}, "
                             f"{self.microbatches} microbatches)")
        self._reduce_gated(self.region(name), self._blocks[name], count, mode)

    def prefix_sum(self, name: str, upto: int) -> torch.Tensor:
        """The gradients of microbatches ``0..upto`` of ``name`` summed in that order (a new tensor): what
        the reference's ``.grad`` holds after its backward of microbatch ``upto``. An accumulating arena
        must hold exactly the writes ``0..upto``; a staged one adds the slots not yet folded, in order."""
        if not self.accumulate:
            return self._ordered_sum(name, upto, "prefix_sum")
        written = sorted(k for (n, k) in self._written if n == name)
        if written != list(range(upto + 1)):
            raise ValueError(f"{name}: the accumulating arena holds the sum over microbatches {written}, "
                             f"not 0..{upto}")
        region = self.region(name)
        last = upto == self.microbatches - 1
        if last:
            self._refuse_taken(name)
        if not self.staging or self.flushes(upto, name) or (last and name in self._last_folded):
            return region.clone()
        acc = region.clone()
        self._reduce(acc, *self._group_upto(name, upto))
        return acc

    def storage_views(self, name: str) -> list[torch.Tensor]:
        """The distinct tensors holding ``name``'s summed gradients: M views, or the one accumulating region."""
        if self.accumulate:
            self._fold_last(name)
            return [self.region(name)]
        return [self._lookup(name, m, "storage_views") for m in range(self.microbatches)]

    def missing(self) -> list[tuple[str, int]]:
        """Views not written in this epoch, in layout order."""
        return [k for k in self._views if k not in self._written]

    def snapshot(self) -> tuple:
        """Hashable host-side picture: epoch, usability, writes and the fixed buffer addresses."""
        return (
            self.name,
            self._epoch,
            self._usable,
            self._finalized,
            tuple(sorted(self._written)),
            tuple((kind, str(dt), b.data_ptr()) for (kind, dt), b in self._buffers.items()),
        )

    # ---------------------------------------------------------------- checking
    def bind(self, name: str, m: int, dest: torch.Tensor) -> torch.Tensor:
        """Check that ``dest`` is exactly the fixed view for ``(name, m)``; return the view."""
        self._require_usable("bind", name, m)
        view = self._lookup(name, m, "bind")
        self._check_binding(name, m, view, dest, "bind")
        return view

    def record_write(self, name: str, m: int, dest: torch.Tensor) -> None:
        """Record that a ``dW`` wrote ``dest`` for ``(name, m)``. All checks run before any mutation."""
        self.check_write(name, m, dest, op="record_write")
        self._written.add((name, m))

    def record_checked(self, name: str, m: int) -> None:
        """Record a ``dW`` write whose destination :meth:`check_write` accepted before the write, with no
        arena call in between (a captured ``dW``: checked, replayed, recorded). The binding and order
        checks held then and nothing since could change them; a duplicate is still refused. Why: checking
        every write twice cost the host a few percent of a captured step."""
        self._require_usable("record_write", name, m)
        self._refuse_duplicate(name, m)
        self._written.add((name, m))

    def check_write(self, name: str, m: int, dest: torch.Tensor, op: str = "check_write") -> None:
        """Every check of :meth:`record_write`, without recording: call it *before* the ``dW`` writes,
        so a duplicate, aliased or misbound write is refused before it touches the buffer."""
        self._require_usable(op, name, m)
        view = self._lookup(name, m, op)
        if _binding_mismatch(view, dest) is not None:
            others = [k for k in self._overlapping(dest)
                      if (k[0] != name if self.accumulate else k != (name, m))]
            if others:
                names = ", ".join(_vk(*k) for k in others)
                raise ArenaViolation(
                    f"aliased write for arena '{self.name}' view {_vk(name, m)}: expected a write confined "
                    f"to {_vk(name, m)}, found a destination overlapping view(s) {names}",
                    relation="aliased write", key=(name, m), expected=(name, m), found=others)
            self._check_binding(name, m, view, dest, op)
        self._refuse_duplicate(name, m)
        # In order: every accepted write had its predecessor, so "m - 1 written" means m is next.
        if self.accumulate and m > 0 and (name, m - 1) not in self._written:
            done = sum((name, k) in self._written for k in range(self.microbatches))
            raise ArenaViolation(
                f"out-of-order accumulation for arena '{self.name}' view {_vk(name, m)}: expected "
                f"microbatch {done} next (an accumulating arena adds m = 0, 1, ..., M-1 in order), found {m}",
                relation="out-of-order accumulation", key=(name, m), expected=done, found=m)

    def finalize(self) -> None:
        """Require every view written exactly once in this epoch (before the optimizer commit)."""
        self._require_usable("finalize", None, None)
        missing = self.missing()
        if missing:
            names = ", ".join(_vk(*k) for k in missing)
            raise ArenaViolation(
                f"missing writes for arena '{self.name}' epoch {self._epoch}: expected all "
                f"{len(self._views)} views written, found {len(missing)} missing: {names}",
                relation="missing write", key=missing[0], expected=len(self._views),
                found=len(self._views) - len(missing))
        self._finalized = True

    def sum_microbatches(self, name: str) -> torch.Tensor:
        """Sum the microbatch gradients of ``name`` in the fixed order m = 0, 1, ..., M-1.

        ``acc = view(0).clone(); acc += view(1); acc += view(2); ...`` -- exactly the order of a
        reference that accumulates microbatch by microbatch, whatever order the schedule ran ``dW``
        in. This fixed order is what makes every schedule bitwise equal to the reference.
        """
        self._require_finalized("sum_microbatches", name, verb="sum")
        if self.accumulate:  # the region holds the sum, added in the order m = 0..M-1 (once folded)
            self._fold_last(name)
            return self.region(name)
        return self._ordered_sum(name, self.microbatches - 1, "sum_microbatches")

    def take_pending_fold(self, name: str) -> tuple[torch.Tensor | None, torch.Tensor, int, bool] | None:
        """The deferred last group of ``name`` as ``(region, block, count, init)`` for a consumer that folds
        it itself (`runtime.adamw.TritonAdamW.fold_into_step`): the sum is ``region`` (not read when
        ``init``) plus slots ``block[0:count]`` in slot order; ``region`` is None where the regions are
        lazy and not made (``init`` is then True: the group is the only one). None when nothing is
        deferred, or it is folded or taken already. The region then lacks the group for the rest of the
        epoch, so every later sum of it (:meth:`sum_microbatches`, :meth:`storage_views`, the last
        :meth:`prefix_sum`) is refused ("sum after take") rather than read short."""
        self._require_finalized("take_pending_fold", name)
        if not self.defer_last_fold or name in self._last_folded or name in self._taken:
            return None
        self._taken.add(name)
        return (self._regions.get(name), *self._group_upto(name, self.microbatches - 1))  # None: lazy, not made

    def _fold_last(self, name: str) -> None:
        """Fold the deferred last group into the region (once per epoch; a no-op without deferral)."""
        if not self.defer_last_fold or name in self._last_folded:
            return
        self._require_usable("fold", name, None)
        self._refuse_taken(name)
        last = self.microbatches - 1
        if (name, last) not in self._written:  # storage_views may come before finalize (data-parallel reduce)
            raise ArenaViolation(
                f"fold before the last write for arena '{self.name}' view {_vk(name, last)}: expected dW({last}) "
                f"written before its deferred group is folded, found writes {sorted(k for n, k in self._written if n == name)}",
                relation="fold before the last write", key=(name, last), expected="written", found="not written")
        self._last_folded.add(name)
        self._reduce(self.region(name), *self._group_upto(name, last))

    def _group_upto(self, name: str, m: int) -> tuple[torch.Tensor, int, bool]:
        """``(block, count, init)`` of ``m``'s staging group up to slot ``m``: the `Reduce` arguments after
        the region (``init``: the first group, which overwrites the region)."""
        first = m - m % self.depth(name)
        return self._blocks[name], m - first + 1, first == 0

    def _refuse_taken(self, name: str) -> None:
        """A region whose deferred group a consumer took lacks it: no sum may be read from it this epoch."""
        if name in self._taken:
            raise ArenaViolation(
                f"sum after take for arena '{self.name}' parameter {name}: expected the deferred last group in "
                f"the region, found it taken by take_pending_fold in epoch {self._epoch} (its consumer has "
                "the finished gradient)", relation="sum after take", key=name, expected="folded", found="taken")

    def _require_finalized(self, op: str, name: str, verb: str | None = None) -> None:
        """A usable, finalized epoch for `op` on `name` (the violation is "`verb` before finalize")."""
        self._require_usable(op, name, None)
        if not self._finalized:
            verb = verb or op
            raise ArenaViolation(
                f"{verb} before finalize for arena '{self.name}' parameter {name}: expected a finalized epoch "
                f"{self._epoch}, found {len(self.missing())} missing writes",
                relation=f"{verb} before finalize", key=name, expected="finalized", found="not finalized")

    # ------------------------------------------------------------- transitions
    def advance_epoch(self, zero: bool = True) -> int:
        """Start the next optimizer epoch (called by the commit barrier after a successful step).

        Clears the writes and, by default, zeroes the buffers on the device (no host sync) so that an
        accumulating kernel (TE fused wgrad accumulation) and an overwriting one both leave exactly the
        microbatch gradient in each view.
        """
        self._require_usable("advance_epoch", None, None)
        if not self._finalized:
            raise ArenaViolation(
                f"advance before finalize for arena '{self.name}': expected a finalized epoch "
                f"{self._epoch}, found {len(self.missing())} missing writes",
                relation="advance before finalize", key=None, expected="finalized", found="not finalized")
        if zero and not self.accumulate:  # an accumulating region is overwritten by dW(0) or its group
            for b in self._buffers.values():
                b.zero_()
        self._written.clear()
        self._last_folded.clear()
        self._taken.clear()
        self._finalized = False
        self._epoch += 1
        return self._epoch

    def abort(self) -> None:
        """Mark the arena unusable for this epoch (partially written); only :meth:`rebuild` recovers."""
        self._usable = False
        self._finalized = False

    def rebuild(self, epoch: int | None = None) -> None:
        """Make an aborted arena usable again: same addresses, zeroed contents, no writes.

        ``epoch`` (optional) re-synchronizes the arena epoch, e.g. with ``e_W`` after a resume.
        """
        for b in self._buffers.values():
            b.zero_()
        self._written.clear()
        self._last_folded.clear()
        self._taken.clear()
        self._finalized = False
        self._usable = True
        if epoch is not None:
            self._epoch = epoch

    # ----------------------------------------------------------------- helpers
    def _uniform_depth(self, op: str) -> int:
        depths = set(self._depth.values())
        if len(depths) > 1:
            raise ValueError(f"arena '{self.name}': {op} needs a parameter name (staging depths {sorted(depths)})")
        return depths.pop()

    def _ordered_sum(self, name: str, upto: int, op: str) -> torch.Tensor:
        """``view(0).clone(); += view(1); ...; += view(upto)``: the reference's order (per-microbatch views)."""
        acc = self._lookup(name, 0, op).clone()
        for m in range(1, upto + 1):
            acc += self._lookup(name, m, op)
        return acc

    def _refuse_duplicate(self, name: str, m: int) -> None:
        if (name, m) in self._written:
            raise ArenaViolation(
                f"duplicate write for arena '{self.name}' view {_vk(name, m)}: expected exactly one write in "
                f"epoch {self._epoch}, found a second write",
                relation="duplicate write", key=(name, m), expected=1, found=2)

    def _require_usable(self, op: str, name: str | None, m: int | None) -> None:
        if not self._usable:
            where = f" view {_vk(name, m)}" if name is not None and m is not None else ""
            raise ArenaViolation(
                f"aborted arena for arena '{self.name}'{where}: expected a usable arena for {op}, found it "
                f"aborted in epoch {self._epoch}; rebuild() it first",
                relation="aborted arena", key=(name, m) if name is not None else None,
                expected="usable", found="aborted")

    def _lookup(self, name: str, m: int, op: str) -> torch.Tensor:
        view = self._views.get((name, m))
        if view is None:
            raise ArenaViolation(
                f"unknown view for arena '{self.name}': expected one of {len(self.specs)} parameters x "
                f"{self.microbatches} microbatches, found ({name!r}, {m!r}) in {op}",
                relation="unknown view", key=(name, m), expected=sorted(self.specs), found=(name, m))
        return view

    def _check_binding(self, name: str, m: int, view: torch.Tensor, dest: object, op: str) -> None:
        diff = _binding_mismatch(view, dest)
        if diff is not None:
            prop, expected, found = diff
            raise ArenaViolation(
                f"wrong binding for arena '{self.name}' view {_vk(name, m)} in {op}: expected {prop} "
                f"{expected}, found {found}",
                relation="wrong binding", key=(name, m), expected=expected, found=found)

    def _overlapping(self, dest: object) -> list[tuple[str, int]]:
        if not isinstance(dest, torch.Tensor) or dest.device != self.device or dest.numel() == 0:
            return []
        start = dest.data_ptr()
        extent = sum((s - 1) * st for s, st in zip(dest.shape, dest.stride(), strict=True)) + 1
        end = start + extent * dest.element_size()
        return [k for lo, hi, k in self._ranges if lo < end and start < hi]


def _binding_mismatch(view: torch.Tensor, dest: object) -> tuple[str, object, object] | None:
    """First property in which ``dest`` differs from ``view`` as (property, expected, found)."""
    if dest is view:  # the usual case (a dW writes the view it was bound): every property the same, no calls
        return None
    if not isinstance(dest, torch.Tensor):
        return ("type", "torch.Tensor", type(dest).__name__)
    if tuple(dest.shape) != tuple(view.shape):
        return ("shape", tuple(view.shape), tuple(dest.shape))
    if dest.dtype != view.dtype:
        return ("dtype", view.dtype, dest.dtype)
    if dest.device != view.device:
        return ("device", view.device, dest.device)
    if dest.data_ptr() != view.data_ptr():
        return ("data_ptr", hex(view.data_ptr()), hex(dest.data_ptr()))
    if dest.stride() != view.stride():
        return ("stride", view.stride(), dest.stride())
    return None
