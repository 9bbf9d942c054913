"""Checkpoints on torch.distributed.checkpoint: save at quiescence, atomic folders, resume, inspect, diff."""

from __future__ import annotations

from qeffect.checkpoint.dcp import (
    latest_checkpoint,
    layout_change,
    load_checkpoint,
    prune_checkpoints,
    remove_stale_saves,
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
    "latest_checkpoint",
    "layout_change",
    "load_checkpoint",
    "load_tensors",
    "open_checkpoint",
    "prune_checkpoints",
    "remove_stale_saves",
    "resolve_checkpoint",
    "save_checkpoint",
    "step_dir",
    "update_latest",
]
