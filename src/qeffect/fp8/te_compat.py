"""Every private name qeffect reaches in Transformer Engine (TE) and in torch, in one module.

Why: private names change between releases without notice. Kept here, an upgrade has one file to
read; the TE releases qeffect is tested with (`TE_SUPPORTED`, pyproject's `te` extra) are checked
when the te backend is selected; and a slower path taken because a private lookup failed is counted
(`fallbacks()`) and reported by `qeffect profile`, never silent. `tests/test_te_compat.py` fails if
another module under src/ reaches a private name of either.

Rules: TE is imported lazily (inside functions only), as in `fp8.te`: this module imports without it.
torch's private ops are bound here as plain attributes, the very objects torch exposes, so a call site
pays no extra Python call on hot paths and computes the same bits.
"""

from __future__ import annotations

import operator
import re
from typing import Any

import torch
from torch.optim.optimizer import _get_scalar_dtype

from qeffect.errors import UserError

# -- torch's private ops ----------------------------------------------------------------------------
scaled_mm = torch._scaled_mm  # cuBLASLt's FP8 GEMM (`fp8.gemm.fp8_mm`)
fused_adamw_ = torch._fused_adamw_  # torch's fused multi-tensor AdamW kernel (`runtime.adamw`)
foreach_pow = torch._foreach_pow
foreach_neg_ = torch._foreach_neg_
foreach_add_ = torch._foreach_add_
foreach_sqrt_ = torch._foreach_sqrt_
foreach_zero_ = torch._foreach_zero_
scalar_dtype = _get_scalar_dtype  # dtype of AdamW's `step` state, as torch's own `_init_group` makes it
# torch's AdamW state initialization, called unbound (`adamw_init_group(optimizer, group, ...)`)
adamw_init_group = torch.optim.AdamW._init_group
foreach_copy_ = torch._foreach_copy_  # one multi-tensor copy (offload's batched slot stores)
foreach_mul_ = torch._foreach_mul_  # gradients times the clip factor (`runtime.recipe`)
# memory-efficient attention (`model.attention`): SDPA's forward op, and the backward kernel it calls, whose
# `num_splits_key` argument SDPA's own backward leaves to a heuristic
sdpa_efficient_forward = torch.ops.aten._scaled_dot_product_efficient_attention
efficient_attention_backward = torch.ops.aten._efficient_attention_backward


def cuda_sleep(cycles: int) -> None:
    """Spin the current stream for `cycles` clock cycles (race checks widen their windows with it)."""
    torch.cuda._sleep(cycles)


def current_raw_stream_getter() -> Any:
    """torch's current raw stream handle of a device index (CUDA builds have it), or None: the caller
    then asks torch's stream object (slower on the host), and the fallback is counted."""
    getter = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    if getter is None:
        count_fallback("torch.current_raw_stream")
    return getter


def storage_from_data_pointer(ptr: int, device: torch.device, nbytes: int) -> Any:
    """An untyped storage over `nbytes` at device address `ptr`, with no deleter: the memory stays
    the caller's (offload's VMM slots, mapped and unmapped by the driver API)."""
    return torch._C._construct_storage_from_data_pointer(int(ptr), device, int(nbytes))

# -- supported Transformer Engine releases ----------------------------------------------------------
# Only what has been tested (the GPU kit's TE 2.20.2); pyproject's `te` extra declares the same range.
TE_SUPPORTED = ">=2.20,<2.21"

_OPS = {">=": operator.ge, "<=": operator.le, ">": operator.gt, "<": operator.lt, "==": operator.eq}


def _release(version: str) -> tuple[int, ...] | None:
    """The leading release numbers of `version` (`2.20.2+cu13` -> (2, 20, 2)); None if it has none."""
    m = re.match(r"\s*v?(\d+(?:\.\d+)*)", version)
    return tuple(int(p) for p in m.group(1).split(".")) if m else None


