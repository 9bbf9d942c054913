"""Pipeline schedules: the project's action IR, torch-backed generators, validation and global order.

Importing this package does not import torch; only `build_schedule` / `build_native_schedule` do.
"""

from __future__ import annotations

from .adapter import build_native_schedule, build_schedule, expected_placement, native_with_placement
from .ir import Action, ActionKind, Schedule, ScheduleError
from .order import (
    dependencies,
    dw_follows_di_order,
    dw_in_order,
    global_order,
    max_live_tapes,
    max_pending_dw,
    per_stage_orders_ascending,
    prerequisites,
)
from .validate import expected_kinds, validate

__all__ = [
    "native_with_placement",
    "Action",
    "ActionKind",
    "Schedule",
    "ScheduleError",
    "build_native_schedule",
    "build_schedule",
    "dependencies",
    "dw_follows_di_order",
    "expected_kinds",
    "expected_placement",
    "global_order",
    "max_live_tapes",
    "max_pending_dw",
    "dw_in_order",
    "per_stage_orders_ascending",
    "prerequisites",
    "validate",
]
