"""Transformer Engine backend: CPU-checkable parts always; the rest (`gpu`) needs CUDA and TE.

GPU tests use the tiny model on CUDA with bf16 activations; the paper shapes are checked with the
`verify-state` command (examples/configs/h2048.toml) on the H200.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from qeffect.config import load_config
from qeffect.errors import UserError
from qeffect.fp8.base import TE_MISSING_MSG, get_backend
from qeffect.fp8.recipe import DelayedScalingRecipe
from qeffect.fp8.te import (
    BACKWARD_STATE,
    FORWARD_STATE,
    TE_STATE_NAMES,
    TEBackend,
    TEWgradWork,
    WgradFifo,
    te_available,
    te_recipe_kwargs,
)

ROOT = Path(__file__).resolve().parents[1]
HAS_TE = te_available()
requires_te = pytest.mark.skipif(not (torch.cuda.is_available() and HAS_TE),
                                 reason="needs CUDA and Transformer Engine")


# ------------------------------------------------------------------------------------------ CPU
def test_import_does_not_import_transformer_engine() -> None:
    code = "import sys, qeffect.fp8.te, qeffect.fp8; print(any(m.startswith('transformer_engine') for m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


@pytest.mark.skipif(HAS_TE, reason="Transformer Engine is importable here")
def test_missing_te_is_a_user_error() -> None:
    r = DelayedScalingRecipe()
    with pytest.raises(UserError) as err:
        get_backend("te", r)
    assert str(err.value) == TE_MISSING_MSG
    with pytest.raises(UserError):
        TEBackend(r)


def test_cudnn_clash_names_the_import_order(monkeypatch: pytest.MonkeyPatch) -> None:
    """The H200 image's clash (TE imported after torch loaded its own cuDNN) says what to do."""
    import builtins

    from qeffect.fp8.te import te_import_error

    real_import = builtins.__import__
    clash = ("/lib/x86_64-linux-gnu/libcudnn_heuristic.so.9: undefined symbol: "
             "_ZTVN5cudnn7backend12OperationSetE, version libcudnn_graph.so.9")

    def fake_import(name: str, *args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        if name.startswith("transformer_engine"):
            raise OSError(clash)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", fake_import)
    reason = te_import_error()
    assert reason is not None and reason.startswith(f"OSError: {clash}")
    assert "import transformer_engine.pytorch before the first cuDNN use" in reason


def test_recipe_mapping() -> None:
    r = DelayedScalingRecipe(margin=2, amax_history_len=7, amax_compute_algo="most_recent")
    assert te_recipe_kwargs(r) == {
        "margin": 2,
        "fp8_format": "HYBRID",
        "amax_history_len": 7,
        "amax_compute_algo": "most_recent",
        "reduce_amax": False,
    }


def test_protocol_state_split() -> None:
    assert TEBackend.state_transitions["dW"] == ()
    assert set(TEBackend.state_transitions["F"]) | set(TEBackend.state_transitions["dI"]) == set(TE_STATE_NAMES)
    # verify-state splits forward vs backward state by a `grad_` prefix: the backend must agree.
    assert all(n.startswith("grad_") for n in BACKWARD_STATE)
    assert not any(n.startswith("grad_") for n in FORWARD_STATE)
    assert {"grad_amax_history", "grad_scale", "input_scale", "weight_amax_history"} <= set(TE_STATE_NAMES)


def test_wgrad_fifo_order_and_handout() -> None:
    f = WgradFifo(owner=1)
    a = f.record(store_size=1)
    assert f.pop_pending() == [a] and f.pop_pending() == []
    b = f.record(store_size=2)
    assert len(f) == 2 and f.pop_pending() == [b]
    with pytest.raises(RuntimeError, match="out of dI order"):
        f.consume(b)  # a is older
    f.consume(a)
    f.consume(b)
    assert len(f) == 0
    with pytest.raises(RuntimeError, match="out of dI order"):
        f.consume(b)  # already drained
    with pytest.raises(RuntimeError, match="not a retained dW item"):
        f.check_next(TEWgradWork(owner=2, seq=1))
    with pytest.raises(RuntimeError, match="not a retained dW item"):
        f.check_next("work")


def test_wgrad_fifo_detects_store_drift() -> None:
    f = WgradFifo(owner=1)
    f.record(store_size=1)
    with pytest.raises(RuntimeError, match="WeightGradStore holds 3"):
        f.record(store_size=3)


def test_fifo_handout_before_drain() -> None:
    f = WgradFifo(owner=1)
    a = f.record()
    with pytest.raises(RuntimeError, match="never handed out"):
        f.consume(a)
    f.pop_pending()
    f.consume(a)
    f.record()
    f.clear()
    assert len(f) == 0 and f.pop_pending() == []


@pytest.mark.parametrize(("name", "hidden", "ffn", "heads", "mbs"),
                         [("h2048", 2048, 8192, 16, 4), ("h4096", 4096, 11008, 32, 8)])
def test_paper_configs(name: str, hidden: int, ffn: int, heads: int, mbs: int) -> None:
    cfg = load_config(ROOT / "examples" / "configs" / f"{name}.toml")
    m, p = cfg.model, cfg.pipeline
    assert (m.hidden, m.ffn, m.heads, m.seq_len, m.microbatch_size) == (hidden, ffn, heads, 256, 1)
    assert (m.vocab_size, m.layers_per_chunk, p.pp, p.chunks_per_rank, p.microbatches) == (32768, 1, 2, 2, mbs)
    assert (cfg.train.device, cfg.train.dtype, cfg.fp8.amax_history_len) == ("cuda", "bfloat16", 4)
    assert p.num_stages * m.layers_per_chunk == 4


# ------------------------------------------------------------------------------------------ GPU
def _bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().contiguous()
    if t.dtype.is_floating_point:
        t = t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])
    return t.cpu()


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(_bits(a), _bits(b))


