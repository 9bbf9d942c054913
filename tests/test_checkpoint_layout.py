"""Layout-free checkpoints in one process: keys name the model's global structure, so a checkpoint resumes
into another pipeline layout of the same model (pp, chunks_per_rank with the same layer count, schedule),
bit for bit what the uninterrupted run in the old layout computes; another model is refused; schema-1
(stage-keyed) checkpoints still load; `verify-state --resume` and `train --resume` on the command line.

Pipelines here use a 256-token vocabulary and synthetic batches; the command-line test runs the tiny
default (the issue's acceptance commands). Torchrun layouts: tests/test_checkpoint_layouts_dist.py.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.distributed.checkpoint as dcp

from qeffect.checkpoint import layout_change, load_checkpoint, load_tensors, open_checkpoint, save_checkpoint
from qeffect.checkpoint.dcp import _data_position
from qeffect.checkpoint.files import quiet_dcp, sha256_file
from qeffect.checkpoint.inspect import compare_tensors, inspect_checkpoint
from qeffect.checkpoint.state import (
    PAYLOAD_FILE,
    global_name,
    local_name,
    local_view,
    parse_key,
    tensor_state,
    v1_key,
)
from qeffect.cli.app import main
from qeffect.config import load_config
from qeffect.errors import UserError
from qeffect.runtime.build import build_single_process
from qeffect.verify.state import run_verify_state, synthetic_batches

SMALL = {"model.vocab_size": 256}
PP4 = {"pipeline.pp": 4, "pipeline.chunks_per_rank": 1}


def small_cfg(**over):
    return load_config().with_overrides(**SMALL, **over)


def run_steps(pipe, cfg, steps: range):
    for step in steps:
        pipe.step(synthetic_batches(cfg, step, "cpu"))
    return pipe


def state_bits(pipe) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in tensor_state(local_view(pipe)).items()}


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b) and len(a) > 100
    diff = compare_tensors(a, b)
    assert not diff, diff[:3]


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[Path, dict[str, torch.Tensor]]:
    """Step 3 of the small pipeline as PP=2 x 2 chunks (Interleaved), and its uninterrupted step 5."""
    cfg = small_cfg()
    pipe = run_steps(build_single_process(cfg, native=False), cfg, range(3))
    path = tmp_path_factory.mktemp("layout") / "step-3"
    save_checkpoint(pipe, path, cfg)
    return path, state_bits(run_steps(pipe, cfg, range(3, 5)))


def test_global_names_round_trip() -> None:
    assert global_name(2, "blocks.1.qkv.weight", 3) == "layers.7.qkv.weight"
    assert global_name(0, "tok_emb.weight", 3) == "tok_emb.weight"
    assert local_name("layers.7.qkv.weight", 3, 4) == (2, "blocks.1.qkv.weight")
    assert local_name("layers.7.qkv.weight", 1, 8) == (7, "blocks.0.qkv.weight")
    assert local_name("head.input_scale", 2, 4) == (3, "head.input_scale")
    assert local_name("pos_emb.weight", 2, 4) == (0, "pos_emb.weight")
    pk = parse_key("optim.layers.7.qkv.weight.exp_avg")
    assert (pk.section, pk.name, pk.state, pk.layer, pk.stage) == ("optim", "layers.7.qkv.weight", "exp_avg", 7, None)
    pk = parse_key("fp8.dp1.s2.blocks.0.fc1.grad_scale")  # schema 1
    assert (pk.section, pk.stage, pk.name, pk.state, pk.dp) == ("fp8", 2, "blocks.0.fc1", "grad_scale", 1)


@pytest.mark.parametrize(("layout", "line"), [
    (PP4, "layout pipeline.chunks_per_rank 2 -> 1, pipeline.pp 2 -> 4 (4 layers)"),
    ({"pipeline.chunks_per_rank": 1, "model.layers_per_chunk": 2},
     "layout model.layers_per_chunk 1 -> 2, pipeline.chunks_per_rank 2 -> 1 (4 layers)"),
    ({"pipeline.schedule": "zbv"}, "layout pipeline.schedule 'interleaved' -> 'zbv' (4 layers)"),
    ({"pipeline.pp": 1, "pipeline.chunks_per_rank": 4}, None),
], ids=["pp4x1", "pp2x1-two-layer-chunks", "zbv", "pp1x4"])
def test_resume_into_another_layout_is_bitwise_the_uninterrupted_run(saved, layout, line) -> None:
    """Saved as PP=2 x 2 chunks at step 3; loaded into another layout and run to step 5: every parameter,
    AdamW moment and FP8 amax history and scale equals the uninterrupted PP=2 x 2 run's, bit for bit
    (the same model and recipe; the layout moves no numbers). The checkpoint's keys are the same either way."""
    path, uninterrupted = saved
    cfg = small_cfg(**layout)
    pipe = build_single_process(cfg, native=False)
    payload = load_checkpoint(pipe, path, cfg)
    assert payload.step == 3 and all(r.clock.e_W == 3 and r.step_index == 3 for r in pipe.ranks)
    if line is None:  # PP=1 x 4 chunks: the stages as before, only the ranks merged
        line = "layout pipeline.chunks_per_rank 2 -> 4, pipeline.pp 2 -> 1 (4 layers)"
    assert layout_change(payload, cfg) == line
    assert_same(state_bits(run_steps(pipe, cfg, range(3, 5))), uninterrupted)


