"""Transformer Engine FP8 backend: `transformer_engine.pytorch.Linear` behind qeffect's linear API.

Transformer Engine is imported lazily (inside functions only): `import qeffect.fp8.te` works on a
machine without it, and `TEBackend(...)` raises `UserError` there.

Design (TE 2.20; see docs/design.md §6):

- **Scaling-state isolation.** TE's delayed scaling keeps every module's amax history in process-global
  buffers keyed by the recipe's text, and each autocast exit (forward) and the backward of the first
  module of an autocast region (backward) rolls the histories of *every* registered module. A module's
  state would then depend on the global order of all chunks' actions (ZB-V reorders them, and the native
  reference and the qeffect run live in one process during verification). So our modules never join
  those buffers (their `fp8_meta` carries a placeholder buffer entry, which makes
  `add_fp8_tensors_to_global_buffer` skip them) and each module performs TE's own fused update kernel
  (`fused_amax_and_scale_update_after_reduction`, the kernel TE's reduce-and-update calls) on its own
  state: the forward state right after its forward (`F`), the backward state right after its autograd
  backward node ran (`dI`, a node post-hook). Exactly one update per module and action, at the same
  logical point in the native reference and in the split path. Single process, no amax reduction.
- **Autocast.** Each forward runs inside `te.pytorch.autocast(recipe=...)` (explicit `DelayedScaling`
  from our recipe, HYBRID) and, when the activations are narrower than the fp32 master weights, inside
  `torch.autocast` (TE requires parameter dtype == input dtype outside an AMP region). No chunk-level
  context is needed, so the backend needs no `forward_context` hook.
- **Retained dW.** Modules are built with `delay_wgrad_compute=True` (so TE's FIFO `WeightGradStore`
  exists) and switched with `delay_wgrad`: off, TE computes wgrad inside the backward (native reference);
  on, the backward queues the wgrad GEMM and `pop_wgrad_work()` hands out one `TEWgradWork` handle per
  backward. `compute_wgrad(handle)` must be called in dI order (checked) and pops TE's queue directly
  (`wgrad_store.pop()`, what `backward_dw()` does minus assigning `weight.grad`).
- **Weight-gradient destination: compute then copy.** The native path's weight gradient is TE's bf16
  wgrad GEMM output cast to the fp32 `.grad` by autograd. So `dW` runs the GEMM into TE's bf16 output
  (or a staging slot) and copies or adds it into the arena view (an exact cast, the same one autograd
  does for the native `.grad`).
- **Fused accumulation** (`fused_wgrad`, `pipeline.wgrad_accumulation = "fused"`): modules are built with
  `fuse_wgrad_accumulation=True`, so the wgrad GEMM accumulates fp32 into `weight.main_grad` (overwriting
  on the first microbatch: TE's `is_first_microbatch`), Megatron-LM's way: other bits than the bf16
  output, and no bf16 gradient. Native eager binds a `main_grad` of its own; a split `dW` names its
  destination and whether it adds when it runs (TE bound `main_grad` and the flag at `dI` time), so the
  same GEMM call writes the arena.
- **Weight cache.** `forward(x, is_first_microbatch=True)` re-quantizes the weight into TE's cached
  workspace (in place, fixed address); `False` reuses it. `invalidate_cache()` only marks it stale (a
  later `False` raises, like the reference) and keeps TE's buffer for a fixed address.
"""

from __future__ import annotations

import contextlib
import functools
import sys
from collections import deque
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from qeffect.errors import UserError
from qeffect.fp8 import te_compat
from qeffect.fp8.recipe import DelayedScalingRecipe
from qeffect.fp8.reference import EMPTY_CACHE_MSG
from qeffect.fp8.weight_cast import WeightCastTarget

TE_MISSING_MSG = (
    "--backend te needs Transformer Engine (pip install 'qeffect[te]'); it is not importable here"
)

# Per role: (fp8_meta key, column in that state's [history, n] tensors, our state name prefix).
# TE's forward state has 3 columns (GEMM1 input, weight, output), the backward state 2 (grad output,
# grad input); `output` and `grad_input` are only used with fp8_output / fp8_grad, but they are state.
STATE_ROLES: tuple[tuple[str, int, str], ...] = (
    ("scaling_fwd", 0, "input"),
    ("scaling_fwd", 1, "weight"),
    ("scaling_fwd", 2, "output"),
    ("scaling_bwd", 0, "grad"),
    ("scaling_bwd", 1, "grad_input"),
)
TE_STATE_NAMES: tuple[str, ...] = tuple(
    f"{prefix}_{kind}" for _, _, prefix in STATE_ROLES for kind in ("amax_history", "scale")
)
FORWARD_STATE: tuple[str, ...] = tuple(n for n in TE_STATE_NAMES if not n.startswith("grad_"))
BACKWARD_STATE: tuple[str, ...] = tuple(n for n in TE_STATE_NAMES if n.startswith("grad_"))