def _pair(delay: tuple[bool, bool], in_f: int = 64, out_f: int = 128, bias: bool = True):
    backend = TEBackend(DelayedScalingRecipe(amax_history_len=4))
    g = torch.Generator().manual_seed(0)
    mods = []
    for d in delay:
        lin = backend.linear(in_f, out_f, bias, device="cuda", dtype=torch.float32)
        with torch.no_grad():
            lin.weight.copy_(torch.randn(out_f, in_f, generator=g.manual_seed(1)) * 0.05)
            if bias:
                lin.bias.copy_(torch.randn(out_f, generator=g.manual_seed(2)) * 0.05)
        lin.delay_wgrad = d
        mods.append(lin)
    return mods


def _inputs(m: int, in_f: int = 64, out_f: int = 128):
    g = torch.Generator().manual_seed(100 + m)
    x = (torch.randn(2, 32, in_f, generator=g) * (1 + m)).to("cuda", torch.bfloat16)
    dy = (torch.randn(2, 32, out_f, generator=g) * 1e-2 * (1 + m)).to("cuda", torch.bfloat16)
    return x, dy


@pytest.mark.gpu
@requires_te
@pytest.mark.parametrize("mode", ["direct", "copy", "staged"])
def test_split_backward_equals_native(mode: str) -> None:
    native, split = _pair((False, True))
    acc = None
    for m in range(3):
        x, dy = _inputs(m)
        xa, xb = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
        ya, yb = native(xa, is_first_microbatch=(m == 0)), split(xb, is_first_microbatch=(m == 0))
        assert _same(ya, yb)
        assert all(_same(native.fp8_state()[k], split.fp8_state()[k]) for k in FORWARD_STATE)
        assert _same(native.weight_cache.w_q, split.weight_cache.w_q)
        assert native.weight_cache.w_q.dtype == torch.float8_e4m3fn
        ya.backward(dy)
        yb.backward(dy)
        assert native.pop_wgrad_work() == [] and split.weight.grad is None
        work = split.pop_wgrad_work()
        assert len(work) == 1
        assert _same(xa.grad, xb.grad) and _same(native.bias.grad, split.bias.grad)
        assert all(_same(native.fp8_state()[k], split.fp8_state()[k]) for k in BACKWARD_STATE)
        if mode == "direct":
            view = torch.full_like(split.weight, float("nan"))
            dw = split.compute_wgrad(work[0], out=view)
            assert dw is view
        elif mode == "staged":  # a staging slot in the GEMM's own dtype is TE's GEMM output buffer
            from qeffect.fp8.te_compat import PLAIN_GEMM_KWARGS, fallbacks, wgrad_gemm_kwargs

            kwargs = wgrad_gemm_kwargs(split.wgrad_store)  # the gate of the no-copy path holds
            assert kwargs is not None and kwargs["out_dtype"] == torch.bfloat16 and not kwargs["accumulate"]
            assert all(kwargs.get(k) is None for k in PLAIN_GEMM_KWARGS)
            before = fallbacks()
            slot = torch.full_like(split.weight, float("nan"), dtype=split.wgrad_dtype(torch.bfloat16))
            dw = split.compute_wgrad(work[0], out=slot)
            assert dw is slot and dw.dtype == torch.bfloat16 and kwargs["out"] is None
            assert fallbacks() == before  # the GEMM wrote the slot: no fallback counted
            dw = dw.float()
        else:
            dw = split.compute_wgrad(work[0])
        assert dw.dtype == torch.float32
        acc = dw.clone() if acc is None else acc.add_(dw)  # the arena's fixed-order sum
        assert _same(native.weight.grad, acc)
    assert split.weight.grad is None


