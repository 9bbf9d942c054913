"""Checkpoints in one process: bitwise round trip, quiescence, atomic folders, refusals, corruption, inspect.

Pipelines here use a 256-token vocabulary and synthetic batches (fast); `test_checkpoint_resume.py`
covers fresh-process resume of the real tiny default through `qeffect train`.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch

import qeffect.checkpoint.dcp as ckdcp
from qeffect.checkpoint import (
    CheckpointDiff,
    CheckpointReport,
    diff_checkpoints,
    inspect_checkpoint,
    load_checkpoint,
    load_tensors,
    open_checkpoint,
    save_checkpoint,
)
from qeffect.checkpoint.inspect import compare_tensors
from qeffect.checkpoint.state import local_view, tensor_state
from qeffect.cli.app import main
from qeffect.config import RunConfig, bit_changing_fields, load_config
from qeffect.contracts import CommitViolation
from qeffect.errors import ReportError, UserError
from qeffect.runtime.build import build_single_process
from qeffect.runtime.transport import LocalTransport
from qeffect.verify.state import synthetic_batches

SMALL = {"model.vocab_size": 256}


def small_cfg(**over):
    return load_config().with_overrides(**SMALL, **over)


def trained(cfg, steps: int):
    pipe = build_single_process(cfg, native=False)
    for step in range(steps):
        pipe.step(synthetic_batches(cfg, step, "cpu"))
    return pipe


def state_bits(pipe) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in tensor_state(local_view(pipe)).items()}


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert sorted(a) == sorted(b)
    assert not compare_tensors(a, b), compare_tensors(a, b)[:3]


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> tuple[Path, object, dict[str, torch.Tensor]]:
    """A checkpoint after 2 steps of the small interleaved pipeline, its config and its tensors."""
    cfg = small_cfg()
    pipe = trained(cfg, 2)
    path = tmp_path_factory.mktemp("ck") / "step-2"
    torch.manual_seed(1234)  # a known RNG state to find again after a load
    save_checkpoint(pipe, path, cfg)
    return path, cfg, state_bits(pipe)


def copy_of(saved_path: Path, tmp_path: Path) -> Path:
    dst = tmp_path / "copy"
    shutil.copytree(saved_path, dst)
    return dst


# ------------------------------------------------------------------------------------- round trip
def test_layout_and_payload(saved) -> None:
    path, cfg, _ = saved
    names = sorted(p.name for p in path.iterdir())
    assert ".metadata" in names and "qeffect.json" in names and any(n.endswith(".distcp") for n in names)
    assert not list(path.parent.glob("*.tmp-*"))
    payload = open_checkpoint(path).payload
    assert payload.schema_version == 2 and payload.step == 2 and payload.epochs == {"0": 2, "1": 2}
    assert payload.config == cfg.model_dump() and payload.schedule == "interleaved"
    assert payload.recipe["amax_history_len"] == cfg.fp8.amax_history_len and payload.recipe["fp8_format"] == "HYBRID"
    assert [s.stage for s in payload.stages] == [0, 1, 2, 3] and [s.layers for s in payload.stages] == [[0], [1], [2], [3]]
    assert "effect tokens" in payload.not_saved and "invalidated on resume" in payload.cache_semantics
    keys = set(open_checkpoint(path).metadata.state_dict_metadata)
    # keyed by the model's global structure (layers, embeddings, head), not by stage or rank
    assert "model.tok_emb.weight" in keys and "optim.head.weight.exp_avg_sq" in keys
    assert "optim.layers.1.qkv.weight.step" in keys and "fp8.head.grad_amax_history" in keys
    assert "fp8.layers.3.fc2.input_scale" in keys and not any(".s0." in k or "blocks" in k for k in keys)


def test_load_restores_every_tensor_epochs_and_rng(saved) -> None:
    path, cfg, bits = saved
    fresh = build_single_process(cfg, native=False)
    assert not fresh.ranks[0].optimizer.state  # lazily created: the load must create it
    torch.manual_seed(99)
    payload = load_checkpoint(fresh, path, cfg)
    assert payload.step == 2
    assert_same(state_bits(fresh), bits)
    restored = torch.get_rng_state().clone()
    assert torch.equal(restored, _rng_after_seed(1234)) and not torch.equal(restored, _rng_after_seed(99))
    for r in fresh.ranks:
        assert r.clock.e_W == 2 and r.step_index == 2 and r.arena.epoch == 2
        for s, chunk in r.chunks.items():
            assert not chunk.caches_valid and r.actions[s].cache.e_C is None


def _rng_after_seed(seed: int) -> torch.Tensor:
    torch.manual_seed(seed)
    return torch.get_rng_state()


@pytest.mark.parametrize("schedule", ["interleaved", "zbv"])
def test_resumed_steps_are_bitwise_equal_to_uninterrupted(schedule, tmp_path) -> None:
    cfg = small_cfg(**{"pipeline.schedule": schedule})
    ref = trained(cfg, 3)
    save_checkpoint(trained(cfg, 1), tmp_path / "ck", cfg)
    resumed = build_single_process(cfg, native=False)
    load_checkpoint(resumed, tmp_path / "ck", cfg)
    losses = [resumed.step(synthetic_batches(cfg, step, "cpu")) for step in (1, 2)]
    assert all(torch.isfinite(x) for x in losses)
    assert_same(state_bits(resumed), state_bits(ref))


def test_load_into_a_used_pipeline_is_in_place(saved) -> None:
    """Loading keeps every tensor's address (what captured graphs hold), optimizer state included."""
    path, cfg, bits = saved
    pipe = trained(cfg, 3)
    live = tensor_state(local_view(pipe))
    ptrs = {k: v.data_ptr() for k, v in live.items()}
    load_checkpoint(pipe, path, cfg)
    after = tensor_state(local_view(pipe))
    assert {k: v.data_ptr() for k, v in after.items()} == ptrs
    assert_same({k: v.clone() for k, v in after.items()}, bits)


