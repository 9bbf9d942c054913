"""Small helpers shared by command modules: config loading with overrides, JSON output."""

from __future__ import annotations

import json
import os
import tempfile
from enum import StrEnum
from pathlib import Path

from pydantic import BaseModel

from qeffect.config import RunConfig, load_config


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


def config_from_cli(config: Path | None, **overrides: object) -> RunConfig:
    """Load `config` (or the embedded default) and apply `section.field` overrides given on the CLI."""
    return load_config(config).with_overrides(**overrides)


def write_json(path: Path, report: BaseModel | dict) -> None:
    """Write atomically (temp file + rename): a crash never leaves half a report under `path`."""
    text = report.model_dump_json(indent=2) if isinstance(report, BaseModel) else json.dumps(report, indent=2)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        f.write(text + "\n")
    os.replace(tmp, path)
