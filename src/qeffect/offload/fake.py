"""A CPU stand-in for one GPU's VMM driver and streams, for testing offload without a GPU.

`FakeCudaDriver` has the surface of `cuda.bindings.driver` that `VmmDriver` uses (same function
names, `(CUresult, value...)` returns, the property structs and enums) and simulates VMM on host
memory: a reserved "VA" is a real host address (so `wrap_pointer` gives CPU tensors at it), unmapped
ranges hold a poison byte, a mapping copies its physical allocation's bytes in and unmapping copies
them back out, and free memory drops at cuMemCreate and returns when an allocation is both released
and unmapped. Every call needs the primary context current on the calling thread, as on a GPU. Any
call can be made to fail once (`fail_next`), every call is appended to `trace`.

`FakeDevice` implements `StreamOps`: each stream is a queue; an operation runs only when the
scheduler picks it, in a random interleaving that respects stream order and event waits (seeded).
Copies check that a VMM range they touch is mapped with access, else `FakeDeviceFault` (error 700).
So a missing wait or an early unmap shows up as wrong bytes or a fault for some seed, and the host
sees only what it explicitly synchronized on.
"""

from __future__ import annotations

import contextlib
import random
import threading
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from enum import IntEnum
from typing import Any

import torch
from torch import Tensor

from qeffect.offload.driver import VmmDriver
from qeffect.offload.vmm import span_bytes

MIB = 1 << 20
POISON = 0xA5  # an unmapped range reads as this (on a GPU it would fault)


class CUresult(IntEnum):
    CUDA_SUCCESS = 0
    CUDA_ERROR_INVALID_VALUE = 1
    CUDA_ERROR_OUT_OF_MEMORY = 2
    CUDA_ERROR_NOT_INITIALIZED = 3
    CUDA_ERROR_INVALID_DEVICE = 101
    CUDA_ERROR_INVALID_CONTEXT = 201
    CUDA_ERROR_ILLEGAL_ADDRESS = 700
    CUDA_ERROR_NOT_PERMITTED = 800
    CUDA_ERROR_NOT_SUPPORTED = 801


class CUmemAllocationType(IntEnum):
    CU_MEM_ALLOCATION_TYPE_INVALID = 0
    CU_MEM_ALLOCATION_TYPE_PINNED = 1


class CUmemLocationType(IntEnum):
    CU_MEM_LOCATION_TYPE_INVALID = 0
    CU_MEM_LOCATION_TYPE_DEVICE = 1


class CUmemAccess_flags(IntEnum):  # noqa: N801  (the binding's name)
    CU_MEM_ACCESS_FLAGS_PROT_NONE = 0
    CU_MEM_ACCESS_FLAGS_PROT_READ = 1
    CU_MEM_ACCESS_FLAGS_PROT_READWRITE = 3


class CUmemAllocationGranularity_flags(IntEnum):  # noqa: N801
    CU_MEM_ALLOC_GRANULARITY_MINIMUM = 0
    CU_MEM_ALLOC_GRANULARITY_RECOMMENDED = 1


class CUmemLocation:
    def __init__(self) -> None:
        self.type = CUmemLocationType.CU_MEM_LOCATION_TYPE_INVALID
        self.id = 0


class CUmemAllocationProp:
    def __init__(self) -> None:
        self.type = CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_INVALID
        self.requestedHandleTypes = 0
        self.location = CUmemLocation()


class CUmemAccessDesc:
    def __init__(self) -> None:
        self.location = CUmemLocation()
        self.flags = CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_NONE


class _Handle:
    """A driver handle: compares by value like cuda-bindings >= 13 handles."""

    def __init__(self, value: int) -> None:
        self.value = int(value)

    def __int__(self) -> int:
        return self.value

    def __eq__(self, other: object) -> bool:
        return isinstance(other, type(self)) and other.value == self.value

    def __hash__(self) -> int:
        return hash((type(self).__name__, self.value))

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.value:#x}>"


