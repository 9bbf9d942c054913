"""Checkpoints on torch.distributed.checkpoint: save at quiescence, atomic folders, resume, inspect, diff."""

from __future__ import annotations

from qeffect.checkpoint.dcp import (
    load_checkpoint,
    resolve_checkpoint,
    save_checkpoint,
    step_dir,
    update_latest,
)
from qeffect.checkpoint.inspect import (
    CheckpointDiff,
    CheckpointReport,
    diff_checkpoints,
    inspect_checkpoint,
    load_tensors,
    open_checkpoint,
)
from qeffect.checkpoint.state import SCHEMA_VERSION, CheckpointPayload

__all__ = [
    "SCHEMA_VERSION",
    "CheckpointDiff",
    "CheckpointPayload",
    "CheckpointReport",
    "diff_checkpoints",
    "inspect_checkpoint",
    "load_checkpoint",
    "load_tensors",
    "open_checkpoint",
    "resolve_checkpoint",
    "save_checkpoint",
    "step_dir",
    "update_latest",
]
