"""The delayed-scaling recipe: Transformer Engine's `DelayedScaling` fields that qeffect supports.

It is persistent configuration (checkpointed with the FP8 state), so it round-trips through a dict.
Only the HYBRID format is supported: E4M3 for forward tensors (inputs, weights), E5M2 for gradients.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any, Literal

import torch

if TYPE_CHECKING:
    from qeffect.config import FP8Config

FP8_MAX: dict[torch.dtype, float] = {
    torch.float8_e4m3fn: 448.0,
    torch.float8_e5m2: 57344.0,
}


def fp8_max(dtype: torch.dtype) -> float:
    """Largest finite value of an FP8 dtype (quantization saturates there)."""
    try:
        return FP8_MAX[dtype]
    except KeyError:
        raise ValueError(f"not an FP8 dtype qeffect supports: {dtype}") from None


@dataclass(frozen=True)
class DelayedScalingRecipe:
    """TE `DelayedScaling(margin, amax_history_len, amax_compute_algo, fp8_format=HYBRID)`."""

    margin: int = 0
    amax_history_len: int = 4
    amax_compute_algo: Literal["max", "most_recent"] = "max"
    fp8_format: Literal["HYBRID"] = "HYBRID"

    def __post_init__(self) -> None:
        if not isinstance(self.margin, int) or self.margin < 0:
            raise ValueError(f"margin must be an int >= 0, got {self.margin!r}")
        if not isinstance(self.amax_history_len, int) or self.amax_history_len < 1:
            raise ValueError(f"amax_history_len must be an int >= 1, got {self.amax_history_len!r}")
        if self.amax_compute_algo not in ("max", "most_recent"):
            raise ValueError(
                f"amax_compute_algo must be 'max' or 'most_recent', got {self.amax_compute_algo!r}"
            )
        if self.fp8_format != "HYBRID":
            raise ValueError(f"only the HYBRID fp8_format is supported, got {self.fp8_format!r}")

    @property
    def fwd_dtype(self) -> torch.dtype:
        return torch.float8_e4m3fn

    @property
    def bwd_dtype(self) -> torch.dtype:
        return torch.float8_e5m2

    @staticmethod
    def fp8_max(dtype: torch.dtype) -> float:
        return fp8_max(dtype)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DelayedScalingRecipe:
        known = {"margin", "amax_history_len", "amax_compute_algo", "fp8_format"}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown recipe fields: {sorted(unknown)}")
        return cls(**data)

    @classmethod
    def from_config(cls, cfg: FP8Config) -> DelayedScalingRecipe:
        """Build from the `[fp8]` section of a run configuration."""
        return cls(
            margin=cfg.margin,
            amax_history_len=cfg.amax_history_len,
            amax_compute_algo=cfg.amax_compute_algo,
        )