def test_state_without_a_place_is_refused(saved, monkeypatch) -> None:
    """A module that exposes no FP8 state (a TE module before its first forward) must not load silently."""
    path, cfg, _ = saved
    pipe = build_single_process(cfg, native=False)
    monkeypatch.setattr(pipe.ranks[0].chunks[0], "fp8_state", lambda: {})
    with pytest.raises(ReportError, match=r"no place for.*fp8\.layers\.0\."):
        load_checkpoint(pipe, path, cfg)


def test_the_oracle_can_fail(saved, tmp_path) -> None:
    """Skipping one piece of state on load breaks bitwise equality (the comparison is not vacuous)."""
    path, cfg, bits = saved
    fresh = build_single_process(cfg, native=False)
    load_checkpoint(fresh, path, cfg)
    next(iter(fresh.ranks[0].chunks[0].fp8_state().values())).add_(1.0)
    assert compare_tensors(state_bits(fresh), bits)


# ------------------------------------------------------------------------------- quiescence, atomic
def test_premature_checkpoint_is_refused_and_writes_nothing(tmp_path) -> None:
    cfg = small_cfg()
    pipe = build_single_process(cfg, native=False)
    rank, action = pipe.order[0]
    pipe.ranks[rank].run(action, synthetic_batches(cfg, 0, "cpu"), LocalTransport())  # a live tape
    with pytest.raises(CommitViolation, match=r"premature checkpoint at e_W=0: expected quiescence .*found: pipeline "
                                              r"rank 0: pool 'rank0\.tapes' has 1 live tape\(s\)") as exc:
        save_checkpoint(pipe, tmp_path / "ck", cfg)
    assert exc.value.relation == "premature checkpoint" and "live tape" in str(exc.value)
    assert list(tmp_path.iterdir()) == []


def test_crash_before_rename_leaves_no_checkpoint(tmp_path, monkeypatch) -> None:
    cfg = small_cfg()
    pipe = trained(cfg, 1)

    def boom(*a, **k):
        raise OSError("disk full (injected)")

    monkeypatch.setattr(ckdcp, "write_text_atomic", boom)
    with pytest.raises(OSError, match="injected"):
        save_checkpoint(pipe, tmp_path / "ck", cfg)
    assert not (tmp_path / "ck").exists() and list(tmp_path.iterdir()) == []


