"""The CUDA driver calls that torch does not offer, through ctypes: a graph added to a stream capture.

A step graph is recorded as the host issues a step: every action graph becomes a child-graph node of the
capture under way on its stream. torch's `CUDAGraph.replay()` refuses to run while a stream captures (its
own check, before CUDA is asked), and the driver refuses `cuGraphLaunch` into a capturing stream (CUDA
900), so the graph is added by hand: the stream's capture graph and its current dependencies
(`cuStreamGetCaptureInfo`), a child-graph node after them (`cuGraphAddChildGraphNode`, which clones the
child), and that node as what the stream's next captured operation depends on
(`cuStreamUpdateCaptureDependencies`). Measured on an H100: 48 graphs of 20 kernels added this way and
launched as one graph cost the host 7.7 us against 404 us launched one by one, with the same values
(`benchmarks/graph_launch.py --nested`).

Importing this module touches nothing; `CaptureInserter()` opens `libcuda.so.1`.
"""

from __future__ import annotations

import ctypes

CAPTURE_STATUS_ACTIVE = 1  # CU_STREAM_CAPTURE_STATUS_ACTIVE
SET_CAPTURE_DEPENDENCIES = 1  # CU_STREAM_SET_CAPTURE_DEPENDENCIES


class CaptureInserter:
    """`add(stream, graph)`: `graph` (a `CUgraph`, e.g. `CUDAGraph(keep_graph=True).raw_cuda_graph()`) as one
    child-graph node of the capture under way on `stream` (a `CUstream` handle, `torch.cuda.Stream.cuda_stream`),
    after everything the stream captured so far; the stream's next captured operation comes after it."""

    def __init__(self) -> None:
        lib = ctypes.CDLL("libcuda.so.1")
        p, n, node_p = ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_void_p)
        self._add_child = lib.cuGraphAddChildGraphNode  # (node out, graph, deps, n deps, child)
        self._add_child.argtypes, self._add_child.restype = [node_p, p, node_p, n, p], ctypes.c_int
        # CUDA 12.3 and later carry edge data (`_v3` / `_v2`); older drivers only the versions without it
        self._with_edges = hasattr(lib, "cuStreamGetCaptureInfo_v3")
        status_p, id_p = ctypes.POINTER(ctypes.c_int), ctypes.POINTER(ctypes.c_uint64)
        if self._with_edges:
            self._info = lib.cuStreamGetCaptureInfo_v3
            self._info.argtypes = [p, status_p, id_p, node_p, ctypes.POINTER(node_p), node_p, ctypes.POINTER(n)]
            self._update = lib.cuStreamUpdateCaptureDependencies_v2
            self._update.argtypes = [p, node_p, p, n, ctypes.c_uint]
        else:
            self._info = lib.cuStreamGetCaptureInfo_v2
            self._info.argtypes = [p, status_p, id_p, node_p, ctypes.POINTER(node_p), ctypes.POINTER(n)]
            self._update = lib.cuStreamUpdateCaptureDependencies
            self._update.argtypes = [p, node_p, n, ctypes.c_uint]
        self._info.restype = self._update.restype = ctypes.c_int

    @staticmethod
    def _check(rc: int, call: str) -> None:
        if rc != 0:
            raise RuntimeError(f"{call} returned CUresult {rc}")

    def add(self, stream: int, graph: int) -> None:
        status, cid, capture = ctypes.c_int(), ctypes.c_uint64(), ctypes.c_void_p()
        deps, count = ctypes.POINTER(ctypes.c_void_p)(), ctypes.c_size_t()
        byref = ctypes.byref
        if self._with_edges:
            edges = ctypes.c_void_p()
            rc = self._info(stream, byref(status), byref(cid), byref(capture), byref(deps), byref(edges), byref(count))
        else:
            rc = self._info(stream, byref(status), byref(cid), byref(capture), byref(deps), byref(count))
        self._check(rc, "cuStreamGetCaptureInfo")
        if status.value != CAPTURE_STATUS_ACTIVE:
            raise RuntimeError(f"the stream is not capturing (capture status {status.value})")
        node = ctypes.c_void_p()
        self._check(self._add_child(byref(node), capture, deps, count.value, graph), "cuGraphAddChildGraphNode")
        rc = (self._update(stream, byref(node), None, 1, SET_CAPTURE_DEPENDENCIES) if self._with_edges
              else self._update(stream, byref(node), 1, SET_CAPTURE_DEPENDENCIES))
        self._check(rc, "cuStreamUpdateCaptureDependencies")