def _padded(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    n = max(len(a), len(b))
    return a + (0,) * (n - len(a)), b + (0,) * (n - len(b))


def te_version_supported(version: str, spec: str = TE_SUPPORTED) -> bool:
    """Whether release `version` satisfies every clause of `spec` (`>=2.20,<2.21`: release numbers only)."""
    have = _release(version)
    if have is None:
        return False
    for clause in spec.split(","):
        m = re.fullmatch(r"\s*(>=|<=|==|>|<)\s*(\d+(?:\.\d+)*)\s*", clause)
        if m is None:
            raise ValueError(f"unsupported version clause {clause!r} in {spec!r}")
        a, b = _padded(have, _release(m.group(2)) or ())
        if not _OPS[m.group(1)](a, b):
            return False
    return True


def installed_te_version() -> str:
    """The importable Transformer Engine's version (lazy import: call only once TE imports)."""
    import transformer_engine

    return str(getattr(transformer_engine, "__version__", "unknown"))


def check_te_version() -> None:
    """UserError (one line, exit 2) when the installed TE is outside `TE_SUPPORTED`: the private names
    below are only known to hold there, and a silent mismatch could change bits or paths."""
    version = installed_te_version()
    if not te_version_supported(version):
        raise UserError(f"Transformer Engine {version} is installed; the te backend supports "
                        f"transformer-engine{TE_SUPPORTED} (the tested releases): pip install 'qeffect[te]'")


# -- fallbacks ---------------------------------------------------------------------------------------
_FALLBACKS: dict[str, int] = {}


def count_fallback(name: str) -> None:
    """Record one slower path taken (host side: an action captured into a CUDA graph counts once)."""
    _FALLBACKS[name] = _FALLBACKS.get(name, 0) + 1


def fallbacks() -> dict[str, int]:
    """{fallback name: times taken} in this process (a copy)."""
    return dict(_FALLBACKS)


def reset_fallbacks() -> None:
    _FALLBACKS.clear()


# -- Transformer Engine's private names ---------------------------------------------------------------
# The names below are TE's own (no other module may use them; the test scans for this set).
LINEAR_BACKWARD_NODE = "_LinearBackward"  # the autograd node of TE `Linear`'s `_Linear` function
TE_PRIVATE_NAMES: frozenset[str] = frozenset({
    LINEAR_BACKWARD_NODE, "_data", "_transpose", "_transpose_invalid", "_scale_inv", "_fp8_workspaces",
    "_get_weight_and_bias_tensors",
})

# Only a plain high-precision wgrad GEMM may be handed our buffer: no output already bound (fused
# accumulation), no output quantizer (block-scaled recipes), no userbuffers communication overlap.
PLAIN_GEMM_KWARGS = ("out", "quantization_params", "ub", "ub_type", "extra_output")


def linear_backward_node(node: Any, depth: int = 4) -> Any:
    """TE's `_Linear` autograd node behind `y.grad_fn` (directly, or under a few view/reshape nodes).

    The backward FP8 update is a post-hook on this node: it must run after TE's backward quantized the
    output gradient (recording its amax), never before.
    """
    if node is None:
        return None
    frontier = [node]
    for _ in range(depth):
        for n in frontier:
            if type(n).__name__ == LINEAR_BACKWARD_NODE:
                return n
        frontier = [nxt for n in frontier for nxt, _ in n.next_functions if nxt is not None]
    raise RuntimeError(f"no TE _LinearBackward node behind {type(node).__name__}: cannot place the backward "
                       "FP8 update")


def wgrad_gemm_kwargs(store: Any) -> dict | None:
    """The keyword dict of the oldest queued wgrad closure (TE 2.x `Linear`), without dequeuing it."""
    queue = getattr(getattr(store, "context", None), "queue", None)
    if not queue:
        return None
    _tensors, func = queue[0]
    code, cells = getattr(func, "__code__", None), getattr(func, "__closure__", None) or ()
    if code is None or "wgrad_gemm_kwargs" not in code.co_freevars:
        return None
    kwargs = cells[code.co_freevars.index("wgrad_gemm_kwargs")].cell_contents
    return kwargs if isinstance(kwargs, dict) else None


def weight_workspace(module: Any) -> Any:
    """TE `Linear`'s cached quantized weight (its `Float8Tensor` workspace), or None."""
    return module._fp8_workspaces.get("weight")


def is_float8_tensor(ws: Any) -> bool:
    return type(ws).__name__ == "Float8Tensor"


def float8_data(ws: Any) -> Any:
    """A `Float8Tensor`'s rowwise FP8 bytes (None: not there)."""
    return getattr(ws, "_data", None)


def float8_transpose(ws: Any) -> Any:
    """A `Float8Tensor`'s columnwise (transposed) FP8 bytes (None: not made)."""
    return getattr(ws, "_transpose", None)


def float8_transpose_invalid(ws: Any) -> bool:
    return getattr(ws, "_transpose_invalid", False)


def float8_scale_inv(ws: Any) -> Any:
    return ws._scale_inv


def bias_stand_in(cls: type, attr: str) -> None:
    """Make TE take `getattr(module, attr)` as the bias of `cls`'s modules when it is set (and the
    module has a bias): TE reads weight and bias through its private `_get_weight_and_bias_tensors`
    on every forward, so `cls` (a subclass of TE `Linear`) gets an override of it."""

    def _get_weight_and_bias_tensors(self: Any) -> tuple[torch.Tensor, torch.Tensor | None]:
        weight, bias = super(cls, self)._get_weight_and_bias_tensors()
        stand_in = getattr(self, attr, None)  # TE's __init__ may ask before ours has run
        return weight, (stand_in if stand_in is not None and bias is not None else bias)

    cls._get_weight_and_bias_tensors = _get_weight_and_bias_tensors