def test_overwrite_rules(saved, tmp_path) -> None:
    path, cfg, _ = saved
    pipe = trained(cfg, 1)
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    with pytest.raises(UserError, match="not a checkpoint"):
        save_checkpoint(pipe, other, cfg)
    assert (other / "notes.txt").read_text() == "mine"
    ck = copy_of(path, tmp_path)
    with pytest.raises(UserError, match="not overwriting"):
        save_checkpoint(pipe, ck, cfg)
    save_checkpoint(pipe, ck, cfg, overwrite=True)
    assert open_checkpoint(ck).payload.step == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["copy", "other"]  # no .tmp- or .old- left


# ------------------------------------------------------------------------------------------ refusals
def test_resume_with_other_recipe_is_refused_and_a_schedule_change_is_not(saved) -> None:
    """The schedule is layout (the keys do not depend on it): only the recipe's difference is named."""
    path, _, _ = saved
    cfg = small_cfg(**{"pipeline.schedule": "zbv", "fp8.margin": 1})
    pipe = build_single_process(cfg, native=False)
    with pytest.raises(UserError) as exc:
        load_checkpoint(pipe, path, cfg)
    msg = str(exc.value)
    assert "pipeline.schedule" not in msg
    assert msg.endswith("checkpoint differs from this run: fp8.margin: checkpoint 0, run 1")
    assert "train.steps" not in msg  # only fields that change the computation are compared
    assert pipe.ranks[0].clock.e_W == 0 and not pipe.ranks[0].optimizer.state  # nothing loaded


def test_resume_with_other_pipeline_shape_is_refused(saved) -> None:
    path, _, _ = saved
    cfg = small_cfg(**{"pipeline.microbatches": 8})
    with pytest.raises(UserError, match="pipeline.microbatches: checkpoint 4, run 8"):
        load_checkpoint(build_single_process(cfg, native=False), path, cfg)


@pytest.mark.parametrize(("field", "value", "named"), [
    ("fp8.margin", 2, "fp8.margin: checkpoint 0, run 2"),
    ("fp8.amax_compute_algo", "most_recent", "fp8.amax_compute_algo: checkpoint 'max', run 'most_recent'"),
    ("optim.lr", 1e-3, "optim.lr: checkpoint 0.003, run 0.001"),
    ("optim.weight_decay", 0.1, "optim.weight_decay: checkpoint 0.0, run 0.1"),
    ("train.dtype", "bfloat16", "train.dtype: checkpoint 'float32', run 'bfloat16'"),
    ("train.seed", 7, "train.seed: checkpoint 0, run 7"),
])
def test_resume_under_another_bit_changing_setting_is_refused(saved, field: str, value: object,
                                                              named: str) -> None:
    """Every setting marked ``changes_bits`` is kept on resume: a different one is refused, by name, before
    anything is loaded."""
    path, _, _ = saved
    assert field in bit_changing_fields()
    cfg = small_cfg(**{field: value})
    pipe = build_single_process(cfg, native=False)
    with pytest.raises(UserError, match=f"checkpoint differs from this run: {re.escape(named)}$"):
        load_checkpoint(pipe, path, cfg)
    assert pipe.ranks[0].clock.e_W == 0 and not pipe.ranks[0].optimizer.state  # nothing loaded


def test_resume_refusal_names_each_difference(saved) -> None:
    path, _, _ = saved
    cfg = small_cfg(**{"optim.lr": 1e-3, "optim.beta2": 0.99, "train.seed": 3, "train.steps": 99})
    with pytest.raises(UserError, match=re.escape(
            "checkpoint differs from this run: optim.beta2: checkpoint 0.95, run 0.99; "
            "optim.lr: checkpoint 0.003, run 0.001; train.seed: checkpoint 0, run 3")):
        load_checkpoint(build_single_process(cfg, native=False), path, cfg)


