"""Settings are config: few environment names left in the source, and every record carries the settings."""

from __future__ import annotations

import re
from pathlib import Path

from qeffect.config import bit_changing_fields, bit_changing_settings, load_config
from qeffect.graphs.handshake import run_settings

SRC = Path(__file__).resolve().parents[1] / "src" / "qeffect"
MAX_ENV_NAMES = 5


def env_names() -> set[str]:
    """Every `QEFFECT_*` name in the package's source (what `grep -rhoE 'QEFFECT_[A-Z0-9_]+'` finds)."""
    pattern = re.compile(r"QEFFECT_[A-Z0-9_]+")
    return {m for f in SRC.rglob("*") if f.is_file() and f.suffix in (".py", ".toml", ".sh", ".md")
            for m in pattern.findall(f.read_text(errors="replace"))}


def test_few_environment_names_remain_in_the_source() -> None:
    """Code paths are chosen by the config (read once when the pipeline is built), not by the environment."""
    names = env_names()
    assert len(names) <= MAX_ENV_NAMES, sorted(names)


def test_run_settings_are_the_bit_changing_settings_and_the_runtime_section() -> None:
    cfg = load_config().with_overrides(**{"fp8.margin": 2, "runtime.rank_streams": False, "train.steps": 3})
    settings = run_settings(cfg)
    assert settings == {**bit_changing_settings(cfg), "runtime.rank_streams": False}
    assert list(settings)[:len(bit_changing_fields())] == list(bit_changing_fields())
    assert settings["fp8.margin"] == 2 and "train.steps" not in settings  # the run length changes no bits
