"""Shared graph memory pools (`runtime.graph_pools = "shared"`) on a GPU: native eager's bits, with and
without offload (a pool per chain, a pool per kind), and less memory reserved than private pools."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _cfg(schedule: str, backend: str, offload: str, pools: str = "shared"):
    from test_step_graph_gpu import _cfg as step_graph_cfg  # the same small GPU model

    return step_graph_cfg(schedule, backend, True).with_overrides(**{"offload.mode": offload,
                                                                    "runtime.graph_pools": pools})


def _needs(backend: str, offload: str) -> None:
    if backend == "te":
        pytest.importorskip("transformer_engine")
    if offload != "off":
        from qeffect.offload.driver import bindings_available

        if not bindings_available():
            pytest.skip("offload needs cuda.bindings")


@pytest.mark.parametrize("offload", ["off", "release"])
@pytest.mark.parametrize("backend", ["reference", "te"])
@pytest.mark.parametrize("schedule", ["interleaved", "zbv"])
def test_shared_pools_keep_native_eager_bits(schedule: str, backend: str, offload: str) -> None:
    """verify-state over 4 steps, every action's fingerprint against native eager's."""
    from qeffect.verify.state import run_verify_state

    _needs(backend, offload)
    report = run_verify_state(_cfg(schedule, backend, offload), steps=4, path="captured-direct")
    assert report.passed, report.first_divergence


@pytest.mark.parametrize("offload", ["off", "release"])
def test_shared_pools_reserve_less_than_private_ones(offload: str) -> None:
    """The same pipeline built with private then shared pools, one after the other: the memory its build
    (warm-up and capture) reserved, and two steps' peak, both lower when shared."""
    from qeffect.profile.matrix import release_memory
    from qeffect.runtime.build import build_single_process
    from qeffect.verify.state import synthetic_batches

    _needs("te", offload)
    dev = torch.device("cuda")
    reserved = {}
    for pools in ("private", "shared"):
        cfg = _cfg("interleaved", "te", offload, pools)
        release_memory(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        before = torch.cuda.memory_reserved(dev)
        pipe = build_single_process(cfg, native=False, device="cuda", path="captured-direct")
        for step in range(2):
            pipe.step(synthetic_batches(cfg, step, "cuda"))
        torch.cuda.synchronize()
        reserved[pools] = torch.cuda.max_memory_reserved(dev) - before
        del pipe
    assert reserved["shared"] < reserved["private"], reserved