class CUdevice(_Handle):
    pass


class CUcontext(_Handle):
    pass


class CUdeviceptr(_Handle):
    pass


class CUmemGenericAllocationHandle(_Handle):
    pass


class FakeDeviceFault(RuntimeError):
    """Device work touched a VMM range that is not mapped with access: on a GPU, error 700."""


@dataclass
class _Reservation:
    size: int
    buf: Tensor  # host memory backing the "VA" (kept alive here)


@dataclass
class _Allocation:
    size: int
    data: Tensor  # the physical bytes while unmapped
    released: bool = False
    mapped_at: int | None = None


@dataclass
class _Mapping:
    size: int
    handle: int
    access: bool = False


_VALUE_COUNTS = {"cuInit": 0, "cuDeviceGet": 1, "cuDevicePrimaryCtxRetain": 1, "cuDevicePrimaryCtxRelease": 0,
                 "cuCtxGetCurrent": 1, "cuCtxSetCurrent": 0, "cuCtxSynchronize": 0,
                 "cuMemGetAllocationGranularity": 1, "cuMemAddressReserve": 1, "cuMemAddressFree": 0,
                 "cuMemCreate": 1, "cuMemRelease": 0, "cuMemMap": 0, "cuMemUnmap": 0, "cuMemSetAccess": 0,
                 "cuMemGetInfo": 2}


