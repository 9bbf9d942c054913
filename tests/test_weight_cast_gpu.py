"""The optimizer's FP8 weight cast (`fp8.weight_cast`) against Transformer Engine's, bit for bit (GPU).

- the cast alone equals TE's own first-microbatch cast: bytes, transpose, 1 / scale and amax, on
  shapes that do and do not fill a tile, with scales that saturate;
- the update with the cast equals torch's fused AdamW followed by that cast, with and without a staged
  fold in the pass;
- captured te training with the cast in the optimizer verifies against native eager (every cache's
  bytes after every forward, the FP8 state, parameters and gradients), and after the first step every
  cast is part of the optimizer's pass.
"""

from __future__ import annotations

import pytest
import torch

from qeffect.fp8.recipe import DelayedScalingRecipe
from qeffect.fp8.te import batched_scaling_updates, te_available
from qeffect.fp8.weight_cast import WeightCastTarget
from qeffect.runtime import adamw
from qeffect.runtime.adamw import TritonAdamW
from test_te_backend import _tiny_te  # the tiny te config of the TE tests (tests/ is on sys.path)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not (torch.cuda.is_available() and te_available()),
                                                  reason="needs CUDA and Transformer Engine")]
FP8 = torch.float8_e4m3fn


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == FP8 else t.view(torch.int32)


@pytest.mark.parametrize(("out_f", "in_f", "scale"), [(384, 320, 1.0), (208, 176, 3.7), (1024, 512, 0.0123)])
def test_the_cast_alone_is_transformer_engines(out_f: int, in_f: int, scale: float) -> None:
    from qeffect.fp8.te import TEBackend

    lin = TEBackend(DelayedScalingRecipe(amax_history_len=4)).linear(in_f, out_f, False, device="cuda")
    with torch.no_grad():
        lin.weight.normal_(0, 40.0, generator=torch.Generator("cuda").manual_seed(out_f))
        lin.weight[0, :8] = torch.tensor([1e4, -1e4, 0.0, -0.0, 448.0, 1e-9, -3e-3, 512.0])  # saturating
    x = torch.randn(16, in_f, device="cuda", requires_grad=True)
    with batched_scaling_updates():  # TE's cast writes the amax row; the update runs after our checks
        lin(x, is_first_microbatch=True)  # builds the cache (and its fp8 state) with scale 1
        t = lin.weight_cast_target("lin")
        t.scale.fill_(scale)
        t.amax_row.zero_()
        lin(x, is_first_microbatch=True)  # TE's own cast with this scale (the target is not fresh)
        want = [c.clone() for c in (t.data, t.transpose, t.scale_inv, t.amax_row)]
        for c in (t.data, t.transpose, t.scale_inv, t.amax_row):
            c.view(torch.uint8).zero_()
        adamw._cast_alone([t])
        assert t.fresh
        t.fold_pending_amax()
        got = [c.clone() for c in (t.data, t.transpose, t.scale_inv, t.amax_row)]  # before the scope's update
        torch.cuda.synchronize()
    for name, a, b in zip(("data", "transpose", "scale_inv", "amax"), got, want, strict=True):
        assert torch.equal(_bits(a), _bits(b)), name
    assert t.pending_amax.item() == 0.0


@pytest.mark.parametrize("fold", [0, 2])
def test_the_update_with_the_cast_is_torch_adamw_then_the_cast(fold: int) -> None:
    gen = torch.Generator("cuda").manual_seed(fold)
    shape = (1536, 1088)  # 1.7M elements: the Triton pass's size, tiles that do not fill the edge
    w0 = torch.randn(shape, device="cuda", generator=gen)
    p_ref, p = torch.nn.Parameter(w0.clone()), torch.nn.Parameter(w0.clone())
    ref = torch.optim.AdamW([p_ref], lr=3e-2, weight_decay=0.1, fused=True)
    opt = TritonAdamW([p], lr=3e-2, weight_decay=0.1)
    rows, cols = shape
    target = WeightCastTarget("w", p, torch.zeros(shape, dtype=FP8, device="cuda"),
                              torch.zeros((cols, rows), dtype=FP8, device="cuda"),
                              torch.full((1,), 97.5, device="cuda"), torch.zeros(1, device="cuda"),
                              torch.zeros(1, device="cuda"))
    opt.cast_after_step(target)
    for step in range(3):
        grad = torch.randn(shape, device="cuda", generator=gen) * 1e-2
        slots = torch.randn((fold, rows * cols), device="cuda", generator=gen).to(torch.bfloat16)
        p_ref.grad = grad.clone()
        for j in range(fold):  # the fold's order: onto the gradient, slot by slot
            p_ref.grad += slots[j].float().view(shape)
        p.grad = grad.clone()
        if fold:
            opt.fold_into_step(p, slots, fold, init=False)
        ref.step()
        opt.step()
        assert target.fresh
        torch.cuda.synchronize()
        assert torch.equal(p, p_ref), step
        want = (p_ref * 97.5).clamp(-448.0, 448.0).to(FP8)
        assert torch.equal(_bits(target.data), _bits(want)), step
        assert torch.equal(_bits(target.transpose), _bits(want.t().contiguous())), step
        assert target.pending_amax.item() == p_ref.abs().max().item()
        assert torch.equal(target.scale_inv, 1.0 / target.scale)
        target.fold_pending_amax()
        target.mark_consumed()


