"""The Llama family through the runtime: verify-state bitwise (both schedules, amax history rolled over,
one process and torchrun PP=2), captured actions' protocol (faked replays), checkpoint resume, training
on the bundled asset; on the GPU (`gpu`), the captured paths and both backends.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from launch import ROOT, SMALL, small_train, torchrun
from launch import run as _run
from qeffect.config import load_config
from qeffect.verify.state import CATEGORIES, run_verify_state

LLAMA_TINY = ROOT / "examples/configs/llama-tiny.toml"


def _llama(**overrides: object):
    return load_config(LLAMA_TINY).with_overrides(**overrides)


def _qeffect(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "200"}
    return subprocess.run([sys.executable, "-m", "qeffect", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=600, env=env)


# ------------------------------------------------------------------------------------- verify-state
@pytest.mark.parametrize("schedule", ["interleaved", "zbv"])
def test_llama_verify_state_is_bitwise_with_the_amax_history_rolled_over(schedule: str) -> None:
    cfg = _llama(**{"pipeline.schedule": schedule})
    report = run_verify_state(cfg, steps=6)
    by = {c.category: c for c in report.categories}
    assert set(by) == set(CATEGORIES)
    assert all(c.mismatches == 0 for c in report.categories), report.first_divergence
    assert all(c.compared > 0 for c in report.categories)
    assert report.amax_rollover.rolled_over
    assert report.amax_rollover.weight_updates_per_module > cfg.fp8.amax_history_len
    assert report.passed and report.losses[-1] < report.losses[0]


def test_llama_verify_state_catches_a_perturbed_scale() -> None:
    report = run_verify_state(_llama(), steps=2, injection="perturb-scale")
    assert not report.passed
    assert {c.category: c.mismatches for c in report.categories}["fp8_state"] > 0


def test_llama_verify_state_cli(tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    proc = _qeffect(tmp_path, "verify-state", "-c", str(LLAMA_TINY), "--schedule", "zbv", "--steps", "6",
                    *SMALL, "--json", str(out))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["passed"] and r["settings"]["model.family"] == "llama" and r["settings"]["model.kv_heads"] == 2
    assert r["amax_rollover"]["rolled_over"]


@pytest.mark.slow
@pytest.mark.parametrize("schedule", ["interleaved", "zbv"])
def test_llama_verify_state_under_torchrun_pp2(tmp_path: Path, schedule: str) -> None:
    out = tmp_path / "report.json"
    proc = _run(torchrun(2, "-m", "qeffect", "verify-state", "--config", str(LLAMA_TINY),
                         "--schedule", schedule,
                         "--steps", "6", *SMALL, "--json", str(out)), tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["kind"] == "verify-state-distributed" and r["world_size"] == 2 and r["passed"]
    assert r["settings"]["model.family"] == "llama"
    by = {c["category"]: c for c in r["categories"]}
    assert {"loss", "parameter_gradients", "parameters", "optimizer_state", "fp8_state"} <= set(by)
    assert all(c["compared"] > 0 and c["mismatches"] == 0 for c in by.values())
    assert by["loss"]["compared"] == 2 * 6


# ---------------------------------------------------------------------------- captured (faked replays)
def test_llama_captured_actions_protocol_with_faked_replays() -> None:
    """The captured stage actions' bookkeeping (tapes, tokens, cache epochs, arena) over a llama chunk,
    as tests/test_captured_protocol.py drives the GPT's: the replays are faked, the checks are real."""
    from qeffect.contracts import GradientArena, TapePool
    from qeffect.contracts.epochs import EpochClock
    from qeffect.graphs.captured import CapturedStageActions, SlotGraphs
    from qeffect.runtime.build import build_chunks_for
    from qeffect.stage.actions import arena_name

    class Replays:
        def __init__(self) -> None:
            self.log: list[str] = []

        def replay(self, action, dynamic=None):
            self.log.append(action.name)
            return action.outputs

    cfg = _llama(**{"model.vocab_size": 256, "pipeline.pp": 1, "pipeline.chunks_per_rank": 1,
                    "pipeline.microbatches": 2})
    chunk = build_chunks_for(cfg, "cpu")[0]
    kinds = {n.rsplit(".", 2)[-2] for n in chunk.matrix_params()}
    assert kinds == {"qkv", "proj", "gate", "up", "down", "head"}
    specs = {arena_name(0, p): (tuple(w.shape), w.dtype) for p, w in chunk.matrix_params().items()}
    arena = GradientArena(specs, 2)
    manager = Replays()
    acts = CapturedStageActions(chunk, TapePool(2), EpochClock(), arena, direct=True, manager=manager)
    for m in range(2):
        tok = torch.zeros((), dtype=torch.int64)
        grads = {p: arena.view(arena_name(0, p), m) for p in chunk.matrix_params()}
        nonmatrix = {n: torch.ones_like(p) for n, p in chunk.nonmatrix_params().items()}
        acts.slots[m] = SlotGraphs(F=SimpleNamespace(name=f"F{m}", outputs=(torch.zeros(()), tok)),
                                   dI=SimpleNamespace(name=f"dI{m}", outputs=(None, nonmatrix, tok)),
                                   dW=SimpleNamespace(name=f"dW{m}", outputs=(grads, tok)))
    acts._ngrad = {n: torch.ones_like(p) for n, p in chunk.nonmatrix_params().items()}
    assert set(acts._ngrad) == {"tok_emb.weight", "blocks.0.ln1.weight", "blocks.0.ln2.weight", "ln_f.weight"}
    x = torch.zeros((2, 32), dtype=torch.int64)
    forwards = []
    for m in range(2):
        forwards.append(acts.forward(m, x, acts.ledger.current, x))
    token = forwards[-1].token
    for f in forwards:
        di = acts.input_grad(f.ref.key.m, f.ref, torch.tensor(0.5), token)
        token = acts.weight_grad(f.ref.key.m, f.ref, di.token).token
    assert manager.log == ["F0", "F1", "dI0", "dW0", "dI1", "dW1"]
    assert acts.pool.live_count == 0 and acts.ledger.seq == 6
    assert len(acts.arena.written) == 2 * len(chunk.matrix_params())


