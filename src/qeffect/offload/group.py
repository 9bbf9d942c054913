"""Offload groups: the saved activations of one captured forward, kept at fixed VAs between F and backward.

Life of a group (one per captured forward whose saved tensors are offloaded, e.g. one (chunk,
microbatch slot) of a captured stage):

1. discovery (`discovering`): an eager warm-up runs under `discovery_hooks()`; every eligible tensor
   autograd saves is recorded (shape, stride, dtype, device). Autograd is unchanged.
2. allocation (`OffloadManager.allocate`, -> `mapped`): outside any capture, the manager lays the
   tensors out (256-byte aligned), reserves VMM slots, maps them and allocates pinned host buffers.
3. capture (`capture_hooks()`, `mapped`): while F is captured, each saved tensor is copied into its
   slot view (those under `store_batch_bytes`, `offload.store_batch_mib`, together by one multi-tensor copy;
   0: each at once) and autograd keeps the view instead, so the captured backward reads the slot's VA. The
   session checks count, order, shape/stride/dtype/device against discovery and data_ptr() == VA.
4. forward offload (`after_forward`): the compute stream records `forward_done`; the D2H stream waits
   on that event only and copies the slot to the group's pinned host buffer, then records `d2h_done`.
   release mode: (-> `release_d2h_pending`) the host does not wait: the first hook that finds
   `d2h_done` complete (an event query) unmaps and releases the slot (-> `unmapped`).
   resident mode: nothing else; the bank stays mapped (-> `resident_d2h_pending`). A group that the
   static plan keeps (`allocate(events=...)`, `offload.plan.kept_groups`: no other group claims its
   bank before its backward) only records `forward_done`, with no D2H (-> `resident_kept`).
5. backward restore (`before_backward`): release: remap at the same VA and H2D on the H2D stream (a
   group still in `release_d2h_pending`, its D2H not yet seen done by any hook, keeps its slot mapped and
   its backward reads the bytes in place: no release, map or H2D, `kept_at_backward`; with
   `offload.release_at_backward`, the host waits for that D2H, releases the slot and restores it at once);
   resident: H2D into the group's bank only if another group took the bank meanwhile
   (`resident_reload_pending`); then the compute stream waits on `restore_done` (-> `mapped`); from
   `resident_d2h_pending` or `resident_kept` nothing to do (-> `mapped`).
   Look-ahead: right after that, the next `lookahead` (`offload.lookahead`, 1 by default)
   offloaded groups in backward order are restored on the H2D stream, so their copies run while the
   current backward graph (and, deeper, the actions after it) run. With `offload.launch_first`
   (the default) the look-ahead, and the
   reaps of finished D2H copies, run in `backward_launched`, right after the backward's dI replay is
   launched, so that the host's driver calls for them do not delay that launch; `after_forward` reaps
   (once the forward is launched) and `before_forward` no longer does. Only the first may evict a live
   group from its bank. With the schedule's events, resident mode starts none that a forward would
   evict again before its backward (`offload.plan.futile_restores`): a wasted copy the forward waits for.
6. `after_backward` records `consumed` on the compute stream: the bytes are no longer needed.

Modes. `release`: each group has its own slot (or shares one: below); the device memory of a group exists only while its
activations are on the device. With `release_consumed` (`offload.reap = true`) the slot
is also released after a consumed backward ("reaped", when its `consumed` event has completed; checked
without blocking at every hook) and remapped, without H2D, before the next forward; the config's
default keeps it mapped from the backward to the next forward, which writes it anyway (half the driver
calls; the memory still comes back between every forward and its backward). Driver calls run on the
hot path, but the host does not wait for a D2H after the forward (that would keep it from running ahead
of the device and serialize every copy with the step): the slot is released at the first hook whose event
query finds the copy done; a backward that comes before that reads the bytes where they are (a host far
ahead of the device sees a short window's copy done only after it queued the backward).
With the schedule's events and `offload.share_slots` ("any" by default; "off": a slot per group), groups
whose backwards follow one another and whose forwards all come before the first of those backwards
(`offload.plan.shared_slots`; up to `offload.slot_members`, 2 by default) share one
slot, one after another in it: the slot goes once every member's D2H is done and no member's bytes are
still needed in it, and comes back (one map) at the first member's restore, which restores every member
whose bytes are on the host. A run needs `offload.share_gap` (4 by default) actions
between its last forward and its first backward, the time for the last member's D2H to finish and be seen.
A step then unmaps and maps each slot once, not each group (h2048: 12 groups in 7 slots Interleaved, 6 ZB-V).
`resident` (ping-pong): at least `num_banks` (2) slots mapped for the whole run; group i of the
backward order uses bank i % num_banks (or the bank its plan gives it: `offload.timing.search_banks`,
the default in a captured pipeline, or `offload.plan.assign_banks`), so the
bank a backward reads and the bank the look-ahead restores into always differ. No driver calls and
no host waits on the hot path. A bank is written (by a forward or a restore) only after its previous
D2H finished and its previous backward consumer finished (stream waits on `bank.last_d2h_by`'s D2H and
`bank.last_consumed`). Host buffers stay per group. With the schedule's events (`allocate(events=)`,
`skip_kept_d2h`), a group whose bank the plan leaves alone from its forward to its backward is not
copied to the host at all (`resident_kept`); a claim that would evict such a group raises
`OffloadStateError` (the run deviates from the plan: its bytes exist nowhere else). Its bank's next
writer still waits on its `consumed` (`bank.last_consumed`); it leaves no D2H to wait for.
Resident copies go in chunks of `copy_chunk_bytes` (`offload.copy_chunk_mib`, 2 MiB by default; 0:
one copy per group), each D2H chunk recording its own event: a restore into a bank whose previous owner's
D2H is still running waits, chunk by chunk, only for the D2H chunk covering the bytes it overwrites, so
the two copies overlap instead of running one after the other (the forward that evicts a group often
runs one or two actions before that group's backward). A forward still waits for the whole D2H.
With the schedule's events and `min_window` > 0 (`offload.min_window`), neither mode offloads a
group whose backward comes within fewer than `min_window` other actions of its forward
(`offload.plan.short_window_groups`: with 2 the last virtual stage's groups; the config's default, 12,
also leaves the third stage's short ones). In release mode its D2H could hardly finish before the backward,
so little memory would come back for the copies and driver calls; in resident mode the plan would mostly
keep it in its bank anyway, so it would add bank memory and slot copies inside its forward graph. Such a
group gets no slot and no bank: its saved tensors stay where autograd puts them (the graph's memory pool),
as with `off`, and its hooks only check the call order (`offloaded` False; the manager's `not_offloaded`).
`off`: hooks only check the call order.

Resident states of a group in one step (F: before/after_forward, B: before_backward):

    mapped --F--> resident_d2h_pending --(another group claims the bank)--> resident_reload_pending
    mapped --F--> resident_kept (planned: no claim before B; a claim raises)
    resident_d2h_pending | resident_kept --B--> mapped (no H2D: reloads_skipped)
    resident_reload_pending --B or look-ahead (H2D)--> mapped

States are explicit (`GroupState`); every hook checks the state and raises `OffloadStateError`
naming the group, the hook and what was expected. Empty groups (nothing eligible) do no copies.

Streams, events and copies go through `StreamOps`, driver calls through `VmmDriver`, so the whole
state machine and its ordering run on CPU against `qeffect.offload.fake.FakeDevice`.

The manager takes its knobs from one `OffloadConfig` (the run config's `[offload]` section). In a
captured pipeline (`graphs/captured.py`, `runtime/build.capture_ranks`) there is one group per
(chunk, microbatch slot): discovery is an eager F of the slot, the backward window runs from `dI`
(`before_backward`) to `dW` (`after_backward`: the retained dW work references saved tensors), and
`offload.planning.plan` allocates the groups at capture: resident banks come from the search over the
schedule's order (`offload.timing.search_banks`, `offload.bank_plan = "search"`), the colouring
(`offload.plan.assign_banks`, `"colour"`) or, for experiments, `offload.explicit_banks`. The CPU tests run
this module against the fake device; `qeffect offload-check` and tests/test_offload_gpu.py on a GPU.
"""