def test_resume_fields_are_the_bit_changing_ones_and_the_layout() -> None:
    """Refused: everything refused before (model, pipeline shape and schedule, fp8, activation dtype) and
    now every bit-changing setting; allowed: what leaves the bits and the layout alone."""
    from qeffect.checkpoint.state import RESUME_FIELDS

    before = [f"{s}.{f}" for s in ("model", "pipeline", "fp8") for f in RunConfig.model_fields[s].annotation.model_fields]
    assert set(before) - {"pipeline.wgrad_staging", "pipeline.wgrad_staging_by_liveness"} <= set(RESUME_FIELDS)
    assert set(bit_changing_fields()) | {"train.dtype", "pipeline.schedule"} <= set(RESUME_FIELDS)
    free = ("pipeline.wgrad_staging", "pipeline.wgrad_staging_by_liveness", "train.steps", "train.path", "train.device", "runtime.rank_streams",
            "offload.mode", "train.checkpoint_every")
    assert not set(free) & set(RESUME_FIELDS)


def test_resume_with_other_speed_settings_loads(saved) -> None:
    """Staged accumulation, the run length and the runtime section change no bits: a resume may change them."""
    path, cfg, bits = saved
    other = cfg.with_overrides(**{"pipeline.wgrad_staging": 0, "train.steps": 7, "runtime.rank_streams": False})
    fresh = build_single_process(other, native=False)
    assert load_checkpoint(fresh, path, other).step == 2
    assert_same(state_bits(fresh), bits)


def test_a_checkpoint_of_the_old_config_schema_loads_and_inspects(saved, tmp_path) -> None:
    """Checkpoints store their config as written: one from before the [offload] section (`train.offload*`
    fields, no [runtime]) still resumes under today's config and inspects."""
    path, cfg, bits = saved
    ck = copy_of(path, tmp_path)
    old = cfg.model_dump()
    old.pop("runtime"), old.pop("offload")
    old["train"].update(offload="off", offload_min_window=12, offload_lookahead=1, offload_reap=False)
    _edit_payload(ck, config=old)
    fresh = build_single_process(cfg, native=False)
    assert load_checkpoint(fresh, ck, cfg).config["train"]["offload"] == "off"
    assert_same(state_bits(fresh), bits)
    report = inspect_checkpoint(ck)
    assert report.config["train"]["offload_lookahead"] == 1 and "runtime" not in report.config
    diff = diff_checkpoints(path, ck)
    assert diff.identical and "train.offload: a absent, b 'off'" in diff.other_config_differences


# ---------------------------------------------------------------------------------------- corruption
def _flip_byte(f: Path, at: int) -> None:
    data = bytearray(f.read_bytes())
    data[at] ^= 0xFF
    f.write_bytes(bytes(data))


def _shard(ck: Path) -> Path:
    return next(ck.glob("*.distcp"))


CORRUPTIONS = {
    "not a folder": (lambda ck: (shutil.rmtree(ck), ck.write_text("x")), "not a folder"),
    "empty folder": (lambda ck: [p.unlink() for p in ck.iterdir()], "not a checkpoint"),
    "no payload": (lambda ck: (ck / "qeffect.json").unlink(), "no qeffect payload"),
    "payload not json": (lambda ck: (ck / "qeffect.json").write_text("{not json"), "qeffect.json is corrupted"),
    "unknown schema": (lambda ck: _edit_payload(ck, schema_version=99), "unknown checkpoint schema version 99"),
    "payload schema": (lambda ck: _edit_payload(ck, step="three"), "does not match schema 2: step"),
    "missing shard": (lambda ck: _shard(ck).unlink(), "missing shard __0_0.distcp"),
    "truncated shard": (lambda ck: _shard(ck).write_bytes(_shard(ck).read_bytes()[:1000]), "is truncated"),
    "corrupted shard": (lambda ck: _flip_byte(_shard(ck), 5000), "shard __0_0.distcp is corrupted"),
    "corrupted metadata": (lambda ck: _flip_byte(ck / ".metadata", 100), "file .metadata is corrupted"),
    "unreadable metadata": (lambda ck: _garbage_metadata(ck), "DCP .metadata cannot be read"),
}


def _edit_payload(ck: Path, **fields) -> None:
    data = json.loads((ck / "qeffect.json").read_text())
    data.update(fields)
    (ck / "qeffect.json").write_text(json.dumps(data))


