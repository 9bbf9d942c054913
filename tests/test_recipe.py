"""The training recipe (`runtime.recipe`): the learning-rate schedule, global gradient-norm clipping and
`train.nonfinite`, in native eager and qeffect alike, bitwise (docs/design.md §7)."""

from __future__ import annotations

import json
import math
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from launch import run as _run
from launch import torchrun
from qeffect.config import OptimConfig, load_config
from qeffect.errors import UserError
from qeffect.runtime.build import build_single_process
from qeffect.runtime.recipe import Recipe, clip_factor, global_norm, stage_square_sum
from qeffect.runtime.single import SingleProcessPipeline
from qeffect.verify.state import bitwise_equal, run_verify_state, synthetic_batches

# the acceptance recipe: warm-up, cosine decay to a floor, clipping that engages on the tiny config
RECIPE = {"optim.schedule": "cosine", "optim.warmup_steps": 3, "optim.min_lr": 0.0003, "optim.clip_grad_norm": 0.5}
RECIPE_SETS = [f"{k}={v}" if not isinstance(v, str) else f'{k}="{v}"' for k, v in RECIPE.items()]


def _optim(**kw) -> OptimConfig:
    return OptimConfig(lr=1e-3, **kw)


def test_default_recipe_is_the_optimizers_lr_at_every_step() -> None:
    r = Recipe(OptimConfig(), total_steps=60)
    assert not r.varies and r.clip == 0.0
    assert all(r.lr(k) == OptimConfig().lr for k in range(1, 200))


def test_warmup_then_cosine_to_min_lr_over_the_rest_of_the_run() -> None:
    r = Recipe(_optim(schedule="cosine", warmup_steps=4, min_lr=1e-4), total_steps=14)
    assert [r.lr(k) for k in (1, 2, 3, 4)] == [1e-3 * 0.25, 1e-3 * 0.5, 1e-3 * 0.75, 1e-3]  # lr * (k / W)
    # decay over train.steps - W = 10 steps: t = k - 4
    for k in range(5, 15):
        t = (k - 4) / 10
        assert r.lr(k) == pytest.approx(1e-4 + 0.9e-3 * 0.5 * (1 + math.cos(math.pi * t)), rel=1e-15)
    assert r.lr(9) == pytest.approx(5.5e-4)  # halfway: the mean of lr and min_lr
    assert r.lr(14) == 1e-4  # the run's last step: min_lr
    assert r.lr(15) == r.lr(1000) == 1e-4
    assert all(r.lr(k) > r.lr(k + 1) for k in range(4, 14))


def test_linear_decay_and_explicit_decay_steps() -> None:
    r = Recipe(_optim(schedule="linear", decay_steps=4, min_lr=2e-4), total_steps=100)
    assert [r.lr(k) for k in (1, 2, 3, 4)] == pytest.approx([8e-4, 6e-4, 4e-4, 2e-4], rel=1e-14)
    assert r.lr(5) == r.lr(99) == 2e-4  # decay_steps, not train.steps, ends the decay
    c = Recipe(_optim(warmup_steps=2), total_steps=10)  # constant after a warm-up
    assert [c.lr(k) for k in (1, 2, 3, 10)] == [5e-4, 1e-3, 1e-3, 1e-3] and c.varies
    with pytest.raises(ValueError, match="optimizer steps count from 1, got 0"):
        c.lr(0)


def test_the_norm_does_not_depend_on_where_the_gradient_lives() -> None:
    """An arena-like view at an offset into a larger buffer and a fresh `.grad` of the same values: the
    same square sum and norm bits; the factor is torch's clip_grad_norm_ formula."""
    torch.manual_seed(0)
    grads = {"b.weight": torch.randn(37, 29), "a.bias": torch.randn(101)}
    buf = torch.zeros(4096 + 37 * 29 + 3)
    offset = 4096 + 3  # an odd offset: the view is copied before it is reduced
    view = buf[offset: offset + 37 * 29].view(37, 29)
    view.copy_(grads["b.weight"])
    region = torch.zeros(2 * 4096)[1024: 1024 + 101]  # 4096-byte offset: reduced in place
    region.copy_(grads["a.bias"])
    fresh = stage_square_sum(grads.items())
    placed = stage_square_sum([("b.weight", view), ("a.bias", region)])
    assert fresh.dtype == torch.float64 and bitwise_equal(fresh, placed)
    norm = global_norm([fresh, stage_square_sum([("w", torch.full((3,), 2.0))])])
    expected = math.sqrt(float(fresh) + 12.0)
    assert float(norm) == pytest.approx(expected, rel=1e-6)  # each gradient's norm is fp32
    f = clip_factor(norm, 0.5)
    assert f.dtype == torch.float32 and float(f) == pytest.approx(0.5 / (expected + 1e-6), rel=1e-7)
    assert float(clip_factor(torch.tensor(0.1, dtype=torch.float64), 0.5)) == 1.0


