"""The stream, event and copy operations an offload group needs, behind one small protocol.

Why a protocol: the correctness of offload is an ordering question (which stream waits on which event
before which copy, and when the host may unmap). With every such operation going through `StreamOps`,
the CPU tests replace the GPU by `qeffect.offload.fake.FakeDevice`, a scheduler that runs each stream's
queue in a random legal interleaving, and check both the recorded order and the bytes.

`StreamOps` is the device-completion contract's `EventOps` (`qeffect.contracts.completion`) plus copies
and host waits: every implementation here (and `FakeDevice`) can back a `CompletionLedger` as is.

`TorchCudaStreams` runs on the H200 in tests/test_offload_gpu.py and `qeffect offload-check`.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Protocol

import torch
from torch import Tensor

from qeffect.contracts import EventOps
from qeffect.fp8.te_compat import current_raw_stream_getter


class StreamOps(EventOps, Protocol):
    """Streams and events are opaque to the caller; only these operations touch them."""

    def current_stream(self) -> Any: ...
    def new_stream(self, name: str) -> Any: ...
    def new_event(self, name: str, timing: bool = False) -> Any: ...
    def record(self, event: Any, stream: Any) -> None: ...
    def wait(self, stream: Any, event: Any) -> None: ...
    def copy(self, dst: Tensor, src: Tensor, stream: Any) -> None: ...
    def synchronize_event(self, event: Any) -> None: ...
    def query(self, event: Any) -> bool: ...
    def host_buffer(self, nbytes: int) -> Tensor: ...


class TorchCudaStreams:
    """The real operations on one CUDA device (torch.cuda streams and events, pinned host memory).

    Copies are torch `copy_` calls, not raw `cuMemcpyAsync`: torch's pinned-memory allocator then knows
    a copy is in flight and does not hand a host buffer freed meanwhile to another tensor. (A raw
    driver copy was measured on the H200 and changed no step time.)"""

    def __init__(self, device: torch.device | str = "cuda") -> None:
        self.device = torch.device(device)
        if self.device.type != "cuda":
            raise ValueError(f"TorchCudaStreams needs a CUDA device, got {self.device}")
        if self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())

    def current_stream(self) -> torch.cuda.Stream:
        return torch.cuda.current_stream(self.device)

    def new_stream(self, name: str) -> torch.cuda.Stream:
        return torch.cuda.Stream(self.device)

    def new_event(self, name: str, timing: bool = False) -> torch.cuda.Event:
        return torch.cuda.Event(enable_timing=timing)

    def record(self, event: torch.cuda.Event, stream: torch.cuda.Stream) -> None:
        event.record(stream)

    def wait(self, stream: torch.cuda.Stream, event: torch.cuda.Event) -> None:
        stream.wait_event(event)

    def copy(self, dst: Tensor, src: Tensor, stream: torch.cuda.Stream) -> None:
        # Slot memory is not the caching allocator's and host buffers live as long as their group,
        # so no record_stream is needed to keep either alive while the copy is queued.
        with torch.cuda.stream(stream), torch.no_grad():
            dst.copy_(src, non_blocking=True)

    def synchronize_event(self, event: torch.cuda.Event) -> None:
        event.synchronize()

    def query(self, event: torch.cuda.Event) -> bool:
        return bool(event.query())

    def host_buffer(self, nbytes: int) -> Tensor:
        """Pinned: a pageable destination would make the copy synchronous (and stage through a bounce buffer)."""
        return torch.empty(int(nbytes), dtype=torch.uint8, pin_memory=True)


class RawStream(NamedTuple):
    """A stream as its handle alone: what `DriverCudaStreams` needs of the current stream (torch builds a
    `torch.cuda.Stream` for each `current_stream` call, several times the raw handle's host cost)."""

    cuda_stream: int


class DriverCudaStreams(TorchCudaStreams):
    """`TorchCudaStreams` whose copies, event records and stream waits are driver calls on raw handles
    (`cuMemcpyAsync`, `cuEventRecord`, `cuStreamWaitEvent`), each result checked.

    Why: chunked resident copies issue several copies and events per group, and the host then queues a
    step almost as slowly as the device runs it; a driver call skips torch's dispatcher and stream
    guard (both measured). Events are torch's (their `query`, `synchronize` and `elapsed_time` stay torch's:
    torch's `Event.query` costs the host less than `cuEventQuery` through `cuda.bindings`, measured in the
    same A/B), created at once by a first record: torch creates
    the CUDA event lazily at its first record, and a raw handle must exist before a driver call uses it.
    The default of `OffloadManager` on a GPU; `offload.driver_streams = false` selects torch's (the A/B).
    Copies need contiguous tensors of equal size: offload copies whole byte views of slots and pinned host buffers."""

    def __init__(self, device: torch.device | str = "cuda") -> None:
        super().__init__(device)
        from qeffect.offload.driver import load_bindings

        self.cu = load_bindings()
        self._ok = self.cu.CUresult.CUDA_SUCCESS
        # raw handle wrappers by handle value (a wrapper holds only the integer: a handle reused after its
        # event or stream was destroyed wraps the same way, so nothing here keeps an object alive or grows)
        self._streams: dict[int, Any] = {}
        self._events: dict[int, Any] = {}
        # torch's current raw stream of a device index (its CUDA builds have it), else torch's stream object
        self._current_raw = current_raw_stream_getter()

    def _check(self, call: str, ret: tuple) -> None:
        if ret[0] != self._ok:
            from qeffect.offload.driver import CudaDriverError, result_code

            raise CudaDriverError(call, result_code(ret[0]), str(ret[0]), "stream operation on raw handles")

    def _stream(self, stream: torch.cuda.Stream) -> Any:
        h = stream.cuda_stream
        raw = self._streams.get(h)
        if raw is None:
            raw = self._streams[h] = self.cu.CUstream(h)
        return raw

    def _event(self, h: int) -> Any:
        raw = self._events.get(h)
        if raw is None:
            raw = self._events[h] = self.cu.CUevent(h)
        return raw

    def current_stream(self) -> Any:
        if self._current_raw is None:
            return super().current_stream()
        return RawStream(self._current_raw(self.device.index))

    def new_event(self, name: str, timing: bool = False) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=timing)
        event.record(torch.cuda.current_stream(self.device))  # creates the CUDA event now; a wait returns at once
        return event

    def record(self, event: torch.cuda.Event, stream: Any) -> None:
        if not event.cuda_event:  # not created yet (made elsewhere): torch's record creates it
            if isinstance(stream, RawStream):
                stream = torch.cuda.ExternalStream(stream.cuda_stream, device=self.device)
            event.record(stream)
            return
        self._check("cuEventRecord", self.cu.cuEventRecord(self._event(event.cuda_event), self._stream(stream)))

    def wait(self, stream: torch.cuda.Stream, event: torch.cuda.Event) -> None:
        if not event.cuda_event:  # never recorded: a no-op, as in CUDA
            return
        self._check("cuStreamWaitEvent",
                    self.cu.cuStreamWaitEvent(self._stream(stream), self._event(event.cuda_event), 0))

    def copy(self, dst: Tensor, src: Tensor, stream: Any) -> None:
        n = dst.numel() * dst.element_size()
        if not (dst.is_contiguous() and src.is_contiguous()) or n != src.numel() * src.element_size():
            raise ValueError(f"driver copy needs contiguous tensors of equal size, got {tuple(dst.shape)} "
                             f"{dst.dtype} <- {tuple(src.shape)} {src.dtype}")
        self._check("cuMemcpyAsync", self.cu.cuMemcpyAsync(dst.data_ptr(), src.data_ptr(), n, self._stream(stream)))
