"""A step's actions as one CUDA graph of child-graph nodes (`runtime.step_graph`) against native eager and
against ordinary captured steps, bit for bit, on a GPU."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _cfg(schedule: str, backend: str, rank_streams: bool):
    from qeffect.config import load_config

    return load_config().with_overrides(**{
        "train.device": "cuda", "train.dtype": "bfloat16", "model.hidden": 512, "model.ffn": 2048,
        "model.heads": 8, "model.seq_len": 128, "pipeline.microbatches": 8, "pipeline.schedule": schedule,
        "fp8.backend": backend, "runtime.rank_streams": rank_streams})


@pytest.mark.parametrize("rank_streams", [True, False])
@pytest.mark.parametrize("backend", ["reference", "te"])
@pytest.mark.parametrize("schedule", ["interleaved", "zbv"])
def test_a_step_graph_keeps_the_bits_of_native_eager(schedule: str, backend: str, rank_streams: bool) -> None:
    """Seven steps of the same data: two ordinary, one recorded, four replayed (each launched before its
    bookkeeping; with rank streams each rank's commit beside the others' last actions). Every loss against
    native eager's and the ordinary captured run's; then every parameter and AdamW moment."""
    from qeffect.runtime.build import STEP_GRAPH_AFTER, build_single_process
    from qeffect.verify.state import bitwise_equal, synthetic_batches
    from test_rank_streams_gpu import _state

    if backend == "te":
        pytest.importorskip("transformer_engine")
    cfg = _cfg(schedule, backend, rank_streams)
    native = build_single_process(cfg, native=True, device="cuda")
    ordinary = build_single_process(cfg.with_overrides(**{"runtime.step_graph": False}), native=False,
                                    device="cuda", path="captured-direct")
    graphed = build_single_process(cfg.with_overrides(**{"runtime.step_graph": True}), native=False,
                                   device="cuda", path="captured-direct")
    assert graphed.step_graph_after == STEP_GRAPH_AFTER and ordinary.step_graph_after is None
    steps = 7
    for step in range(steps):
        batches = synthetic_batches(cfg, step, "cuda")
        want = native.step(batches)
        assert bitwise_equal(ordinary.step(batches), want), step
        assert bitwise_equal(graphed.step(batches), want), step
    assert graphed.recorded is not None and graphed.recorded.replays == steps - STEP_GRAPH_AFTER
    # with rank streams each rank's commit waits for its own event of the graph, not the whole graph
    assert (graphed.recorded.rank_done is not None) == rank_streams
    for pipe in (native, ordinary, graphed):
        pipe.settle()
    want = _state(native)
    for pipe in (ordinary, graphed):
        got = _state(pipe)
        assert sorted(got) == sorted(want)
        for k, v in want.items():
            assert bitwise_equal(got[k], v), k


def test_a_step_graph_launches_once_per_step() -> None:
    """After the recorded step, a step's host issues one launch: its graph launches and input copies are
    gone from the manager's counts (the action graphs replay inside the step graph)."""
    from qeffect.graphs.stats import COPY, LAUNCH
    from qeffect.runtime.build import build_single_process
    from qeffect.verify.state import synthetic_batches

    cfg = _cfg("interleaved", "reference", True).with_overrides(**{"runtime.step_graph": True})
    pipe = build_single_process(cfg, native=False, device="cuda", path="captured-direct")
    for step in range(4):
        pipe.step(synthetic_batches(cfg, step, "cuda"))
    host = pipe.time_host_phases()
    before = {name: a.replays for name, a in pipe.manager.actions.items()}
    pipe.step(synthetic_batches(cfg, 4, "cuda"))
    torch.cuda.synchronize()
    assert {name: a.replays for name, a in pipe.manager.actions.items()} != before  # counted by the dry run
    assert host.calls[LAUNCH] == 1 and host.calls[COPY] == 0  # the step graph's one launch
