"""Triton kernels built on first use.

Why: Triton is optional (CPU machines and CI lack it) and slow to import, so every fused pass (the
staged fold, the FP8 quantization, the scaling update) builds its kernel the first time a CUDA tensor
asks for it, and falls back to torch where Triton is missing.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any, TypeVar

import torch

K = TypeVar("K")


def triton_kernel(build: Callable[[Any, Any], K]) -> Callable[[], K | None]:
    """Decorate `build(triton, tl)`, which defines and returns a `@triton.jit` function: the result is a
    cached getter returning that function, or None where Triton does not import."""

    @functools.cache
    def get() -> K | None:
        try:
            import triton
            import triton.language as tl
        except ImportError:
            return None
        return build(triton, tl)

    get.__doc__ = build.__doc__
    return get


def on_device(device: torch.device) -> contextlib.AbstractContextManager:
    """Launch on `device` (Triton launches on the current CUDA device); nothing to select elsewhere
    (Triton's interpreter, which the CPU tests use)."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()