from __future__ import annotations

import contextlib
import time
import weakref
from collections.abc import Callable, Collection, Iterator, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Literal

import torch
from torch import Tensor

from qeffect.config import OffloadConfig
from qeffect.fp8.te_compat import foreach_copy_
from qeffect.offload.driver import VmmDriver
from qeffect.offload.plan import backward_order as plan_backward_order
from qeffect.offload.plan import (
    check_events,
    futile_restores,
    kept_groups,
    shared_slots,
    short_window_groups,
)
from qeffect.offload.streams import DriverCudaStreams, StreamOps, TorchCudaStreams
from qeffect.offload.vmm import VmmSlot, span_bytes

OffloadMode = Literal["off", "release", "resident"]
MODES: tuple[str, ...] = ("off", "release", "resident")
ALIGNMENT = 256  # what cudaMalloc guarantees; vectorized kernels may rely on it
MIB = 1 << 20
# The defaults of the sizes the manager takes from its config live in qeffect.config, next to their fields:
# resident copies in chunks of DEFAULT_COPY_CHUNK_MIB (2 MiB: h2048's 18 MiB groups as 9 copies) ran faster
# than one copy per group and than 4 MiB chunks; a shared release slot
# needs DEFAULT_SHARE_GAP (4) actions between its last forward and its first backward, else its last D2H is
# rarely seen done before that backward and the slot is not released that step.
#
# A captured forward copies its saved tensors smaller than `store_batch_bytes` (DEFAULT_STORE_BATCH_MIB) into
# the slot together, one multi-tensor kernel per batch instead of one copy node each (h2048: about 22 tensors
# per group, many of a few KiB, each a copy node of about 1 us); larger ones are copied at once, since a
# multi-tensor kernel gives one block to each 64 Ki elements, too few for MiB-sized tensors (batching every
# tensor was slower; the small ones alone faster). A batch
# is copied at the group's last saved tensor, or once it holds STORE_BATCH_FLUSH times the threshold: the
# originals stay alive until then, so each forward graph's private pool may hold that much more.
STORE_BATCH_FLUSH = 8
_WORD_DTYPES = ((8, torch.int64), (4, torch.int32), (2, torch.int16), (1, torch.uint8))


class GroupState(StrEnum):
    DISCOVERING = "discovering"  # recording saved-tensor descriptors; no memory yet
    MAPPED = "mapped"  # the group's slot (or bank) is mapped; its bytes are there, or it holds nothing
    UNMAPPED = "unmapped"  # release mode: no physical memory; live bytes (if any) are on the host
    RELEASE_D2H_PENDING = "release_d2h_pending"  # release: D2H enqueued; unmapped once a query finds it done
    RESIDENT_D2H_PENDING = "resident_d2h_pending"  # resident: D2H enqueued; the bank still holds the bytes
    RESIDENT_RELOAD_PENDING = "resident_reload_pending"  # resident: another group took the bank; bytes on host
    RESIDENT_KEPT = "resident_kept"  # resident: no D2H (the plan leaves the bank alone until B); bytes only in the bank
    CLOSED = "closed"  # terminal: the manager was closed


class OffloadStateError(RuntimeError):
    """A hook was called in a state that does not allow it (a protocol violation, not a CUDA error)."""


def _dense(shape: Sequence[int], stride: Sequence[int]) -> bool:
    """Non-overlapping and dense: some permutation of the dims is contiguous (no gaps, no aliasing)."""
    expected = 1
    for st, n in sorted((int(s), int(n)) for n, s in zip(shape, stride, strict=True) if int(n) != 1):
        if st != expected:
            return False
        expected *= n
    return True


def default_eligible(t: Tensor) -> bool:
    """Plain, dense, non-empty tensors that are not leaves requiring grad (nor views of them).

    Parameters and static graph inputs are persistent anyway, and tensor subclasses (FP8 tensors)
    cannot be copied into a plain view: those stay where autograd keeps them.
    """
    if type(t) is not torch.Tensor or t.numel() == 0:
        return False
    base = t._base if t._base is not None else t
    if base.is_leaf and base.requires_grad:
        return False
    return _dense(t.shape, t.stride())