def _cfg(**extra):
    return load_config().with_overrides(**{**RECIPE, "train.steps": 12, **extra})


def test_clipping_engages_and_the_lr_follows_the_schedule() -> None:
    """Native eager on the tiny config with the acceptance recipe: the norm is above 0.5 on some step
    (factor < 1) and the gradients AdamW then uses have norm 0.5; every commit's learning rate is the
    schedule's, in every rank's optimizer."""
    cfg = _cfg()
    recipe = Recipe(cfg.optim, 12)
    pipe = build_single_process(cfg, native=True)
    clipped = []

    def used(rank) -> None:  # the gradients AdamW is about to use, per rank
        used.sq = getattr(used, "sq", 0.0) + sum(float(p.grad.double().square().sum())
                                                 for p in rank.optimizer.param_groups[0]["params"]
                                                 if p.grad is not None)

    for step in range(1, 6):
        used.sq = 0.0
        pipe.run_actions(synthetic_batches(cfg, step - 1, "cpu"))
        pipe.commit(before_step=used)
        norm = float(pipe.last_grad_norm)
        factor = float(clip_factor(pipe.last_grad_norm, 0.5))
        assert pipe.last_lr == recipe.lr(step)
        assert all(g["lr"] == recipe.lr(step) for r in pipe.ranks for g in r.optimizer.param_groups)
        if factor < 1.0:
            clipped.append(step)
            # each gradient's norm is an fp32 reduction, as torch's clip_grad_norm_ takes it: on the CPU, off
            # by up to ~3e-4 over the 2M-element head
            assert math.sqrt(used.sq) == pytest.approx(0.5, rel=1e-3)
        else:
            assert math.sqrt(used.sq) == pytest.approx(norm, rel=1e-3)
    assert clipped, "clipping never engaged"
    assert [pipe.last_lr, recipe.lr(1), recipe.lr(3)] == [recipe.lr(5), 1e-3, 3e-3]


def test_the_default_recipe_computes_no_norm(monkeypatch: pytest.MonkeyPatch) -> None:
    """Constant lr and no clipping: no gradient norm, no extra pass, each rank commits on its own."""
    from qeffect.runtime.rank import BaseRank

    def refuse(self):
        raise AssertionError("the default recipe must not read the gradients for a norm")

    monkeypatch.setattr(BaseRank, "gradient_square_sums", refuse)
    cfg = load_config()
    pipe = build_single_process(cfg, native=False)
    pipe.step(synthetic_batches(cfg, 0, "cpu"))
    assert pipe.last_grad_norm is None and pipe.last_lr == cfg.optim.lr
    assert all(g["lr"] == cfg.optim.lr for r in pipe.ranks for g in r.optimizer.param_groups)


@pytest.mark.parametrize("schedule", ["interleaved", "zbv"])
def test_verify_state_with_warmup_cosine_and_clipping_is_bitwise(schedule: str) -> None:
    """Single process, every action and commit against native eager, with the recipe on (the norm and
    the learning rate compared too); the horizon is the run's 6 steps: warm-up 3, decay 3."""
    cfg = load_config().with_overrides(**{**RECIPE, "pipeline.schedule": schedule})
    report = run_verify_state(cfg, steps=6)
    assert report.passed, report.first_divergence
    assert all(c.mismatches == 0 and c.compared > 0 for c in report.categories)


def _state(pipe: SingleProcessPipeline) -> dict[str, torch.Tensor]:
    out = {}
    for r in pipe.ranks:
        r.settle()
        for s, c in r.chunks.items():
            for n, p in c.named_parameters():
                out[f"s{s}.{n}"] = p.detach().clone()
                for k, v in r.optimizer.state.get(p, {}).items():
                    out[f"s{s}.{n}.{k}"] = v.detach().clone()
    return out


def _fp8(pipe: SingleProcessPipeline) -> dict[str, torch.Tensor]:
    return {f"s{s}.{k}": v.clone() for r in pipe.ranks for s in r.chunks for k, v in r.fp8_state(s).items()}