def test_the_layout_oracle_can_fail(saved) -> None:
    """One FP8 state tensor left out of the load breaks the comparison above (it is not vacuous)."""
    path, uninterrupted = saved
    cfg = small_cfg(**PP4)
    pipe = build_single_process(cfg, native=False)
    load_checkpoint(pipe, path, cfg)
    next(iter(pipe.ranks[3].chunks[3].fp8_state().values())).mul_(2.0)
    assert compare_tensors(state_bits(run_steps(pipe, cfg, range(3, 5))), uninterrupted)


@pytest.mark.parametrize(("over", "named"), [
    ({"model.layers_per_chunk": 2}, "model layers (layers_per_chunk x pp x chunks_per_rank): checkpoint 4, run 8"),
    ({"pipeline.pp": 4}, "model layers (layers_per_chunk x pp x chunks_per_rank): checkpoint 4, run 8"),
    ({"model.hidden": 32}, "model.hidden: checkpoint 64, run 32"),
    ({"pipeline.microbatches": 8}, "pipeline.microbatches: checkpoint 4, run 8"),
])
def test_another_model_is_refused_by_name(saved, over, named) -> None:
    path, _ = saved
    cfg = small_cfg(**over)
    pipe = build_single_process(cfg, native=False)
    with pytest.raises(UserError, match=f"checkpoint differs from this run: .*{re.escape(named)}"):
        load_checkpoint(pipe, path, cfg)
    assert pipe.ranks[0].clock.e_W == 0 and not pipe.ranks[0].optimizer.state  # nothing loaded


def _as_schema_1(src: Path, dst: Path) -> None:
    """Rewrite a checkpoint as schema 1 wrote it: stage-qualified keys, `schema_version` 1, no stage layers."""
    ck = open_checkpoint(src)
    lpc, n = ck.payload.config["model"]["layers_per_chunk"], ck.payload.num_stages
    old = {}
    for key, t in load_tensors(ck).items():
        pk = parse_key(key)
        name = pk.name if pk.section == "model" else f"{pk.name}.{pk.state}"
        stage, local = local_name(name, lpc, n)
        old[v1_key(pk.section, stage, local)] = t
    with quiet_dcp():
        dcp.save(old, storage_writer=dcp.FileSystemWriter(str(dst)), no_dist=True)
    data = json.loads((src / PAYLOAD_FILE).read_text())
    data["schema_version"] = 1
    for s in data["stages"]:
        s.pop("layers")
    data["files"] = {f.name: {"bytes": f.stat().st_size, "sha256": sha256_file(f)}
                     for f in sorted(dst.iterdir()) if f.is_file()}
    (dst / PAYLOAD_FILE).write_text(json.dumps(data))


