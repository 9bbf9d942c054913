"""A VMM slot: a fixed virtual address range whose physical backing can be released and replaced.

Why: a CUDA graph records addresses. Offloading an activation by freeing it and reallocating it later
(`torch.empty`) gives it a new address the graph never reads. A slot reserves its VA once; tensors
wrap that VA (`data_ptr() == va` for the slot's whole life, mapped or not), and only the pages behind
it change: `unmap()` (synchronize, unmap, release: free device memory comes back) and `map()` (create,
map at the same VA, grant access). A graph captured over the slot's tensors stays valid across any
number of remaps, provided the slot is mapped (and holds the right bytes) whenever a replay touches it;
a replay that touches it unmapped is a hard fault (illegal address, error 700) that kills the context.

Driver calls go through a `VmmDriver` (checked, any thread). On CPU the tests use a fake driver whose
"VA" is host memory, which is also how `wrap_pointer` is tested with a CPU pointer.

On a GPU: `qeffect offload-check` and tests/test_offload_gpu.py.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from qeffect.fp8.te_compat import storage_from_data_pointer
from qeffect.offload.driver import VmmDriver


def round_up(nbytes: int, granularity: int) -> int:
    """`nbytes` rounded up to a multiple of `granularity` (at least one granule)."""
    if granularity <= 0:
        raise ValueError(f"granularity must be positive, got {granularity}")
    return max(granularity, -(-int(nbytes) // granularity) * granularity)


def contiguous_stride(shape: Sequence[int]) -> tuple[int, ...]:
    stride, acc = [], 1
    for n in reversed(shape):
        stride.append(acc)
        acc *= max(int(n), 1)
    return tuple(reversed(stride))


def span_bytes(shape: Sequence[int], stride: Sequence[int], itemsize: int) -> int:
    """Bytes from the first to one past the last element a (shape, stride) view touches."""
    if any(int(n) == 0 for n in shape):
        return 0
    return (sum((int(n) - 1) * int(s) for n, s in zip(shape, stride, strict=True)) + 1) * itemsize


def wrap_pointer(ptr: int, nbytes: int, device: torch.device | str, dtype: torch.dtype, shape: Sequence[int],
                 stride: Sequence[int] | None = None) -> torch.Tensor:
    """A tensor over memory PyTorch does not own: `data_ptr() == ptr`, nothing is freed when it dies.

    `fp8.te_compat.storage_from_data_pointer` builds a storage with no deleter over
    [ptr, ptr + nbytes); `Tensor.set_` gives it a dtype, shape and stride. Works for CUDA and CPU
    pointers alike (the CPU tests wrap a CPU tensor's pointer).
    """
    device = torch.device(device)
    shape = tuple(int(n) for n in shape)
    stride = tuple(int(s) for s in stride) if stride is not None else contiguous_stride(shape)
    itemsize = dtype.itemsize
    need = span_bytes(shape, stride, itemsize)
    if need > nbytes:
        raise ValueError(f"a {dtype} view of shape {shape} stride {stride} needs {need} bytes, only {nbytes} given")
    if ptr % itemsize:
        raise ValueError(f"pointer {ptr:#x} is not aligned to the {itemsize}-byte {dtype}")
    storage = storage_from_data_pointer(ptr, device, nbytes)
    t = torch.empty(0, dtype=dtype, device=device)
    t.set_(storage, 0, shape, stride)
    return t


class VmmSlot:
    """A fixed VA range of `size` bytes (granularity-rounded) with swappable physical backing.

    Life: reserve (constructor) -> map -> [unmap -> map]* -> close. `va` never changes; tensors from
    `tensor()` stay valid views of it across remaps (their bytes do not: a fresh mapping holds garbage
    until someone writes it).
    """

    def __init__(self, driver: VmmDriver, nbytes: int, *, map_now: bool = True,
                 device: torch.device | str | None = None, name: str = "slot") -> None:
        if nbytes <= 0:
            raise ValueError(f"slot {name!r}: nbytes must be positive, got {nbytes}")
        self.driver, self.name = driver, name
        self.requested = int(nbytes)
        self.size = driver.round_up(nbytes)
        self.device = torch.device(device) if device is not None else driver.torch_device
        self.va = driver.reserve(self.size)
        self._handle = None
        self._mapped = False
        self._closed = False
        self.maps = 0
        self.unmaps = 0
        if map_now:
            self.map()

    @property
    def mapped(self) -> bool:
        return self._mapped

    @property
    def closed(self) -> bool:
        return self._closed

    def _live(self, op: str) -> None:
        if self._closed:
            raise RuntimeError(f"slot {self.name!r}: {op} after close()")

    def map(self) -> None:
        """Create physical memory, map it at `va` and grant this device read-write access."""
        self._live("map")
        if self._mapped:
            raise RuntimeError(f"slot {self.name!r} is already mapped")
        d = self.driver
        handle = d.create(self.size)
        try:
            d.map(self.va, self.size, handle)
        except BaseException:
            d.release(handle)
            raise
        try:
            d.set_access(self.va, self.size)  # after EVERY map: a new mapping starts with no access
        except BaseException:
            d.unmap(self.va, self.size)
            d.release(handle)
            raise
        self._handle, self._mapped = handle, True
        self.maps += 1

    def unmap(self, *, wait: Callable[[], None] | None = None) -> None:
        """Wait, unmap and release the physical memory; the VA stays reserved.

        `wait` must return only when no queued device work touches the slot any more (for example the
        host synchronize of the event recorded after the last copy out of it). Default: synchronize
        the whole context (always safe, stalls every stream).
        """
        self._live("unmap")
        if not self._mapped:
            raise RuntimeError(f"slot {self.name!r} is not mapped")
        (wait or self.driver.synchronize)()
        self.driver.unmap(self.va, self.size)
        handle, self._handle, self._mapped = self._handle, None, False
        self.unmaps += 1
        self.driver.release(handle)

    def remap(self, *, wait: Callable[[], None] | None = None) -> None:
        """New physical pages at the same VA (the old bytes are gone)."""
        self.unmap(wait=wait)
        self.map()

    def tensor(self, shape: Sequence[int], dtype: torch.dtype, *, offset: int = 0,
               stride: Sequence[int] | None = None) -> torch.Tensor:
        """A view at `va + offset`; its data_ptr() is that address whether or not the slot is mapped."""
        self._live("tensor")
        if offset < 0 or offset >= self.size:
            raise ValueError(f"slot {self.name!r}: offset {offset} outside [0, {self.size})")
        return wrap_pointer(self.va + offset, self.size - offset, self.device, dtype, shape, stride)

    def bytes(self, nbytes: int | None = None, *, offset: int = 0) -> torch.Tensor:
        """The slot's bytes [offset, offset + nbytes) as a flat uint8 tensor (for whole-slot copies)."""
        n = self.size - offset if nbytes is None else int(nbytes)
        return self.tensor((n,), torch.uint8, offset=offset)

    def close(self, *, wait: Callable[[], None] | None = None) -> None:
        """Unmap (if mapped) and free the VA. Tensors from `tensor()` must not be used afterwards."""
        if self._closed:
            return
        if self._mapped:
            self.unmap(wait=wait)
        self.driver.free_address(self.va, self.size)
        self._closed = True

    def __enter__(self) -> VmmSlot:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else ("mapped" if self._mapped else "unmapped")
        return f"VmmSlot({self.name!r}, va={self.va:#x}, size={self.size}, {state})"
