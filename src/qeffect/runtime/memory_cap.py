"""`train.memory_fraction`: cap this process's CUDA memory, and say in one line when a run does not fit.

Why a cap: pipeline users run out of memory before anything else, and offload exists to lower the peak.
A cap makes "fits or not" a property of a configuration on a bigger GPU, so a run that needs offload can
be shown to need it. torch's caching allocator enforces the cap (`set_per_process_memory_fraction`):
an allocation over it raises `torch.OutOfMemoryError`. Inside a CUDA graph capture the failed allocation
also invalidates the capture, and the capture's own exit may raise a second error over it, so the out of
memory error is looked for along the exception's chain.

Offload's slots are CUDA VMM memory, which the caching allocator never sees: under a cap, `CappedVmm`
counts them with torch's reserved bytes, so that a run cannot pass by moving its activations out of the
cap's sight.
"""

from __future__ import annotations

import gc
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from qeffect.config import RunConfig
from qeffect.errors import UserError

GIB = 1024**3
# the fraction `apply_memory_fraction` set, by device index: torch's cap is the process's, and so is this
_APPLIED: dict[int, float] = {}


def apply_memory_fraction(cfg: RunConfig, device: torch.device | None = None) -> float | None:
    """Set the cap on `device` (default: the current CUDA device); returns the fraction, None without one."""
    fraction = cfg.train.memory_fraction
    if not fraction:
        return None
    if cfg.train.device != "cuda" or not torch.cuda.is_available():
        raise UserError(f"train.memory_fraction = {fraction} caps CUDA memory: it needs train.device = cuda "
                        "and a CUDA device")
    index = device.index if device is not None and device.index is not None else torch.cuda.current_device()
    torch.cuda.set_per_process_memory_fraction(fraction, index)
    _APPLIED[index] = fraction
    return fraction


def cap_bytes(device: torch.device) -> int | None:
    """The cap in bytes that this process put on `device` (`apply_memory_fraction`; None without one).
    Only a cap in force counts offload's slots: a benchmark or a verification that builds a config with
    `train.memory_fraction` but never applies it runs uncapped, its offload included."""
    if device.type != "cuda" or not _APPLIED:
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    fraction = _APPLIED.get(index)
    if not fraction:
        return None
    return int(fraction * torch.cuda.get_device_properties(index).total_memory)


class CappedVmm:
    """A VMM driver (`offload.driver.VmmDriver`) whose physical memory counts against the cap with the
    caching allocator's reserved bytes: a `create` that would take their sum over the cap raises
    `torch.OutOfMemoryError`, as a torch allocation over it does, and torch's own limit is the cap less
    the live VMM bytes, moved at each `create` and `release`. Everything else is the wrapped driver's.
    `reserved` and `set_limit` default to torch's (CUDA) and are parameters for tests."""

    def __init__(self, driver: Any, cap: int, *, reserved: Callable[[], int] | None = None,
                 set_limit: Callable[[int], None] | None = None) -> None:
        self._driver = driver
        self.cap = cap
        index = getattr(driver, "ordinal", 0)
        total = torch.cuda.get_device_properties(index).total_memory if set_limit is None else 0
        self._reserved = reserved or (lambda: torch.cuda.memory_reserved(index))
        self._set_limit = set_limit or (
            lambda nbytes: torch.cuda.set_per_process_memory_fraction(max(nbytes, 0) / total, index))
        self._live: list[tuple[Any, int]] = []  # (handle, bytes) of every physical allocation not released
        self.peak_bytes = 0

    @property
    def live_bytes(self) -> int:
        return sum(size for _, size in self._live)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._driver, name)

    def create(self, size: int) -> Any:
        used = self._reserved()
        if used + self.live_bytes + size > self.cap:
            raise torch.OutOfMemoryError(
                f"CUDA out of memory: an offload slot of {size} bytes over the cap of {self.cap} bytes "
                f"(torch reserved {used}, offload slots {self.live_bytes})")
        handle = self._driver.create(size)
        self._live.append((handle, size))
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)
        self._set_limit(self.cap - self.live_bytes)
        return handle

    def release(self, handle: Any) -> None:
        self._driver.release(handle)
        for i, (h, _) in enumerate(self._live):
            if h is handle or h == handle:
                del self._live[i]
                self._set_limit(self.cap - self.live_bytes)
                break


def is_out_of_memory(err: BaseException) -> bool:
    """Whether `err`, or an exception it was raised from or during, is a device out-of-memory error."""
    seen: set[int] = set()
    e: BaseException | None = err
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower():
            return True
        e = e.__cause__ or e.__context__
    return False


def refusal(cfg: RunConfig, total_bytes: int | None) -> str:
    """The one line a capped run that does not fit stops with."""
    fraction = cfg.train.memory_fraction
    cap = f"{fraction * total_bytes / GIB:.1f} GiB of {total_bytes / GIB:.1f} GiB" if total_bytes else "its cap"
    mode = cfg.offload.mode
    hint = ("set offload.mode = release to lower the peak" if mode == "off"
            else f"offload.mode = {mode} does not lower the peak enough: raise the cap")
    return (f"train.memory_fraction = {fraction}: the {cfg.train.path} run does not fit in {cap} "
            f"(out of device memory); {hint}")


@contextmanager
def refuse_out_of_memory(cfg: RunConfig) -> Iterator[None]:
    """With a cap: an out-of-memory error inside becomes one `UserError` line (`refusal`); anything else,
    and any error without a cap, passes unchanged."""
    try:
        yield
    except UserError:
        raise
    except Exception as err:
        if not cfg.train.memory_fraction or not is_out_of_memory(err):
            raise
        total = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory \
            if torch.cuda.is_available() else None
        raise UserError(refusal(cfg, total)) from None


def release_device_memory(device: torch.device) -> None:
    """A dropped pipeline's memory back to the device before the next one is built: reference cycles
    collected, the device idle, torch's cached blocks returned."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