# A placeholder for TE's "index in the global amax buffers" entry: a module that has one is never
# appended to those buffers again. Shaped like the real entry (fwd pos, fwd key, bwd pos, bwd key) so
# TE code that unpacks it (amax-history resizing) works; the keys name no buffer.
_UNREGISTERED = [0, "qeffect-private-forward", 0, "qeffect-private-backward"]


def te_import_error() -> str | None:
    """Why `transformer_engine.pytorch` does not import here (it needs CUDA libraries), or None.

    A missing package says nothing more than TE_MISSING_MSG; any other failure (a broken install, a
    library clash) is worth its own words, so it is returned for the error message."""
    try:
        import transformer_engine.pytorch  # noqa: F401
    except ModuleNotFoundError as err:
        if (err.name or "").split(".")[0] == "transformer_engine":
            return ""
        return f"{type(err).__name__}: {err}"
    except Exception as err:  # a broken install (missing CUDA libraries), or an import-order clash
        reason = f"{type(err).__name__}: {err}"
        if "undefined symbol" in reason and "cudnn" in reason:
            reason += ("; torch loaded its own cuDNN before Transformer Engine opened another one: import "
                       "transformer_engine.pytorch before the first cuDNN use in this process")
        return reason
    return None


def te_available() -> bool:
    """Whether `transformer_engine.pytorch` imports here."""
    return te_import_error() is None


def require_te() -> None:
    """UserError unless Transformer Engine imports here and is a supported release (`te_compat`)."""
    reason = te_import_error()
    if reason is not None:
        raise UserError(TE_MISSING_MSG + (f" ({reason})" if reason else ""))
    te_compat.check_te_version()


def te_recipe_kwargs(recipe: DelayedScalingRecipe) -> dict[str, Any]:
    """`transformer_engine.common.recipe.DelayedScaling` arguments for our recipe (format by name).

    `reduce_amax=False`: amaxes are never all-reduced (our modules update their own state; a
    data-parallel amax reduction would be a separate, explicit step).
    """
    return {
        "margin": recipe.margin,
        "fp8_format": recipe.fp8_format,
        "amax_history_len": recipe.amax_history_len,
        "amax_compute_algo": recipe.amax_compute_algo,
        "reduce_amax": False,
    }


def make_te_recipe(recipe: DelayedScalingRecipe) -> Any:
    """The explicit TE `DelayedScaling` recipe for `recipe`."""
    from transformer_engine.common.recipe import DelayedScaling, Format

    kw = te_recipe_kwargs(recipe)
    kw["fp8_format"] = getattr(Format, kw["fp8_format"])
    return DelayedScaling(**kw)


@dataclass(frozen=True, eq=False)
class TEWgradWork:
    """Handle for one queued wgrad GEMM in a module's TE `WeightGradStore` (FIFO).

    The tensors stay inside TE's store; the handle names the module and the position (`seq`, counted
    from 1 per module) so `compute_wgrad` can prove it drains the queue in order.
    """

    owner: int  # id() of the module
    seq: int


class WgradFifo:
    """Bookkeeping over TE's per-module FIFO of delayed wgrad GEMMs (pure Python, CPU-testable).

    `record()` after each delayed backward (the store grew by one), `pop_pending()` hands the new
    handles to `dI`, `check_next(work)` before draining one, `consume(work)` after.
    """

    def __init__(self, owner: int) -> None:
        self.owner = owner
        self._seq = 0
        self._pending: list[TEWgradWork] = []
        self._queued: deque[TEWgradWork] = deque()  # everything in TE's store, oldest first

    def __len__(self) -> int:
        return len(self._queued)

    def record(self, store_size: int | None = None) -> TEWgradWork:
        self._seq += 1
        work = TEWgradWork(self.owner, self._seq)
        self._pending.append(work)
        self._queued.append(work)
        if store_size is not None and store_size != len(self._queued):
            raise RuntimeError(
                f"TE WeightGradStore holds {store_size} wgrad GEMMs, qeffect expected {len(self._queued)}"
            )
        return work

    def pop_pending(self) -> list[TEWgradWork]:
        work, self._pending = self._pending, []
        return work

    def check_next(self, work: object) -> None:
        if not isinstance(work, TEWgradWork) or work.owner != self.owner:
            raise RuntimeError(f"compute_wgrad got {work!r}, not a retained dW item of this module")
        if not self._queued or work is not self._queued[0]:
            nxt = self._queued[0].seq if self._queued else None
            raise RuntimeError(
                f"dW out of dI order: TE's WeightGradStore is FIFO; got item {work.seq}, next is {nxt}"
            )
        if work in self._pending:
            raise RuntimeError(f"dW item {work.seq} was never handed out by pop_wgrad_work()")

    def consume(self, work: TEWgradWork) -> None:
        self.check_next(work)
        self._queued.popleft()

    def clear(self) -> None:
        self._pending = []
        self._queued.clear()


