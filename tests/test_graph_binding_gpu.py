"""Graphs bounded by liveness on the GPU: at M = 16, both schedules, copy and direct, bitwise equal to
native eager through `verify-state`, with the planned (not 3 x M x chunks) graph count captured."""

from __future__ import annotations

import pytest
import torch

from qeffect.config import load_config
from qeffect.fp8.te import te_available
from qeffect.runtime.build import build_single_process
from qeffect.verify.state import run_verify_state, synthetic_batches

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

BACKENDS = ["reference", pytest.param("te", marks=pytest.mark.skipif(not te_available(),
                                                                      reason="needs Transformer Engine"))]


def _cfg(backend: str, schedule: str, microbatches: int = 16):
    over = {"train.device": "cuda", "train.dtype": "bfloat16", "fp8.backend": backend,
            "pipeline.schedule": schedule, "pipeline.microbatches": microbatches, "fp8.amax_history_len": 4,
            "pipeline.wgrad_staging_by_liveness": True}  # staging bounded by liveness too
    if backend == "te":  # TE's FP8 GEMMs want multiples of 16
        over.update({"model.hidden": 128, "model.ffn": 256, "model.heads": 4, "model.seq_len": 32,
                     "model.vocab_size": 512})
    return load_config().with_overrides(**over)


@pytest.mark.parametrize("path", ["captured-direct", "captured-copy"])
@pytest.mark.parametrize("schedule", ["interleaved", "zbv"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_bounded_graphs_are_bitwise_native_at_m16(backend: str, schedule: str, path: str) -> None:
    cfg = _cfg(backend, schedule)
    report = run_verify_state(cfg, steps=6, path=path)
    assert report.passed, report.first_divergence
    g = report.graphs
    p = cfg.pipeline
    assert g["graphs_per_rank"] == g["expected_per_rank"] < 3 * p.microbatches * p.chunks_per_rank


@pytest.mark.parametrize("schedule", ["interleaved", "zbv"])
def test_graphs_per_rank_stop_growing_from_m8(schedule: str) -> None:
    """What the pipeline captures is what the plan says, and M = 16 captures no more than M = 8."""
    counts = {}
    for m in (8, 16):
        pipe = build_single_process(_cfg("reference", schedule, m), native=False, path="captured-direct")
        assert pipe.manager.stats.graph_count == sum(r.planned_graphs() for r in pipe.ranks)
        pipe.step(synthetic_batches(_cfg("reference", schedule, m), 0, "cuda"))
        counts[m] = pipe.manager.stats.graph_count
        del pipe
        torch.cuda.empty_cache()
    assert counts[16] <= counts[8] * 1.5, counts