class FakeCudaDriver:
    """The slice of `cuda.bindings.driver` that `VmmDriver` uses, simulated on host memory."""

    CUresult = CUresult
    CUmemAllocationType = CUmemAllocationType
    CUmemLocationType = CUmemLocationType
    CUmemAccess_flags = CUmemAccess_flags
    CUmemAllocationGranularity_flags = CUmemAllocationGranularity_flags
    CUmemAllocationProp = CUmemAllocationProp
    CUmemAccessDesc = CUmemAccessDesc
    CUmemLocation = CUmemLocation

    def __init__(self, *, granularity: int = 2 * MIB, total: int = 256 * MIB, device_count: int = 1,
                 on_synchronize: Callable[[], None] | None = None) -> None:
        self.granularity, self.total, self.free = granularity, total, total
        self.device_count = device_count
        self.on_synchronize = on_synchronize
        self.trace: list[tuple] = []
        self.fail_next: dict[str, CUresult] = {}
        self.primary_retains = [0] * device_count
        self.reservations: dict[int, _Reservation] = {}
        self.allocations: dict[int, _Allocation] = {}
        self.mappings: dict[int, _Mapping] = {}
        self._initialized = False
        self._next_handle = 1
        self._tls = threading.local()

    # ----------------------------------------------------------------------------------- plumbing
    def _fail(self, name: str, code: CUresult) -> tuple:
        return (code,) + (None,) * _VALUE_COUNTS[name]

    def _enter(self, name: str, *args: Any, needs_context: bool = True) -> tuple | None:
        """Trace the call; return an error tuple if it must fail, else None."""
        self.trace.append((name, *args))
        if name in self.fail_next:
            return self._fail(name, self.fail_next.pop(name))
        if name != "cuInit" and not self._initialized:
            return self._fail(name, CUresult.CUDA_ERROR_NOT_INITIALIZED)
        if needs_context:
            ctx = getattr(self._tls, "ctx", None)
            if ctx is None or self.primary_retains[ctx.value - 0xC0DE0] == 0:
                return self._fail(name, CUresult.CUDA_ERROR_INVALID_CONTEXT)
        return None

    def current_context_of_this_thread(self) -> CUcontext | None:
        return getattr(self._tls, "ctx", None)

    # ------------------------------------------------------------------------------ init, context
    def cuInit(self, flags: int) -> tuple:  # noqa: N802
        if (err := self._enter("cuInit", flags, needs_context=False)) is not None:
            return err
        self._initialized = True
        return (CUresult.CUDA_SUCCESS,)

    def cuDeviceGet(self, ordinal: int) -> tuple:  # noqa: N802
        if (err := self._enter("cuDeviceGet", ordinal, needs_context=False)) is not None:
            return err
        if not 0 <= int(ordinal) < self.device_count:
            return self._fail("cuDeviceGet", CUresult.CUDA_ERROR_INVALID_DEVICE)
        return (CUresult.CUDA_SUCCESS, CUdevice(ordinal))

    def cuDevicePrimaryCtxRetain(self, dev: CUdevice) -> tuple:  # noqa: N802
        if (err := self._enter("cuDevicePrimaryCtxRetain", dev, needs_context=False)) is not None:
            return err
        self.primary_retains[int(dev)] += 1
        return (CUresult.CUDA_SUCCESS, CUcontext(0xC0DE0 + int(dev)))

    def cuDevicePrimaryCtxRelease(self, dev: CUdevice) -> tuple:  # noqa: N802
        if (err := self._enter("cuDevicePrimaryCtxRelease", dev, needs_context=False)) is not None:
            return err
        if self.primary_retains[int(dev)] == 0:
            return self._fail("cuDevicePrimaryCtxRelease", CUresult.CUDA_ERROR_INVALID_CONTEXT)
        self.primary_retains[int(dev)] -= 1
        return (CUresult.CUDA_SUCCESS,)

    def cuCtxGetCurrent(self) -> tuple:  # noqa: N802
        if (err := self._enter("cuCtxGetCurrent", needs_context=False)) is not None:
            return err
        return (CUresult.CUDA_SUCCESS, getattr(self._tls, "ctx", None) or CUcontext(0))

    def cuCtxSetCurrent(self, ctx: CUcontext) -> tuple:  # noqa: N802
        if (err := self._enter("cuCtxSetCurrent", ctx, needs_context=False)) is not None:
            return err
        self._tls.ctx = ctx if int(ctx) else None
        return (CUresult.CUDA_SUCCESS,)

    def cuCtxSynchronize(self) -> tuple:  # noqa: N802
        if (err := self._enter("cuCtxSynchronize")) is not None:
            return err
        if self.on_synchronize is not None:
            self.on_synchronize()
        return (CUresult.CUDA_SUCCESS,)

    def cuGetErrorName(self, code: Any) -> tuple:  # noqa: N802
        try:
            return (CUresult.CUDA_SUCCESS, CUresult(int(code)).name.encode())
        except ValueError:
            return (CUresult.CUDA_ERROR_INVALID_VALUE, None)

    def cuGetErrorString(self, code: Any) -> tuple:  # noqa: N802
        try:
            return (CUresult.CUDA_SUCCESS, f"fake driver: {CUresult(int(code)).name.lower()}".encode())
        except ValueError:
            return (CUresult.CUDA_ERROR_INVALID_VALUE, None)

    # ------------------------------------------------------------------------------------- memory
    def _prop_ok(self, prop: Any) -> bool:
        return (prop.type == CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
                and prop.location.type == CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
                and 0 <= prop.location.id < self.device_count)

    def cuMemGetAllocationGranularity(self, prop: Any, flag: Any) -> tuple:  # noqa: N802
        if (err := self._enter("cuMemGetAllocationGranularity", flag)) is not None:
            return err
        if not self._prop_ok(prop):
            return self._fail("cuMemGetAllocationGranularity", CUresult.CUDA_ERROR_INVALID_VALUE)
        return (CUresult.CUDA_SUCCESS, self.granularity)

    def cuMemAddressReserve(self, size: int, alignment: int, addr: Any, flags: int) -> tuple:  # noqa: N802
        if (err := self._enter("cuMemAddressReserve", size, alignment)) is not None:
            return err
        g = max(self.granularity, int(alignment) or self.granularity)
        if size <= 0 or size % self.granularity or int(addr) or flags:
            return self._fail("cuMemAddressReserve", CUresult.CUDA_ERROR_INVALID_VALUE)
        buf = torch.full((size + g,), POISON, dtype=torch.uint8)
        va = -(-buf.data_ptr() // g) * g
        self.reservations[va] = _Reservation(size, buf)
        return (CUresult.CUDA_SUCCESS, CUdeviceptr(va))

    def cuMemAddressFree(self, va: Any, size: int) -> tuple:  # noqa: N802
        va = int(va)
        if (err := self._enter("cuMemAddressFree", va, size)) is not None:
            return err
        r = self.reservations.get(va)
        if r is None or r.size != size or any(va <= m < va + size for m in self.mappings):
            return self._fail("cuMemAddressFree", CUresult.CUDA_ERROR_INVALID_VALUE)
        del self.reservations[va]
        return (CUresult.CUDA_SUCCESS,)

    def cuMemCreate(self, size: int, prop: Any, flags: int) -> tuple:  # noqa: N802
        if (err := self._enter("cuMemCreate", size)) is not None:
            return err
        if size <= 0 or size % self.granularity or flags or not self._prop_ok(prop):
            return self._fail("cuMemCreate", CUresult.CUDA_ERROR_INVALID_VALUE)
        if size > self.free:
            return self._fail("cuMemCreate", CUresult.CUDA_ERROR_OUT_OF_MEMORY)
        h = self._next_handle
        self._next_handle += 1
        # fresh physical memory holds someone's old bytes: a per-allocation pattern, never the poison
        self.allocations[h] = _Allocation(size, torch.full((size,), (0x30 + 7 * h) % 0x60, dtype=torch.uint8))
        self.free -= size
        self.trace[-1] = ("cuMemCreate", size, h)
        return (CUresult.CUDA_SUCCESS, CUmemGenericAllocationHandle(h))

    def _region(self, va: int, size: int) -> Tensor | None:
        for base, r in self.reservations.items():
            if base <= va and va + size <= base + r.size:
                start = va - r.buf.data_ptr()
                return r.buf[start:start + size]
        return None

    def cuMemMap(self, va: Any, size: int, offset: int, handle: Any, flags: int) -> tuple:  # noqa: N802
        va, h = int(va), int(handle)
        if (err := self._enter("cuMemMap", va, size, h)) is not None:
            return err
        a, region = self.allocations.get(h), self._region(va, size)
        overlaps = any(m < va + size and va < m + mp.size for m, mp in self.mappings.items())
        if a is None or a.released or a.mapped_at is not None or a.size != size or offset or flags \
                or region is None or overlaps:
            return self._fail("cuMemMap", CUresult.CUDA_ERROR_INVALID_VALUE)
        region.copy_(a.data)
        a.mapped_at = va
        self.mappings[va] = _Mapping(size, h)
        return (CUresult.CUDA_SUCCESS,)

    def cuMemSetAccess(self, va: Any, size: int, descs: Sequence[Any], count: int) -> tuple:  # noqa: N802
        va = int(va)
        if (err := self._enter("cuMemSetAccess", va, size)) is not None:
            return err
        m = self.mappings.get(va)
        ok = m is not None and m.size == size and len(descs) == count >= 1 and all(
            d.location.type == CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE and 0 <= d.location.id < self.device_count
            and d.flags == CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE for d in descs)
        if not ok:
            return self._fail("cuMemSetAccess", CUresult.CUDA_ERROR_INVALID_VALUE)
        m.access = True
        return (CUresult.CUDA_SUCCESS,)

    def cuMemUnmap(self, va: Any, size: int) -> tuple:  # noqa: N802
        va = int(va)
        if (err := self._enter("cuMemUnmap", va, size)) is not None:
            return err
        m = self.mappings.get(va)
        if m is None or m.size != size:
            return self._fail("cuMemUnmap", CUresult.CUDA_ERROR_INVALID_VALUE)
        region, a = self._region(va, size), self.allocations[m.handle]
        a.data.copy_(region)
        region.fill_(POISON)
        a.mapped_at = None
        del self.mappings[va]
        if a.released:
            self._free_allocation(m.handle)
        return (CUresult.CUDA_SUCCESS,)

    def cuMemRelease(self, handle: Any) -> tuple:  # noqa: N802
        h = int(handle)
        if (err := self._enter("cuMemRelease", h)) is not None:
            return err
        a = self.allocations.get(h)
        if a is None or a.released:
            return self._fail("cuMemRelease", CUresult.CUDA_ERROR_INVALID_VALUE)
        a.released = True
        if a.mapped_at is None:
            self._free_allocation(h)
        return (CUresult.CUDA_SUCCESS,)

    def _free_allocation(self, h: int) -> None:
        self.free += self.allocations.pop(h).size

    def cuMemGetInfo(self) -> tuple:  # noqa: N802
        if (err := self._enter("cuMemGetInfo")) is not None:
            return err
        return (CUresult.CUDA_SUCCESS, self.free, self.total)

    # ------------------------------------------------------------------------------ device access
    def check_access(self, t: Tensor, what: str = "tensor") -> None:
        """Raise FakeDeviceFault if `t`'s bytes fall in a reserved range that is not mapped with access."""
        lo = t.data_ptr()
        hi = lo + max(1, span_bytes(t.shape, t.stride(), t.element_size()))
        for base, r in self.reservations.items():
            if lo < base + r.size and base < hi:
                ok = any(m <= lo and hi <= m + mp.size and mp.access for m, mp in self.mappings.items())
                if not ok:
                    raise FakeDeviceFault(f"CUDA_ERROR_ILLEGAL_ADDRESS (700): {what} touches "
                                          f"[{lo:#x}, {hi:#x}), not mapped with access")


# ---------------------------------------------------------------------------------------- streams
class _Token:
    """One record of an event (a wait snapshots the latest record, as cudaStreamWaitEvent does)."""

    __slots__ = ("event", "done")

    def __init__(self, event: FakeEvent) -> None:
        self.event, self.done = event, False


@dataclass(eq=False)
class FakeEvent:
    name: str
    timing: bool = False
    last: _Token | None = None


@dataclass(eq=False)
class FakeStream:
    name: str
    speed: float = 1.0  # relative chance to be picked when several streams can run
    queue: deque = field(default_factory=deque)

    def __repr__(self) -> str:
        return f"<FakeStream {self.name}>"


class FakeDeadlock(RuntimeError):
    pass


class FakeDevice:
    """Fake driver + streams for one device. `seed` picks the interleaving; `progress` is how many
    queued operations may run after each enqueue (random in [0, progress]): 0 keeps the device as lazy
    as possible."""

    def __init__(self, seed: int = 0, *, progress: int = 2, granularity: int = 2 * MIB, total: int = 256 * MIB) -> None:
        self.cu = FakeCudaDriver(granularity=granularity, total=total, on_synchronize=self.synchronize)
        self.trace = self.cu.trace  # driver calls and stream operations, in host order
        self.executed: list[tuple[str, str]] = []  # (stream, label) in device order
        self.rng = random.Random(seed)
        self.progress = progress
        self.streams: list[FakeStream] = []
        self.compute = self.new_stream("compute")
        self._current = self.compute

    def driver(self) -> VmmDriver:
        return VmmDriver(0, cu=self.cu, torch_device="cpu")

    # -------------------------------------------------------------------------------- StreamOps
    def current_stream(self, device: Any = None) -> FakeStream:
        """`device` is ignored (one fake device): it lets `LocalTransport(ops=FakeDevice())` ask per tensor."""
        return self._current

    def new_stream(self, name: str) -> FakeStream:
        # each seed gives each stream its own speed, so some seeds starve compute and others the copies
        s = FakeStream(name, speed=self.rng.choice((0.02, 0.2, 1.0, 5.0)))
        self.streams.append(s)
        return s

    def new_event(self, name: str, timing: bool = False) -> FakeEvent:
        return FakeEvent(name, timing)

    def record(self, event: FakeEvent, stream: FakeStream) -> None:
        tok = _Token(event)
        event.last = tok
        self.trace.append(("record", stream.name, event.name))
        self._enqueue(stream, ("record", tok, f"record {event.name}"))

    def record_stream(self, tensor: Any, stream: FakeStream) -> None:
        """No caching allocator here (the tensors are CPU tensors): nothing to hold back."""

    def wait(self, stream: FakeStream, event: FakeEvent) -> None:
        if event.last is None:  # never recorded: a no-op, as in CUDA
            self.trace.append(("wait-unrecorded", stream.name, event.name))
            return
        self.trace.append(("wait", stream.name, event.name))
        self._enqueue(stream, ("wait", event.last, f"wait {event.name}"))

    def copy(self, dst: Tensor, src: Tensor, stream: FakeStream) -> None:
        self.trace.append(("copy", stream.name, dst.data_ptr(), src.data_ptr(), dst.numel() * dst.element_size()))

        def run() -> None:
            self.cu.check_access(src, f"copy source on {stream.name}")
            self.cu.check_access(dst, f"copy destination on {stream.name}")
            dst.copy_(src)

        self._enqueue(stream, ("run", run, f"copy {src.data_ptr():#x}->{dst.data_ptr():#x}"))

    def synchronize_event(self, event: FakeEvent) -> None:
        self.trace.append(("sync", event.name))
        tok = event.last
        if tok is not None:
            self._run_until(lambda: tok.done, f"event {event.name}")

    def query(self, event: FakeEvent) -> bool:
        self._advance()
        done = event.last is None or event.last.done
        self.trace.append(("query", event.name, done))
        return done

    def host_buffer(self, nbytes: int) -> Tensor:
        return torch.full((int(nbytes),), 0xEE, dtype=torch.uint8)

    # ---------------------------------------------------------------------------- test helpers
    def launch(self, stream: FakeStream, fn: Callable[[], None], label: str, touches: Sequence[Tensor] = ()) -> None:
        """Queue `fn` (a stand-in for a graph replay) on `stream`; it faults if it touches unmapped VMM."""
        self.trace.append(("launch", stream.name, label))

        def run() -> None:
            for t in touches:
                self.cu.check_access(t, label)
            fn()

        self._enqueue(stream, ("run", run, label))

    @contextlib.contextmanager
    def use(self, stream: FakeStream) -> Iterator[FakeStream]:
        prev, self._current = self._current, stream
        try:
            yield stream
        finally:
            self._current = prev

    @contextlib.contextmanager
    def host_compute(self) -> Iterator[None]:
        """Run host code as if on the compute stream now: first drain what is queued on it."""
        self._run_until(lambda: not self.compute.queue, "the compute stream")
        yield

    def synchronize(self) -> None:
        """Run every queued operation (cuCtxSynchronize)."""
        self._run_until(lambda: all(not s.queue for s in self.streams), "every stream")

    # ------------------------------------------------------------------------------- scheduling
    def _enqueue(self, stream: FakeStream, op: tuple) -> None:
        stream.queue.append(op)
        self._advance()

    def _advance(self) -> None:
        for _ in range(self.rng.randint(0, self.progress)):
            if not self._step():
                break

    def _runnable(self) -> list[FakeStream]:
        out = []
        for s in self.streams:
            if s.queue:
                op = s.queue[0]
                if op[0] != "wait" or op[1].done:
                    out.append(s)
        return out

    def _step(self) -> bool:
        ready = self._runnable()
        if not ready:
            return False
        s = self.rng.choices(ready, weights=[r.speed for r in ready])[0]
        kind, arg, label = s.queue.popleft()
        if kind == "record":
            arg.done = True
        elif kind == "run":
            arg()
        self.executed.append((s.name, label))
        return True

    def _run_until(self, done: Callable[[], bool], what: str) -> None:
        while not done():
            if not self._step():
                heads = {s.name: s.queue[0][2] for s in self.streams if s.queue}
                raise FakeDeadlock(f"waiting for {what}, but no stream can progress: {heads}")