def test_a_schema_1_checkpoint_loads_into_another_layout(saved, tmp_path) -> None:
    """A stage-keyed checkpoint of before is translated through the stages it was written with: loaded into
    PP=4 x 1 it gives the same run as the schema-2 checkpoint; inspect names its modules globally too."""
    path, uninterrupted = saved
    old = tmp_path / "v1"
    _as_schema_1(path, old)
    keys = set(open_checkpoint(old).metadata.state_dict_metadata)
    assert "model.s2.blocks.0.qkv.weight" in keys and "fp8.s3.head.input_scale" in keys
    cfg = small_cfg(**PP4)
    pipe = build_single_process(cfg, native=False)
    assert load_checkpoint(pipe, old, cfg).schema_version == 1
    assert_same(state_bits(run_steps(pipe, cfg, range(3, 5))), uninterrupted)
    report = inspect_checkpoint(old)
    assert report.keys == "stage" and report.checkpoint_schema_version == 1 and report.layers == 4
    assert {m.module for m in report.fp8_modules} == {m.module for m in inspect_checkpoint(path).fp8_modules}
    assert {(m.module, m.stage) for m in report.fp8_modules} >= {("layers.2.qkv", 2), ("head", 3)}


def test_native_eager_loads_the_same_checkpoint(saved) -> None:
    """Native eager (the oracle's side) loads by the same names: parameters, AdamW state and FP8 state as
    the qeffect pipeline loads them."""
    path, _ = saved
    cfg = small_cfg(**PP4)
    native, qeff = build_single_process(cfg, native=True), build_single_process(cfg, native=False)
    for pipe in (native, qeff):
        load_checkpoint(pipe, path, cfg)
    assert_same(state_bits(native), state_bits(qeff))
    assert all(r.step_index == 3 for r in native.ranks)


def test_verify_state_resumes_into_another_layout(saved) -> None:
    """`run_verify_state(resume=...)`: both sides from the checkpoint, PP=4 x 1, steps 3..5, bitwise."""
    path, _ = saved
    report = run_verify_state(small_cfg(**PP4), steps=3, resume=path)
    assert report.passed and report.start_step == 3 and report.resumed_from == str(path)
    assert report.resumed_layout == "layout pipeline.chunks_per_rank 2 -> 1, pipeline.pp 2 -> 4 (4 layers)"
    assert all(c.compared > 0 and c.mismatches == 0 for c in report.categories)
    with pytest.raises(UserError, match="model.hidden: checkpoint 64, run 32"):
        run_verify_state(small_cfg(**{"model.hidden": 32}), steps=1, resume=path)