@dataclass(frozen=True)
class TensorSpec:
    """What discovery recorded for one saved tensor; capture must see the same."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device

    @classmethod
    def of(cls, t: Tensor) -> TensorSpec:
        return cls(tuple(t.shape), tuple(t.stride()), t.dtype, t.device)

    @property
    def nbytes(self) -> int:
        return span_bytes(self.shape, self.stride, self.dtype.itemsize)

    def mismatch(self, t: Tensor) -> str | None:
        got = TensorSpec.of(t)
        for f in ("shape", "stride", "dtype", "device"):
            if getattr(got, f) != getattr(self, f):
                return f"{f} {getattr(got, f)} != discovered {getattr(self, f)}"
        return None


@dataclass
class RestoreRecord:
    """One H2D restore (kept only with `timing=True`): events on the H2D stream around the copy."""

    group: str
    prefetched_under: str | None  # the group whose backward this restore ran under (look-ahead), if any
    start: Any
    end: Any


@dataclass
class OffloadStats:
    d2h_copies: int = 0
    d2h_bytes: int = 0
    d2h_skipped: int = 0  # resident: forwards of kept groups, not copied to the host (`offload.plan.kept_groups`)
    h2d_copies: int = 0
    h2d_bytes: int = 0
    maps: int = 0  # physical mappings created on the hot path (not counting allocate)
    # the most device bytes mapped by slots and banks at once, as the host saw it after each mapping: memory the
    # caching allocator does not count (CUDA VMM)
    peak_mapped_bytes: int = 0
    unmaps: int = 0
    released_live: int = 0  # release mode: slots released between forward and backward once a query found the D2H done
    # release mode, `release_at_backward`: slots whose backward came first, released by its wait, then restored
    released_at_backward: int = 0
    # release mode: backwards that came before any hook saw their D2H done; the slot stayed mapped, read in place
    kept_at_backward: int = 0
    reaped: int = 0  # release mode: consumed slots released
    prefetches: int = 0  # restores started by look-ahead
    prefetches_wasted: int = 0  # resident: a prefetched restore evicted before its backward
    prefetches_skipped: int = 0  # resident: the target bank was being read by a running backward
    prefetches_futile: int = 0  # resident, with the plan's events: a forward would evict it before its backward
    # resident: the bank still held the group's bytes at its backward; release: the slot did (`kept_at_backward`)
    reloads_skipped: int = 0
    evictions: int = 0  # resident: a group's bytes left its bank (they are on the host)
    # release: host time the main thread spent blocked on offload (the event synchronizations before each unmap:
    # events a query found done, unless `reap(block=True)` or, with `release_at_backward`, a backward waits for
    # its D2H to release the slot): where the host lost its lead over the device
    host_wait_seconds: float = 0.0
    restores: list[RestoreRecord] = field(default_factory=list)


@dataclass
class Bank:
    """Resident mode: one of `num_banks` slots mapped for the whole run, shared by every group assigned to it."""

    index: int
    slot: VmmSlot
    owner: OffloadGroup | None = None  # the group whose bytes (or forward) the bank holds now
    # the group whose D2H out of this bank was the last (a writer must wait on its `d2h_done`; a chunked
    # restore, per chunk of its own, only on the D2H chunk events covering the bytes it overwrites)
    last_d2h_by: OffloadGroup | None = None
    last_consumed: Any = None  # event: the last backward that read this bank (a writer must wait on it)


class OffloadGroup:
    """The saved activations of one captured forward. Create with `OffloadManager.group(name)`."""

    def __init__(self, manager: OffloadManager, name: str, index: int) -> None:
        self.manager, self.name, self.index = manager, name, index
        self.state = GroupState.DISCOVERING
        self.specs: list[TensorSpec] = []
        self.offsets: list[int] = []
        self.nbytes = 0
        self.slot: VmmSlot | None = None  # release: its own (or its run's, `members`); resident: its bank's
        self.base = 0  # where its bytes start in its slot (release: after the members before it in a shared slot)
        # release: the groups sharing its slot (`OffloadManager.share_slots`), in backward order; itself alone
        self.members: list[OffloadGroup] = [self]
        self.bank: Bank | None = None
        self.host: Tensor | None = None
        self.slot_bytes: Tensor | None = None  # uint8 view of [base, base + nbytes) of the slot (one copy per direction)
        self.next_backward: OffloadGroup | None = None
        self.kept = False  # resident: the plan says no other group claims its bank between F and B (no D2H)
        self.offloaded = True  # False where the plan's window is too short (no slot; autograd keeps it)
        self.live = False  # holds a forward's activations that its backward has not consumed yet
        self.phase: Literal["forward", "backward"] | None = None
        self._views: list[Tensor] = []
        self.forward_done: Any = None
        self.d2h_done: Any = None
        self.chunks: list[tuple[int, int]] = []  # resident: [start, end) byte ranges of its copies (`copy_chunk_bytes`)
        self.d2h_chunk_done: list[Any] = []  # resident: one event per D2H chunk; the last one is `d2h_done`
        self.chunk_views: list[tuple[Tensor, Tensor]] = []  # (slot bytes, host bytes) per chunk, sliced once
        self.restore_done: Any = None
        self.consumed: Any = None
        self._consumed_recorded = False
        self._d2h_recorded = False  # a D2H out of the slot was enqueued (writers of the slot wait on d2h_done)
        self._restore_pending = False  # restore enqueued; the compute stream has not waited on it yet

    # ----------------------------------------------------------------------------------- discovery
    def discover(self, t: Tensor) -> int | None:
        """Record `t` as the next saved tensor if eligible; returns its index (None if not eligible)."""
        if self.state is not GroupState.DISCOVERING:
            raise OffloadStateError(f"group {self.name!r}: discover() after allocate() (state {self.state})")
        if not self.manager._eligible(t):
            return None
        self.specs.append(TensorSpec.of(t))
        return len(self.specs) - 1

    def adopt_specs(self, specs: Sequence[TensorSpec]) -> None:
        """Take another group's discovered specs (microbatch slots of one chunk save the same tensors)."""
        if self.state is not GroupState.DISCOVERING:
            raise OffloadStateError(f"group {self.name!r}: adopt_specs() after allocate() (state {self.state})")
        self.specs = list(specs)

    @contextlib.contextmanager
    def discovery_hooks(self) -> Iterator[OffloadGroup]:
        """Record the tensors autograd saves in this block (an eager warm-up of the forward)."""
        if self.state is not GroupState.DISCOVERING:
            raise OffloadStateError(f"group {self.name!r}: discovery_hooks() after allocate() (state {self.state})")
        seen = _SavedOnce()  # the same rule as capture_hooks, so both count the same tensors

        def pack(t: Tensor) -> Tensor:
            if self.manager._eligible(t) and seen.get(t) is None:
                seen.add(t, True)
                self.discover(t)
            return _unlinked(t)

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield self

    # ------------------------------------------------------------------------------------- capture
    @property
    def views(self) -> list[Tensor]:
        """The slot views, one per discovered tensor, in discovery order (fixed addresses)."""
        self._allocated("views")
        return list(self._views)

    @property
    def va(self) -> int | None:
        """Address of the group's first byte (its slot's or bank's VA); None for an empty or 'off' group."""
        return self.slot.va + self.base if self.slot is not None else None

    def store(self, i: int, t: Tensor) -> Tensor:
        """Copy `t` into slot view `i` (on the current stream: captured when inside a capture)."""
        view = self._checked_view(i, t)
        with torch.no_grad():
            view.copy_(t)
        return view

    def byte_copy(self, i: int, t: Tensor) -> tuple[Tensor, Tensor]:
        """(slot bytes of view `i`, `t`'s bytes) as words of the widest size both addresses and the length
        allow. Saved tensors are dense (`default_eligible`) and their views have the same strides, so the
        span from `t.data_ptr()` holds exactly the view's bytes. The source is a new tensor over `t`'s
        storage: it keeps the memory, not `t` itself, alive (`_SavedOnce` keys on `t`'s life)."""
        self._checked_view(i, t)
        n = self.specs[i].nbytes
        src = torch.empty(0, dtype=torch.uint8, device=t.device).set_(
            t.untyped_storage(), t.storage_offset() * t.element_size(), (n,), (1,))
        dst = self.slot_bytes[self.offsets[i]:self.offsets[i] + n]
        w, dtype = next((w, d) for w, d in _WORD_DTYPES
                        if n % w == 0 and src.data_ptr() % w == 0 and dst.data_ptr() % w == 0)
        return (dst.view(dtype), src.view(dtype)) if w > 1 else (dst, src)

    @staticmethod
    def store_batch(copies: Sequence[tuple[Tensor, Tensor]]) -> None:
        """Run `byte_copy` pairs with one multi-tensor copy per word size, not one copy per tensor."""
        by_word: dict[torch.dtype, tuple[list[Tensor], list[Tensor]]] = {}
        for dst, src in copies:
            dsts, srcs = by_word.setdefault(dst.dtype, ([], []))
            dsts.append(dst)
            srcs.append(src)
        with torch.no_grad():
            for dsts, srcs in by_word.values():
                foreach_copy_(dsts, srcs)

    def _checked_view(self, i: int, t: Tensor) -> Tensor:
        self._allocated("store")
        reason = self.specs[i].mismatch(t)
        if reason:
            raise OffloadStateError(f"group {self.name!r}: saved tensor #{i} differs from discovery: {reason}")
        return self._views[i]

    @contextlib.contextmanager
    def capture_hooks(self) -> Iterator[OffloadGroup]:
        """While F is captured: each eligible saved tensor goes into its slot view; autograd keeps the view.

        The captured backward then reads the slot's VA. Must see exactly the discovered tensors, in
        order. In `off` mode (and for an empty or not offloaded group) autograd is left alone. Saved tensors
        smaller than `OffloadManager.store_batch_bytes` are copied together (`store_batch`), at the group's
        last saved tensor at the latest, so all are in before the forward ends; a saved tensor is not modified
        after it is saved (autograd would refuse the backward), so the later copy reads the same bytes.
        """
        self._allocated("capture_hooks")
        if self.live or self.phase == "backward":
            raise OffloadStateError(f"group {self.name!r}: capture_hooks() while its activations are live")
        lazy = self._maps_at_forward
        if self.state is not (GroupState.UNMAPPED if lazy else GroupState.MAPPED):
            raise OffloadStateError(f"group {self.name!r}: capture_hooks() needs a "
                                    f"{'released' if lazy else 'mapped'} slot (state {self.state})")
        with self.mapped_for_capture(), self.slot_stores():
            yield self

    @contextlib.contextmanager
    def mapped_for_capture(self) -> Iterator[None]:
        """Around each capture that writes or reads the group's slot (its forward's, its backward's):
        with `offload.map_slots = "forward"` the slot is mapped for it and released after (nothing
        captured runs, so the unmap waits for no copy; a replay maps it again at its forward). Mapped
        because some kernels check their pointers when launched, under a capture too (Triton's). Nothing
        where the slot is mapped already (another member of a shared slot mapped it), or mapped at build."""
        if not self._maps_at_forward or self.slot.mapped:
            yield
            return
        self.slot.map()
        self.manager.note_mapped()
        try:
            yield
        finally:
            if self.slot.mapped:
                self.slot.unmap()

    @contextlib.contextmanager
    def slot_stores(self) -> Iterator[OffloadGroup]:
        """The saved-tensor hooks of `capture_hooks`, without its checks or mapping: each saved tensor copied
        into its slot view, which autograd keeps (what the captured forward's graph does at every replay; a
        fake replay on a CPU runs them). Nothing in `off` mode or for an empty or not offloaded group."""
        if self.manager.mode == "off" or not self.specs or not self.offloaded:
            yield self
            return
        seen = _SavedOnce()  # holds no original: once copied, its memory goes back to the graph's pool
        count = 0
        batch = self.manager.store_batch_bytes
        pending: list[tuple[Tensor, Tensor]] = []  # `byte_copy`s of saved tensors not copied yet
        pending_bytes = 0

        def pack(t: Tensor) -> Tensor:
            nonlocal count, pending_bytes
            if not self.manager._eligible(t):
                return _unlinked(t)
            view = seen.get(t)
            if view is not None:
                return view
            if count >= len(self.specs):
                raise OffloadStateError(f"group {self.name!r}: capture saved more tensors than discovery "
                                        f"({len(self.specs)})")
            n = self.specs[count].nbytes
            if n < batch and _dense(t.shape, t.stride()):  # (a custom `eligible` may pass others: copied at once)
                view = self._views[count]
                pending.append(self.byte_copy(count, t))
                pending_bytes += n
            else:
                view = self.store(count, t)
            if pending and (pending_bytes >= STORE_BATCH_FLUSH * batch or count + 1 == len(self.specs)):
                self.store_batch(pending)
                pending.clear()
                pending_bytes = 0
            seen.add(t, view)
            count += 1
            return view

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            yield self
        if count != len(self.specs):
            raise OffloadStateError(f"group {self.name!r}: capture saved {count} tensors, discovery {len(self.specs)}")
        for i, v in enumerate(self._views):
            if v.data_ptr() != self.va + self.offsets[i]:
                raise OffloadStateError(f"group {self.name!r}: view #{i} moved off its VA")

    # ------------------------------------------------------------------------------------- hot path
    def before_forward(self) -> None:
        """Before the forward replay: make the slot writable (release: remap if reaped; resident:
        claim the bank, the compute stream waiting on its previous D2H and backward consumer)."""
        self._expect("before_forward", phase=None, live=False)
        m = self.manager
        if self._inactive():
            self.phase = "forward"
            return
        if not m.launch_first:  # else `after_forward` reaps, once this forward is launched
            m._maybe_reap(exclude=self)
        cur = m.streams.current_stream()
        if m.mode == "release":
            if self.state is GroupState.RELEASE_D2H_PENDING:  # a discarded group whose slot was not released:
                m._d2h_fifo.remove(self)  # it stays mapped and leaves the reap queue, whose front it would block
                self.state = GroupState.MAPPED
            if not self.slot.mapped:
                self.slot.map()  # a fresh mapping: the forward writes every view before anything reads it
                m.stats.maps += 1
                m.note_mapped()
            elif self.state is not GroupState.UNMAPPED and self._consumed_recorded:
                # still mapped: the last backward's reads come before these writes (a D2H still reading the
                # slot may copy torn bytes, but only into this group's host buffer, which this forward's own
                # D2H, later on the same stream, overwrites before any restore). UNMAPPED in a mapped shared
                # slot: another member mapped it afresh since this group's bytes left; nothing reads them
                m.streams.wait(cur, self.consumed)
            self.state = GroupState.MAPPED
        else:
            m._claim(self.bank, self, cur)
            self.state = GroupState.MAPPED
        self.phase = "forward"

    def after_forward(self) -> None:
        """After the forward replay: D2H on the D2H stream (waiting on forward_done only); release: unmap.
        Resident, kept by the plan: no D2H (its bank holds the bytes until its backward)."""
        self._expect("after_forward", phase="forward")
        m = self.manager
        self.phase, self.live = None, True
        if self._inactive():
            return
        s = m.streams
        s.record(self.forward_done, s.current_stream())
        if self.kept:
            self.state = GroupState.RESIDENT_KEPT
            m.stats.d2h_skipped += 1
            return
        s.wait(m.d2h_stream, self.forward_done)
        for (slot, host), done in zip(self.chunk_views, self.d2h_chunk_done, strict=True):
            s.copy(host, slot, m.d2h_stream)  # one chunk (the last event: `d2h_done`) unless resident chunks
            s.record(done, m.d2h_stream)
        self._d2h_recorded = True
        m.stats.d2h_copies += 1
        m.stats.d2h_bytes += self.nbytes
        if m.mode == "release":
            # No host wait: a later hook's `reap` releases the slot once a query finds this copy done.
            self.state = GroupState.RELEASE_D2H_PENDING
            m._d2h_fifo.append(self)
            m._maybe_reap(exclude=self)
        else:
            self.bank.last_d2h_by = self
            self.state = GroupState.RESIDENT_D2H_PENDING

    def prefetch(self) -> bool:
        """Start this group's restore on the H2D stream now, if it needs one. True if one was started."""
        self._allocated("prefetch")
        return self.manager._prefetch(self, under=None)

    def before_backward(self) -> None:
        """Before the backward replay: restore if needed, make the compute stream wait on it, then
        start the look-ahead restore of the next group in backward order."""
        self._expect("before_backward", phase=None, live=True)
        m = self.manager
        if self._inactive():
            self.phase = "backward"
            if m.mode != "off" and not m.launch_first:
                m._prefetch_ahead(self)  # its backward still hides the next restores
            return
        if not m.launch_first:
            m._maybe_reap(exclude=self)
        if self.state is GroupState.RELEASE_D2H_PENDING and m.release_at_backward:  # no hook found its D2H done
            m._release(self, block=True, at_backward=True)  # yet: release it now, unless a shared member can't go
        if self.state in (GroupState.UNMAPPED, GroupState.RESIDENT_RELOAD_PENDING):
            m._restore(self, under=None)
        elif self.state in (GroupState.RESIDENT_D2H_PENDING, GroupState.RESIDENT_KEPT, GroupState.RELEASE_D2H_PENDING):
            if self.state is GroupState.RELEASE_D2H_PENDING:  # its D2H not seen done (or a shared member's)
                m._d2h_fifo.remove(self)
                m.stats.kept_at_backward += 1
            self.state = GroupState.MAPPED  # nobody took the bank (or slot): the forward's bytes are still there
            m.stats.reloads_skipped += 1
        elif not (self.state is GroupState.MAPPED and self._restore_pending):
            raise OffloadStateError(f"group {self.name!r}: before_backward in state {self.state} with no restore")
        if self._restore_pending:
            m.streams.wait(m.streams.current_stream(), self.restore_done)
            self._restore_pending = False
        self.phase = "backward"
        if not m.launch_first:
            m._prefetch_ahead(self)

    def backward_launched(self) -> None:
        """Right after the backward's first replay (dI) is launched: with the manager's `launch_first`, the
        work that replay does not wait for, released finished D2H slots and the look-ahead restores, runs
        now, while the device runs it, instead of before its launch. Without, nothing (`before_backward`
        did it)."""
        self._expect("backward_launched", phase="backward")
        m = self.manager
        if m.mode == "off" or not m.launch_first:
            return
        if not self._inactive():
            m._maybe_reap(exclude=self)
        m._prefetch_ahead(self)

    def after_backward(self) -> None:
        """After the LAST replay that reads this group's saved tensors (dI, or dW if it reads them too)."""
        self._expect("after_backward", phase="backward")
        m = self.manager
        self.phase, self.live = None, False
        if self._inactive():
            return
        m.streams.record(self.consumed, m.streams.current_stream())
        self._consumed_recorded = True
        if m.mode == "resident":
            self.bank.last_consumed = self.consumed

    def abandon(self) -> None:
        """Forget the activations of an aborted step: a forward or backward whose replay failed between
        its hooks, or live activations whose tape was aborted. A failed backward still records
        `consumed`, so the next writer of the slot waits for anything its replay had queued."""
        self._allocated("abandon")
        if self.phase == "backward":
            self.after_backward()
        elif self.phase == "forward":
            self.phase = None  # nothing was copied out; the next forward rewrites the slot
        self.discard()

    def discard(self) -> None:
        """Drop live activations without a backward (an aborted tape). The slot stays allocated."""
        self._allocated("discard")
        if self.phase is not None:
            raise OffloadStateError(f"group {self.name!r}: discard() during its {self.phase} (call after_{self.phase})")
        if not self.live:
            return
        m = self.manager
        self.live = False
        if self._inactive():
            return
        if self._restore_pending:  # let the queued H2D finish before anyone writes the slot again
            cur = m.streams.current_stream()
            m.streams.wait(cur, self.restore_done)
            m.streams.record(self.consumed, cur)
            self._consumed_recorded = True
            if self.bank is not None:
                self.bank.last_consumed = self.consumed
            self._restore_pending = False
        if self.state in (GroupState.RESIDENT_D2H_PENDING, GroupState.RESIDENT_RELOAD_PENDING,
                          GroupState.RESIDENT_KEPT):
            self.state = GroupState.MAPPED

    # -------------------------------------------------------------------------------------- helpers
    @property
    def _maps_at_forward(self) -> bool:
        """Its slot gets device memory at each forward, not at allocate (`offload.map_slots = "forward"`)."""
        return self.manager.map_at_forward and self.slot is not None

    def _inactive(self) -> bool:
        return self.manager.mode == "off" or self.nbytes == 0 or not self.offloaded

    def _allocated(self, op: str) -> None:
        if self.state is GroupState.DISCOVERING:
            raise OffloadStateError(f"group {self.name!r}: {op} before OffloadManager.allocate() (state discovering)")
        if self.state is GroupState.CLOSED:
            raise OffloadStateError(f"group {self.name!r}: {op} after the manager was closed")

    def _expect(self, op: str, *, phase: str | None, live: bool | None = None) -> None:
        self._allocated(op)
        if self.phase != phase:
            now = f"inside its {self.phase} (after before_{self.phase}, before after_{self.phase})" \
                if self.phase else "outside forward and backward"
            want = f"after before_{phase}" if phase else "outside forward and backward"
            raise OffloadStateError(f"group {self.name!r}: {op} called {now}; it must come {want}")
        if live is not None and self.live != live:
            why = ("its forward activations are still live (after_backward not called yet)" if self.live
                   else "it holds no forward activations (after_forward not called since the last backward)")
            raise OffloadStateError(f"group {self.name!r}: {op} not allowed: {why}")

    def __repr__(self) -> str:
        return f"OffloadGroup({self.name!r}, {self.state}, live={self.live}, phase={self.phase}, nbytes={self.nbytes})"


