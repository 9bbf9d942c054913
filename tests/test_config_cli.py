"""`--set section.field=value` on train, verify-state, profile and capture; `qeffect config show | schema`."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from qeffect.cli.app import main
from qeffect.cli.config import config_toml, toml_value
from qeffect.config import (
    RunConfig,
    apply_sets,
    bit_changing_fields,
    load_config,
    parse_set,
    validate_config,
)
from qeffect.errors import UserError

ACCEPTANCE_FIELDS = ("optim.warmup_steps", "optim.clip_grad_norm", "optim.min_lr", "train.log_every")


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exc:
        main(list(argv))
    out, err = capsys.readouterr()
    return int(exc.value.code or 0), out, err


def _field(dotted: str):
    section, name = dotted.split(".")
    return RunConfig.model_fields[section].annotation.model_fields[name]


# ------------------------------------------------------------------------------------- parsing
@pytest.mark.parametrize(("item", "expected"), [
    ("optim.lr=3e-4", ("optim", "lr", 3e-4)),
    ("optim.lr = 0.00217", ("optim", "lr", 0.00217)),
    ("train.device=cuda", ("train", "device", "cuda")),
    ("fp8.backend=te", ("fp8", "backend", "te")),
    ("fp8.backend='te'", ("fp8", "backend", "te")),
    ("offload.explicit_banks=[0,1,0]", ("offload", "explicit_banks", [0, 1, 0])),
    ("logging.tensorboard=true", ("logging", "tensorboard", True)),
    ("train.run_dir=runs/a b", ("train", "run_dir", "runs/a b")),
    ('data.path="a=b"', ("data", "path", "a=b")),
    ("data.path=", ("data", "path", "")),
    ("data.eot=2024", ("data", "eot", "2024")),  # a string field keeps the text
    ("train.run_dir=2024-01-01", ("train", "run_dir", "2024-01-01")),  # not a TOML date
])
def test_parse_set_reads_a_toml_value_else_the_text(item: str, expected: tuple) -> None:
    assert parse_set(item) == expected


@pytest.mark.parametrize(("item", "match"), [
    ("optim.lr", r"^--set optim\.lr: expected section\.field=value \(no '='\)$"),
    ("lr=1", r"^--set lr=1: expected section\.field=value \(did you mean optim\.lr\?\)$"),
    ("=1", r"^--set =1: expected section\.field=value$"),
    ("optim.lrr=1", r"^--set optim\.lrr=1: unknown field \(did you mean optim\.lr\?\)$"),
    ("optm.lr=1", r"^--set optm\.lr=1: unknown section \(did you mean optim\?\)$"),
    ("zzz.lr=1", r"^--set zzz\.lr=1: unknown section \(sections: model, pipeline, .*offload\)$"),
    ("optim.qqq=1", r"^--set optim\.qqq=1: unknown field \(fields of \[optim\]: lr, beta1, .*clip_grad_norm\)$"),
    ("optim.lr=-1", r"^--set optim\.lr=-1: invalid configuration: optim\.lr: Input should be greater than 0$"),
    ("train.device=tpu", r"^--set train\.device=tpu: invalid configuration: train\.device: Input should be 'cpu' "),
    ("optim.min_lr=1", r"^--set optim\.min_lr=1: invalid configuration: optim: .*min_lr \(1\.0\) must not exceed"),
])
def test_bad_set_is_one_user_error_naming_it(item: str, match: str) -> None:
    with pytest.raises(UserError, match=match):
        apply_sets(RunConfig(), [item])


def test_apply_sets_later_items_win_and_take_raw_toml_data() -> None:
    cfg = apply_sets(RunConfig(), ["train.steps=3", "optim.lr=1e-3", "train.steps=9"])
    assert (cfg.train.steps, cfg.optim.lr) == (9, 1e-3)
    assert apply_sets(RunConfig(), []) == RunConfig()
    # a job's TOML data before validation: a section it lacks is created
    data = {"optim": {"lr": 1e-3}}
    cfg = apply_sets(data, ["optim.min_lr=1e-4", "data.path=c4/*.json.gz"], source="job x")
    assert (cfg.optim.lr, cfg.optim.min_lr, cfg.data.path) == (1e-3, 1e-4, "c4/*.json.gz")
    assert data == {"optim": {"lr": 1e-3}}  # not modified
    with pytest.raises(UserError, match=r"^job x optim\.lr=0: invalid configuration: optim\.lr: "):
        apply_sets(data, ["optim.lr=0"], source="job x")


def test_every_field_has_a_description() -> None:
    for section, info in RunConfig.model_fields.items():
        assert (info.annotation.__doc__ or "").strip(), f"[{section}] has no docstring"
        for name, field in info.annotation.model_fields.items():
            assert (field.description or "").strip(), f"{section}.{name} has no description"


# ------------------------------------------------------------------------------------- TOML out
@pytest.mark.parametrize("value", [0.1, 1 / 3, 3e-4, 1e-8, 1e300, 5e-324, -2.5, 0.0, 1e16, math.inf, -math.inf])
def test_floats_round_trip(value: float) -> None:
    import tomllib

    assert tomllib.loads(f"v = {toml_value(value)}")["v"] == value


@pytest.mark.parametrize("value", ["", "plain", 'quote " and \\ backslash', "tab\tnew\nline", "del\x7f ctl\x01",
                                   "unicode: é ∞ 🙂", "[not] a table"])
def test_strings_round_trip(value: str) -> None:
    import tomllib

    assert tomllib.loads(f"v = {toml_value(value)}")["v"] == value


def test_config_toml_round_trips_through_load_config(tmp_path: Path) -> None:
    cfg = apply_sets(RunConfig(), ["optim.lr=0.00217", "optim.eps=1e-9", "offload.explicit_banks=[0,1,0]",
                                   'data.eot="<|end|> \\"q\\""', "logging.tensorboard=true", "train.steps=7"])
    path = tmp_path / "resolved.toml"
    path.write_text(config_toml(cfg, ["a header line"]))
    assert load_config(path) == cfg
    assert path.read_text().startswith("# a header line\n\n[model]\n")


# ------------------------------------------------------------------------------------- config show
def test_show_set_prints_the_value_and_reads_back(capsys, tmp_path: Path) -> None:
    rc, out, err = run(capsys, "config", "show", "--set", "optim.lr=0.00217")
    assert rc == 0 and err == ""
    assert "\nlr = 0.00217\n" in out
    path = tmp_path / "shown.toml"
    path.write_text(out)
    assert load_config(path) == load_config().with_overrides(**{"optim.lr": 0.00217})


def test_show_file_then_set(capsys, tmp_path: Path) -> None:
    cfg = tmp_path / "run.toml"
    cfg.write_text("[train]\nsteps = 3\nlog_every = 2\n[optim]\nwarmup_steps = 5\n")
    rc, out, _ = run(capsys, "config", "show", "-c", str(cfg), "--set", "train.steps=11",
                     "--set", "offload.explicit_banks=[0, 1, 0]")
    assert rc == 0
    assert f"# qeffect config show: {cfg}\n# --set train.steps=11\n" in out
    for line in ("steps = 11", "log_every = 2", "warmup_steps = 5", "explicit_banks = [0, 1, 0]"):
        assert f"\n{line}\n" in out
    shown = tmp_path / "shown.toml"
    shown.write_text(out)
    assert load_config(shown).train.steps == 11


# ------------------------------------------------------------------------------------- config schema
def test_schema_table_lists_fields_with_descriptions(capsys, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "1000")  # one line per field: no wrapped description
    rc, out, _ = run(capsys, "config", "schema")
    assert rc == 0
    for dotted in ACCEPTANCE_FIELDS:
        line = next((row for row in out.splitlines() if f" {dotted} " in row), None)
        assert line is not None, f"{dotted} not listed"
        assert " ".join(_field(dotted).description.split()) in line
    assert "[section]" in out  # no rich markup eaten


def test_schema_json_has_every_field(capsys) -> None:
    rc, out, _ = run(capsys, "config", "schema", "--json")
    assert rc == 0
    rows = {row["field"]: row for row in json.loads(out)}
    expected = [f"{s}.{n}" for s, info in RunConfig.model_fields.items() for n in info.annotation.model_fields]
    assert list(rows) == expected
    assert {f for f, row in rows.items() if row["changes_bits"]} == set(bit_changing_fields())
    for dotted in ACCEPTANCE_FIELDS:
        assert rows[dotted]["description"] == _field(dotted).description
    assert rows["optim.warmup_steps"] | {"description": ""} == {
        "field": "optim.warmup_steps", "type": "int", "choices": None, "bounds": {"ge": 0}, "default": 0,
        "changes_bits": True, "description": ""}
    assert rows["pipeline.schedule"]["choices"] == ["interleaved", "zbv"]
    assert rows["offload.explicit_banks"]["type"] == "list[int]" and rows["offload.explicit_banks"]["default"] == []
    # the defaults make the default config
    data: dict = {}
    for dotted, row in rows.items():
        section, name = dotted.split(".")
        data.setdefault(section, {})[name] = row["default"]
    assert validate_config(data, source="schema defaults") == RunConfig()


# ------------------------------------------------------------------------------------- the commands
class _Seen(Exception):
    """Raised by a stand-in for a command's runner: the config (and kwargs) it was given."""

    def __init__(self, cfg: RunConfig, **kw) -> None:
        super().__init__(f"lr={cfg.optim.lr} steps={cfg.train.steps} log_every={cfg.train.log_every}")
        self.cfg, self.kw = cfg, kw


