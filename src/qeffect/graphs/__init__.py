"""CUDA graph manager: one graph stream, one pool, two-way or stream-ordered replay, statistics.

Importing this package touches no CUDA; only constructing a `GraphManager` without a fake backend does.
"""

from __future__ import annotations

from qeffect.graphs.manager import (
    CapturedAction,
    GraphBackend,
    GraphManager,
    HandshakeProtocol,
    TorchCudaBackend,
)
from qeffect.graphs.stats import GraphStats

__all__ = ["CapturedAction", "GraphBackend", "GraphManager", "GraphStats", "HandshakeProtocol", "TorchCudaBackend"]