@dataclass(frozen=True)
class TEWeightCache:
    """TE's cached FP8 weight (`Float8Tensor` workspace), exposed like the reference's `WeightCache`."""

    w_q: Tensor  # [out, in] E4M3 (rowwise data)
    w_q_t: Tensor | None  # [in, out] E4M3 (columnwise data, for dgrad), if TE made it
    scale_inv: Tensor


def clear_global_amax_buffers() -> int:
    """Empty Transformer Engine's process-global delayed-scaling buffers; returns the entries they held.

    TE's own modules (not qeffect's linears, which stay out of them) join these buffers on their first
    forward, and from then on every outermost autocast exit in grad mode updates every entry, whichever
    module it belongs to and whether or not that module still runs: a concatenation and an update kernel per
    exit, captured into any graph whose body exits an autocast (each qeffect TE linear's forward does). A
    process that runs one configuration after another (`qeffect profile`'s interleaved rounds, after the
    TE anchors) empties them between configurations, or a later one pays for an earlier one's modules. Only
    between configurations: a module still in use would not join again. Without TE imported: nothing (0)."""
    quantization = sys.modules.get("transformer_engine.pytorch.quantization")
    if quantization is None:
        return 0
    state = quantization.FP8GlobalStateManager.quantization_state
    held = sum(len(v) for v in state.global_amax_buffer.values())
    for buffer in (state.global_amax_buffer, state.global_amax_history_buffer, state.global_scale_buffer):
        buffer.clear()
    return held