# ------------------------------------------------------------------------------------- checkpoints
def test_llama_resume_is_bitwise_equal(tmp_path: Path) -> None:
    """Uninterrupted 6 steps against 3 steps, then a fresh process resuming to 6: identical checkpoints
    (parameters, AdamW, the FP8 state of all 21 linears, rolled over) and losses. launch.SMALL_VOCAB rows."""
    from qeffect.checkpoint import diff_checkpoints, inspect_checkpoint

    common = ["-c", str(LLAMA_TINY), "--set", "train.eval_every=0", *small_train(tmp_path)]
    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    for out, args in ((a, ["--steps", "6", "--checkpoint-every", "6"]),
                      (b, ["--steps", "3", "--checkpoint-every", "3"])):
        proc = _qeffect(tmp_path, "train", "--out", str(out), *common, *args)
        assert proc.returncode == 0, proc.stderr[-3000:]
    ck = tmp_path / "c-checkpoints"
    proc = _qeffect(tmp_path, "train", "--out", str(c), *common, "--steps", "6", "--checkpoint-every", "6",
                    "--checkpoint-dir", str(ck), "--resume", str(b / "checkpoints"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    diff = diff_checkpoints(a / "checkpoints" / "step-00000006", ck / "step-00000006")
    assert diff.identical, diff.model_dump_json(indent=2)[:3000]
    assert not diff.only_in_a and not diff.only_in_b
    report = inspect_checkpoint(ck / "step-00000006")
    assert len(report.fp8_modules) == 4 * 5 + 1 and all(m.history_len == 4 for m in report.fp8_modules)

    def losses(run: Path) -> dict[int, float]:
        rows = map(json.loads, (run / "metrics.jsonl").read_text().splitlines())
        return {r["step"]: r["loss"] for r in rows}

    la, lc = losses(a), losses(c)
    assert sorted(lc) == [4, 5, 6] and [lc[s] for s in (4, 5, 6)] == [la[s] for s in (4, 5, 6)]


# ----------------------------------------------------------------------------------------- training
@pytest.mark.slow
def test_llama_tiny_trains_on_the_bundled_asset(tmp_path: Path) -> None:
    """The acceptance run: `qeffect train -c examples/configs/llama-tiny.toml` learns (last ten / first ten
    training cross-entropy < 0.8); about 30 s on two idle cores, the bound is three minutes."""
    proc = _qeffect(tmp_path, "train", "-c", str(LLAMA_TINY))
    assert proc.returncode == 0, proc.stderr[-3000:]
    (run,) = (tmp_path / "runs").iterdir()
    summary = json.loads((run / "summary.json").read_text())
    assert summary["last_to_first_ratio"] < 0.8, summary
    assert summary["heldout_last"] < summary["heldout_first"]
    assert summary["steps"] == load_config(LLAMA_TINY).train.steps


# ---------------------------------------------------------------------------------------------- GPU
requires_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _te_ok() -> bool:
    from qeffect.fp8.te import te_available

    return torch.cuda.is_available() and te_available()


requires_te = pytest.mark.skipif(not _te_ok(), reason="needs CUDA and Transformer Engine")


@pytest.mark.gpu
@requires_cuda
@pytest.mark.parametrize("path", ["eager", "captured-copy", "captured-direct"])
@pytest.mark.parametrize("schedule", ["interleaved", "zbv"])
def test_llama_reference_backend_cuda_bf16_all_paths(schedule: str, path: str) -> None:
    cfg = _llama(**{"train.device": "cuda", "train.dtype": "bfloat16", "pipeline.schedule": schedule})
    report = run_verify_state(cfg, steps=6, path=path)
    assert report.passed, report.first_divergence
    assert all(c.mismatches == 0 and c.compared > 0 for c in report.categories)
    assert report.amax_rollover.rolled_over


@pytest.mark.gpu
@requires_te
@pytest.mark.parametrize("path", ["eager", "captured-copy", "captured-direct"])
@pytest.mark.parametrize("schedule", ["interleaved", "zbv"])
def test_llama_te_backend_cuda_bf16_all_paths(schedule: str, path: str) -> None:
    """The te backend's llama layer (TE Linears for qkv, proj, gate, up, down and the head, with
    delay_wgrad_compute; RMSNorm, rotary and GQA attention in torch) eager and captured against native."""
    cfg = _llama(**{"train.device": "cuda", "train.dtype": "bfloat16", "fp8.backend": "te",
                    "pipeline.schedule": schedule})
    report = run_verify_state(cfg, steps=6, path=path)
    assert report.passed, report.first_divergence
    assert all(c.mismatches == 0 and c.compared > 0 for c in report.categories)
    by = {c.category: c for c in report.categories}
    assert by["fp8_state"].compared > 0 and report.amax_rollover.rolled_over


@pytest.mark.gpu
@requires_te
def test_llama_te_backend_split_dw_is_delayed_for_every_linear() -> None:
    """Every matrix of the llama layer on the te backend is a TE Linear with a delayed wgrad queue."""
    from qeffect.runtime.build import build_chunks_for

    cfg = _llama(**{"train.device": "cuda", "train.dtype": "bfloat16", "fp8.backend": "te"})
    chunks = build_chunks_for(cfg, "cuda")
    lins = {n: m for c in chunks.values() for n, m in c.matrix_linears().items()}
    assert {n.rsplit(".", 1)[-1] for n in lins} == {"qkv", "proj", "gate", "up", "down", "head"}
    assert all(m.wgrad_store is not None and m.bias is None for m in lins.values())


# ---------------------------------------------------------------------------------- offload (fake device)
@pytest.mark.parametrize("mode", ["release", "resident"])
def test_llama_chunk_activations_round_trip_through_an_offload_slot_bitwise(mode: str) -> None:
    """A llama chunk's forward with its saved tensors stored in a VMM slot (on the fake device), the slot
    released or overwritten by another group, restored for the backward: the input, norm and matrix
    gradients are those of the plain run, bit for bit; the rotary tables are not among the saved tensors."""
    import copy

    from qeffect.config import OffloadConfig
    from qeffect.offload import OffloadManager
    from qeffect.offload.fake import FakeDevice
    from qeffect.runtime.build import build_chunks_for

    cfg = _llama(**{"model.vocab_size": 256, "pipeline.pp": 1, "pipeline.chunks_per_rank": 3})
    base = build_chunks_for(cfg, "cpu")[1]  # a middle chunk: hidden in, hidden out
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 32, 64, generator=gen)
    gy = torch.randn(2, 32, 64, generator=gen)

    plain = copy.deepcopy(base)  # every FP8 forward moves its state on: each run gets a fresh copy
    x0 = x.clone().requires_grad_()
    ref = torch.autograd.grad(plain(x0, is_first_microbatch=True), [x0, *plain.parameters()], gy)
    dev = FakeDevice(0, granularity=64 << 10)
    config = OffloadConfig(mode=mode, reap=True, min_window=0)
    mgr = OffloadManager(config, device="cpu", driver=dev.driver(), streams=dev)
    g, mid, other = mgr.group("F0"), mgr.group("F1"), mgr.group("F2")
    with g.discovery_hooks():
        copy.deepcopy(base)(x.clone().requires_grad_(), is_first_microbatch=True)
    mid.adopt_specs(g.specs)
    other.adopt_specs(g.specs)
    assert g.specs and not any(s.shape == tuple(base.rope_cos.shape) for s in g.specs)
    mgr.allocate([g, mid, other])  # resident: g and other share a bank (tests/test_offload.py's round trip)
    chunk = copy.deepcopy(base)
    xi = x.clone().requires_grad_()
    g.before_forward()
    with dev.host_compute(), g.capture_hooks():
        y = chunk(xi, is_first_microbatch=True)
    g.after_forward()
    if mode == "release":
        mgr.reap(block=True)
    other.before_forward()
    with dev.host_compute():
        for v in other.views:
            v.fill_(-3.0)  # another forward's activations where g's were
    other.after_forward()
    g.before_backward()
    with dev.host_compute():
        got = torch.autograd.grad(y, [xi, *chunk.parameters()], gy)
    g.after_backward()
    assert mgr.stats.h2d_copies >= 1
    assert all(torch.equal(a, b) for a, b in zip(got, ref, strict=True))
    mgr.close()


# ------------------------------------------------------------------------------------- torchao head
def test_llama_with_a_stateless_untied_head_is_bitwise(monkeypatch) -> None:
    """`fp8.head = "torchao"` on a llama run: the untied head is a stateless linear whose weight gradient
    comes in dI (here a plain stand-in for torchao's Float8Linear, which needs CUDA and the torchao extra; the
    real one: `test_llama_torchao_head_cuda`). The split actions match native eager bit for bit."""
    from torch import nn

    from qeffect.fp8 import torchao_head as ao
    from qeffect.runtime.build import build_chunks_for

    class StandInHead(nn.Linear):
        def forward(self, x: torch.Tensor, is_first_microbatch: bool | None = None) -> torch.Tensor:
            return super().forward(x)

    monkeypatch.setattr(ao, "require_torchao", lambda: None)
    monkeypatch.setattr(ao, "torchao_head",
                        lambda i, o, *, device=None: StandInHead(i, o, bias=False, device=device))
    cfg = _llama(**{"fp8.head": "torchao"})
    last = build_chunks_for(cfg, "cpu")[cfg.pipeline.num_stages - 1]
    assert "head.weight" in last.nonmatrix_params() and "head" not in last.matrix_linears()
    report = run_verify_state(cfg, steps=2)
    assert report.passed, report.first_divergence
    assert all(c.compared > 0 for c in report.categories)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA and torchao")
@pytest.mark.parametrize("path", ["eager", "captured-direct"])
def test_llama_torchao_head_cuda(path: str) -> None:
    pytest.importorskip("torchao")
    cfg = _llama(**{"fp8.head": "torchao", "train.device": "cuda", "train.dtype": "bfloat16"})
    report = run_verify_state(cfg, steps=3, path=path)
    assert report.passed, report.first_divergence
    assert all(c.mismatches == 0 for c in report.categories)


@pytest.mark.parametrize("layout", [{"pipeline.pp": 4, "pipeline.chunks_per_rank": 1},
                                    {"pipeline.chunks_per_rank": 1, "model.layers_per_chunk": 2}],
                         ids=["pp4x1", "pp2x1-two-layer-chunks"])
def test_llama_checkpoint_resumes_into_another_layout_bitwise(tmp_path: Path, layout: dict) -> None:
    """Layout-free checkpoints hold for the llama family: saved as PP=2 x 2 chunks at step 2, loaded into
    another layout of the same 4 layers and run to step 4, every parameter, AdamW moment and FP8 state
    tensor equals the uninterrupted run's, bit for bit."""
    from qeffect.checkpoint import load_checkpoint, save_checkpoint
    from qeffect.checkpoint.inspect import compare_tensors
    from qeffect.checkpoint.state import local_view, tensor_state
    from qeffect.runtime.build import build_single_process
    from qeffect.verify.state import synthetic_batches

    def run_steps(pipe, cfg, steps: range):
        for step in steps:
            pipe.step(synthetic_batches(cfg, step, "cpu"))
        return pipe

    def bits(pipe) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in tensor_state(local_view(pipe)).items()}

    cfg = _llama(**{"model.vocab_size": 256})
    pipe = run_steps(build_single_process(cfg, native=False), cfg, range(2))
    save_checkpoint(pipe, tmp_path / "step-2", cfg)
    uninterrupted = bits(run_steps(pipe, cfg, range(2, 4)))
    other = cfg.with_overrides(**layout)
    moved = build_single_process(other, native=False)
    assert load_checkpoint(moved, tmp_path / "step-2", other).step == 2
    resumed = bits(run_steps(moved, other, range(2, 4)))
    assert sorted(resumed) == sorted(uninterrupted) and len(resumed) > 100
    assert any(".gate." in k for k in resumed) and not any("pos_emb" in k for k in resumed)
    assert not compare_tensors(resumed, uninterrupted)