@pytest.mark.parametrize("schedule", ["interleaved", "zbv"])
def test_captured_te_verifies_with_the_cast_in_the_optimizer(schedule: str) -> None:
    from qeffect.verify.state import run_verify_state

    report = run_verify_state(_tiny_te(schedule), steps=3, path="captured-direct")
    assert report.passed, report.first_divergence
    by = {c.category: c for c in report.categories}
    assert by["cache_contents"].compared > 0 and by["fp8_state"].compared > 0


def test_after_the_first_step_every_cast_is_in_the_optimizers_pass(monkeypatch: pytest.MonkeyPatch) -> None:
    from qeffect.runtime.build import build_single_process
    from qeffect.verify.state import synthetic_batches

    cfg = _tiny_te("interleaved")
    pipe = build_single_process(cfg, native=False, device="cuda", path="captured-direct")
    targets = [t for r in pipe.ranks for a in r.actions.values() for t in a.weight_casts]
    stale, now = [0, 0, 0], [0]  # per step: how many caches its first forwards found stale (cast first)
    real = TritonAdamW.cast_now

    def counting(self, ts):
        n = real(self, ts)
        stale[now[0]] += n
        return n

    monkeypatch.setattr(TritonAdamW, "cast_now", counting)
    losses = []
    for s in range(3):
        now[0] = s
        losses.append(pipe.step(synthetic_batches(cfg, s, "cuda")))
    native = build_single_process(cfg, native=True, device="cuda")
    ref = [native.step(synthetic_batches(cfg, s, "cuda")) for s in range(3)]
    assert torch.equal(torch.stack(losses), torch.stack(ref))
    assert targets and all(t.captured for t in targets)
    assert stale == [len(targets), 0, 0]  # the first step's casts before its forwards; the commits' since
    assert all(t.fresh for t in targets)  # the last commit cast them for a next step


def test_an_eager_first_forward_casts_a_stale_cache_itself() -> None:
    """Outside a capture (evaluation) a first forward takes the optimizer's cast only while it is fresh:
    after the weight changed elsewhere, Transformer Engine casts it again, from the weight as it is."""
    from qeffect.runtime.build import build_single_process
    from qeffect.verify.state import synthetic_batches

    cfg = _tiny_te("interleaved")
    pipe = build_single_process(cfg, native=False, device="cuda", path="captured-direct")
    pipe.step(synthetic_batches(cfg, 0, "cuda"))
    lin, t = next((lin, lin._weight_cast) for r in pipe.ranks for c in r.chunks.values()
                  for lin in c.matrix_linears().values() if getattr(lin, "_weight_cast", None) is not None)
    assert t.fresh  # the commit cast it for the next step
    with torch.no_grad():
        t.weight.mul_(1.5)  # written outside the optimizer: the cached cast is of the old weight
        assert not t.fresh
        lin(torch.randn(16, lin.in_features, device="cuda", dtype=torch.bfloat16), is_first_microbatch=True)
    want = (t.weight * t.scale).clamp(-448.0, 448.0).to(FP8)
    assert torch.equal(_bits(t.data), _bits(want)) and not t.fresh


@pytest.mark.parametrize("graph", [True, False])
def test_the_captured_optimizer_step_replays_from_a_graph_with_natives_bits(graph: bool) -> None:
    """A captured pipeline's optimizer step is captured at its third step and replayed after (`use_graph`,
    what a captured rank sets; off: launched eagerly every step); losses and the final parameters, moments
    and FP8 state equal native eager's either way."""
    from qeffect.runtime.build import build_single_process
    from qeffect.verify.state import synthetic_batches

    cfg = _tiny_te("zbv")
    steps = 6
    pipe = build_single_process(cfg, native=False, device="cuda", path="captured-direct")
    for r in pipe.ranks:
        r.optimizer.use_graph(graph)
    losses = torch.stack([pipe.step(synthetic_batches(cfg, s, "cuda")) for s in range(steps)])
    native = build_single_process(cfg, native=True, device="cuda")
    ref = torch.stack([native.step(synthetic_batches(cfg, s, "cuda")) for s in range(steps)])
    assert torch.equal(losses, ref)
    got, want = _params_and_moments(pipe), _params_and_moments(native)
    assert got.keys() == want.keys() and len(got) > 0
    differing = [k for k in got if not torch.equal(got[k], want[k])]
    assert not differing, differing[:5]
    counts = [(r.optimizer.graph_captures, r.optimizer.graph_replays) for r in pipe.ranks]
    # step 0 initializes the optimizer state, step 1 is the first key, step 2 captures: 4 replays
    assert counts == [(1, steps - 2)] * len(pipe.ranks) if graph else [(0, 0)] * len(pipe.ranks)


def _params_and_moments(pipe) -> dict[tuple, torch.Tensor]:
    """Every parameter and its AdamW state by (stage, name, what), from each rank's chunks and optimizer."""
    out: dict[tuple, torch.Tensor] = {}
    pipe.settle()  # a row-lazy token table (runtime/lazy_rows.py) up to date before reading it
    for r in pipe.ranks:
        for stage, chunk in r.chunks.items():
            for name, p in chunk.named_parameters():
                out[(stage, name, "param")] = p.detach()
                for k in ("exp_avg", "exp_avg_sq", "step"):
                    out[(stage, name, k)] = r.optimizer.state[p][k]
    return out