@functools.cache
def te_linear_class() -> type[nn.Module]:
    """`TELinear`, a subclass of `transformer_engine.pytorch.Linear` (built on first use: lazy import)."""
    import transformer_engine.pytorch as te
    from transformer_engine.pytorch.quantization import FP8GlobalStateManager

    buffer_key = FP8GlobalStateManager.get_buffer_info()

    class TELinear(te.Linear):
        """qeffect's matrix module on TE: the `RefFP8Linear` API over `te.Linear` (weight, bias named so)."""

        qeffect_matrix_linear = True

        def __init__(
            self,
            in_features: int,
            out_features: int,
            bias: bool,
            recipe: DelayedScalingRecipe,
            te_recipe: Any,
            *,
            device: torch.device | str | None = None,
            dtype: torch.dtype = torch.float32,
            fused_wgrad: bool = False,
        ) -> None:
            super().__init__(
                in_features,
                out_features,
                bias=bias,
                params_dtype=dtype,
                device="cuda" if device is None else device,
                delay_wgrad_compute=True,  # creates the FIFO store; `delay_wgrad` switches it
                fuse_wgrad_accumulation=fused_wgrad,
            )
            self.fused_wgrad = fused_wgrad
            if not bias:
                self.bias = None  # TE leaves an empty tensor; the reference API has None
            self.recipe = recipe
            self._te_recipe = te_recipe
            self.fp8_meta[buffer_key] = list(_UNREGISTERED)
            self._fifo = WgradFifo(id(self))
            self._cache_valid = False
            self._bias_act: Tensor | None = None
            self._weight_cast: WeightCastTarget | None = None
            self.delay_wgrad = False

        def extra_repr(self) -> str:
            return (
                f"in_features={self.in_features}, out_features={self.out_features}, "
                f"bias={self.use_bias}, delay_wgrad={self.delay_wgrad}"
            )

        # -- retained dW switch ------------------------------------------------------------------
        @property
        def delay_wgrad(self) -> bool:
            return self.wgrad_store.delay_wgrad_compute()

        @delay_wgrad.setter
        def delay_wgrad(self, flag: bool) -> None:
            if flag:
                self.wgrad_store.enable_delay_wgrad_compute()
            else:
                self.wgrad_store.disable_delay_wgrad_compute()

        # -- scaling state -------------------------------------------------------------------------
        @property
        def fp8_initialized_state(self) -> bool:
            return "scaling_fwd" in self.fp8_meta and "scaling_bwd" in self.fp8_meta

        def fp8_state(self) -> dict[str, Tensor]:
            """Amax histories and scales per role, as live views of TE's state (empty before the first forward)."""
            if not self.fp8_initialized_state:
                return {}
            out: dict[str, Tensor] = {}
            for key, col, prefix in STATE_ROLES:
                st = self.fp8_meta[key]
                out[f"{prefix}_amax_history"] = st.amax_history[:, col]
                out[f"{prefix}_scale"] = st.scale[col]
            return out

        def _update_scaling(self, key: str, forward: bool) -> None:
            """TE's delayed-scaling update (roll the amax history, recompute scales) for this module only,
            or queued for the enclosing `batched_scaling_updates` scope."""
            st = self.fp8_meta[key]
            if _PENDING is not None:
                _PENDING.append((st, forward, self._te_recipe))
                return
            _run_updates([st], forward, self._te_recipe)

        def extra_state(self) -> dict[str, Tensor]:
            """Persistent FP8 state as plain tensors (copies), safe to checkpoint without pickle.

            TE's own `get_extra_state()` (the module's `_extra_state` in `state_dict`) pickles the
            recipe with it, and TE 2.20 refuses to load that unless NVTE_ALLOW_UNSAFE_PICKLE_EXTRA_STATE=1.
            """
            if not self.fp8_initialized_state:
                return {}
            out = {}
            for key, tag in (("scaling_fwd", "fwd"), ("scaling_bwd", "bwd")):
                out[f"{tag}_scale"] = self.fp8_meta[key].scale.detach().clone()
                out[f"{tag}_amax_history"] = self.fp8_meta[key].amax_history.detach().clone()
            return out

        def allocate_fp8_state(self) -> None:
            """Allocate the scaling state before a first forward, so that a checkpoint can load into it. The
            first forward then keeps it: TE re-creates a delayed-scaling state only when none of that kind
            exists yet."""
            if self.fp8_initialized_state:
                return
            self.fp8_meta["num_gemms"] = 1
            self.fp8_meta["recipe"] = self._te_recipe
            with te.autocast(enabled=True, recipe=self._te_recipe):
                self.init_fp8_meta_tensors(self._te_recipe)

        def load_extra_state(self, state: dict[str, Tensor]) -> None:
            """Copy `extra_state()` output into the live state (allocating it before a first forward)."""
            if not state:
                return
            self.allocate_fp8_state()
            if self._weight_cast is not None:  # cast with another scale
                self._weight_cast.mark_consumed()
            with torch.no_grad():
                for key, tag in (("scaling_fwd", "fwd"), ("scaling_bwd", "bwd")):
                    for name in ("scale", "amax_history"):
                        dst, src = getattr(self.fp8_meta[key], name), state[f"{tag}_{name}"]
                        if dst.shape != src.shape:
                            raise ValueError(f"{tag}_{name}: expected {tuple(dst.shape)}, got {tuple(src.shape)}")
                        dst.copy_(src)

        # -- weight cache --------------------------------------------------------------------------
        @property
        def cache_valid(self) -> bool:
            return self._cache_valid

        def cache_storage(self) -> list[Tensor]:
            """Every tensor of the FP8 weight workspace TE keeps, valid or not (memory accounting: the
            workspace stays allocated between an invalidation and the next refresh)."""
            ws = te_compat.weight_workspace(self)
            if ws is None:
                return []
            parts = (te_compat.float8_data(ws), te_compat.float8_transpose(ws), te_compat.float8_scale_inv(ws))
            return [t for t in parts if isinstance(t, Tensor)]

        @property
        def weight_cache(self) -> TEWeightCache | None:
            ws = te_compat.weight_workspace(self)
            if not self._cache_valid or ws is None or te_compat.float8_data(ws) is None:
                return None
            data = te_compat.float8_data(ws)
            w_t = te_compat.float8_transpose(ws)
            fp8 = self.recipe.fwd_dtype
            return TEWeightCache(
                data.view(fp8) if data.dtype == torch.uint8 else data,
                None if w_t is None else (w_t.view(fp8) if w_t.dtype == torch.uint8 else w_t),
                te_compat.float8_scale_inv(ws),
            )

        def invalidate_cache(self) -> None:
            """Mark the quantized weight stale (TE's buffer is kept: fixed address for graph capture)."""
            self._cache_valid = False
            if self._weight_cast is not None:
                self._weight_cast.mark_consumed()

        def weight_cast_target(self, name: str = "") -> WeightCastTarget:
            """TE's cached FP8 weight as the optimizer casts into it (`fp8.weight_cast`): from now on a
            first forward whose cache the optimizer made fresh takes it as it is. Needs the cache TE
            builds on the first forward with ``is_first_microbatch=True``."""
            if self._weight_cast is not None:
                return self._weight_cast
            ws = te_compat.weight_workspace(self)
            data = te_compat.float8_data(ws)
            if not self.fp8_initialized_state or data is None or not te_compat.is_float8_tensor(ws):
                raise RuntimeError(f"{name or 'linear'}: no FP8 weight cache yet (TE builds it on the first forward "
                                   "with is_first_microbatch=True)")
            if self.recipe.fwd_dtype != torch.float8_e4m3fn or te_compat.float8_transpose_invalid(ws):
                raise RuntimeError(f"{name or 'linear'}: the optimizer's cast writes E4M3 with a valid transpose")
            t = te_compat.float8_transpose(ws)
            st = self.fp8_meta["scaling_fwd"]
            self._weight_cast = WeightCastTarget(
                name, self.weight, data.view(torch.float8_e4m3fn),
                None if t is None else t.view(torch.float8_e4m3fn), st.scale[1:2],
                te_compat.float8_scale_inv(ws), st.amax_history[0, 1:2])
            return self._weight_cast

        # -- bias in the activation dtype ------------------------------------------------------------
        def use_activation_bias(self, dtype: torch.dtype) -> None:
            """Hand TE the bias already in `dtype`, cast once per step (with the weight cache, on the first
            microbatch) into a fixed tensor, instead of TE casting the fp32 bias in every forward and the
            autograd engine casting its bf16 gradient back to fp32 in every backward (two small kernels
            per linear and microbatch). Its gradient is then `bias_grad_input`'s, in `dtype`, which the
            caller accumulates into the fp32 `.grad` (`stage.actions.accumulate_grads`): a cast of a bf16
            value to fp32 is exact, so the sums have the bits of the engine's cast then AccumulateGrad's add."""
            if self.bias is None or self.bias.dtype == dtype:
                return
            self._bias_act = torch.empty(self.bias.shape, dtype=dtype, device=self.bias.device, requires_grad=True)

        @property
        def bias_grad_input(self) -> Tensor | None:
            """The tensor TE takes as the bias, whose gradient is the bias's (None: the bias itself)."""
            return self._bias_act

        # -- compute -------------------------------------------------------------------------------
        def _contexts(self, act_dtype: torch.dtype) -> contextlib.ExitStack:
            stack = contextlib.ExitStack()
            stack.enter_context(te.autocast(enabled=True, recipe=self._te_recipe))
            # No module of ours may trigger TE's global backward reduce-and-update.
            FP8GlobalStateManager.quantization_state.is_first_fp8_module = False
            if act_dtype != self.weight.dtype:
                stack.enter_context(torch.autocast("cuda", dtype=act_dtype, cache_enabled=False))
            return stack

        @property
        def needs_main_grad(self) -> bool:
            """Fused accumulation: TE's backward reads `weight.main_grad` (`bind_main_grad`)."""
            return self.fused_wgrad

        def bind_main_grad(self, grad: Tensor | None) -> None:
            """The fp32 tensor of the weight's shape TE's fused wgrad GEMM accumulates into: native eager's
            own gradient buffer; None binds a placeholder that holds no memory (the split path, where every
            `dW` names its destination when it runs)."""
            if grad is None:
                grad = torch.zeros((), dtype=torch.float32, device=self.weight.device).expand(self.weight.shape)
            if grad.shape != self.weight.shape or grad.dtype != torch.float32 or grad.device != self.weight.device:
                raise ValueError(f"main_grad must be {tuple(self.weight.shape)} float32 on {self.weight.device}, "
                                 f"got {tuple(grad.shape)} {grad.dtype} on {grad.device}")
            self.weight.main_grad = grad

        def forward(self, x: Tensor, is_first_microbatch: bool) -> Tensor:  # type: ignore[override]
            if not is_first_microbatch and not self._cache_valid:
                raise RuntimeError(EMPTY_CACHE_MSG)
            if self.fused_wgrad and torch.is_grad_enabled() and getattr(self.weight, "main_grad", None) is None:
                raise RuntimeError("fused wgrad accumulation: bind the weight's main_grad (bind_main_grad) before "
                                   "a forward whose backward computes its gradient")
            if x.shape[-1] != self.in_features:
                raise ValueError(f"expected input [..., {self.in_features}], got {tuple(x.shape)}")
            delayed = self.delay_wgrad
            if is_first_microbatch and self._bias_act is not None:  # refreshed when the weight cache is
                with torch.no_grad():
                    self._bias_act.copy_(self.bias)
            cast = self._weight_cast
            cached = (bool(is_first_microbatch) and cast is not None
                      and cast.use_cache(torch.cuda.is_current_stream_capturing()))
            if cached:  # the optimizer cast the weight already (`fp8.weight_cast`): its amax joins the history
                cast.fold_pending_amax()
                cast.mark_consumed()
            with self._contexts(x.dtype):
                y = super().forward(x, is_first_microbatch=bool(is_first_microbatch) and not cached)
            if is_first_microbatch:
                self._cache_valid = True
            if torch.is_grad_enabled():  # TE updates forward scaling only in grad mode, too
                self._update_scaling("scaling_fwd", forward=True)
                node = te_compat.linear_backward_node(y.grad_fn)
                if node is not None:
                    node.register_hook(functools.partial(self._after_backward, delayed))
            return y

        def _after_backward(self, delayed: bool, grad_inputs: Any, grad_outputs: Any) -> None:
            """Node post-hook: TE's backward of this microbatch is done (dI, or dI+dW when not delayed)."""
            self._update_scaling("scaling_bwd", forward=False)
            if delayed and self.weight.requires_grad:
                self._fifo.record(self.wgrad_store.context.qsize())

        def pop_wgrad_work(self) -> list[TEWgradWork]:
            """Handles for the wgrad GEMMs queued since the last call (one per delayed backward)."""
            return self._fifo.pop_pending()

        def wgrad_dtype(self, activation_dtype: torch.dtype) -> torch.dtype:
            """The dtype TE's wgrad GEMM writes (the activation dtype; fp32 with fused accumulation): a
            staging slot in it is written by the GEMM itself, with no copy."""
            return torch.float32 if self.fused_wgrad else activation_dtype

        def compute_wgrad(self, work: TEWgradWork, out: Tensor | None = None, accumulate: bool = False) -> Tensor:
            """Run the oldest queued wgrad GEMM (must be `work`); write `dW` into `out` (or, `accumulate`,
            add it: one mixed-dtype add, the bits of casting to fp32 and then adding) or return it (fp32).

            `out` in the weight's dtype (fp32) gets the GEMM output cast (copied or added); `out` in the
            GEMM's own dtype (a staging slot, `wgrad_dtype`) is the GEMM's output buffer itself."""
            self._fifo.check_next(work)
            if self.fused_wgrad:
                return self._fused_wgrad(work, out, accumulate)
            raw = out is not None and out.dtype != self.weight.dtype
            if out is not None and (
                out.shape != self.weight.shape or out.device != self.weight.device
                or (raw and (accumulate or not out.is_contiguous()))
            ):
                raise ValueError(
                    f"dW destination must be {tuple(self.weight.shape)} {self.weight.dtype} on "
                    f"{self.weight.device} (or contiguous, overwritten, in the wgrad GEMM's dtype), got "
                    f"{tuple(out.shape)} {out.dtype} on {out.device}" + (" to add into" if accumulate else "")
                )
            wgrad = self._pop_wgrad(out if raw else None)
            self._fifo.consume(work)
            if out is None:
                return wgrad.to(self.weight.dtype)
            if raw:
                if wgrad.data_ptr() != out.data_ptr():  # TE did not take the buffer: same bits via a copy
                    if wgrad.dtype != out.dtype:  # a narrower slot would round the gradient: refuse
                        raise ValueError(f"dW staging slot is {out.dtype}, the wgrad GEMM wrote {wgrad.dtype}")
                    te_compat.count_fallback("te.wgrad_staging_copy")
                    out.copy_(wgrad)
                return out
            if accumulate:
                out.add_(wgrad)
            else:
                out.copy_(wgrad)
            return out

        def _fused_wgrad(self, work: TEWgradWork, out: Tensor | None, accumulate: bool) -> Tensor:
            """The queued fused wgrad GEMM with its destination and accumulate flag set now: into `out`
            (added with `accumulate`, else overwritten), or into a fresh fp32 tensor without `out`. The
            flag TE bound at `dI` follows `is_first_microbatch`, which a weight the optimizer cast passes
            as False; the arena's rule (overwrite on the first microbatch) is what the native GEMM did."""
            if accumulate and out is None:
                raise ValueError("compute_wgrad(accumulate=True) needs out")
            if out is not None and (out.shape != self.weight.shape or out.dtype != torch.float32
                                    or out.device != self.weight.device or not out.is_contiguous()):
                raise ValueError(f"fused dW destination must be contiguous {tuple(self.weight.shape)} float32 on "
                                 f"{self.weight.device}, got {tuple(out.shape)} {out.dtype} on {out.device}")
            kwargs = te_compat.wgrad_gemm_kwargs(self.wgrad_store)
            if kwargs is None or "accumulate" not in kwargs or "out" not in kwargs:
                raise RuntimeError("fused wgrad accumulation: Transformer Engine's queued wgrad closure has no "
                                   "out/accumulate arguments to set (an unsupported TE version)")
            tensors, func = self.wgrad_store.context.get()
            bound = kwargs["out"], kwargs["accumulate"]
            kwargs["out"], kwargs["accumulate"] = out, accumulate
            try:
                wgrad, _bgrad = func(*tensors)
            finally:
                kwargs["out"], kwargs["accumulate"] = bound
            self._fifo.consume(work)
            return wgrad

        def _pop_wgrad(self, into: Tensor | None) -> Tensor:
            """`wgrad_store.pop()`, optionally with the GEMM's output buffer set to `into` (TE's wgrad
            closure keeps its GEMM arguments in `wgrad_gemm_kwargs`, with `out=None` when not fusing
            accumulation); a closure of another shape or dtype falls back to TE's own buffer."""
            kwargs = te_compat.wgrad_gemm_kwargs(self.wgrad_store) if into is not None else None
            plain = kwargs is not None and all(kwargs.get(k) is None for k in te_compat.PLAIN_GEMM_KWARGS)
            if not plain or kwargs.get("out_dtype") != into.dtype or kwargs.get("accumulate"):
                if into is not None and kwargs is None:  # the closure lookup failed: never silent
                    te_compat.count_fallback("te.wgrad_closure_lookup")
                (wgrad, _bgrad), _ = self.wgrad_store.pop()
                return wgrad
            tensors, func = self.wgrad_store.context.get()
            kwargs["out"] = into
            try:
                wgrad, _bgrad = func(*tensors)
            finally:
                kwargs["out"] = None
            return wgrad

        def discard_wgrad_work(self) -> int:
            """Drop every queued wgrad GEMM (after an aborted epoch); returns how many were dropped."""
            n = len(self._fifo)
            while self.wgrad_store.context is not None and self.wgrad_store.context.qsize():
                self.wgrad_store.context.get_nowait()
            self._fifo.clear()
            return n

    # Read/write access to single state tensors by the reference's names (fault injection uses them).
    def _state_property(name: str) -> property:
        return property(lambda self: self.fp8_state()[name])

    for _name in TE_STATE_NAMES:
        setattr(TELinear, _name, _state_property(_name))
    te_compat.bias_stand_in(TELinear, "_bias_act")  # TE then takes `use_activation_bias`'s tensor as the bias

    return TELinear


