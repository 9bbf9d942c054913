"""Graph manager on a real GPU: bitwise replay, dynamic inputs, the handshake race, no memory growth."""

from __future__ import annotations

import pytest
import torch

from qeffect.fp8.te import te_available

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def _body(a: torch.Tensor, b: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    h = torch.relu(a @ w + b)
    return torch.softmax(h, dim=-1) * h.sum() - b


def _capture(protocol: str = "two-way"):
    from qeffect.graphs import GraphManager

    g = torch.Generator(device="cuda").manual_seed(0)
    a = torch.randn(64, 128, device="cuda", generator=g)
    b = torch.randn(256, device="cuda", generator=g)
    w = torch.randn(128, 256, device="cuda", generator=g)
    mgr = GraphManager("cuda", protocol=protocol)
    action = mgr.capture("body", lambda: _body(a, b, w), static_inputs={"a": a, "b": b}, warmup=2)
    return mgr, action, (a, b, w), g


def test_capture_and_replay_match_eager_bitwise() -> None:
    mgr, action, (a, b, w), _ = _capture()
    eager = _body(a.clone(), b.clone(), w)
    out = mgr.replay(action)
    assert torch.equal(out, eager)
    assert out is action.outputs
    assert (mgr.stats.graph_count, mgr.stats.replay_count, mgr.stats.handoffs) == (1, 1, 2)
    assert mgr.stats.capture_host_seconds > 0


def test_replay_with_new_dynamic_inputs_gives_the_new_result() -> None:
    mgr, action, (a, b, w), g = _capture()
    first = _body(a.clone(), b.clone(), w)
    for _ in range(3):
        a2 = torch.randn(64, 128, device="cuda", generator=g)
        b2 = torch.randn(256, device="cuda", generator=g)
        eager = _body(a2, b2, w)
        out = mgr.replay(action, {"a": a2, "b": b2})
        assert torch.equal(out, eager)
        assert not torch.equal(out, first)
    assert torch.equal(action.static_inputs["a"], a2)


def test_handshake_one_way_races_and_two_way_and_stream_ordered_do_not() -> None:
    from qeffect.graphs.handshake import run_handshake_check

    one = run_handshake_check("one-way", 200)
    two = run_handshake_check("two-way", 200)
    ordered = run_handshake_check("stream-ordered", 200)
    assert one.stale_reads > 0, one
    assert two.stale_reads == 0, two
    assert ordered.stale_reads == 0, ordered


def test_no_persistent_memory_growth_over_50_replays() -> None:
    mgr, action, (a, b, w), g = _capture()
    caller = torch.cuda.current_stream()
    kept = []
    for step in range(50):
        a2 = torch.randn(64, 128, device="cuda", generator=g)
        out = mgr.replay(action, {"a": a2})
        del a2  # freed at once; record_stream holds it for the graph stream's copy only
        if step % 10 == 0:
            kept.append(out.sum().item())  # a consumer on the caller stream (host sync is the test's, not replay's)
        caller.synchronize()
        mgr.mark_step()
    assert len(mgr.stats.step_allocated) == 50
    assert mgr.persistent_growth_per_step() == 0.0, mgr.stats.step_allocated
    assert mgr.stats.persistent_growth_bytes() == 0
    assert mgr.stats.replay_count == 50 and mgr.stats.handoffs == 100


def test_the_device_token_chain_follows_the_ledger() -> None:
    """Captured actions carry each chunk's effect token on the device (in place on one buffer every graph
    of the chunk increments): after every step its device value is the ledger's host sequence number, and
    the losses are native eager's bit for bit."""
    from qeffect.config import load_config
    from qeffect.graphs.captured import CapturedStageActions
    from qeffect.runtime.build import build_single_process
    from qeffect.verify.state import synthetic_batches

    cfg = load_config(None).with_overrides(**{"train.device": "cuda"})
    pipe = build_single_process(cfg, native=False, device="cuda", path="captured-direct")
    acts = [a for r in pipe.ranks for a in r.actions.values()]
    assert acts and all(isinstance(a, CapturedStageActions) for a in acts)
    losses = []
    for step in range(3):
        losses.append(pipe.step(synthetic_batches(cfg, step, "cuda")))
        torch.cuda.synchronize()
        for a in acts:  # 3 actions per microbatch and step on every chunk
            assert a.ledger.seq == 3 * cfg.pipeline.microbatches * (step + 1)
            assert int(a.ledger.current.value) == a.ledger.seq, a.stage
    native = build_single_process(cfg, native=True, device="cuda")
    ref = [native.step(synthetic_batches(cfg, step, "cuda")) for step in range(3)]
    assert torch.equal(torch.stack(losses), torch.stack(ref))  # the token carries no numbers of the model


@pytest.mark.skipif(not torch.cuda.is_available() or not te_available(), reason="needs CUDA and Transformer Engine")
def test_a_captured_te_step_launches_only_its_own_scaling_updates_and_no_skipped_fold() -> None:
    """After TE's own modules ran in this process (the te-graphed anchor) and the profile emptied TE's global
    delayed-scaling buffers, a captured te step holds one batched scaling update per F and dI graph, none of
    the anchor's, and no gated fold that every replay skips (fixed staging depth: the deferred last group)."""
    from torch.profiler import ProfilerActivity, profile

    from qeffect.config import load_config
    from qeffect.profile.matrix import release_memory
    from qeffect.profile.te_anchor import TEGraphedLayers
    from qeffect.runtime.build import build_single_process
    from qeffect.verify.state import synthetic_batches

    device = torch.device("cuda", torch.cuda.current_device())
    cfg = load_config().with_overrides(**{"fp8.backend": "te", "train.device": "cuda"})
    anchor = TEGraphedLayers(cfg, device)
    anchor.step(anchor.data(0))  # its modules join TE's global buffers
    del anchor
    release_memory(device)
    pipe = build_single_process(cfg, native=False, device=device, path="captured-direct")
    for i in range(3):
        pipe.step(synthetic_batches(cfg, i, device))
    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        pipe.step(synthetic_batches(cfg, 3, device))
        torch.cuda.synchronize(device)
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    p = cfg.pipeline
    assert sum("amax_and_scale_update" in n for n in names) == 2 * p.num_stages * p.microbatches
    assert not any("fold_gated" in n for n in names)
