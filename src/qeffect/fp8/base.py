"""The FP8 backend protocol and registry.

The stage and contract layers talk to a backend only through this protocol, never through its class
names: what `F` and `dI` update (state order, threaded by the effect token), what is retained between
`dI` and `dW` (owned by a tape), how the weight cache is refreshed (versioned by epochs), which state is
persistent (checkpointed), and what weight-gradient destination `dW` accepts (the arena).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
from torch import nn

from qeffect.errors import UserError
from qeffect.fp8.recipe import DelayedScalingRecipe
from qeffect.fp8.reference import STATE_NAMES, RefFP8Linear
from qeffect.fp8.te import TE_MISSING_MSG, TEBackend

BACKENDS: tuple[str, ...] = ("reference", "te")

__all__ = ["BACKENDS", "TE_MISSING_MSG", "FP8Backend", "ReferenceBackend", "TEBackend", "get_backend",
           "is_backend_linear"]


@runtime_checkable
class FP8Backend(Protocol):
    """What a numerical backend exposes to the stage actions."""

    name: str
    recipe: DelayedScalingRecipe
    # Per action, the module state names it updates (in this order); `dW` must update nothing.
    state_transitions: dict[str, tuple[str, ...]]
    # Module state that survives a restart (checkpointed); everything else is process-local.
    persistent_state: tuple[str, ...]
    # What `dI` leaves behind for `dW`.
    retained_object: str
    # What `dW` writes into.
    wgrad_destination: str
    # How the quantized weight cache is refreshed and checked.
    cache_refresh: str

    def linear(
        self, in_f: int, out_f: int, bias: bool, *, device: torch.device | str | None, dtype: torch.dtype
    ) -> nn.Module: ...


class ReferenceBackend:
    """Pure-PyTorch delayed scaling (`RefFP8Linear`); CPU and GPU."""

    name = "reference"
    state_transitions: dict[str, tuple[str, ...]] = {
        "F": ("weight_amax_history", "weight_scale", "input_amax_history", "input_scale"),
        "dI": ("grad_amax_history", "grad_scale"),
        "dW": (),
    }
    persistent_state: tuple[str, ...] = STATE_NAMES
    retained_object = "WgradWork list per matrix module (RefFP8Linear.wgrad_store, drained by pop_wgrad_work)"
    wgrad_destination = (
        "compute_wgrad(work, out=view, accumulate=False): any contiguous tensor of the weight's shape, dtype "
        "and device (16-byte aligned on CUDA), overwritten, or added into with accumulate=True; or a fresh "
        "tensor without out"
    )
    cache_refresh = (
        "forward(x, is_first_microbatch=True) re-quantizes the weight (weight amax/scale update); "
        "False reuses the cache and raises RuntimeError if invalidate_cache() dropped it"
    )

    def __init__(self, recipe: DelayedScalingRecipe, *, fused_wgrad: bool = False) -> None:
        self.recipe = recipe
        self.fused_wgrad = fused_wgrad

    def linear(
        self,
        in_f: int,
        out_f: int,
        bias: bool,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> RefFP8Linear:
        return RefFP8Linear(in_f, out_f, bias, self.recipe, device=device, dtype=dtype, fused_wgrad=self.fused_wgrad)

    def __repr__(self) -> str:
        return f"ReferenceBackend({self.recipe})"


def get_backend(name: str, recipe: DelayedScalingRecipe, *, fused_wgrad: bool = False) -> FP8Backend:
    """The backend called `name` (`reference` or `te`), configured with `recipe`; `fused_wgrad`: its wgrad
    GEMMs accumulate in fp32 into the gradient (`pipeline.wgrad_accumulation = "fused"`)."""
    if name == "reference":
        return ReferenceBackend(recipe, fused_wgrad=fused_wgrad)
    if name == "te":
        return TEBackend(recipe, fused_wgrad=fused_wgrad)  # UserError without Transformer Engine (lazy import)
    raise UserError(f"unknown FP8 backend {name!r}; choose one of: {', '.join(BACKENDS)}")


def is_backend_linear(module: nn.Module) -> bool:
    """Whether `module` is a backend matrix module (its weight gets `dW`; it owns FP8 state).

    Backends whose linear classes are not ours mark them with `qeffect_matrix_linear = True`.
    """
    return isinstance(module, RefFP8Linear) or getattr(module, "qeffect_matrix_linear", False) is True
