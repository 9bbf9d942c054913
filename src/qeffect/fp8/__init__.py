"""FP8 numerical backends behind one protocol (reference: pure PyTorch; te: Transformer Engine)."""

from __future__ import annotations

from qeffect.fp8.base import BACKENDS, FP8Backend, ReferenceBackend, get_backend, is_backend_linear
from qeffect.fp8.gemm import fp8_mm
from qeffect.fp8.recipe import FP8_MAX, DelayedScalingRecipe, fp8_max
from qeffect.fp8.reference import STATE_NAMES, RefFP8Linear, WeightCache, WgradWork
from qeffect.fp8.scaling import ScalingState, quantize, record_amax, update_scale

__all__ = [
    "BACKENDS",
    "FP8_MAX",
    "STATE_NAMES",
    "DelayedScalingRecipe",
    "FP8Backend",
    "RefFP8Linear",
    "ReferenceBackend",
    "ScalingState",
    "WeightCache",
    "WgradWork",
    "fp8_max",
    "fp8_mm",
    "get_backend",
    "is_backend_linear",
    "quantize",
    "record_amax",
    "update_scale",
]
