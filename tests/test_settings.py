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
    assert settings == {**bit_changing_settings(cfg), "runtime.rank_streams": False, "runtime.step_graph": "auto",
                        "runtime.graph_pools": "private"}
    assert list(settings)[:len(bit_changing_fields())] == list(bit_changing_fields())
    assert settings["fp8.margin"] == 2 and "train.steps" not in settings  # the run length changes no bits


def test_a_decay_to_the_last_step_makes_the_run_length_a_resume_setting() -> None:
    """With decay_steps = 0 the learning rate depends on train.steps: another length is refused."""
    from qeffect.checkpoint.state import config_differences

    base = load_config().with_overrides(**{"optim.schedule": "cosine"})
    longer = base.with_overrides(**{"train.steps": 80})
    assert config_differences(base.model_dump(), longer.model_dump()) == ["train.steps: checkpoint 60, run 80"]
    fixed = base.with_overrides(**{"optim.decay_steps": 50})
    assert config_differences(fixed.model_dump(), fixed.with_overrides(**{"train.steps": 80}).model_dump()) == []
    constant = load_config()
    assert config_differences(constant.model_dump(), constant.with_overrides(**{"train.steps": 80}).model_dump()) == []


def test_a_checkpoint_without_newer_fields_resumes_with_their_defaults() -> None:
    """A field a stored config lacks ran at its default; a field it has that is gone is not compared."""
    from qeffect.checkpoint.state import config_differences

    current = load_config().model_dump()
    stored = {k: dict(v) for k, v in current.items() if k not in ("runtime", "offload", "data", "logging")}
    for key in ("schedule", "warmup_steps", "decay_steps", "min_lr", "clip_grad_norm"):
        del stored["optim"][key]
    stored["train"]["offload"] = "off"
    assert config_differences(stored, current) == []
    stored["optim"]["lr"] = 1e-3
    assert config_differences(stored, current) == ["optim.lr: checkpoint 0.001, run 0.003"]
