"""Checked CUDA driver calls for virtual memory management (VMM), over `cuda.bindings.driver`.

Why a wrapper: every `cuda.bindings.driver` function returns `(CUresult, value...)` and never raises, so
an unchecked call fails silently and the next one fails somewhere else. `VmmDriver` checks every
result and raises `CudaDriverError` naming the call and the code. It also works from any thread: a
thread that never touched CUDA has no current context, and every VMM call from it fails with
CUDA_ERROR_INVALID_CONTEXT (nothing done); the wrapper then binds the device's primary context and
makes the call again. The VMM calls name their device themselves (allocation and access
descriptors), so they need a context, not a particular one: no context lookup precedes them on the
hot path (release offload makes a few hundred per step). The calls whose meaning is the current
context's (`cuCtxSynchronize`, `cuMemGetInfo`) bind the primary context first, every time.

`cu` is injectable: the real module on a GPU machine, or `qeffect.offload.fake.FakeCudaDriver` (same
function names, same tuple returns) on CPU, so this exact code is what the CPU tests run.

Written against cuda-bindings 13.x (the H200 has 13.3.1); run there by `qeffect offload-check` and
tests/test_offload_gpu.py, and by the CPU tests through the fake module.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from typing import Any

import torch


class OffloadUnavailable(RuntimeError):
    """VMM offload cannot run here: no CUDA device or no `cuda.bindings` (cuda-bindings package)."""


class CudaDriverError(RuntimeError):
    """A driver call returned an error code. `call` is the function name, `code` the numeric CUresult."""

    def __init__(self, call: str, code: int, name: str, message: str) -> None:
        self.call, self.code, self.name, self.message = call, code, name, message
        super().__init__(f"{call} failed: {name} ({code}): {message}")


def load_bindings() -> Any:
    """Import `cuda.bindings.driver` lazily (it ships with the GPU machine's PyTorch, not with qeffect)."""
    try:
        from cuda.bindings import driver
    except ImportError as err:
        raise OffloadUnavailable("cuda.bindings.driver is not importable (install cuda-bindings, which "
                                 f"ships with CUDA builds of PyTorch): {err}") from None
    return driver


def bindings_available() -> bool:
    try:
        load_bindings()
    except OffloadUnavailable:
        return False
    return True


def result_code(result: Any) -> int:
    """Numeric value of a CUresult (IntEnum before cuda-bindings 13.1, a faster int-like enum after)."""
    try:
        return int(result)
    except (TypeError, ValueError):
        return int(getattr(result, "value", -1))


# Calls whose result depends on which context is current: made on this device's primary context, always.
CONTEXT_CALLS = frozenset({"cuCtxSynchronize", "cuMemGetInfo"})


class VmmDriver:
    """One device's VMM calls, each checked, from any thread (see the module docstring on contexts).

    Holds a reference on the device's primary context (`cuDevicePrimaryCtxRetain`, the context PyTorch
    uses) until `close()`.
    """

    def __init__(self, ordinal: int = 0, *, cu: Any | None = None, torch_device: torch.device | str | None = None) -> None:
        self.cu = cu if cu is not None else load_bindings()
        self.ordinal = int(ordinal)
        self.torch_device = torch.device(torch_device) if torch_device is not None else torch.device("cuda", self.ordinal)
        self._lock = threading.Lock()
        self._granularity: int | None = None
        self._prop: Any = None
        self._access: Any = None
        retry = ("CUDA_ERROR_INVALID_CONTEXT", "CUDA_ERROR_CONTEXT_IS_DESTROYED")
        self._no_context = tuple(getattr(self.cu.CUresult, n) for n in retry if hasattr(self.cu.CUresult, n))
        self._closed = False
        # host time spent in each driver call made through `call` (seconds) and how many: a call that
        # blocks the host (waits for the device) shows up here, where the step time cannot say which
        self.call_seconds: Counter[str] = Counter()
        self.call_counts: Counter[str] = Counter()
        self._raw("cuInit", 0)
        self.device = self._raw("cuDeviceGet", self.ordinal)
        self.context = self._raw("cuDevicePrimaryCtxRetain", self.device)

    # ------------------------------------------------------------------------------------ checking
    def _error(self, call: str, result: Any) -> CudaDriverError:
        code = result_code(result)
        name, message = getattr(result, "name", None) or f"CUresult {code}", "(no description)"
        try:  # describing an error must never raise a different one
            r, s = self.cu.cuGetErrorName(result)
            if r == self.cu.CUresult.CUDA_SUCCESS and s:
                name = s.decode() if isinstance(s, bytes) else str(s)
            r, s = self.cu.cuGetErrorString(result)
            if r == self.cu.CUresult.CUDA_SUCCESS and s:
                message = s.decode() if isinstance(s, bytes) else str(s)
        except Exception:  # noqa: BLE001
            pass
        return CudaDriverError(call, code, name, message)

    def _invoke(self, call: str, *args: Any) -> tuple:
        """`cu.<call>(*args)` as (CUresult, values), unchecked."""
        ret = getattr(self.cu, call)(*args)
        if not isinstance(ret, tuple) or not ret:
            raise TypeError(f"{call} returned {ret!r}; cuda.bindings calls return (CUresult, value...)")
        return ret[0], ret[1:]

    def _check(self, call: str, result: Any, values: tuple) -> Any:
        if result != self.cu.CUresult.CUDA_SUCCESS:
            raise self._error(call, result)
        if not values:
            return None
        return values[0] if len(values) == 1 else values

    def _raw(self, call: str, *args: Any) -> Any:
        """Call `cu.<call>(*args)` and check its CUresult; return None, the one value, or a tuple of values."""
        return self._check(call, *self._invoke(call, *args))

    def make_current(self) -> None:
        """Bind this device's primary context to the calling thread if another (or none) is current."""
        if self._closed:
            raise RuntimeError("VmmDriver is closed")
        current = self._raw("cuCtxGetCurrent")
        # cuda-bindings >= 13.0 compares handles by address; int(handle) is deprecated there.
        if current is None or not (current == self.context):
            self._raw("cuCtxSetCurrent", self.context)

    def call(self, call: str, *args: Any) -> Any:
        """A checked driver call from any thread: bound to this device's primary context first when it
        depends on the current context; otherwise made at once and, where the thread has no context
        yet (CUDA_ERROR_INVALID_CONTEXT: nothing was done), made again after binding it."""
        if self._closed:
            raise RuntimeError("VmmDriver is closed")
        t0 = time.perf_counter()
        try:
            if call in CONTEXT_CALLS:
                self.make_current()
                return self._raw(call, *args)
            result, values = self._invoke(call, *args)
            if result in self._no_context:
                self.make_current()
                result, values = self._invoke(call, *args)
            return self._check(call, result, values)
        finally:
            self.call_seconds[call] += time.perf_counter() - t0
            self.call_counts[call] += 1

    # --------------------------------------------------------------------------------- descriptors
    def allocation_prop(self) -> Any:
        """Pinned (non-migratable) device memory on this device, no shareable handle (built once: the
        driver only reads it)."""
        if self._prop is None:
            cu = self.cu
            prop = cu.CUmemAllocationProp()
            prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
            prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
            prop.location.id = self.ordinal
            self._prop = prop
        return self._prop

    def access_desc(self) -> Any:
        """Read-write access for this device (cuMemSetAccess after every map: a fresh mapping has none;
        built once)."""
        if self._access is None:
            cu = self.cu
            desc = cu.CUmemAccessDesc()
            desc.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
            desc.location.id = self.ordinal
            desc.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
            self._access = desc
        return self._access

    # --------------------------------------------------------------------------------- operations
    @property
    def granularity(self) -> int:
        """Minimum mapping granularity (2 MiB on the H200); every size and VA here is a multiple of it."""
        if self._granularity is None:
            flag = self.cu.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM
            g = int(self.call("cuMemGetAllocationGranularity", self.allocation_prop(), flag))
            if g <= 0 or g & (g - 1):
                raise RuntimeError(f"cuMemGetAllocationGranularity returned {g}, not a power of two")
            self._granularity = g
        return self._granularity

    def round_up(self, nbytes: int) -> int:
        """`nbytes` rounded up to the granularity; at least one granule."""
        g = self.granularity
        return max(g, -(-int(nbytes) // g) * g)

    def reserve(self, size: int) -> int:
        """Reserve `size` bytes of VA (granularity-aligned); returns the VA as an int."""
        self._check_size(size)
        return int(self.call("cuMemAddressReserve", size, self.granularity, 0, 0))

    def create(self, size: int) -> Any:
        """Create `size` bytes of physical memory; free device memory drops here. Returns the handle."""
        self._check_size(size)
        return self.call("cuMemCreate", size, self.allocation_prop(), 0)

    def map(self, va: int, size: int, handle: Any) -> None:
        self.call("cuMemMap", va, size, 0, handle, 0)

    def set_access(self, va: int, size: int) -> None:
        self.call("cuMemSetAccess", va, size, [self.access_desc()], 1)

    def unmap(self, va: int, size: int) -> None:
        self.call("cuMemUnmap", va, size)

    def release(self, handle: Any) -> None:
        """Release a physical allocation; its memory returns once it is also unmapped."""
        self.call("cuMemRelease", handle)

    def free_address(self, va: int, size: int) -> None:
        self.call("cuMemAddressFree", va, size)

    def synchronize(self) -> None:
        """Wait for all work of the context (every stream)."""
        self.call("cuCtxSynchronize")

    def mem_get_info(self) -> tuple[int, int]:
        """(free, total) device memory as the driver sees it (includes VMM allocations)."""
        free, total = self.call("cuMemGetInfo")
        return int(free), int(total)

    def close(self) -> None:
        """Drop this object's reference on the primary context (PyTorch keeps its own)."""
        with self._lock:
            if self._closed:
                return
            self._raw("cuDevicePrimaryCtxRelease", self.device)
            self._closed = True

    def _check_size(self, size: int) -> None:
        g = self.granularity
        if size <= 0 or size % g:
            raise ValueError(f"size {size} is not a positive multiple of the VMM granularity {g}")