def test_data_position_moves_to_another_data_parallel_degree() -> None:
    """Replica 0's position, as global microbatches served in the epoch, rounded up to whole batches of the
    new replicas; the layout line names what is skipped."""
    data = {"epoch": 1, "cursor": 5, "seed": 0, "batch_size": 2, "dp_rank": 0, "dp_size": 1}
    payload = SimpleNamespace(dp=1, pp=2, world_size=2, processes=[
        SimpleNamespace(global_rank=r, dp_rank=0, data=data, rng={}) for r in (0, 1)])
    for dp_rank in (0, 1):
        view = SimpleNamespace(dp=2, dp_rank=dp_rank, pp=2, world_size=4, global_rank=2 * dp_rank)
        moved = _data_position(payload, view, SimpleNamespace(batches_per_epoch=100))
        assert moved == {**data, "cursor": 3, "dp_rank": dp_rank, "dp_size": 2}  # 5 served -> 6 = 3 x 2
    back = {**data, "cursor": 3, "dp_size": 2}
    payload = SimpleNamespace(dp=2, pp=2, world_size=4, processes=[
        SimpleNamespace(global_rank=g, dp_rank=g // 2, data={**back, "dp_rank": g // 2}, rng={}) for g in range(4)])
    view = SimpleNamespace(dp=1, dp_rank=0, pp=2, world_size=1, global_rank=0)
    assert _data_position(payload, view, SimpleNamespace(batches_per_epoch=100))["cursor"] == 6
    assert _data_position(payload, view, SimpleNamespace(batches_per_epoch=4))["cursor"] == 4  # epoch's end


# ------------------------------------------------------------------------------ the command line
def _cli(capsys, *argv: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exc:
        main(list(argv))
    out, err = capsys.readouterr()
    return int(exc.value.code or 0), out, err


def test_cli_train_and_verify_resume_into_pp4(tmp_path, capsys, monkeypatch) -> None:
    """The acceptance commands on the tiny default: save at step 3 as PP=2 x 2 chunks; `train --resume CK
    --set pipeline.pp=4 --set pipeline.chunks_per_rank=1 --steps 5` trains on (naming the layout change in
    one line), and `verify-state --resume CK` in that layout passes bitwise for 3 steps."""
    monkeypatch.setenv("COLUMNS", "200")
    a = tmp_path / "a"
    rc, _, err = _cli(capsys, "train", "--steps", "3", "--checkpoint-every", "3", "--set", "train.eval_every=0",
                      "--out", str(a))
    assert rc == 0, err
    ck = a / "checkpoints"
    pp4 = ["--set", "pipeline.pp=4", "--set", "pipeline.chunks_per_rank=1"]
    rc, out, err = _cli(capsys, "train", "--resume", str(ck), *pp4, "--steps", "5", "--set", "train.eval_every=0",
                        "--out", str(tmp_path / "b"), "--json", str(tmp_path / "b.json"))
    assert rc == 0, err
    line = "layout pipeline.chunks_per_rank 2 -> 1, pipeline.pp 2 -> 4 (4 layers)"
    assert out.count(line) == 1 and "resumed from" in out
    summary = json.loads((tmp_path / "b.json").read_text())
    assert summary["start_step"] == 3 and summary["resumed_layout"] == line
    steps = [json.loads(x)["step"] for x in (tmp_path / "b" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [4, 5]
    rc, out, err = _cli(capsys, "verify-state", "--resume", str(ck), *pp4, "--steps", "3",
                        "--json", str(tmp_path / "v.json"))
    assert rc == 0, out + err
    assert "PASS: bitwise equal" in out and line in out and "at step 3" in out
    report = json.loads((tmp_path / "v.json").read_text())
    assert report["passed"] and report["pp"] == 4 and report["start_step"] == 3 and len(report["losses"]) == 3
    rc, _, err = _cli(capsys, "verify-state", "--resume", str(ck), "--faults")
    assert rc != 0 and "--resume" in err and err.count("\n") == 1


# --------------------------------------------------------------------------------------------- GPU
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("backend", ["reference", "te"])
def test_captured_verify_resumes_into_another_layout_on_gpu(backend, tmp_path) -> None:
    """On a GPU: a captured-direct PP=2 x 2 run saved at step 2, then native eager and captured-direct both
    started from it as PP=4 x 1 (graphs captured after the load) and ZB-V, bitwise for 3 steps."""
    if backend == "te":
        pytest.importorskip("transformer_engine.pytorch")
    cfg = small_cfg(**{"train.device": "cuda", "fp8.backend": backend, "train.dtype": "bfloat16"})
    pipe = build_single_process(cfg, native=False, path="captured-direct")
    for step in range(2):
        pipe.step(synthetic_batches(cfg, step, "cuda"))
    save_checkpoint(pipe, tmp_path / "ck", cfg)
    for layout in (PP4, {"pipeline.schedule": "zbv"}):
        report = run_verify_state(small_cfg(**{"train.device": "cuda", "fp8.backend": backend,
                                               "train.dtype": "bfloat16", **layout}),
                                  steps=3, path="captured-direct", resume=tmp_path / "ck")
        assert report.passed and report.start_step == 2 and report.resumed_layout is not None, report.first_divergence
