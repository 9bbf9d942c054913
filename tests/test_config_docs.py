"""docs/configuration.md is generated from the config models: a config change without regenerating fails."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import tomllib
from pathlib import Path

from qeffect.config import RunConfig, validate_config

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "config_docs.py"


def _module():
    spec = importlib.util.spec_from_file_location("config_docs", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_configuration_doc_is_up_to_date():
    done = subprocess.run([sys.executable, str(SCRIPT), "--check"], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr + "\n(regenerate: python3 scripts/config_docs.py)"


def test_check_fails_on_a_stale_file(tmp_path):
    stale = tmp_path / "configuration.md"
    stale.write_text("# Configuration\n")
    done = subprocess.run([sys.executable, str(SCRIPT), "--check", "--output", str(stale)],
                          capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 1
    assert "stale" in done.stderr


def test_every_field_is_documented():
    text = _module().render()
    for section, info in RunConfig.model_fields.items():
        assert f"\n## {section}\n" in text
        for name, field in info.annotation.model_fields.items():
            assert field.description, f"{section}.{name} has no description"
            assert f"| `{name}` |" in text, f"{section}.{name} missing from docs/configuration.md"


def test_the_example_is_a_valid_config():
    cfg = validate_config(tomllib.loads(_module().EXAMPLE), source="docs example")
    assert cfg.train.path == "captured-direct"


def test_cli_flags_are_found():
    flags = _module().cli_flags()
    assert "`qeffect train --steps`" in flags["train.steps"]
    assert "`qeffect train --offload`" in flags["offload.mode"]


def test_the_intro_says_every_field_takes_set():
    text = _module().render()
    assert "with `--set section.field=value`" in text and "`qeffect config schema`" in text
    flags = _module().cli_flags()  # said once in the intro, not as a flag of every field
    assert not any("--set" in entry for entries in flags.values() for entry in entries)