@pytest.mark.gpu
@requires_te
def test_bias_taken_in_the_activation_dtype_has_the_native_bits() -> None:
    """`use_activation_bias`: TE gets a bf16 stand-in cast on the first microbatch (the fp32 bias is not
    in the autograd graph), and its bf16 gradients accumulated into fp32 give the native `.grad` bits."""
    from qeffect.stage.actions import accumulate_grads

    native, split = _pair((False, True))
    split.use_activation_bias(torch.bfloat16)
    stand_in = split.bias_grad_input
    assert stand_in is not None and stand_in.dtype == torch.bfloat16 and stand_in.is_leaf
    assert _pair((False,), bias=False)[0].bias_grad_input is None
    for m in range(3):
        x, dy = _inputs(m)
        xa, xb = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
        ya, yb = native(xa, is_first_microbatch=(m == 0)), split(xb, is_first_microbatch=(m == 0))
        assert _same(ya, yb) and _same(stand_in, split.bias.detach().to(torch.bfloat16))
        ya.backward(dy)
        gx, gb = torch.autograd.grad(yb, [xb, stand_in], dy)
        assert gb.dtype == torch.bfloat16 and (m > 0 or split.bias.grad is None)  # only ours writes .grad
        accumulate_grads({"bias": split.bias}, {"bias": gb})
        for work in split.pop_wgrad_work():
            split.compute_wgrad(work)
        assert _same(xa.grad, gx) and _same(native.bias.grad, split.bias.grad)
    with torch.no_grad():  # an optimizer step: the next first microbatch refreshes the stand-in
        split.bias.add_(1.0)
    with torch.no_grad():
        split(_inputs(0)[0], is_first_microbatch=True)
    assert _same(stand_in, split.bias.detach().to(torch.bfloat16))


@pytest.mark.gpu
@requires_te
def test_qeffect_ranks_take_te_biases_in_the_activation_dtype_and_native_does_not() -> None:
    from qeffect.runtime.build import build_single_process

    cfg = _tiny_te("interleaved")
    for native, expect in ((True, False), (False, True)):
        pipe = build_single_process(cfg, native=native, device="cuda")
        lins = [m for r in pipe.ranks for c in r.chunks.values() for m in c.matrix_linears().values()
                if m.bias is not None]
        assert lins and all((m.bias_grad_input is not None) is expect for m in lins)


@pytest.mark.gpu
@requires_te
def test_fifo_enforced_and_cache_checked() -> None:
    (lin,) = _pair((True,))
    items = []
    for m in range(2):
        x, dy = _inputs(m)
        y = lin(x.requires_grad_(True), is_first_microbatch=(m == 0))
        y.backward(dy)
        items += lin.pop_wgrad_work()
    assert len(items) == 2 and items[0].seq == 1 and items[1].seq == 2
    with pytest.raises(RuntimeError, match="out of dI order"):
        lin.compute_wgrad(items[1])
    with pytest.raises(ValueError, match="dW destination"):
        lin.compute_wgrad(items[0], out=torch.empty(3, 3, device="cuda"))
    lin.compute_wgrad(items[0])
    lin.compute_wgrad(items[1])
    assert lin.wgrad_store.context.qsize() == 0
    lin.invalidate_cache()
    assert not lin.cache_valid and lin.weight_cache is None
    with pytest.raises(RuntimeError, match="weight cache is empty"):
        lin(_inputs(0)[0], is_first_microbatch=False)
    lin(_inputs(0)[0], is_first_microbatch=True)
    assert lin.cache_valid and lin.weight_cache is not None


@pytest.mark.gpu
@requires_te
def test_modules_do_not_share_scaling_state() -> None:
    """TE's global amax buffers would roll every module's history at any autocast exit: ours must not."""
    a, b = _pair((False, False))
    x, dy = _inputs(0)
    b(x.requires_grad_(True), is_first_microbatch=True).backward(dy)
    before = {k: v.clone() for k, v in b.fp8_state().items()}
    for m in range(3):
        xa, dya = _inputs(m + 1)
        a(xa.requires_grad_(True), is_first_microbatch=(m == 0)).backward(dya)
    assert all(_same(before[k], v) for k, v in b.fp8_state().items())
    assert not all(_same(before[k], v) for k, v in a.fp8_state().items())