def test_a_skipped_commit_keeps_parameters_and_moments_in_native_and_qeffect_alike() -> None:
    """Step 2 of 3 skipped (after its actions and norm): parameters and AdamW state as after step 1, the
    FP8 state as the actions left it, the step counted (schedule, epochs); then native and qeffect are
    still bitwise equal."""
    cfg = _cfg()
    native, qeff = build_single_process(cfg, native=True), build_single_process(cfg, native=False)
    for step in range(3):
        batches = synthetic_batches(cfg, step, "cpu")
        for pipe in (native, qeff):
            if step == 1:
                before, fp8_before = _state(pipe), _fp8(pipe)
            pipe.run_actions(batches)
            if step == 1:
                assert math.isfinite(float(pipe.grad_norm()))
                pipe.commit(skip=True)
                after = _state(pipe)
                assert before.keys() == after.keys()
                assert all(bitwise_equal(before[k], after[k]) for k in before)
                assert any(not torch.equal(v, _fp8(pipe)[k]) for k, v in fp8_before.items())
            else:
                pipe.commit()
    assert native.last_lr == qeff.last_lr == Recipe(cfg.optim, 12).lr(3)
    assert all(r.step_index == 3 for r in native.ranks + qeff.ranks)
    assert all(r.clock.e_W == 3 for r in qeff.ranks)
    a, b = _state(native), _state(qeff)
    assert a.keys() == b.keys() and all(bitwise_equal(a[k], b[k]) for k in a)
    fa, fb = _fp8(native), _fp8(qeff)
    assert all(bitwise_equal(fa[k], fb[k]) for k in fa)


def _nan_at(monkeypatch: pytest.MonkeyPatch, step: int) -> None:
    """The step loss of training step `step` (counted from 1) reads NaN (the gradients stay finite)."""
    calls = {"n": 0}
    actions = SingleProcessPipeline._actions

    def patched(self, batches, observer=None):
        loss = actions(self, batches, observer)
        calls["n"] += 1
        return torch.full_like(loss, math.nan) if calls["n"] == step else loss

    monkeypatch.setattr(SingleProcessPipeline, "_actions", patched)