def _stand_ins(monkeypatch: pytest.MonkeyPatch) -> None:
    def seen(cfg, **kw):
        raise _Seen(cfg, **kw)

    monkeypatch.setattr("qeffect.runtime.train.train", seen)
    monkeypatch.setattr("qeffect.verify.state.run_verify_state", seen)
    monkeypatch.setattr("qeffect.profile.matrix.run_profile", seen)
    monkeypatch.setattr("qeffect.profile.capture.run_capture", seen)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # capture; nothing here touches CUDA


@pytest.mark.parametrize("command", [["train"], ["verify-state"], ["profile"], ["capture"]])
def test_set_reaches_each_commands_config(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                          command: list[str]) -> None:
    _stand_ins(monkeypatch)
    monkeypatch.chdir(tmp_path)
    with pytest.raises(_Seen, match=r"^lr=0\.00217 steps=60 log_every=3$") as exc:
        main([*command, "--set", "optim.lr=0.00217", "--set", "train.log_every=3"])
    assert exc.value.cfg.optim.clip_grad_norm == 0.0
    if command == ["profile"]:  # the report records the command line
        assert exc.value.kw["command"].endswith("--set optim.lr=0.00217 --set train.log_every=3")


def test_set_wins_over_the_file_and_dedicated_flags(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    _stand_ins(monkeypatch)
    cfg = tmp_path / "run.toml"
    cfg.write_text("[train]\nsteps = 4\nseed = 1\n[optim]\nlr = 1e-3\n")
    with pytest.raises(_Seen, match=r"^lr=0\.002 steps=9 log_every=10$") as exc:
        main(["train", "-c", str(cfg), "--steps", "5", "--seed", "2", "--set", "train.steps=7",
              "--set", "optim.lr=0.002", "--set", "train.steps=9", "--out", str(tmp_path / "run")])
    assert exc.value.cfg.train.seed == 2  # the dedicated flag over the file
    with pytest.raises(_Seen, match=r"^lr=0\.001 steps=5 log_every=10$"):
        main(["train", "-c", str(cfg), "--steps", "5", "--out", str(tmp_path / "run")])
    with pytest.raises(_Seen, match=r"^lr=0\.003 ") as exc:
        main(["verify-state", "--backend", "reference", "--set", "fp8.backend=te", "--set", "fp8.head=torchao"])
    assert (exc.value.cfg.fp8.backend, exc.value.cfg.fp8.head) == ("te", "torchao")


def test_capture_refuses_a_set_device_other_than_cuda(monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    _stand_ins(monkeypatch)
    rc, _, err = run(capsys, "capture", "--set", "train.device=cpu")
    assert rc == 2
    assert err == "qeffect: error: qeffect capture captures CUDA graphs: train.device must be cuda, not cpu\n"


@pytest.mark.parametrize("command", [["train"], ["verify-state"], ["profile"], ["capture"], ["config", "show"]])
@pytest.mark.parametrize(("item", "needle"), [
    ("optim.lrr=1", "--set optim.lrr=1: unknown field (did you mean optim.lr?)"),
    ("optim.lr=abc", "--set optim.lr=abc: invalid configuration: optim.lr: Input should be a valid number"),
    ("optim.lr", "--set optim.lr: expected section.field=value (no '=')"),
])
def test_bad_set_is_one_line_exit_2_writing_nothing(capsys, monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                    command: list[str], item: str, needle: str) -> None:
    monkeypatch.chdir(tmp_path)
    json_out = ["--json", str(tmp_path / "report.json")] if command != ["config", "show"] else []
    rc, out, err = run(capsys, *command, "--set", "train.steps=2", "--set", item, *json_out)
    assert rc == 2
    assert err.startswith(f"qeffect: error: {needle}") and err.count("\n") == 1
    assert out == "" and list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("command", [["train"], ["verify-state"], ["profile"], ["capture"], ["config", "show"]])
def test_help_documents_set(capsys, command: list[str]) -> None:
    rc, out, _ = run(capsys, *command, "--help")
    assert rc == 0
    text = " ".join(out.split())
    assert "--set SECTION.FIELD=VALUE" in text and "wins over --config and the dedicated flags" in text


def test_verify_state_runs_with_set(capsys, tmp_path: Path) -> None:
    """End to end on the CPU: the fields given with --set are the ones the report records."""
    report = tmp_path / "vs.json"
    rc, out, _ = run(capsys, "verify-state", "--steps", "1", "--set", "optim.lr=0.00217",
                     "--set", "fp8.amax_history_len=2", "--set", "model.vocab_size=512",
                     "--set", "pipeline.microbatches=2", "--json", str(report))
    assert rc == 0 and "PASS" in out
    r = json.loads(report.read_text())
    assert r["settings"]["optim.lr"] == 0.00217 and r["settings"]["model.vocab_size"] == 512
    assert r["amax_rollover"]["amax_history_len"] == 2 and r["microbatches"] == 2
