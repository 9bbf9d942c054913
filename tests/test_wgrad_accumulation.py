"""`pipeline.wgrad_accumulation`: the weight-gradient GEMM adds into the gradient in the activation dtype
("add", autograd's way) or accumulates in fp32 ("fused", Megatron-LM's). Native eager and every path follow
the choice, so each path is bitwise equal to its own native eager; the choices differ with bf16 activations.

CPU: the reference backend (eager split paths, and captured paths through the fake graphs of
`test_graph_binding_bitwise`). GPU (`gpu`): Transformer Engine's fused GEMM against its native backward,
and the captured paths on CUDA.
"""

from __future__ import annotations

import pytest
import torch

from qeffect.config import load_config
from qeffect.contracts.arena import GradientArena
from qeffect.fp8.gemm import fp8_mm
from qeffect.fp8.recipe import DelayedScalingRecipe
from qeffect.fp8.reference import RefFP8Linear
from qeffect.runtime.build import schedule_of, staging_of
from qeffect.verify.state import run_verify_state
from test_graph_binding_bitwise import BASE, fake_graphs  # noqa: F401 - the fixture, by name

BF16 = {"train.dtype": "bfloat16"}


def _passed(report) -> None:
    bad = [c for c in report.categories if c.mismatches or (c.compared == 0 and c.category != "cache_contents")]
    assert report.passed, (report.first_divergence, bad)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().view(torch.int32)


# ------------------------------------------------------------------------------------------ CPU
def test_fused_sums_fp32_gemm_results_and_add_sums_bf16_ones() -> None:
    """Native autograd over three microbatches: with `fused_wgrad` the fp32 `.grad` is the in-order sum of
    fp32 wgrad GEMM results; without, of bf16 ones cast. The two differ (bf16 rounding between)."""
    grads = {}
    for fused in (False, True):
        lin = RefFP8Linear(32, 16, False, DelayedScalingRecipe(), fused_wgrad=fused)
        with torch.no_grad():
            lin.weight.copy_(torch.randn(16, 32, generator=torch.Generator().manual_seed(0)) * 0.1)
        expected = None
        for m in range(3):
            g = torch.Generator().manual_seed(10 + m)
            x = torch.randn(8, 32, generator=g).to(torch.bfloat16).requires_grad_(True)
            dy = torch.randn(8, 16, generator=g).to(torch.bfloat16)
            lin.delay_wgrad = True  # keep the work to recompute the GEMM by hand, then run it natively
            lin(x, is_first_microbatch=(m == 0)).backward(dy)
            (work,) = lin.pop_wgrad_work()
            r = fp8_mm(work.dy_q_t, work.dy_scale_inv, work.x_q_t, work.x_scale_inv,
                       torch.float32 if fused else torch.bfloat16).float()
            expected = r if expected is None else expected + r
            dw = lin.compute_wgrad(work)
            assert dw.dtype == torch.float32
            lin.weight.grad = dw if lin.weight.grad is None else lin.weight.grad + dw
        assert lin.wgrad_dtype(torch.bfloat16) == (torch.float32 if fused else torch.bfloat16)
        assert torch.equal(_bits(lin.weight.grad), _bits(expected))
        grads[fused] = lin.weight.grad
    assert not torch.equal(grads[False], grads[True])


def test_fused_stages_nothing() -> None:
    cfg = load_config().with_overrides(**{"pipeline.wgrad_accumulation": "fused", "pipeline.wgrad_staging": 8})
    schedule = schedule_of(cfg)
    assert set(staging_of(cfg.pipeline, schedule, schedule.stages_of(0)).values()) == {0}
    plain = load_config().with_overrides(**{"pipeline.wgrad_staging": 3})
    assert set(staging_of(plain.pipeline, schedule, schedule.stages_of(0)).values()) == {3}


@pytest.mark.parametrize("schedule", ["interleaved", "zbv"])
def test_fused_eager_split_is_native_eager_bits_and_not_add_bits(monkeypatch, schedule: str) -> None:
    """bf16 activations: the split eager path is bitwise equal to native eager under fused accumulation,
    stages nothing, and its losses leave the add choice's (the choice is not a no-op)."""
    staged: list[dict] = []
    init = GradientArena.__init__

    def record(self, *args, **kwargs) -> None:
        staged.append(kwargs.get("staging"))
        init(self, *args, **kwargs)

    monkeypatch.setattr(GradientArena, "__init__", record)
    losses = {}
    for mode in ("add", "fused"):
        staged.clear()
        cfg = load_config().with_overrides(**{**BF16, "pipeline.schedule": schedule,
                                              "pipeline.wgrad_accumulation": mode})
        report = run_verify_state(cfg, steps=3)
        _passed(report)
        assert report.settings["pipeline.wgrad_accumulation"] == mode
        depths = {d for s in staged for d in (s.values() if isinstance(s, dict) else [s])}
        assert depths == ({0} if mode == "fused" else {min(cfg.pipeline.wgrad_staging, cfg.pipeline.microbatches)})
        losses[mode] = report.losses
    assert losses["add"][0] == losses["fused"][0]  # the first step's loss precedes any gradient
    assert losses["add"] != losses["fused"]


