"""Reference FP8 backend: a pure-PyTorch linear layer with TE delayed-scaling semantics.

One `RefFP8Linear` owns three scaling states (input and weight in E4M3, output gradient in E5M2),
a process-local quantized-weight cache, and a store of retained weight-gradient work:

- `F`  quantizes the weight on the first microbatch after a commit (cache refresh: weight amax and
  scale update) and the input on every call (input amax and scale update), then `Y = X W^T (+ b)`.
- `dI` (the autograd backward of `F`) quantizes the output gradient once (grad amax and scale update),
  computes `dX`, the bias gradient, and packages the rest as a `WgradWork`.
- `dW` is `compute_wgrad(work)`: one `fp8_mm`, no state transition. With `delay_wgrad=False` it runs
  inside the backward (the native path, like TE without `delay_wgrad_compute`); with `True` the work is
  retained in `wgrad_store` and the stage runs it later. That timing is the only difference, so both
  paths give the same bits.

The weight-gradient GEMM writes the activation dtype, as Transformer Engine's does (its wgrad GEMM
outputs the activation dtype unless accumulation is fused), and the fp32 `.grad` sums those values
cast: the te backend's numerics, and half the staging memory and traffic of fp32 slots (the staged
fold reads every slot once per step, and the GEMMs write half the bytes). With fp32 activations, as on
the CPU, that is the weight's dtype. With `fused_wgrad` (`pipeline.wgrad_accumulation = "fused"`) the
GEMM writes fp32 and the gradient adds that: the sum of fp32 GEMM results in microbatch order, what an
fp32 accumulation into `main_grad` computes (Megatron-LM's fusion), with no bf16 rounding between.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from qeffect.fp8.gemm import bias_in_epilogue, fp8_mm
from qeffect.fp8.recipe import DelayedScalingRecipe
from qeffect.fp8.scaling import ScalingState
from qeffect.fp8.weight_cast import WeightCastTarget

STATE_NAMES: tuple[str, ...] = (
    "input_amax_history",
    "input_scale",
    "weight_amax_history",
    "weight_scale",
    "grad_amax_history",
    "grad_scale",
)

_SCRATCH_ROW = {"input": 0, "weight": 1, "grad": 2}  # each state's row of `RefFP8Linear.transition_scratch`

EMPTY_CACHE_MSG = "weight cache is empty: the first microbatch after a commit or resume must refresh it"


@dataclass(frozen=True)
class WgradWork:
    """Everything `dW` needs for one (module, microbatch), retained between `dI` and `dW`.

    `dW = fp8_mm(dy_q_t, dy_scale_inv, x_q_t, x_scale_inv)`: `dy_q_t` is `[out, N]` E5M2, `x_q_t` is
    `[in, N]` E4M3, both contiguous; the scale inverses are those the tensors were quantized with.
    """

    dy_q_t: Tensor
    dy_scale_inv: Tensor
    x_q_t: Tensor
    x_scale_inv: Tensor
    activation_dtype: torch.dtype  # of the input and output gradient: what the GEMM writes (module doc)

    def tensors(self) -> tuple[Tensor, ...]:
        return (self.dy_q_t, self.dy_scale_inv, self.x_q_t, self.x_scale_inv)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())


@dataclass(frozen=True)
class WeightCache:
    """The quantized weight of one optimizer epoch: `w_q [out, in]`, `w_q_t [in, out]`, `scale_inv`."""

    w_q: Tensor
    w_q_t: Tensor
    scale_inv: Tensor


class _FP8LinearFn(torch.autograd.Function):
    """`y = fp8(x) fp8(W)^T (+ b)` on a 2-D input; backward is `dI` and, unless delayed, `dW`."""

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        x: Tensor,
        weight: Tensor,
        bias: Tensor | None,
        module: RefFP8Linear,
        w_q: Tensor,
        w_q_t: Tensor,
        w_scale_inv: Tensor,
        bias_cast: Tensor | None = None,
    ) -> Tensor:
        x_q_t = None  # what dW needs of x: its transpose, made in the same pass as x_q
        if ctx.needs_input_grad[1]:  # (forward runs with grad mode off: requires_grad is what says a dW comes)
            x_q, x_q_t, x_scale_inv = module.input_state().quantize_pair(x)
        else:
            x_q, x_scale_inv = module.input_state().quantize(x)
        epilogue_bias = bias if bias_cast is None else bias_cast  # (`RefFP8Linear.bias_cast`: the same values)
        y = fp8_mm(x_q, x_scale_inv, w_q, w_scale_inv, out_dtype=x.dtype, bias=epilogue_bias)  # (`gemm.bias_in_epilogue`)
        ctx.save_for_backward(x_q_t, x_scale_inv, w_q_t, w_scale_inv)
        ctx.module = module
        ctx.x_dtype = x.dtype
        ctx.bias_dtype = None if bias is None else bias.dtype
        return y

    @staticmethod
    def backward(ctx: Any, dy: Tensor) -> tuple[Tensor | None, ...]:
        x_q_t, x_scale_inv, w_q_t, w_scale_inv = ctx.saved_tensors
        module: RefFP8Linear = ctx.module
        # The one backward state transition of this module for this microbatch.
        dy_q_t = dbias = None
        want_dbias = ctx.bias_dtype is not None and ctx.needs_input_grad[2]
        if ctx.needs_input_grad[1] and want_dbias:  # the bias gradient from the quantize pass (on a GPU)
            dy_q, dy_q_t, dy_scale_inv, dbias = module.grad_state().quantize_pair_colsum(dy, ctx.bias_dtype)
        elif ctx.needs_input_grad[1]:
            dy_q, dy_q_t, dy_scale_inv = module.grad_state().quantize_pair(dy)
        else:
            dy_q, dy_scale_inv = module.grad_state().quantize(dy)
        dx = None
        if ctx.needs_input_grad[0]:
            dx = fp8_mm(dy_q, dy_scale_inv, w_q_t, w_scale_inv, out_dtype=ctx.x_dtype)
        if want_dbias and dbias is None:
            dbias = dy.sum(0, dtype=ctx.bias_dtype)
        dw = None
        if ctx.needs_input_grad[1]:
            work = WgradWork(dy_q_t, dy_scale_inv, x_q_t, x_scale_inv, ctx.x_dtype)
            if module.delay_wgrad:
                module.wgrad_store.append(work)
            else:
                dw = module.compute_wgrad(work)
        return dx, dw, dbias, None, None, None, None, None


class RefFP8Linear(nn.Module):
    """FP8 linear layer of the reference backend (a "matrix" module: its `weight` gets `dW`)."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        recipe: DelayedScalingRecipe,
        *,
        device: torch.device | str | None = None,
        dtype: torch.dtype = torch.float32,
        fused_wgrad: bool = False,
    ) -> None:
        super().__init__()
        self.fused_wgrad = fused_wgrad
        self.in_features = in_features
        self.out_features = out_features
        self.recipe = recipe
        self.weight = nn.Parameter(torch.zeros(out_features, in_features, device=device, dtype=dtype))
        if bias:
            self.bias = nn.Parameter(torch.zeros(out_features, device=device, dtype=dtype))
        else:
            self.register_parameter("bias", None)
        for prefix in ("input", "weight", "grad"):
            self.register_buffer(
                f"{prefix}_amax_history",
                torch.zeros(recipe.amax_history_len, dtype=torch.float32, device=device),
            )
            self.register_buffer(f"{prefix}_scale", torch.ones((), dtype=torch.float32, device=device))
        # per state two int32 words the quantize kernel completes its transition through (`ScalingState.
        # scratch`): zero between launches, not state (not in the state_dict)
        self.register_buffer("transition_scratch", torch.zeros(3, 2, dtype=torch.int32, device=device),
                             persistent=False)
        self.delay_wgrad = False
        self.wgrad_store: list[WgradWork] = []
        self._cache: WeightCache | None = None
        self._bias_buffer: Tensor | None = None  # `bias_cast`'s buffer
        self._bias_cast: Tensor | None = None  # the bias as this epoch's forwards read it (None: as it is)
        self._weight_cast: WeightCastTarget | None = None  # the optimizer casts the weight (`weight_cast_target`)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"
        )

    # -- scaling state ---------------------------------------------------------------------------
    # Built over the buffers at each use so `.to()` / `load_state_dict` never leave a stale reference.
    def _state(self, prefix: str, fp8_dtype: torch.dtype) -> ScalingState:
        return ScalingState(
            getattr(self, f"{prefix}_amax_history"),
            getattr(self, f"{prefix}_scale"),
            fp8_dtype,
            self.recipe.margin,
            self.recipe.amax_compute_algo,
            self.transition_scratch[_SCRATCH_ROW[prefix]],
        )

    def input_state(self) -> ScalingState:
        return self._state("input", self.recipe.fwd_dtype)

    def weight_state(self) -> ScalingState:
        return self._state("weight", self.recipe.fwd_dtype)

    def grad_state(self) -> ScalingState:
        return self._state("grad", self.recipe.bwd_dtype)

    def fp8_state(self) -> dict[str, Tensor]:
        """The six persistent FP8 state tensors (the live buffers, not copies)."""
        return {name: getattr(self, name) for name in STATE_NAMES}

    # -- weight cache ------------------------------------------------------------------------------
    @property
    def cache_valid(self) -> bool:
        return self._cache is not None

    @property
    def weight_cache(self) -> WeightCache | None:
        return self._cache

    def cache_storage(self) -> list[Tensor]:
        """Every tensor of the FP8 weight cache this linear keeps, valid or not: the cache and the buffers
        the optimizer casts into (memory accounting: those stay allocated while the cache is invalid)."""
        out = [self._cache.w_q, self._cache.w_q_t, self._cache.scale_inv] if self._cache is not None else []
        cast = self._weight_cast
        if cast is not None:
            out += [t for t in (cast.data, cast.transpose, cast.scale_inv, cast.pending_amax) if t is not None]
        return out

    def invalidate_cache(self) -> None:
        """Drop the quantized weight (after a commit or a resume the next forward must refresh it)."""
        self._cache = None
        self._bias_cast = None
        if self._weight_cast is not None:  # its cast may be of another scale or weight now
            self._weight_cast.mark_consumed()

    def weight_cast_target(self, name: str = "") -> WeightCastTarget:
        """The quantized weight as the optimizer casts it in its pass (`fp8.weight_cast`, as the te
        backend's): fixed E4M3 buffers for `w_q` and `w_q_t` and a `scale_inv`, cast with the forward weight
        scale; from now on a first forward that finds the cast fresh (or is captured: its caller casts a
        stale one first) takes them as they are instead of quantizing the weight again."""
        if self._weight_cast is not None:
            return self._weight_cast
        if self.recipe.fwd_dtype != torch.float8_e4m3fn or self.weight.dtype != torch.float32:
            raise RuntimeError(f"{name or 'linear'}: the optimizer's cast writes E4M3 from an fp32 weight")
        out_f, in_f = self.weight.shape
        dev, fp8 = self.weight.device, torch.float8_e4m3fn
        self._weight_cast = WeightCastTarget(
            name, self.weight, torch.empty(out_f, in_f, dtype=fp8, device=dev),
            torch.empty(in_f, out_f, dtype=fp8, device=dev), self.weight_scale.view(1),
            torch.empty_like(self.weight_scale), self.weight_amax_history[0:1])  # `quantize_pair`'s shape
        return self._weight_cast

    @torch.no_grad()
    def refresh_cache(self) -> WeightCache:
        """Quantize the weight with the current weight scale, then record its amax and update the scale.

        New tensors every time it quantizes: tapes of an earlier epoch may still hold the previous ones.
        Where the optimizer cast the weight (`weight_cast_target`) the cast is taken instead, in buffers
        fixed for the module's life (the optimizer rewrites them only after every tape of the step has run,
        as the te backend's cast): its amax folds into the history's current row (zeroed by the last
        update, so the row becomes the amax, as a fresh quantization records it), then the same scale
        update; `q`, `q^T` and `1 / scale` are the bits the quantization would give (the optimizer's cast
        is the same arithmetic, GPU-tested).
        """
        cast = self._weight_cast
        if cast is not None and cast.use_cache(self.weight.is_cuda and torch.cuda.is_current_stream_capturing()):
            cast.fold_pending_amax()
            cast.mark_consumed()
            self.weight_state().update()
            self._cache = WeightCache(cast.data, cast.transpose, cast.scale_inv)
            return self._cache
        w_q, w_q_t, scale_inv = self.weight_state().quantize_pair(self.weight)
        self._cache = WeightCache(w_q, w_q_t, scale_inv)
        return self._cache

    # -- compute -----------------------------------------------------------------------------------
    def forward(self, x: Tensor, is_first_microbatch: bool) -> Tensor:
        if is_first_microbatch:
            cache = self.refresh_cache()
            self._bias_cast = self.bias_cast(x.dtype)
        else:
            cache = self._cache
            if cache is None:
                raise RuntimeError(EMPTY_CACHE_MSG)
        if x.shape[-1] != self.in_features:
            raise ValueError(f"expected input [..., {self.in_features}], got {tuple(x.shape)}")
        lead = x.shape[:-1]
        x2d = x.reshape(-1, self.in_features)
        bias_cast = self._bias_cast if self._bias_cast is not None and self._bias_cast.dtype == x.dtype else None
        y = _FP8LinearFn.apply(x2d, self.weight, self.bias, self, cache.w_q, cache.w_q_t, cache.scale_inv, bias_cast)
        return y.reshape(*lead, self.out_features)

    @torch.no_grad()
    def bias_cast(self, dtype: torch.dtype) -> Tensor | None:
        """The bias in `dtype` (the activations'), as the GEMM's epilogue reads it, cast at the first
        microbatch into a buffer fixed for the module's life; the forwards of the epoch read it.

        Why: `fp8_mm` casts the fp32 bias for each call, a copy kernel per linear and microbatch (128 per
        captured h4096 reference step; 16 with this, one per linear). Rewriting the buffer at the next first
        forward is safe: no forward of the epoch before runs after it, and nothing else reads it. None
        (each call casts, as before) where the epilogue does not take the bias (`gemm.bias_in_epilogue`),
        the bias is already in `dtype`, or the buffer would first be made inside a graph capture."""
        b = self.bias
        if b is None or b.dtype == dtype or not bias_in_epilogue(b.device, dtype):
            return None
        buf = self._bias_buffer
        if buf is None or buf.dtype != dtype or buf.device != b.device:
            if b.is_cuda and torch.cuda.is_current_stream_capturing():
                return None
            buf = self._bias_buffer = torch.empty_like(b, dtype=dtype)
        return buf.copy_(b)

    def wgrad_dtype(self, activation_dtype: torch.dtype) -> torch.dtype:
        """The dtype the wgrad GEMM writes: the activation dtype, or the weight's with `fused_wgrad`
        (module doc). A staging slot in it is the GEMM's own output."""
        return self.weight.dtype if self.fused_wgrad else activation_dtype

    def compute_wgrad(self, work: WgradWork, out: Tensor | None = None, accumulate: bool = False) -> Tensor:
        """`dW [out, in]` from retained work, in the weight's dtype; with `out` it is written there (direct
        placement: `out` in the GEMM's dtype is its output buffer, in the weight's gets the exact cast), or
        added into it with `accumulate` (the accumulating arena: one mixed-dtype add, the bits of the cast
        then the add, as autograd's cast and AccumulateGrad).

        Touches no scaling state, so it may run at any time after `dI` and in any order.
        """
        gemm_dtype = self.wgrad_dtype(work.activation_dtype)
        if accumulate and out is None:
            raise ValueError("compute_wgrad(accumulate=True) needs out")
        if out is not None and not accumulate and out.dtype == gemm_dtype:
            return fp8_mm(work.dy_q_t, work.dy_scale_inv, work.x_q_t, work.x_scale_inv, gemm_dtype, out=out)
        if out is not None and (out.dtype != self.weight.dtype or out.shape != self.weight.shape):
            raise ValueError(f"dW destination must be {tuple(self.weight.shape)} {self.weight.dtype} (or, "
                             f"overwritten, {gemm_dtype}), got {tuple(out.shape)} {out.dtype}")
        dw = fp8_mm(work.dy_q_t, work.dy_scale_inv, work.x_q_t, work.x_scale_inv, gemm_dtype)
        if out is None:
            return dw.to(self.weight.dtype)
        return out.add_(dw) if accumulate else out.copy_(dw)

    def pop_wgrad_work(self) -> list[WgradWork]:
        """Return the retained work (in `dI` order) and clear the store."""
        work, self.wgrad_store = self.wgrad_store, []
        return work