@pytest.mark.gpu
@requires_te
def test_extra_state_round_trip() -> None:
    a, b = _pair((False, False))
    for m in range(2):
        x, dy = _inputs(m)
        a(x.requires_grad_(True), is_first_microbatch=(m == 0)).backward(dy)
    state = a.extra_state()
    assert set(state) == {"fwd_scale", "fwd_amax_history", "bwd_scale", "bwd_amax_history"}
    b.load_extra_state(state)
    assert set(b.fp8_state()) == set(TE_STATE_NAMES)
    assert all(_same(a.fp8_state()[k], b.fp8_state()[k]) for k in TE_STATE_NAMES)
    x, _ = _inputs(5)
    assert _same(a(x, is_first_microbatch=True), b(x, is_first_microbatch=True))


def _tiny_te(schedule: str = "interleaved"):
    return load_config().with_overrides(**{"train.device": "cuda", "fp8.backend": "te",
                                           "train.dtype": "bfloat16", "pipeline.schedule": schedule})


@pytest.mark.gpu
@requires_te
def test_native_te_runs_are_deterministic() -> None:
    from qeffect.runtime.build import build_single_process
    from qeffect.verify.state import synthetic_batches

    cfg = _tiny_te()
    runs = []
    for _ in range(2):
        pipe = build_single_process(cfg, native=True, device="cuda")
        losses = [pipe.step(synthetic_batches(cfg, s, "cuda")) for s in range(3)]
        state = {f"s{s}.{n}": p for r in pipe.ranks for s, c in r.chunks.items() for n, p in c.named_parameters()}
        state.update({f"s{s}.{k}": v for r in pipe.ranks for s, c in r.chunks.items()
                      for k, v in c.fp8_state().items()})
        runs.append((losses, state))
    (la, sa), (lb, sb) = runs
    assert all(_same(x, y) for x, y in zip(la, lb, strict=True))
    assert set(sa) == set(sb) and all(_same(sa[k], sb[k]) for k in sa)


@pytest.mark.gpu
@requires_te
@pytest.mark.parametrize("schedule", ["interleaved", "zbv"])
def test_verify_state_te_tiny(schedule: str) -> None:
    from qeffect.verify.state import run_verify_state

    report = run_verify_state(_tiny_te(schedule), steps=3)
    assert report.passed, report.first_divergence
    assert report.amax_rollover.rolled_over
    by = {c.category: c for c in report.categories}
    assert by["fp8_state"].compared > 0 and by["cache_contents"].compared > 0


@pytest.mark.gpu
@requires_te
def test_perturbed_te_scale_is_caught() -> None:
    from qeffect.verify.state import run_verify_state

    report = run_verify_state(_tiny_te(), steps=2, injection="perturb-scale")
    assert not report.passed
    d = report.first_divergence
    assert {c.category: c.mismatches for c in report.categories}["fp8_state"] > 0
    assert d is not None and d.step == 1 and d.action == "F"


def test_wgrad_closure_lookup_without_te() -> None:
    """The keyword dict of the oldest queued closure is found by its free-variable name, without
    dequeuing; anything else (empty queue, another closure) gives None, so the caller falls back."""
    import queue
    from types import SimpleNamespace

    from qeffect.fp8.te_compat import wgrad_gemm_kwargs as _wgrad_gemm_kwargs

    def make(kw):
        wgrad_gemm_kwargs = kw

        def wgrad_gemm(x, dy):
            return wgrad_gemm_kwargs, x, dy

        return wgrad_gemm

    store = SimpleNamespace(context=queue.Queue())
    assert _wgrad_gemm_kwargs(store) is None
    first, second = {"out": None, "out_dtype": "bf16"}, {"out": None}
    store.context.put([["x", "dy"], make(first)])
    store.context.put([["x", "dy"], make(second)])
    assert _wgrad_gemm_kwargs(store) is first and store.context.qsize() == 2
    other = SimpleNamespace(context=queue.Queue())
    other.context.put([["x"], lambda x: x])
    assert _wgrad_gemm_kwargs(other) is None
    assert _wgrad_gemm_kwargs(SimpleNamespace(context=None)) is None