# The updates queued by the innermost `batched_scaling_updates` scope (None: update at once).
_PENDING: list[tuple[Any, bool, Any]] | None = None


def _run_updates(states: list[Any], forward: bool, te_recipe: Any) -> None:
    """One `fused_amax_and_scale_update_after_reduction` over `states` (one recipe, one direction).

    The kernel updates each state in its own thread block from its own slice of the amax buffer, so
    one call over many states writes the same bits as one call per state; the buffer is the states'
    current amaxes concatenated (what TE passes after its reduction; a single process has none)."""
    import transformer_engine_torch as tex
    from transformer_engine.pytorch.quantization import get_fp8_te_dtype

    tex.fused_amax_and_scale_update_after_reduction(
        torch.cat([st.amax_history[0] for st in states]),
        [st.amax_history for st in states],
        [st.scale for st in states],
        te_recipe.amax_compute_algo,
        get_fp8_te_dtype(te_recipe, forward),
        float(te_recipe.margin),
    )


@contextlib.contextmanager
def batched_scaling_updates():
    """Defer the delayed-scaling updates of every TE linear inside the scope to its end, as one fused
    kernel per (recipe, direction) instead of a clone and a kernel per module and action.

    Same bits as updating each module right after its forward (or backward): a module's state is read
    only by its own next forward (backward), never by another module of the same action, so moving its
    update to the end of the action changes nothing any kernel reads. Meant for one chunk action (`F`
    or `dI`): captured, it saves two small kernels per linear and microbatch. Hooks that run on
    autograd's device thread queue into the same list, so the scope is process-wide, not per thread."""
    global _PENDING
    outer, _PENDING = _PENDING, []
    try:
        yield
        pending = _PENDING
    finally:
        _PENDING = outer
    if outer is not None:  # nested: the outer scope flushes
        outer.extend(pending)
        return
    groups: dict[tuple[int, bool], tuple[Any, list[Any]]] = {}
    for st, forward, te_recipe in pending:
        groups.setdefault((id(te_recipe), forward), (te_recipe, []))[1].append(st)
    for (_, forward), (te_recipe, states) in groups.items():
        _run_updates(states, forward, te_recipe)