@pytest.mark.parametrize(("schedule", "path"), [
    ("interleaved", "captured-direct"), ("interleaved", "captured-copy"),
    ("zbv", "captured-direct"), ("zbv", "captured-copy"),
])
def test_fused_captured_paths_keep_native_eager_bits(fake_graphs, schedule: str, path: str) -> None:  # noqa: F811
    cfg = load_config().with_overrides(**{**BASE, **BF16, "pipeline.schedule": schedule, "pipeline.microbatches": 6,
                                          "pipeline.wgrad_accumulation": "fused"})
    report = run_verify_state(cfg, steps=3, path=path)
    _passed(report)
    assert report.graphs is not None and report.graphs["replays"] == 3 * 3 * 6 * 4


# ------------------------------------------------------------------------------------------ GPU
def _te_or_skip() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    pytest.importorskip("transformer_engine")


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["direct", "copy"])
def test_te_fused_split_dw_equals_the_native_fused_backward(mode: str) -> None:
    """TE built with fused accumulation: the native backward's GEMM accumulates into `main_grad`
    (overwriting at microbatch 0); the split `dW` writes the arena view (direct: the same GEMM call with its
    destination and flag set when it runs; copy: a fresh fp32 result the arena adds). Bits equal, and they
    differ from the bf16-output sum."""
    _te_or_skip()
    from qeffect.fp8.te import TEBackend

    backend = TEBackend(DelayedScalingRecipe(amax_history_len=4), fused_wgrad=True)
    mods = []
    for delayed in (False, True):
        lin = backend.linear(64, 128, True, device="cuda", dtype=torch.float32)
        with torch.no_grad():
            lin.weight.copy_(torch.randn(128, 64, generator=torch.Generator().manual_seed(1)) * 0.05)
            lin.bias.copy_(torch.randn(128, generator=torch.Generator().manual_seed(2)) * 0.05)
        lin.delay_wgrad = delayed
        mods.append(lin)
    native, split = mods
    native.bind_main_grad(torch.zeros_like(native.weight))
    split.bind_main_grad(None)
    view = torch.full_like(split.weight, float("nan"))
    for m in range(3):
        g = torch.Generator().manual_seed(100 + m)
        x = (torch.randn(2, 32, 64, generator=g) * (1 + m)).to("cuda", torch.bfloat16)
        dy = (torch.randn(2, 32, 128, generator=g) * 1e-2 * (1 + m)).to("cuda", torch.bfloat16)
        # the split path's weight was cast by its optimizer: TE sees is_first_microbatch=False and binds
        # accumulate=True at dI; the dW below must still overwrite at m = 0
        ya = native(x.clone().requires_grad_(True), is_first_microbatch=(m == 0))
        yb = split(x.clone().requires_grad_(True), is_first_microbatch=(m == 0))
        ya.backward(dy)
        yb.backward(dy)
        assert native.weight.grad is None and split.weight.grad is None  # no autograd weight gradient
        (work,) = split.pop_wgrad_work()
        if mode == "direct":
            assert split.compute_wgrad(work, out=view, accumulate=m > 0) is view
        else:
            dw = split.compute_wgrad(work)
            assert dw.dtype == torch.float32 and dw.shape == view.shape
            view.copy_(dw) if m == 0 else view.add_(dw)
        assert torch.equal(_bits(native.weight.main_grad), _bits(view)), m


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["te", "reference"])
@pytest.mark.parametrize(("schedule", "path"), [
    ("interleaved", "captured-direct"), ("zbv", "captured-direct"), ("interleaved", "captured-copy"),
])
def test_fused_captured_paths_on_cuda_keep_native_eager_bits(backend: str, schedule: str, path: str) -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    if backend == "te":
        _te_or_skip()
    cfg = load_config().with_overrides(**{**BF16, "train.device": "cuda", "fp8.backend": backend,
                                          "pipeline.schedule": schedule, "pipeline.wgrad_accumulation": "fused"})
    report = run_verify_state(cfg, steps=5, path=path)
    _passed(report)
    assert report.amax_rollover.rolled_over