def _unlinked(t: Tensor) -> Tensor:
    """What a pack hook keeps of a tensor it does not move: the same bytes without the autograd link.

    Autograd stores whatever a pack hook returns, and keeps the pack hook itself with it. A tensor
    with its `grad_fn` in either (an op that saves its own output: exp, softmax, a norm's statistics;
    or a hook closure that remembers the tensors it saw) is a cycle through C++ objects the garbage
    collector cannot see: it keeps the whole forward graph (saved tensors, parameters) alive after the
    graph is dropped. Plain tensors only: a subclass (an FP8 tensor) is returned as it is."""
    return t.detach() if type(t) is torch.Tensor else t


def _key(t: Tensor) -> tuple:
    """Same bytes, same view: a tensor saved twice (x by three projections) is stored once."""
    return (t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype, t.device, t._version)


class _SavedOnce:
    """The saved tensors one forward has already handled, by `_key`, without keeping them alive.

    An entry counts only while the tensor it was made for is alive: then its memory cannot have been
    reused, so an equal key is the same bytes. Once that tensor is gone, an equal key may be a new
    tensor at the recycled address, and is handled as new. Holding the tensors instead (to rule out
    reuse) kept every saved original of a captured forward alive until the capture ended, so each
    forward graph's private pool reserved them next to their slot copies. Weak references also keep
    no reference cycle through autograd, which keeps the hook closure with every tensor it packs."""

    def __init__(self) -> None:
        self._entries: dict[tuple, tuple[Any, weakref.ref]] = {}

    def get(self, t: Tensor) -> Any:
        """What `add` stored for a live tensor with `t`'s key (None: not seen, or that tensor is gone)."""
        entry = self._entries.get(_key(t))
        return entry[0] if entry is not None and entry[1]() is not None else None

    def add(self, t: Tensor, value: Any) -> None:
        self._entries[_key(t)] = (value, weakref.ref(t))


