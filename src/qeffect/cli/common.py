"""Small helpers shared by command modules: config loading with overrides, JSON output."""

from __future__ import annotations

import json
import os
import tempfile
from enum import StrEnum
from pathlib import Path

from pydantic import BaseModel

from qeffect.config import RunConfig, apply_sets, load_config


class Schedule(StrEnum):
    interleaved = "interleaved"
    zbv = "zbv"


class PathMode(StrEnum):
    eager = "eager"
    captured_copy = "captured-copy"
    captured_direct = "captured-direct"


class Offload(StrEnum):
    """`--offload` of train and verify-state: the `offload.mode` override (the values of `OffloadConfig.mode`)."""

    off = "off"
    release = "release"
    resident = "resident"


class Device(StrEnum):
    cpu = "cpu"
    cuda = "cuda"


class Backend(StrEnum):
    reference = "reference"
    te = "te"


class Head(StrEnum):
    backend = "backend"
    torchao = "torchao"


# `--set` of train, verify-state, profile, capture and config show (the same text in each command's --help)
SET_METAVAR = "SECTION.FIELD=VALUE"
SET_HELP = ("Set any config field as the TOML would, e.g. --set optim.lr=3e-4 --set train.device=cuda (value: a "
            "TOML value, else plain text); repeatable. Applied last: wins over --config and the dedicated flags. "
            "`qeffect config schema` lists the fields.")


def config_from_cli(config: Path | None, *, sets: list[str] | None = None, **overrides: object) -> RunConfig:
    """Load `config` (or the embedded default), apply the dedicated flags' `section.field` overrides, then the
    `--set section.field=value` items: file < dedicated flags < --set (the last of two --set of one field wins)."""
    return apply_sets(load_config(config).with_overrides(**overrides), sets)


def write_json(path: Path, report: BaseModel | dict) -> None:
    """Write atomically (temp file + rename): a crash never leaves half a report under `path`."""
    text = report.model_dump_json(indent=2) if isinstance(report, BaseModel) else json.dumps(report, indent=2)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        f.write(text + "\n")
    os.replace(tmp, path)