class TEBackend:
    """Transformer Engine `Linear` with delayed scaling, retained dW and a cached FP8 weight."""

    name = "te"
    state_transitions: dict[str, tuple[str, ...]] = {
        "F": FORWARD_STATE,
        "dI": BACKWARD_STATE,
        "dW": (),
    }
    persistent_state: tuple[str, ...] = TE_STATE_NAMES
    retained_object = (
        "TE WeightGradStore FIFO per module (delay_wgrad_compute); pop_wgrad_work hands out one TEWgradWork "
        "handle per dI, compute_wgrad drains them in dI order"
    )
    wgrad_destination = (
        "compute_wgrad(work, out=view, accumulate=False): a tensor of the weight's shape, dtype (fp32) and device, "
        "overwritten, or added into with accumulate=True "
        "with the bf16 wgrad GEMM output (copy); or a fresh fp32 tensor without out. Fused accumulation: the "
        "GEMM itself writes or adds fp32 into out"
    )
    cache_refresh = (
        "forward(x, is_first_microbatch=True) re-quantizes the weight into TE's cached workspace (in place); "
        "False reuses it and raises RuntimeError after invalidate_cache()"
    )

    def __init__(self, recipe: DelayedScalingRecipe, *, fused_wgrad: bool = False) -> None:
        require_te()
        self.recipe = recipe
        self.te_recipe = make_te_recipe(recipe)
        self.fused_wgrad = fused_wgrad

    def linear(
        self,
        in_f: int,
        out_f: int,
        bias: bool,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
    ) -> nn.Module:
        return te_linear_class()(in_f, out_f, bias, self.recipe, self.te_recipe, device=device, dtype=dtype,
                                 fused_wgrad=self.fused_wgrad)

    def __repr__(self) -> str:
        return f"TEBackend({self.recipe})"


