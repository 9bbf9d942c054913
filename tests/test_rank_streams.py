"""Which one-process pipelines put each rank on its own stream, and the transport without events (CPU)."""

from __future__ import annotations

import pytest
import torch

from qeffect.config import load_config
from qeffect.runtime.build import build_single_process, rank_streams
from qeffect.runtime.transport import LocalTransport


def test_rank_streams_are_for_pipelines_without_offload() -> None:
    """Both backends (Transformer Engine's captures get a workspace per rank), not with offload, not when
    switched off."""
    cfg = load_config()
    assert cfg.fp8.backend == "reference" and rank_streams(cfg)
    assert rank_streams(cfg.with_overrides(**{"fp8.backend": "te"}))
    assert not rank_streams(cfg.with_overrides(**{"offload.mode": "release"}))
    assert not rank_streams(cfg.with_overrides(**{"offload.mode": "resident"}))
    assert not rank_streams(cfg.with_overrides(**{"runtime.rank_streams": False}))


def test_pipelines_without_graphs_keep_one_stream() -> None:
    """Eager qeffect and native eager have no rank streams (and a CPU cannot have any)."""
    cfg = load_config()
    for native in (True, False):
        assert build_single_process(cfg, native=native, device="cpu").rank_streams is None


def test_the_transport_without_events_hands_over_once() -> None:
    t = LocalTransport()
    x = torch.ones(3)
    t.put("act", 0, 1, x)
    with pytest.raises(RuntimeError, match="published twice"):
        t.put("act", 0, 1, x)
    assert t.get("act", 0, 1) is x and t.empty()
    with pytest.raises(RuntimeError, match="not available yet"):
        t.get("act", 0, 1)