def _garbage_metadata(ck: Path) -> None:
    """A .metadata that matches the manifest but is not a pickle: the DCP reader's own error is wrapped."""
    from qeffect.checkpoint.files import sha256_file

    (ck / ".metadata").write_bytes(b"garbage" * 10)
    data = json.loads((ck / "qeffect.json").read_text())
    data["files"][".metadata"] = {"bytes": 70, "sha256": sha256_file(ck / ".metadata")}
    (ck / "qeffect.json").write_text(json.dumps(data))


@pytest.mark.parametrize("case", sorted(CORRUPTIONS))
def test_corruption_gives_one_line_and_exit_1(case, saved, tmp_path, capsys) -> None:
    path, cfg, _ = saved
    ck = copy_of(path, tmp_path)
    damage, expected = CORRUPTIONS[case]
    damage(ck)
    with pytest.raises(ReportError, match=expected):
        inspect_checkpoint(ck)
    rc, out, err = _cli(capsys, "inspect-checkpoint", str(ck))
    assert rc == 1 and out == ""
    assert err.count("\n") == 1 and err.startswith("qeffect: error: ") and str(ck) in err and expected in err
    if case not in ("not a folder", "empty folder"):  # resume refuses the same folder the same way
        with pytest.raises(ReportError, match=expected):
            load_checkpoint(build_single_process(cfg, native=False), ck, cfg)


def test_tensor_read_errors_are_wrapped(saved, tmp_path) -> None:
    """Even with the manifest out of the way, DCP's own read error becomes one ReportError line."""
    path, _, _ = saved
    ck = copy_of(path, tmp_path)
    opened = open_checkpoint(ck)
    shard = _shard(ck)
    shard.write_bytes(b"\0" * shard.stat().st_size)  # right size, not a torch.save archive
    with pytest.raises(ReportError, match="cannot read checkpoint tensors") as exc:
        load_tensors(opened, ["fp8.layers.0.qkv.input_scale"])
    assert "\n" not in str(exc.value)