class OffloadManager:
    """Owns the groups of one device, their slots or banks, the D2H and H2D streams, and statistics.

    Every knob comes from one `OffloadConfig` (`config`, the run config's `[offload]` section), so a
    training run, `qeffect verify-state` and `qeffect offload-check` build their managers alike; its field
    descriptions say what each does. `device`, `driver` and `streams` default to the real CUDA ones (built
    only for release and resident modes); the CPU tests pass a `FakeDevice`'s. `timing`: restores keep
    timed events (`OffloadStats.restores`); `alignment`: of each saved tensor in its slot; `eligible`:
    which saved tensors are offloaded (`default_eligible`).
    """

    def __init__(self, config: OffloadConfig, *, device: torch.device | str | None = None,
                 driver: VmmDriver | None = None, streams: StreamOps | None = None, timing: bool = False,
                 alignment: int = ALIGNMENT, eligible: Callable[[Tensor], bool] | None = None,
                 owns_driver: bool = False) -> None:
        if not isinstance(config, OffloadConfig):
            raise TypeError(f"OffloadManager takes an OffloadConfig (the run config's [offload] section), got "
                            f"{config!r}")
        if alignment <= 0 or alignment & (alignment - 1):
            raise ValueError(f"alignment must be a power of two, got {alignment}")
        self.config = config
        self.mode: OffloadMode = config.mode
        # resident: at least this many banks (the colouring may add more: `allocate(banks=)`)
        self.num_banks = config.banks
        # look-ahead depth: how many offloaded groups, next in backward order, each backward restores ahead
        self.lookahead = config.lookahead
        # release: also release a slot once its backward has consumed it (`offload.reap`)
        self.release_consumed = config.reap
        # The host work a replay does not wait for (reaps of finished D2Hs, the look-ahead restores) runs after
        # the replay is launched (`OffloadGroup.backward_launched`, and `after_forward`'s reap), not before it:
        # else the device stands idle before each backward launch while the host makes that work's driver
        # calls. False: before the replay.
        self.launch_first = config.launch_first
        # release, with allocate(events=): groups whose backwards follow one another share one slot, up to
        # `slot_members` of them (`offload.plan.shared_slots`; "nested": only groups that nest), so one unmap
        # and one map (five driver calls in all) serve them all, for the same peak driver memory.
        # "off": a slot per group.
        self.share_slots: Literal["any", "nested", "off"] = config.share_slots
        self.slot_members = config.slot_members
        # release: a shared slot's run needs this many actions between its last forward and its first backward
        # (`shared_slots(min_gap=)`)
        self.share_gap = config.share_gap
        # release: a backward that finds its slot's D2H not yet seen done keeps the slot mapped (its bytes are
        # still there: no unmap, map or H2D; `kept_at_backward`). True: the host waits for the D2H, releases the
        # slot and restores it at once (its memory comes back only for that moment).
        self.release_at_backward = config.release_at_backward
        # release: the host waits for the oldest copy-out once more than this many are pending (0: never), so
        # that slots are released however far ahead of the device the host runs
        self.max_pending_copies = config.max_pending_copies
        # release: slots get device memory only while a capture uses them and then at each forward
        # ("forward"), not all at allocate ("build"), so that at most one slot adds to the build's peak (the
        # graph pools at their fullest)
        self.map_at_forward = self.mode == "release" and config.map_slots == "forward"
        self.shared: list[list[OffloadGroup]] = []  # release: the runs of groups sharing a slot (backward order)
        self.timing, self.alignment = timing, alignment
        self.skip_kept_d2h = config.skip_kept_d2h  # resident, with allocate(events=): no D2H for kept groups
        # resident: copy each group in chunks of this many bytes (0: one copy), so that a restore into a bank
        # whose previous owner's D2H is still running follows it chunk by chunk instead of waiting for all of it
        chunk = int(config.copy_chunk_mib * MIB)
        self.copy_chunk_bytes = -(-chunk // alignment) * alignment
        # capture: saved tensors smaller than this many bytes go into the slot in batches (0: one copy each)
        self.store_batch_bytes = int(config.store_batch_mib * MIB)
        # with allocate(events=): a group with fewer other actions than this between its F and its B (the
        # last virtual stage's) is not offloaded (0: every group). Release: its D2H could not finish, no memory
        # would come back. Resident: the plan keeps it in its bank anyway; left out, it needs no bank and
        # skips its slot copies inside the forward graph
        self.min_window = config.min_window
        self._eligible_fn = eligible or default_eligible
        # resident, with allocate(events=): start no look-ahead restore a forward evicts before its backward,
        # a wasted copy that forward would wait for
        self.skip_futile_restores = config.skip_futile_restores
        self.groups: list[OffloadGroup] = []
        self.banks: list[Bank] = []
        self.stats = OffloadStats()
        self.backward_order: list[OffloadGroup] = []
        self.bank_plan: list[int] = []
        self.kept: list[OffloadGroup] = []  # resident: groups the plan keeps in their bank (no D2H)
        # resident: the bank search's result (`offload.timing.SearchResult`), once `offload.planning.plan` ran it
        self.bank_search: Any = None
        self.not_offloaded: list[OffloadGroup] = []  # groups the plan leaves out: short windows (no slot, no bank)
        # resident, with allocate(events=): (x, g) look-ahead restores of g at x's backward that a forward
        # would evict before g's backward (`offload.plan.futile_restores`): not started
        self.futile: set[tuple[int, int]] = set()
        # release: groups whose D2H is queued and whose slot is still mapped, in the order of their D2Hs
        # (one stream, so they complete in this order): a reap queries from the front and stops at the
        # first copy not done, instead of every group at every hook
        self._d2h_fifo: list[OffloadGroup] = []
        self._allocated = False
        self._closed = False
        if device is None:
            device = torch.device("cuda", driver.ordinal) if driver is not None else torch.device("cuda")
        self.device = torch.device(device)
        self.driver: VmmDriver | None = driver
        self.streams: StreamOps | None = streams
        self._own_driver = owns_driver and driver is not None  # `close` closes a given driver too
        if self.mode != "off":
            if self.device.type == "cuda" and self.device.index is None:
                self.device = torch.device("cuda", torch.cuda.current_device())
            if self.streams is None:
                # the driver's stream operations cost the host less per copy and event record than torch's;
                # false: torch's (the A/B)
                self.streams = (DriverCudaStreams if config.driver_streams else TorchCudaStreams)(self.device)
            if self.driver is None:
                self.driver = VmmDriver(self.device.index or 0)
                self._own_driver = True
        self.d2h_stream: Any = None
        self.h2d_stream: Any = None

    def _eligible(self, t: Tensor) -> bool:
        return t.device == self.device and self._eligible_fn(t)

    # ---------------------------------------------------------------------------------- building
    def group(self, name: str) -> OffloadGroup:
        if self._allocated:
            raise OffloadStateError(f"group {name!r}: groups must be created before allocate()")
        if any(g.name == name for g in self.groups):
            raise ValueError(f"an offload group named {name!r} already exists")
        g = OffloadGroup(self, name, len(self.groups))
        self.groups.append(g)
        return g

    def allocate(self, backward_order: Sequence[OffloadGroup] | None = None,
                 banks: Sequence[int] | None = None,
                 events: Sequence[tuple[str, OffloadGroup]] | None = None,
                 not_offloaded: Collection[OffloadGroup] = ()) -> None:
        """Lay out every group, create slots (release) or banks (resident), map them, pin host buffers.

        `backward_order`: the order in which the groups' backwards run in a step (default: reverse
        creation order, a layer stack). It links look-ahead and, in resident mode, assigns banks so
        that consecutive backwards never share one. Release mode, without `events` or `banks`: a group
        that serves several forwards a step (a captured chain's, one per microbatch it runs) may appear
        once per backward; each group then links to the first other group whose backward follows its
        first one (look-ahead only restores ahead: any link is safe, the usual one is just the fastest).
        `not_offloaded`: groups given no slot or bank (their saved tensors stay where autograd keeps
        them), beside `events`' short windows. `banks` (resident mode): the bank index of each
        group of `backward_order` (see `offload.plan.assign_banks`), instead of position mod
        `num_banks`; the manager then has max(banks) + 1 banks. `events`: one step's F / B / E events
        in execution order (`offload.plan`; `offload.planning.step_events`), the same every step: in
        resident mode with `skip_kept_d2h`, the groups `offload.plan.kept_groups` keeps are never copied
        to the host (and a claim that would evict one raises); with `min_window` > 0 (release and
        resident), the groups `offload.plan.short_window_groups` names are not offloaded (no slot, no
        bank). Call outside any capture.
        """
        if self._closed:
            raise OffloadStateError("allocate() after close()")
        if self._allocated:
            raise OffloadStateError("allocate() was already called")
        sequence = list(backward_order) if backward_order is not None else list(reversed(self.groups))
        first: dict[int, int] = {}  # each group's first backward in `sequence`
        for i, g in enumerate(sequence):
            first.setdefault(id(g), i)
        order = [sequence[i] for i in first.values()]  # each group once, at its first backward
        ids = [id(g) for g in order]
        repeated = len(order) < len(sequence)
        if set(ids) != {id(g) for g in self.groups} or (repeated and (self.mode != "release" or events is not None
                                                                      or banks is not None)):
            names = [g.name for g in sequence]
            raise ValueError(f"backward_order must list every group, each exactly once (release mode without "
                             f"events or banks: once per backward); got {names}, groups "
                             f"{[g.name for g in self.groups]}")
        if events is not None:
            events = list(events)
            check_events(events)
            if [id(g) for g in plan_backward_order(events)] != ids:
                raise ValueError("events: their backward order differs from backward_order")
        if banks is not None:
            banks = [int(b) for b in banks]
            if len(banks) != len(order) or min(banks, default=0) < 0:
                raise ValueError(f"banks must give one index >= 0 per group of backward_order, got {banks}")
            self.num_banks = max(self.num_banks, max(banks, default=0) + 1)
        self.bank_plan = banks if banks is not None else [pos % self.num_banks for pos in range(len(order))]
        self.backward_order = order
        for g in order:  # the first other group whose backward follows g's first one (unrepeated: the next)
            g.next_backward = next((h for h in sequence[first[id(g)] + 1:] if h is not g), None)
        for g in self.groups:
            g.offsets, g.nbytes = self.layout(g.specs)
        for g in [*not_offloaded, *(self.short_window(events) if events is not None else ())]:
            g.offloaded = False
        self.not_offloaded = [g for g in order if not g.offloaded]
        if events is not None:
            if self.mode == "release" and self.share_slots != "off":
                self.shared = shared_slots(events, [g for g in order if g.offloaded and g.nbytes], self.slot_members,
                                           nested=self.share_slots == "nested", min_gap=self.share_gap)
                for run in self.shared:
                    for g in run:
                        g.members = run
        if self.mode != "off":
            self._allocate_memory(order)
        if self.mode == "resident" and events is not None and self.skip_kept_d2h:
            keep = kept_groups(events, {g: g.bank.index for g in order if g.bank is not None})
            self.kept = [g for g in order if g in keep]
            for g in self.kept:
                g.kept = True
        if self.mode == "resident" and events is not None and self.skip_futile_restores:
            in_banks = {g: g.bank.index for g in order if g.bank is not None}
            futile = futile_restores(events, in_banks)
            self.futile = {(id(x), id(g)) for x, g in futile}
        for g in self.groups:
            g.state = GroupState.UNMAPPED if g._maps_at_forward else GroupState.MAPPED
        self._allocated = True
        self.note_mapped()

    def short_window(self, events: Sequence[tuple[str, Any]]) -> set[Any]:
        """The groups of `events` this manager does not offload (`offload.plan.short_window_groups`): release
        and resident modes' with `min_window` (0: none)."""
        if self.mode == "off" or self.min_window == 0:
            return set()
        return short_window_groups(events, self.min_window)

    def _allocate_memory(self, order: list[OffloadGroup]) -> None:
        s = self.streams
        self.d2h_stream, self.h2d_stream = s.new_stream("d2h"), s.new_stream("h2d")
        if self.mode == "release":
            for g in self.groups:
                if g.nbytes and g.offloaded and g is g.members[0]:  # one slot per run of `shared` (or group)
                    bases, end = self._pack([m.nbytes for m in g.members])
                    slot = VmmSlot(self.driver, end, map_now=not self.map_at_forward, device=self.device,
                                   name="+".join(m.name for m in g.members))
                    for m, base in zip(g.members, bases, strict=True):
                        m.slot, m.base = slot, base
        else:
            need = [0] * self.num_banks
            for pos, g in enumerate(order):
                if g.offloaded:
                    need[self.bank_plan[pos]] = max(need[self.bank_plan[pos]], g.nbytes)
            self.banks = [Bank(b, VmmSlot(self.driver, n, device=self.device, name=f"bank{b}"))
                          for b, n in enumerate(need) if n]
            by_index = {b.index: b for b in self.banks}
            for pos, g in enumerate(order):
                if g.nbytes and g.offloaded:
                    g.bank = by_index[self.bank_plan[pos]]
                    g.slot = g.bank.slot
        for g in self.groups:
            if g.slot is None:
                continue
            g._views = [g.slot.tensor(sp.shape, sp.dtype, offset=g.base + o, stride=sp.stride)
                        for sp, o in zip(g.specs, g.offsets, strict=True)]
            g.slot_bytes = g.slot.bytes(g.nbytes, offset=g.base)
            g.host = s.host_buffer(g.nbytes)
            g.forward_done = s.new_event(f"{g.name}.forward_done")
            g.d2h_done = s.new_event(f"{g.name}.d2h_done")
            size = self.copy_chunk_bytes if self.mode == "resident" and self.copy_chunk_bytes else g.nbytes
            g.chunks = [(a, min(a + size, g.nbytes)) for a in range(0, g.nbytes, size)]
            g.d2h_chunk_done = [s.new_event(f"{g.name}.d2h_chunk{i}") for i in range(len(g.chunks) - 1)] + [g.d2h_done]
            g.chunk_views = [(g.slot_bytes[a:b], g.host[a:b]) for a, b in g.chunks]  # no slicing on the hot path
            g.restore_done = s.new_event(f"{g.name}.restore_done", self.timing)
            g.consumed = s.new_event(f"{g.name}.consumed")

    # ------------------------------------------------------------------------------------- internals
    def _claim(self, bank: Bank, g: OffloadGroup, writer: Any, chunked: bool = False) -> list[Any]:
        """Resident: `writer` (a stream) is about to write `g`'s bytes into `bank`. Evict its owner (whose
        bytes are safe on the host once its D2H is done) and order the write after the bank's last D2H
        and last backward consumer. `chunked` (a restore copying `g.chunks` one by one): the last D2H is
        not waited for here; returns, per chunk of `g`, the D2H chunk event to wait for before copying it
        (None: an earlier wait covers it), the first that covers its last byte (D2H chunks run in order)."""
        owner = bank.owner
        if owner is not None and owner is not g and owner.live:
            if owner.phase == "backward":
                raise OffloadStateError(f"bank {bank.index} is busy: group {owner.name!r} is inside its backward "
                                        f"(before_backward called, after_backward not yet); group {g.name!r} "
                                        "cannot write it")
            if owner.state is GroupState.RESIDENT_KEPT:
                raise OffloadStateError(f"bank {bank.index}: group {g.name!r} would evict group {owner.name!r}, "
                                        "whose D2H was skipped (the plan keeps it in the bank until its backward, "
                                        "so its bytes are nowhere else): the hooks deviate from the planned events")
            if owner._restore_pending:  # prefetched but not consumed yet: finish that copy first
                self.streams.wait(writer, owner.restore_done)
                owner._restore_pending = False
                self.stats.prefetches_wasted += 1
            owner.state = GroupState.RESIDENT_RELOAD_PENDING
            self.stats.evictions += 1
        waits: list[Any] = []
        prev = bank.last_d2h_by
        if prev is not None and not chunked:
            self.streams.wait(writer, prev.d2h_done)
        elif prev is not None:
            i, done = 0, -1
            for _, end in g.chunks:  # both in increasing order: the first D2H chunk reaching `end`, else the last
                while i < len(prev.chunks) - 1 and prev.chunks[i][1] < end:
                    i += 1
                waits.append(prev.d2h_chunk_done[i] if i > done else None)
                done = i
        if bank.last_consumed is not None:
            self.streams.wait(writer, bank.last_consumed)
        bank.owner = g
        return waits

    def _restore(self, g: OffloadGroup, *, under: OffloadGroup | None) -> None:
        """H2D of `g`'s bytes into its slot (release: mapped first, if it is not; a shared slot's other members
        whose bytes are on the host come back with it, after it) or its bank (resident: claimed first)."""
        chunk_waits: list[Any] = []
        if self.mode == "release":
            if not g.slot.mapped:
                g.slot.map()  # same VA, new pages
                self.stats.maps += 1
                self.note_mapped()
            for m in g.members:
                if m is g or (m.state is GroupState.UNMAPPED and m.live and m.phase is None):
                    self._copy_in(m, under, [])
            return
        chunk_waits = self._claim(g.bank, g, self.h2d_stream, chunked=len(g.chunks) > 1)
        self._copy_in(g, under, chunk_waits)

    def _copy_in(self, g: OffloadGroup, under: OffloadGroup | None, chunk_waits: list[Any]) -> None:
        s, h2d = self.streams, self.h2d_stream
        s.wait(h2d, g.d2h_done)  # the host buffer must be complete (release: already waited by the host)
        start = None
        if self.timing:
            start = s.new_event(f"{g.name}.restore_start", True)
            g.restore_done = s.new_event(f"{g.name}.restore_done", True)
            s.record(start, h2d)
        # each chunk after the previous owner's D2H has read those bytes out (chunked), else one copy
        for (slot, host), ev in zip(g.chunk_views, chunk_waits or [None] * len(g.chunks), strict=True):
            if ev is not None:
                s.wait(h2d, ev)
            s.copy(slot, host, h2d)
        s.record(g.restore_done, h2d)
        g._restore_pending = True
        g.state = GroupState.MAPPED
        self.stats.h2d_copies += 1
        self.stats.h2d_bytes += g.nbytes
        if self.timing:
            self.stats.restores.append(RestoreRecord(g.name, under.name if under else None, start, g.restore_done))

    def _prefetch_ahead(self, g: OffloadGroup) -> None:
        """Look-ahead from `g`'s backward: restore the next `lookahead` offloaded groups in backward order
        (groups without a slot are passed over), so their copies run under this and the next backwards.
        Only the first may evict a live group from its bank (resident): a deeper one would take a bank
        whose bytes an earlier backward may still need."""
        nxt, depth = g.next_backward, 0
        while nxt is not None and depth < self.lookahead:
            if not nxt._inactive():
                self._prefetch(nxt, under=g, evict=depth == 0)
                depth += 1
            nxt = nxt.next_backward

    def _prefetch(self, g: OffloadGroup, *, under: OffloadGroup | None, evict: bool = True) -> bool:
        if g._inactive() or not g.live or g.phase is not None:
            return False
        if g.state is GroupState.RELEASE_D2H_PENDING:  # release it if its D2H is done, else its backward reads it
            # where it is
            if not self._release(g, block=False):
                return False
        if g.state not in (GroupState.UNMAPPED, GroupState.RESIDENT_RELOAD_PENDING):
            return False  # already on the device (or being restored)
        owner = g.bank.owner if g.bank is not None else None
        if owner is not None and owner is not g and (owner.phase == "backward" or (owner.live and not evict)):
            self.stats.prefetches_skipped += 1  # an optimization only: never fail a step for it
            return False
        if under is not None and (id(under), id(g)) in self.futile:
            self.stats.prefetches_futile += 1  # the plan: a forward evicts it before its backward
            return False
        self._maybe_reap(exclude=g)
        self._restore(g, under=under)
        self.stats.prefetches += 1
        return True

    def _maybe_reap(self, *, exclude: OffloadGroup | None = None) -> None:
        if self.mode == "release":
            self.reap(block=False, exclude=exclude)
            if self.max_pending_copies:
                self._reap_oldest(self.max_pending_copies, exclude=exclude)

    def _reap_oldest(self, keep: int, *, exclude: OffloadGroup | None) -> int:
        """Release: the host waits for the oldest pending copy-outs and releases their slots until at most
        `keep` remain pending (groups inside a replay, or in a shared slot another member still fills, stay
        and are passed over). Every copy waited for is already queued behind work the host launched, so the
        wait ends; it only keeps the host from mapping more than `keep` slots ahead of the device."""
        n = 0
        for g in self._pending_copies(exclude):
            if len(self._d2h_fifo) <= keep:
                break
            n += self._release(g, block=True)
        return n

    def _pending_copies(self, exclude: OffloadGroup | None) -> Iterator[OffloadGroup]:
        """The copy-out queue's groups still pending and outside any replay, oldest first, each checked when
        its turn comes (one released with another member of its shared slot is no longer pending)."""
        for g in list(self._d2h_fifo):
            if g is not exclude and g.phase is None and g.state is GroupState.RELEASE_D2H_PENDING:
                yield g

    # ---------------------------------------------------------------------------------- public
    def begin_step(self) -> int:
        """A step starts: every group should be consumed. One that is still live (or inside a replay)
        belongs to an aborted step; abandon it, so that this step's claims neither wait on nor trip over
        its bytes (a kept group's bank is otherwise refused to any other writer). Returns how many."""
        if not self._allocated or self._closed:
            return 0
        stale = [g for g in self.groups if g.live or g.phase is not None]
        for g in stale:
            g.abandon()
        return len(stale)

    def reap(self, *, block: bool = False, exclude: OffloadGroup | None = None) -> int:
        """Release mode: release the slots whose bytes are on the host (D2H done) and, with
        `release_consumed`, those of consumed groups (backward and any D2H done). Without `block`, only
        where a query says the events completed (no host wait). Returns how many were released."""
        if self.mode != "release" or not self._allocated or self._closed:
            return 0
        n = 0
        if not block and not self.release_consumed:  # only D2H-pending slots to release: front to back
            for g in self._pending_copies(exclude):
                if not self.streams.query(g.d2h_done):
                    break  # a later D2H on the same stream is not done either
                n += self._release(g, block=False, done=g.d2h_done)  # (False: a member of its shared slot is not ready)
            return n
        for g in self.groups:
            if g is not exclude and g.phase is None and g.slot is not None and g.slot.mapped:
                n += self._release(g, block=block)
        return n

    def _release(self, g: OffloadGroup, *, block: bool, at_backward: bool = False, done: Any = None) -> bool:
        """Unmap and release `g`'s slot if its bytes are on the host (D2H done) or, with
        `release_consumed`, consumed (backward and any D2H done). `block`: the host waits for those
        events; otherwise only a query. `at_backward`: called by `g`'s own backward (counted apart:
        that memory comes back only for the moment before the restore). A shared slot goes only when each
        of its members' bytes may (or are not in it); else nothing happens. `done`: an event the caller has
        just found complete (not queried again). True if released."""
        s = self.streams
        if not g.slot.mapped:
            return False
        events = []
        for m in g.members:
            if m.phase is not None:
                return False
            if m.state is GroupState.RELEASE_D2H_PENDING:
                events.append(m.d2h_done)
            elif self.release_consumed and m.state is GroupState.MAPPED and not m.live and m._consumed_recorded:
                events += [m.consumed] + ([m.d2h_done] if m._d2h_recorded else [])
            elif m is g or m.state is not GroupState.UNMAPPED:  # (UNMAPPED: its bytes are not in the slot)
                return False
        if len(g.members) > 1 and len({m.live for m in g.members}) > 1:
            return False  # a shared slot between its members' forwards (or backwards): it goes once all are done
        if not block and not all(e is done or s.query(e) for e in events):
            return False

        def wait() -> None:  # with `block`, the host's time blocked on offload
            t0 = time.perf_counter()
            for e in events:
                s.synchronize_event(e)
            self.stats.host_wait_seconds += time.perf_counter() - t0

        g.slot.unmap(wait=wait)
        self.stats.unmaps += 1
        for m in g.members:
            if m.state is GroupState.RELEASE_D2H_PENDING:
                self._d2h_fifo.remove(m)
                if at_backward and m is g:
                    self.stats.released_at_backward += 1
                else:
                    self.stats.released_live += int(m.live)
            elif m.state is GroupState.MAPPED:
                self.stats.reaped += 1
            m.state = GroupState.UNMAPPED
        return True

    def layout(self, specs: Sequence[TensorSpec]) -> tuple[list[int], int]:
        """Each saved tensor's offset in its group's slot (aligned) and the slot bytes the group needs."""
        return self._pack([spec.nbytes for spec in specs])

    def _pack(self, sizes: Sequence[int]) -> tuple[list[int], int]:
        """Byte ranges of `sizes`, one after another, each start aligned: (the starts, the end of the last)."""
        offsets, off = [], 0
        for n in sizes:
            off = -(-off // self.alignment) * self.alignment
            offsets.append(off)
            off += n
        return offsets, off

    def slots(self) -> list[VmmSlot]:
        """Each slot (release; a shared one once) or bank (resident) of this manager."""
        if self.mode == "resident":
            return [b.slot for b in self.banks]
        return [slot for slot, _ in self.release_slots()]

    def release_slots(self) -> list[tuple[VmmSlot, list[OffloadGroup]]]:
        """Release: each slot once, with the groups in it (`OffloadGroup.members`, backward order)."""
        return [(g.slot, g.members) for g in self.groups if g.slot is not None and g is g.members[0]]

    def mapped_bytes(self) -> int:
        """Device bytes currently mapped by this manager's slots and banks."""
        return sum(s.size for s in self.slots() if s.mapped)

    def note_mapped(self) -> None:
        """After a mapping: `stats.peak_mapped_bytes` takes the bytes mapped now."""
        self.stats.peak_mapped_bytes = max(self.stats.peak_mapped_bytes, self.mapped_bytes())

    def host_bytes(self) -> int:
        return sum(g.host.numel() for g in self.groups if g.host is not None)

    def close(self) -> None:
        """Synchronize the device, unmap and free every slot, drop the driver's context reference."""
        if self._closed:
            return
        if self.mode != "off" and self._allocated:
            self.driver.synchronize()
            for slot in self.slots():
                slot.close(wait=lambda: None)  # the whole context was synchronized just above
        if self._own_driver:
            self.driver.close()
        for g in self.groups:
            g.state, g.live, g.phase = GroupState.CLOSED, False, None
            g._views, g.chunk_views = [], []
        self._d2h_fifo.clear()
        self._closed = True

    def __enter__(self) -> OffloadManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["ALIGNMENT", "MODES", "Bank", "GroupState", "OffloadGroup", "OffloadManager", "OffloadMode",
           "OffloadStateError", "OffloadStats", "RestoreRecord", "TensorSpec", "default_eligible"]