def test_batched_scaling_updates_group_nest_and_drop(monkeypatch: pytest.MonkeyPatch) -> None:
    """The scope's bookkeeping, with TE's kernel replaced by a recorder: one call per (recipe,
    direction) at the outermost exit, the amax buffer being the states' current amaxes in queue
    order; nothing runs when the body raises."""
    import types

    import qeffect.fp8.te as te_mod

    calls = []

    def fake_update(buf, hists, scales, algo, dtype, margin):
        calls.append((buf.tolist(), [h.data_ptr() for h in hists], [s.data_ptr() for s in scales], algo, dtype, margin))

    monkeypatch.setitem(sys.modules, "transformer_engine_torch",
                        types.SimpleNamespace(fused_amax_and_scale_update_after_reduction=fake_update))
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch.quantization",
                        types.SimpleNamespace(get_fp8_te_dtype=lambda r, fwd: ("e4m3" if fwd else "e5m2", r.tag)))
    monkeypatch.setitem(sys.modules, "transformer_engine", types.ModuleType("transformer_engine"))
    monkeypatch.setitem(sys.modules, "transformer_engine.pytorch", types.ModuleType("transformer_engine.pytorch"))

    def state(v: float):
        return types.SimpleNamespace(amax_history=torch.tensor([[v, v + 0.5], [0.0, 0.0]]), scale=torch.ones(2))

    ra = types.SimpleNamespace(tag="a", amax_compute_algo="max", margin=0)
    rb = types.SimpleNamespace(tag="b", amax_compute_algo="most_recent", margin=1)
    s1, s2, s3, s4 = state(1.0), state(2.0), state(3.0), state(4.0)
    with te_mod.batched_scaling_updates():
        te_mod._PENDING.append((s1, True, ra))
        with te_mod.batched_scaling_updates():  # nested: handed to the outer scope
            te_mod._PENDING.append((s2, False, ra))
            te_mod._PENDING.append((s3, True, ra))
        assert calls == []
        te_mod._PENDING.append((s4, True, rb))
    assert te_mod._PENDING is None
    ptrs = lambda *ss: [s.amax_history.data_ptr() for s in ss]  # noqa: E731
    assert [(c[0], c[1], c[4]) for c in calls] == [
        ([1.0, 1.5, 3.0, 3.5], ptrs(s1, s3), ("e4m3", "a")),
        ([2.0, 2.5], ptrs(s2), ("e5m2", "a")),
        ([4.0, 4.5], ptrs(s4), ("e4m3", "b")),
    ]
    assert [(c[3], c[5]) for c in calls] == [("max", 0.0), ("max", 0.0), ("most_recent", 1.0)]
    calls.clear()
    with pytest.raises(ValueError), te_mod.batched_scaling_updates():
        te_mod._PENDING.append((s1, True, ra))
        raise ValueError("body failed")
    assert calls == [] and te_mod._PENDING is None


@pytest.mark.gpu
@requires_te
def test_batched_scaling_updates_equal_per_module() -> None:
    """A chain of three TE linears: forward and backward inside `batched_scaling_updates` (one fused
    update per direction at the scope's end) give the bits of the per-module updates, over enough
    microbatches to roll the amax history; inside the scope no state has moved yet."""
    from qeffect.fp8.te import batched_scaling_updates

    chains = [_pair((False, False, False), in_f=64, out_f=64) for _ in range(2)]

    def run(chain, x):
        for lin in chain:
            x = lin(x, is_first_microbatch=False if lin.cache_valid else True)
        return x

    for m in range(6):
        x, dy = _inputs(m, 64, 64)
        xa, xb = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
        ya = run(chains[0], xa)
        before = [{k: v.clone() for k, v in lin.fp8_state().items()} for lin in chains[1]]
        with batched_scaling_updates():
            yb = run(chains[1], xb)
            if m > 0:  # deferred: no scale recomputed, no history rolled inside the scope (the forward
                # itself only records this microbatch's amaxes into row 0; before m=0 there is no state)
                moved = [k for b, lin in zip(before, chains[1], strict=True) for k, v in lin.fp8_state().items()
                         if k in FORWARD_STATE and not _same(b[k] if k.endswith("_scale") else b[k][1:],
                                                             v if k.endswith("_scale") else v[1:])]
                assert moved == []
        assert _same(ya, yb)
        ya.backward(dy)
        with batched_scaling_updates():
            yb.backward(dy)
        assert _same(xa.grad, xb.grad)
        for a, b in zip(*chains, strict=True):
            assert set(a.fp8_state()) == set(TE_STATE_NAMES)
            assert all(_same(a.fp8_state()[k], b.fp8_state()[k]) for k in TE_STATE_NAMES)
            assert _same(a.weight.grad, b.weight.grad)
