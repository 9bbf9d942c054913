"""One-process captured pipelines with each rank on its own stream: the handoff's event, and the bits of
native eager and of the one-stream run."""

from __future__ import annotations

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.mark.parametrize("events", [True, False])
def test_a_handoff_waits_for_the_producers_stream_only_with_events(events: bool) -> None:
    """A producer stream busy for ~50 ms, then writing the tensor it publishes; the consumer takes it on its
    own stream and copies it at once. With events the copy sees the write; without (the host's order
    only, the fault) it reads the old value: the check can fail."""
    from qeffect.runtime.transport import LocalTransport

    producer, consumer = torch.cuda.Stream(), torch.cuda.Stream()
    t = torch.zeros(1 << 20, device="cuda")
    torch.cuda.synchronize()
    transport = LocalTransport(events=events)
    with torch.cuda.stream(producer):
        torch.cuda._sleep(100_000_000)  # cycles: tens of milliseconds on any current GPU
        t.fill_(1.0)
        transport.put("act", 0, 0, t)
    with torch.cuda.stream(consumer):
        seen = transport.get("act", 0, 0).clone()
    torch.cuda.synchronize()
    assert bool((seen == 1.0).all()) == events


def _cfg(schedule: str, backend: str):
    from qeffect.config import load_config

    # big enough that one rank's kernels run beside the other's (the tiny default's steps are host-bound)
    return load_config().with_overrides(**{
        "train.device": "cuda", "train.dtype": "bfloat16", "model.hidden": 512, "model.ffn": 2048,
        "model.heads": 8, "model.seq_len": 128, "pipeline.microbatches": 8, "pipeline.schedule": schedule,
        "fp8.backend": backend})


@pytest.mark.parametrize("backend", ["reference", "te"])
@pytest.mark.parametrize("schedule", ["interleaved", "zbv"])
@pytest.mark.parametrize("path", ["captured-direct", "captured-copy"])
def test_rank_streams_keep_the_bits_of_native_eager_and_of_one_stream(schedule: str, path: str,
                                                                      backend: str) -> None:
    """Five steps of the same data: the losses, then every parameter and optimizer moment, bit for bit,
    with rank streams (the default), with one stream (``runtime.rank_streams = false``) and native eager."""
    from qeffect.runtime.build import build_single_process
    from qeffect.verify.state import bitwise_equal, synthetic_batches

    if backend == "te":
        pytest.importorskip("transformer_engine")
    cfg = _cfg(schedule, backend)
    native = build_single_process(cfg, native=True, device="cuda")
    streams = build_single_process(cfg, native=False, device="cuda", path=path)
    one = build_single_process(cfg.with_overrides(**{"runtime.rank_streams": False}), native=False, device="cuda",
                               path=path)
    assert streams.rank_streams is not None and len(streams.rank_streams) == cfg.pipeline.pp
    assert one.rank_streams is None
    # Transformer Engine's captures took a workspace per rank, kept with the pipeline
    assert len(streams.keep_alive) == (cfg.pipeline.pp if backend == "te" else 0)
    for step in range(5):
        batches = synthetic_batches(cfg, step, "cuda")
        want = native.step(batches)
        assert bitwise_equal(streams.step(batches), want), step
        assert bitwise_equal(one.step(batches), want), step
    for pipe in (native, streams, one):
        pipe.settle()
    want = _state(native)  # by stage and name: ZB-V's ranks own other stages than native's (Interleaved)
    for pipe in (streams, one):
        got = _state(pipe)
        assert sorted(got) == sorted(want)
        for k, v in want.items():
            assert bitwise_equal(got[k], v), k


def _state(pipe) -> dict[str, torch.Tensor]:
    """Every parameter and its two AdamW moments, by stage and name."""
    out = {}
    for r in pipe.ranks:
        for s, chunk in r.chunks.items():
            for name, p in chunk.named_parameters():
                state = r.optimizer.state[p]
                out[f"s{s}.{name}"] = p
                out[f"s{s}.{name}.exp_avg"] = state["exp_avg"]
                out[f"s{s}.{name}.exp_avg_sq"] = state["exp_avg_sq"]
    return out


def test_te_gemms_take_the_scopes_own_workspace() -> None:
    """Inside `own_cublas_workspace` Transformer Engine's GEMMs get the scope's workspace; after it, TE's
    own again."""
    te_gemm = pytest.importorskip("transformer_engine.pytorch.cpp_extensions.gemm")
    from qeffect.fp8.te import own_cublas_workspace

    index = torch.cuda.current_device()
    default = te_gemm.get_cublas_workspace(index, False, False)
    with own_cublas_workspace("cuda") as ws:
        assert te_gemm.get_cublas_workspace(index, False, False) is ws
        assert ws is not default and ws.numel() == default.numel()
    assert te_gemm.get_cublas_workspace(index, False, False) is default
