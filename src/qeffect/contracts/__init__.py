"""Explicit state and resource contracts: keys, tape pool, effect token, epochs, device completion, arena,
commit barrier.

Everything here is host-side bookkeeping that imports no CUDA and never initializes a CUDA context,
so every contract check runs (and is tested) on a CPU-only machine.
"""

from __future__ import annotations

from .arena import ALIGN_BYTES, GradientArena
from .commit import CommitBarrier, ReductionTracker
from .completion import CheckedCompletionLedger, CompletionLedger, EventOps, completion_ledger
from .epochs import EpochClock, WeightCacheVersion
from .errors import (
    FAMILIES,
    ArenaViolation,
    CacheEpochViolation,
    CommitViolation,
    ConsumerOrderViolation,
    ContractViolation,
    DeviceCompletionViolation,
    EffectTokenViolation,
    PoolCapacityError,
    TapeViolation,
)
from .keys import InvocationKey
from .tape import BOTH_CONSUMERS, NO_CONSUMER, Consumer, Tape, TapePool, TapeRef
from .token import EffectLedger, EffectToken

__all__ = [
    "ALIGN_BYTES",
    "BOTH_CONSUMERS",
    "FAMILIES",
    "NO_CONSUMER",
    "ArenaViolation",
    "CacheEpochViolation",
    "CheckedCompletionLedger",
    "CommitBarrier",
    "CommitViolation",
    "CompletionLedger",
    "Consumer",
    "ConsumerOrderViolation",
    "ContractViolation",
    "DeviceCompletionViolation",
    "EffectLedger",
    "EffectToken",
    "EffectTokenViolation",
    "EpochClock",
    "EventOps",
    "GradientArena",
    "InvocationKey",
    "PoolCapacityError",
    "ReductionTracker",
    "Tape",
    "TapePool",
    "TapeRef",
    "TapeViolation",
    "WeightCacheVersion",
    "completion_ledger",
]