# ---------------------------------------------------------------------------------- inspect and diff
def _cli(capsys, *argv: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exc:
        main(list(argv))
    out, err = capsys.readouterr()
    return int(exc.value.code or 0), out, err


def test_inspect_json_validates(saved, capsys) -> None:
    path, cfg, _ = saved
    rc, out, _ = _cli(capsys, "inspect-checkpoint", str(path), "--json")
    assert rc == 0
    report = CheckpointReport.model_validate_json(out)
    assert report.schema_version == 1 and report.step == 2 and report.epochs == {"0": 2, "1": 2}
    assert report.total_bytes == sum(p.stat().st_size for p in path.iterdir())
    assert report.qeffect_runtime_state_bytes == report.sections["fp8"].stored_bytes + report.payload_bytes
    assert 0 < report.qeffect_runtime_state_bytes < report.total_bytes
    assert [s.stage for s in report.stages] == [0, 1, 2, 3]
    assert sum(s.param_bytes for s in report.stages) == report.sections["model"].logical_bytes
    assert len(report.fp8_modules) == 4 * 4 + 1  # qkv, proj, fc1, fc2 per stage + the head
    for m in report.fp8_modules:
        assert m.history_len == cfg.fp8.amax_history_len and set(m.tensors) == {"input", "weight", "grad"}
        assert 0 < m.amax_range[0] <= m.amax_range[1] and m.scale_range[0] > 0


def test_inspect_prints_sizes_and_fp8(saved, capsys, monkeypatch) -> None:
    path, _, _ = saved
    monkeypatch.setenv("COLUMNS", "200")  # rich wraps at 80 columns without a terminal
    rc, out, _ = _cli(capsys, "inspect-checkpoint", str(path.parent / path.name), "--modules", "0")
    assert rc == 0
    for text in ("step 2", "total checkpoint bytes", "qeffect runtime state", "per stage",
                 "FP8 state per module", "s3 head", "interleaved"):
        assert text in out


def test_diff(saved, tmp_path, capsys) -> None:
    path, cfg, _ = saved
    same = copy_of(path, tmp_path)
    assert diff_checkpoints(path, same).identical
    rc, out, _ = _cli(capsys, "inspect-checkpoint", str(path), "--diff", str(same), "--json")
    assert rc == 0 and CheckpointDiff.model_validate_json(out).identical

    later = tmp_path / "later"
    save_checkpoint(trained(cfg, 3), later, cfg)
    d = diff_checkpoints(path, later)
    assert not d.identical and any(s.startswith("step: 2 vs 3") for s in d.state_differences)
    keys = {t.key for t in d.tensors_differing}
    assert "model.tok_emb.weight" in keys and "fp8.head.input_amax_history" in keys
    rc, out, _ = _cli(capsys, "inspect-checkpoint", str(path), "--diff", str(later))
    assert rc == 1 and "DIFFERENT" in out and "model.tok_emb.weight" in out
    # a checkpoint that cannot be read is trouble (2, as diff(1)), never a difference (1)
    (tmp_path / "empty").mkdir()
    for other in (tmp_path / "missing", tmp_path / "empty"):
        for a, b in ((path, other), (other, path)):
            rc, out, err = _cli(capsys, "inspect-checkpoint", str(a), "--diff", str(b))
            assert rc == 2 and not out and len(err.strip().splitlines()) == 1 and other.name in err, err


def test_diff_is_bitwise() -> None:
    a = {"z": torch.tensor([0.0, float("nan")]), "same": torch.ones(3)}
    b = {"z": torch.tensor([-0.0, float("nan")]), "same": torch.ones(3)}
    diff = compare_tensors(a, b)
    assert [(d.key, d.differing_elements) for d in diff] == [("z", 1)]  # -0.0 != 0.0 bitwise
    assert compare_tensors({"x": torch.ones(2)}, {"x": torch.ones(2, dtype=torch.float64)})[0].reason.startswith("dtype")


# ------------------------------------------------------------------------------ train --resume (CLI)
@pytest.fixture(scope="module")
def default_ck(tmp_path_factory) -> Path:
    """A step-0 checkpoint of the embedded tiny default (what `qeffect train --resume` runs against)."""
    from qeffect.runtime.train import _prepare_data

    cfg = load_config()
    path = tmp_path_factory.mktemp("default") / "step-0"
    save_checkpoint(build_single_process(cfg, native=False), path, cfg, stream=_prepare_data(cfg, 0, 1).stream)
    return path


def test_train_resume_refuses_other_schedule_and_recipe(default_ck, tmp_path, capsys) -> None:
    from importlib import resources

    text = resources.files("qeffect.configs").joinpath("tiny.toml").read_text()
    assert "margin = 0" in text
    config = tmp_path / "margin1.toml"
    config.write_text(text.replace("margin = 0", "margin = 1"))
    out = tmp_path / "run"
    rc, _, err = _cli(capsys, "train", "--config", str(config), "--schedule", "zbv", "--steps", "2",
                      "--resume", str(default_ck), "--out", str(out))
    assert rc == 2 and err.count("\n") == 1
    assert err == f"qeffect: error: --resume {default_ck}: checkpoint differs from this run: fp8.margin: checkpoint 0, run 1\n"
    assert not out.exists()  # refused before the run folder is created


def test_train_resume_needs_steps_left_and_an_existing_folder(default_ck, tmp_path, capsys) -> None:
    ck = copy_of(default_ck, tmp_path)
    _edit_payload(ck, step=5, epochs={"0": 5, "1": 5})  # qeffect.json is outside the file manifest
    rc, _, err = _cli(capsys, "train", "--steps", "3", "--resume", str(ck), "--out", str(tmp_path / "run"))
    assert rc == 2 and "checkpoint is at step 5" in err and "nothing to train" in err
    rc, _, err = _cli(capsys, "train", "--steps", "3", "--resume", str(tmp_path / "nope"),
                      "--out", str(tmp_path / "run"))
    assert rc == 1 and err.count("\n") == 1
    assert err == f"qeffect: error: --resume {tmp_path / 'nope'}: no such checkpoint folder\n"
    assert not (tmp_path / "run").exists()