def test_nonfinite_stop_names_the_step_and_the_last_good_checkpoint(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from qeffect.runtime.train import train

    _nan_at(monkeypatch, 3)
    cfg = load_config().with_overrides(**{"train.steps": 5, "train.eval_every": 0, "train.checkpoint_every": 2})
    out = tmp_path / "run"
    ck = out / "checkpoints" / "step-00000002"
    with pytest.raises(UserError, match=rf"^step 3: non-finite loss \(nan\); last good checkpoint: {re.escape(str(ck))} "):
        train(cfg, out=out)
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [1, 2]  # the metrics so far
    assert all(m["lr"] == cfg.optim.lr and m["grad_norm"] is None and not m["skipped"] for m in lines)


def test_nonfinite_skip_drops_the_commit_and_counts_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from qeffect.runtime.train import train

    _nan_at(monkeypatch, 2)
    cfg = load_config().with_overrides(**{**RECIPE, "train.steps": 4, "train.eval_every": 0,
                                          "train.nonfinite": "skip"})
    summary = train(cfg, out=tmp_path / "run")
    assert summary.skipped_steps == 1
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert [m["skipped"] for m in lines] == [False, True, False, False]
    assert lines[1]["loss"] is None  # NaN is written as JSON null
    recipe = Recipe(cfg.optim, 4)
    assert [m["lr"] for m in lines] == [recipe.lr(k) for k in range(1, 5)]  # a skipped step still counts
    assert all(m["grad_norm"] > 0 for m in lines)  # skip mode computes the norm every step
    assert math.isfinite(summary.first_ten_ce)


def test_nonfinite_stop_on_the_gradient_norm(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With clipping, a non-finite global norm stops the run too (no checkpoint yet: 'none')."""
    from qeffect.runtime import single
    from qeffect.runtime.train import train

    norm = single.global_norm
    monkeypatch.setattr(single, "global_norm", lambda sums: norm(sums) * math.inf)
    cfg = load_config().with_overrides(**{**RECIPE, "train.steps": 3, "train.eval_every": 0})
    with pytest.raises(UserError, match=r"^step 1: non-finite gradient norm \(inf\); last good checkpoint: none"):
        train(cfg, out=tmp_path / "run")


def test_a_resumed_run_continues_the_schedule_and_the_clipping(tmp_path: Path) -> None:
    """Steps 3-4 resumed from step 2's checkpoint: the same learning rates, norms and losses as the run
    that went through (the schedule counts from the checkpoint's step)."""
    from qeffect.runtime.train import train

    cfg = load_config().with_overrides(**{**RECIPE, "train.steps": 4, "train.eval_every": 0,
                                          "train.checkpoint_every": 2})
    train(cfg, out=tmp_path / "through")
    train(cfg, out=tmp_path / "resumed", resume=tmp_path / "through" / "checkpoints" / "step-00000002")

    def records(run: str) -> list[tuple]:
        lines = [json.loads(x) for x in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]
        return [(m["step"], m["loss"], m["lr"], m["grad_norm"]) for m in lines if m["step"] > 2]

    assert records("resumed") == records("through") and len(records("through")) == 2


INTERPRETED = textwrap.dedent("""
    import os
    os.environ["TRITON_INTERPRET"] = "1"
    import torch
    from qeffect.runtime import adamw, lazy_rows
    # the learning rate from a device scalar (`TritonAdamW.use_tensor_lr`) against the launch argument:
    # the same bits (rates exact in fp32: the interpreter keeps float arguments in double precision)
    n = adamw.BLOCK + 17
    torch.manual_seed(0)
    p0 = torch.randn(n) * 0.02
    runs = []
    for by_pointer in (False, True):
        p, m, v, step = p0.clone(), torch.zeros(n), torch.zeros(n), torch.zeros(())
        lr_t = torch.zeros(1)
        for k in range(1, 4):
            lr = 2.0**-12 * (1 + k / 4)  # a schedule
            g = torch.randn(n, generator=torch.Generator().manual_seed(k)) * 1e-3
            step += 1
            bc1, bc2 = adamw.bias_corrections([step], 0.875, 0.9375)
            extra = adamw._lr_args(lr_t if by_pointer else None, p)
            lr_t.fill_(lr)
            adamw._kernel()[(-(-n // adamw.BLOCK),)](p, g, g, 0, m, v, bc1[0], bc2[0], n,
                                                    0.0 if by_pointer else lr, 0.875, 0.9375, 0.125, 2.0**-27,
                                                    p, p, p, p, 0.0, COUNT=0, INIT=False, DECAY=True,
                                                    UPDATE=True, CAST=False, BLOCK=adamw.BLOCK, **extra)
        runs.append((p, m, v))
    assert not torch.equal(runs[0][0], p0)
    for a, b in zip(*runs):
        assert torch.equal(a, b)
    V, H = 6, 40
    tables = []
    for by_pointer in (False, True):
        p, m, v = p0[: V * H].clone().view(V, H), torch.zeros(V, H), torch.zeros(V, H)
        rows = torch.tensor([1, 4, V], dtype=torch.int64)
        lazy = lazy_rows.LazyRows(p, m, v, rows)
        step, lr_t = torch.zeros(()), torch.zeros(1)
        for k in range(1, 4):
            lr = 2.0**-12 * (1 + k / 4)
            lr_t.fill_(lr)
            g = torch.randn(V, H, generator=torch.Generator().manual_seed(k)) * 1e-3
            step += 1
            bc1, bc2 = adamw.bias_corrections([step], 0.875, 0.9375)
            lazy.update(g, bc1[0], bc2[0], lr=0.0 if by_pointer else lr, betas=(0.875, 0.9375), weight_decay=0.0,
                        eps=2.0**-27, lr_ptr=lr_t if by_pointer else None)
            lazy.stepped()
        lazy.settle()
        tables.append((p, m, v))
    for a, b in zip(*tables):
        assert torch.equal(a, b)
    print("ok")
""")


def test_the_learning_rate_from_the_device_gives_the_same_bits_under_the_interpreter() -> None:
    """The Triton passes read the rate from a device scalar (what a replayed optimizer graph needs) with
    the bits of the launch argument: the dense pass and the row-lazy table's update."""
    triton = pytest.importorskip("triton")
    if tuple(int(x) for x in triton.__version__.split(".")[:2]) < (3, 9):
        pytest.skip("the interpreter takes runtime loop bounds from Triton 3.9")
    out = subprocess.run([sys.executable, "-c", INTERPRETED], capture_output=True, text=True, timeout=900)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["interleaved", "zbv"])
def test_verify_state_with_the_recipe_under_torchrun_pp2(tmp_path: Path, schedule: str) -> None:
    """PP=2 under torchrun (gloo, 2 processes): the all-gathered global norm, the clip and the schedule,
    bitwise against native eager with the same mapping on every rank."""
    out = tmp_path / "report.json"
    sets = [a for s in RECIPE_SETS for a in ("--set", s)]
    proc = _run(torchrun(2, "-m", "qeffect", "verify-state", "--schedule", schedule, "--steps", "6", *sets,
                         "--set", "pipeline.pp=2", "--json", str(out)), tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["passed"] and r["pp"] == 2 and r["world_size"] == 2
    assert all(c["compared"] > 0 and c["mismatches"] == 0 for c in r["categories"])
    assert r["settings"]["optim.clip_grad_norm"] == 0.5 and r["settings"]["optim.schedule"] == "cosine"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("schedule", ["interleaved", "zbv"])
def test_captured_verify_state_with_the_recipe_on_cuda(schedule: str) -> None:
    """Captured-direct on the GPU with warm-up, cosine and clipping: bitwise against native eager."""
    cfg = load_config().with_overrides(**{**RECIPE, "pipeline.schedule": schedule, "train.device": "cuda"})
    report = run_verify_state(cfg, steps=8, path="captured-direct")
    assert report.passed, report.first_divergence


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_captured_optimizer_step_takes_each_steps_lr_and_clip_factor_without_recapture() -> None:
    """Interleaved captured-direct with a new learning rate and clip factor every step: each rank's
    optimizer graph is captured once and replayed after, and the run stays bitwise native eager's."""
    cfg = load_config().with_overrides(**{**RECIPE, "train.device": "cuda", "train.steps": 10})
    native = build_single_process(cfg, native=True)
    qeff = build_single_process(cfg, native=False, path="captured-direct")
    for step in range(10):
        batches = synthetic_batches(cfg, step, "cuda")
        assert bitwise_equal(native.step(batches), qeff.step(batches)), step
        assert bitwise_equal(native.last_grad_norm, qeff.last_grad_norm), step
    torch.cuda.synchronize()
    assert native.last_lr == qeff.last_lr == Recipe(cfg.optim, 10).lr(10)  # optimizer steps count from 1
    for r in qeff.ranks:
        assert r.optimizer.tensor_lr and r.optimizer.graph_captures == 1 and r.optimizer.graph_replays >= 6
    a, b = _state(native), _state(qeff)
    assert all(bitwise_equal(a[k], b[k]) for k in a)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_graphed_triton_adamw_with_a_new_lr_every_step_is_torch_fused_and_captures_once() -> None:
    """`use_tensor_lr`: the Triton pass (large tensors) and torch's fused kernel (small ones) read the
    rate from the device; a schedule's rate every step replays one graph, with torch's fused bits."""
    from qeffect.runtime import adamw

    if adamw._kernel() is None:
        pytest.skip("needs Triton")
    shapes = [(adamw.MIN_NUMEL + 17,), (257, 129), (33,)]
    gen = torch.Generator("cuda").manual_seed(0)
    init = [torch.randn(s, device="cuda", generator=gen) * 0.02 for s in shapes]
    recipe = Recipe(OptimConfig(lr=1e-3, schedule="cosine", warmup_steps=2, min_lr=1e-4), total_steps=8)
    ref_params = [torch.nn.Parameter(w.clone()) for w in init]
    params = [torch.nn.Parameter(w.clone()) for w in init]
    hyper = dict(betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    ref = torch.optim.AdamW(ref_params, lr=1e-3, fused=True, **hyper)
    opt = adamw.TritonAdamW(params, lr=1e-3, graph=True, **hyper)
    opt.use_tensor_lr()
    grads = [torch.empty_like(p) for p in params]  # fixed addresses, as the arena's
    for step in range(1, 9):
        step_gen = torch.Generator("cuda").manual_seed(100 + step)
        fresh = [torch.randn(s, device="cuda", generator=step_gen) * 1e-3 for s in shapes]
        for p, r, g, f in zip(params, ref_params, grads, fresh, strict=True):
            g.copy_(f)
            p.grad, r.grad = g, f.clone()
        for o in (ref, opt):
            o.param_groups[0]["lr"] = recipe.lr(step)
            o.step()
        torch.cuda.synchronize()
        for p, r in zip(params, ref_params, strict=True):
            assert torch.equal(p, r), step
            for k in ("exp_avg", "exp_avg_sq", "step"):
                assert torch.equal(opt.state[p][k], ref.state[r][k]), (step, k)
    assert opt.graph_captures == 1 and opt.graph_replays == 6  # step 1 initializes, 2 keys, 3 captures