@contextlib.contextmanager
def own_cublas_workspace(device: torch.device | str):
    """Inside the scope, Transformer Engine's GEMMs take a new cuBLAS workspace of their own; yields it.

    Why: TE's `general_gemm` asks `get_cublas_workspace` for one process-wide workspace per device
    whatever the stream, and a captured GEMM keeps the pointer it was given. Graphs that may replay at the
    same time on different streams (`SingleProcessPipeline.rank_streams`) would then race on it: each
    rank's graphs are captured inside this scope, with a workspace of the rank's. The caller keeps the
    yielded tensor alive as long as those graphs (a graph holds the address, not the tensor). Userbuffer
    and grouped GEMMs keep TE's own workspaces (qeffect's linears use neither)."""
    from transformer_engine.pytorch.cpp_extensions import gemm as te_gemm

    original = te_gemm.get_cublas_workspace
    workspace = torch.empty(te_gemm.get_cublas_workspace_size_bytes(), dtype=torch.uint8, device=device)

    def rank_workspace(device_index: int, ub: bool, grouped_gemm: bool):  # noqa: ANN202 - TE's signature
        return original(device_index, ub, grouped_gemm) if ub or grouped_gemm else workspace

    te_gemm.get_cublas_workspace = rank_workspace
    try:
        yield workspace
    finally:
        te_gemm.get_cublas_workspace = original
