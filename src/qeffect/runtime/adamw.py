"""torch's fused AdamW with the update as one Triton pass per parameter: the same bits, the same state.

Why: at hidden 4,096 the optimizer is a fifth of a captured step, and it is a memory pass: per fp32
parameter it reads the parameter, gradient and both moments and writes three of them back. Over h4096's
parameters on the H200 torch's fused multi-tensor kernel moved those bytes at 3.25 TB/s, this at 3.56
(7.75 against 7.07 ms: `docs/results/2026-12-01-h200-kernels.md`).

Bits: the arithmetic is torch's fused kernel's (``ATen/native/cuda/fused_adam_utils.cuh``): fp32 math,
decoupled weight decay first, ``exp_avg = fma(b1, m, fma(-b1, g, g))``, ``exp_avg_sq = fma(b2, v,
fma(-b2, g*g, g*g))``, ``step_size = lr / bc1``, ``denom = sqrt(v) / sqrt(bc2) + eps``, ``p -= step_size
* m / denom``, IEEE-rounded division and square root. The bias corrections ``1 - beta**step`` come from
torch's own ``pow`` on the device step (`torch._foreach_pow`): Triton's ``pow`` is a few ulp away from
CUDA's ``powf`` (measured: 0.95**1 gave 0.94999993). `benchmarks/adamw_ab.py` checks the bits against
torch's kernel on the GPU, and the bitwise verification tests compare whole runs against native eager,
which keeps torch's optimizer.

Tensors under `MIN_NUMEL` elements (norms, biases) take torch's own fused kernel, in one launch for all
of them: the Triton pass pays off on large tensors, and one launch per small tensor would cost more host
time than it saves. The step counts are incremented first, for all, as torch's fused step does.

The staged fold can ride along (`TritonAdamW.fold_into_step`, fed by `contracts.arena`'s deferred last
group): the pass then reads the bf16 staging slots, adds them in slot order in fp32 (the fold's own
additions, so its bits) and updates with the sum, never writing the fp32 gradient: 40 bytes per element
instead of the fold's 20 plus the update's 28 (h4096 on the H200, `benchmarks/adamw_ab.py
--fold-sweep`: 8.48 against 9.92 ms). Where the fold starts the sum (one staging group a step), the pass
reads no gradient at all, and the arena need not hold one (`TritonAdamW.fold_without_region`).

The FP8 weight cast can ride along too (`TritonAdamW.cast_after_step`, `fp8.weight_cast`): for each
registered Transformer Engine weight the pass also writes the updated weight's E4M3 bytes, its amax and
1 / scale (Transformer Engine's delayed-scaling cast, bit for bit), and a byte pass its transpose: the
next step's first forward then does not read every fp32 weight again (h4096 on the H200,
8.44 ms against 7.46 + 1.45 for the pass and TE's cast:
`docs/results/2026-12-01-h200-kernels.md`).

State: the optimizer is a `torch.optim.AdamW(fused=True)` and initializes its state through it, so
checkpoints, `state_dict` and resumes see torch's layout (`step` a device fp32 scalar). Anything the
Triton pass does not cover (CPU, amsgrad, maximize, a tensor learning rate, a closure, non-fp32 or
non-contiguous tensors, no Triton) runs torch's own step.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from qeffect.fp8.fused_quantize import transpose_bytes
from qeffect.fp8.recipe import fp8_max
from qeffect.fp8.te_compat import (
    adamw_init_group,
    foreach_add_,
    foreach_neg_,
    foreach_pow,
    foreach_sqrt_,
    foreach_zero_,
    fused_adamw_,
    scalar_dtype,
)
from qeffect.fp8.weight_cast import WeightCastTarget
from qeffect.runtime import lazy_rows
from qeffect.runtime.adamw_math import adamw_math
from qeffect.runtime.lazy_rows import LazyRows
from qeffect.stage.accumulate import fold_staged
from qeffect.triton_lazy import triton_kernel

BLOCK = 4096
NUM_WARPS = 16  # best of an ad-hoc sweep (BLOCK 1024-8192 x 4-16 warps, one 50M-element tensor, H200): all within 5%
FOLD_BLOCK = 1024  # the pass that also folds the staged slots (`TritonAdamW.fold_into_step`): best of
FOLD_WARPS = 16  # `adamw_ab.py --fold-sweep` (block 1024-8192 x 4-16 warps on h4096, H200): 4.04 TB/s
MIN_NUMEL = 1 << 20  # smaller tensors (norms, biases) stay in torch's one multi-tensor launch: same bits
CAST_ITER = 4  # blocks per program when the pass casts (`benchmarks/weight_cast_ab.py --iters`, h4096 on the
# H200: 8.82 / 8.60 / 8.36 / 8.44 / 8.65 ms for 1 / 2 / 4 / 8 / 16, against 8.91 for the pass and TE's cast)
CAST_TRANSPOSE_BLOCK = (128, 128, 8)  # the cast's byte transpose (`weight_cast_ab.py --sweep`, h4096's 17
# weights on the H200: 0.58 ms against 0.78 with `transpose_bytes`' default 64 x 64 x 4; 0.46 / 0.53
# in a later run)


@triton_kernel
def _kernel(triton, tl):  # noqa: ANN001, ANN202 - builds a Triton JIT function
    _adamw_update, _ = adamw_math()
    globals()["_adamw_update"] = _adamw_update  # Triton resolves callees in module globals

    @triton.jit
    def adamw(p_ptr, g_ptr, s_ptr, slot_stride, m_ptr, v_ptr, bc1_ptr, bc2_sqrt_ptr, n, lr, beta1, beta2,
              weight_decay, eps, q_ptr, scale_ptr, scale_inv_ptr, amax_bits_ptr, fmax, COUNT: tl.constexpr,
              INIT: tl.constexpr, DECAY: tl.constexpr, UPDATE: tl.constexpr, CAST: tl.constexpr,
              BLOCK: tl.constexpr, ITER: tl.constexpr = 1, lr_ptr=None, LR_PTR: tl.constexpr = False):
        """The update of `TritonAdamW` over a flat parameter (``COUNT=0``: the gradient is ``g``); with
        ``CAST`` then Transformer Engine's delayed-scaling cast of the new weight (`fp8.weight_cast`):
        its E4M3 bytes in the same (row-major) order, the amax as an integer atomic max over |w|'s bits,
        and 1 / scale. ``UPDATE=False``: the cast alone. ``ITER`` blocks per program (with the cast: one
        atomic per program, not per block: they serialize on the one amax word). ``LR_PTR``: the learning
        rate is the fp32 at ``lr_ptr`` (a graph replays with each step's), not the argument ``lr``."""
        if LR_PTR:
            lr = tl.load(lr_ptr)
        amax = tl.zeros((BLOCK,), dtype=tl.int32)
        for i in tl.static_range(ITER):
            offs = (tl.program_id(0).to(tl.int64) * ITER + i) * BLOCK + tl.arange(0, BLOCK)
            mask = offs < n
            if UPDATE:
                p = _adamw_update(p_ptr, g_ptr, s_ptr, slot_stride, m_ptr, v_ptr, bc1_ptr, bc2_sqrt_ptr, offs, mask,
                                  lr, beta1, beta2, weight_decay, eps, COUNT, INIT, DECAY)
            else:
                p = tl.load(p_ptr + offs, mask=mask, other=0.0)
            if CAST:
                x = p * tl.load(scale_ptr)
                x = tl.where(x > fmax, fmax, x)  # comparisons with NaN are false: NaN passes (satfinite's result)
                x = tl.where(x < -fmax, -fmax, x)
                tl.store(q_ptr + offs, x.to(tl.float8e4nv).to(tl.uint8, bitcast=True), mask=mask)
                amax = tl.maximum(amax, tl.where(mask, p.to(tl.int32, bitcast=True) & 0x7FFFFFFF, 0))
        if CAST:
            tl.atomic_max(amax_bits_ptr, tl.max(amax, axis=0))
            if tl.program_id(0) == 0:
                tl.store(scale_inv_ptr, tl.div_rn(1.0, tl.load(scale_ptr)))

    return adamw


def _fresh_state(param: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor) -> dict[str, torch.Tensor]:
    """A parameter's state as torch's fused AdamW creates it before its first step (`_init_group`), in
    the given (zeroed) moment tensors."""
    step = torch.zeros((), dtype=scalar_dtype(is_fused=True), device=param.device)
    return {"step": step, "exp_avg": exp_avg, "exp_avg_sq": exp_avg_sq}


def _fp32_contiguous_cuda(t: torch.Tensor) -> bool:
    return t.is_cuda and t.dtype == torch.float32 and t.is_contiguous()


def bias_corrections(steps: list[torch.Tensor], beta1: float, beta2: float) -> tuple[list[torch.Tensor], ...]:
    """``1 - beta1**step`` and ``sqrt(1 - beta2**step)`` per step tensor, with torch's device ``pow``
    (four multi-tensor launches per list, whatever its length)."""
    bc1 = foreach_pow(beta1, steps)
    foreach_neg_(bc1)
    foreach_add_(bc1, 1.0)
    bc2 = foreach_pow(beta2, steps)
    foreach_neg_(bc2)
    foreach_add_(bc2, 1.0)
    foreach_sqrt_(bc2)
    return bc1, bc2


class TritonAdamW(torch.optim.AdamW):
    """`torch.optim.AdamW(fused=True)` whose CUDA update runs as Triton passes with the same bits."""

    def __init__(self, params: Iterable, *, graph: bool = False, **kwargs) -> None:
        super().__init__(params, fused=True, **kwargs)
        self._folds: dict[torch.Tensor, tuple[torch.Tensor, int, bool]] = {}
        self._lazy: dict[torch.Tensor, LazyRows] = {}  # row-lazy tables (`lazy_rows`)
        self._casts: dict[torch.Tensor, WeightCastTarget] = {}
        self._placeholders: dict[torch.Tensor, torch.Tensor] = {}  # `fold_without_region`'s, per parameter
        self._zeros: dict[torch.device, torch.Tensor] = {}  # the one element each device's placeholders show
        self._groups_index: tuple[int, dict[torch.Tensor, dict]] = (0, {})  # `_group_of`
        self.graph = graph  # see `use_graph`
        self.tensor_lr = False  # see `use_tensor_lr`
        self._lr_buffers: dict[int, torch.Tensor] = {}  # per parameter group: its learning rate on the device
        self._graph: torch.cuda.CUDAGraph | None = None
        self._graph_key: tuple | None = None
        self._last_key: tuple | None = None
        self.graph_captures = 0
        self.graph_replays = 0

    def use_graph(self, enabled: bool = True) -> None:
        """Replay the step from a CUDA graph once the same work (the same tensors, folds, casts and
        hyper-parameters: `_work_key`) came twice in a row; any change runs eagerly and is captured anew.

        Why: the step is ~40 kernel launches from Python (Triton's launcher costs tens of microseconds
        each), about a third of a captured h2048 step's host time, which is what a host-bound step (release
        offload) waits for. A replay launches the same kernels with the same arguments: the same bits. Host
        state the eager step keeps (consumed folds, the casts' stamps) is kept by the replay too."""
        self.graph = enabled
        if not enabled:
            self._graph = self._graph_key = self._last_key = None

    def use_tensor_lr(self, enabled: bool = True) -> None:
        """Let the Triton passes and torch's fused kernel read each group's learning rate from a device
        fp32 scalar, written from ``group["lr"]`` before every step (eager or replayed), instead of taking
        it as a launch argument: a schedule's new rate every step then replays the same graph (`use_graph`),
        with no capture per rate. The same bits: torch's fused kernel rounds a float argument and reads a
        tensor as fp32 alike, and a Triton float argument is fp32. Off (the default), nothing changes."""
        self.tensor_lr = enabled
        if not enabled:
            self._lr_buffers = {}
        self._graph = self._graph_key = self._last_key = None  # the launches' arguments change

    def _lr_buffer(self, index: int) -> torch.Tensor:
        """Group `index`'s device learning rate (created on its first parameter's device)."""
        buf = self._lr_buffers.get(index)
        if buf is None:
            device = self.param_groups[index]["params"][0].device
            buf = self._lr_buffers[index] = torch.zeros(1, dtype=torch.float32, device=device)
        return buf

    def _write_lrs(self) -> None:
        """Each group's learning rate into its device scalar, on the current stream (before the step's
        kernels or its graph's replay, outside any capture)."""
        for i, group in enumerate(self.param_groups):
            self._lr_buffer(i).fill_(float(group["lr"]))

    def drop_folds(self) -> None:
        """Forget the folds handed over for the next step (a commit that runs no step: the staged
        gradients belong to the step it drops)."""
        self._folds = {}

    def cast_after_step(self, target: WeightCastTarget) -> None:
        """From now on every :meth:`step` also casts `target.weight` into its FP8 cache (`fp8.weight_cast`):
        in the update's own pass where the Triton pass covers the weight, as its own pass otherwise."""
        if self._group_of(target.weight) is None:
            raise ValueError(f"cast_after_step: {target.name}'s weight is not in this optimizer's groups")
        if not target.weight.is_cuda or _kernel() is None:
            raise ValueError(f"cast_after_step: {target.name}: the cast is a Triton pass (needs CUDA and Triton)")
        self._casts[target.weight] = target

    def cast_now(self, targets: Iterable[WeightCastTarget]) -> int:
        """Cast every target whose cache is not fresh (first step, after a resume or a weight written
        outside the optimizer); returns how many were cast. A target not yet registered is registered
        (:meth:`cast_after_step`): every later step casts it."""
        targets = list(targets)
        for t in targets:
            if t.weight not in self._casts:
                self.cast_after_step(t)
        stale = [t for t in targets if not t.fresh]
        _cast_alone(stale)
        return len(stale)

    def lazy_rows(self, param: torch.Tensor, rows: torch.Tensor) -> LazyRows:
        """Update `param` (a [V, H] table) row-lazily from now on (`runtime.lazy_rows`): each step only
        on `rows` (the rows the step touched, V in unused slots), every other row when it is next read.
        Its state is created now, as torch creates it, so that graphs captured before the first step can
        take its tensors. Whoever reads the table or its moments otherwise must `settle` first."""
        group = self._group_of(param)
        if group is None:
            raise ValueError("lazy_rows: the table is not in this optimizer's groups")
        if not self._covered(group, [], []) or not lazy_rows.available(param):  # the group's flags; the table
            raise ValueError("lazy_rows: the Triton pass does not cover this table or its group")
        state = self.state[param]
        if not state:  # ahead of the first step
            state.update(_fresh_state(param, torch.zeros_like(param, memory_format=torch.preserve_format),
                                      torch.zeros_like(param, memory_format=torch.preserve_format)))
        lazy = LazyRows(param, state["exp_avg"], state["exp_avg_sq"], rows, done=int(state["step"].item()))
        self._lazy[param] = lazy
        return lazy

    def settle(self) -> None:
        """Every row-lazy table and its moments up to date (before anything reads them)."""
        for lazy in self._lazy.values():
            lazy.settle()

    def state_dict(self) -> dict:
        self.settle()
        return super().state_dict()

    def load_state_dict(self, state_dict: dict) -> None:
        """torch's, keeping a row-lazy table's moment tensors (captured graphs hold them): the loaded
        values are copied into them, and every row counts as current at the loaded step."""
        kept = {p: (lz.exp_avg, lz.exp_avg_sq) for p, lz in self._lazy.items()}
        super().load_state_dict(state_dict)
        for p, (m, v) in kept.items():
            state = self.state.get(p)
            if state:
                m.copy_(state["exp_avg"])
                v.copy_(state["exp_avg_sq"])
                state["exp_avg"], state["exp_avg_sq"] = m, v
        self.reset_lazy()

    def reset_lazy(self) -> None:
        """After the tables and moments were written in place (a checkpoint load): every row current."""
        for p, lazy in self._lazy.items():
            state = self.state.get(p)
            if not state:  # loaded without state for it (saved before any step): fresh, in its tensors
                self.state[p] = state = _fresh_state(p, lazy.exp_avg.zero_(), lazy.exp_avg_sq.zero_())
            lazy.reset(int(state["step"].item()))

    def fold_into_step(self, param: torch.Tensor, block: torch.Tensor, count: int, init: bool) -> None:
        """Let the next :meth:`step` finish `param`'s staged fold: its gradient is ``param.grad`` (the
        fp32 region; with `init` not read) plus the slots ``block[0:count]`` added in slot order, as
        `stage.accumulate.fold_staged` adds them. Where the Triton pass covers `param` the fold is part
        of its update (the gradient is never written: 8 bytes per element less); otherwise the fold runs
        first, into ``param.grad``."""
        if param.grad is None:
            raise ValueError("fold_into_step: the parameter has no .grad (the region to fold into)")
        if not 1 <= count <= block.shape[0] or block.dim() != 2 or block.shape[1] < param.numel():
            raise ValueError(f"fold of {count} slots of {tuple(block.shape)} into {param.numel()} elements")
        self._folds[param] = (block, count, init)

    def folds_in_pass(self, param: torch.Tensor, block: torch.Tensor) -> bool:
        """Whether the next step's Triton pass folds `param`'s staged `block` itself, so that a fold that
        starts the sum never reads `.grad`: the group's options and the tensors are the pass's (a large fp32
        CUDA weight, not a row-lazy table) and the pass can read the block."""
        group = self._group_of(param)
        return (group is not None and self._group_covered(group) and _fp32_contiguous_cuda(param)
                and param.numel() >= MIN_NUMEL and param not in self._lazy and _fusable(block))

    def _group_of(self, param: torch.Tensor) -> dict | None:
        """`param`'s group, from an index made again when the groups change (asked for every weight every
        step: a scan of every group's parameters would cost the host more than the rest of the commit)."""
        count, index = self._groups_index
        if count != len(self.param_groups) or param not in index:
            index = {p: g for g in self.param_groups for p in g["params"]}
            self._groups_index = (len(self.param_groups), index)
        return index.get(param)

    def fold_without_region(self, param: torch.Tensor, block: torch.Tensor, count: int) -> None:
        """:meth:`fold_into_step` of a fold that starts the sum (``init``) where no region holds the gradient
        (`contracts.arena`'s lazy regions): `.grad` becomes a placeholder of the parameter's shape that holds
        no memory (one fp32 zero, expanded), which the pass never reads. Only where the pass folds `param`
        (:meth:`folds_in_pass`); a step that would take another route refuses it rather than write into it."""
        if not self.folds_in_pass(param, block):
            raise ValueError("fold_without_region: the Triton pass does not fold this parameter; give it a region")
        placeholder = self._placeholders.get(param)
        if placeholder is None:
            zero = self._zeros.get(param.device)
            if zero is None:
                zero = self._zeros[param.device] = torch.zeros(1, dtype=torch.float32, device=param.device)
            placeholder = self._placeholders[param] = zero.expand(param.shape)
        param.grad = placeholder
        self.fold_into_step(param, block, count, True)

    def gradient(self, param: torch.Tensor) -> torch.Tensor | None:
        """The gradient the next step uses for `param`: ``.grad``, or with a pending fold a new tensor
        holding it finished (the fold's additions, so the bits the step's pass computes)."""
        fold = self._folds.get(param)
        if fold is None:
            return param.grad
        g = param.grad.clone()
        fold_staged(g, *fold)
        return g

    def pending_folds(self) -> int:
        """How many parameters' folds the next step will finish."""
        return len(self._folds)

    def _covered(self, group: dict, params: list[torch.Tensor], grads: list[torch.Tensor]) -> bool:
        return (self._group_covered(group) and all(_fp32_contiguous_cuda(t) for t in params)
                and all(_fp32_contiguous_cuda(g) or _placeholder(g) for g in grads))

    @staticmethod
    def _group_covered(group: dict) -> bool:
        """The Triton pass takes the group's options (its tensors are checked apart)."""
        return (_kernel() is not None and not group["amsgrad"] and not group["maximize"]
                and not group["capturable"] and not group["differentiable"] and not torch.is_tensor(group["lr"]))

    def _work_key(self) -> tuple | None:
        """What one step's kernels read and write, and their scalar arguments, or None when the step must
        run eagerly (no graph: state not yet initialized, a tensor not covered by the Triton pass, a step
        under another capture)."""
        # One pass per parameter (the host builds this key every step): the checks of `_covered` and of the
        # state, then the addresses.
        key: list = []
        is_tensor, state_of = torch.is_tensor, self.state.get
        for i, group in enumerate(self.param_groups):
            if not self._group_covered(group):
                return None
            lr = ("lr-tensor", self._lr_buffer(i).data_ptr()) if self.tensor_lr else group["lr"]
            key.append((lr, group["betas"], group["eps"], group["weight_decay"]))
            live = 0
            for p in group["params"]:
                g = p.grad
                if g is None:
                    continue
                live += 1
                state = state_of(p)
                if not (state and _fp32_contiguous_cuda(p) and (_fp32_contiguous_cuda(g) or _placeholder(g))):
                    return None
                step, m, v = state.get("step"), state.get("exp_avg"), state.get("exp_avg_sq")
                if not (is_tensor(step) and is_tensor(m) and is_tensor(v)):
                    return None
                key.append((p.data_ptr(), p.numel(), g.data_ptr(), step.data_ptr(), m.data_ptr(), v.data_ptr()))
            if not live:
                return None
        for p, (block, count, init) in self._folds.items():
            key.append((id(p), block.data_ptr(), tuple(block.shape), tuple(block.stride()), count, init))
        for p, lazy in self._lazy.items():
            key.append((id(p), lazy.rows.data_ptr(), lazy.done.data_ptr()))
        for t in self._casts.values():
            key.append((id(t.weight), t.data.data_ptr(), None if t.transpose is None else t.transpose.data_ptr(),
                        t.scale.data_ptr(), t.scale_inv.data_ptr(), t.pending_amax.data_ptr()))
        # every group covered: all on CUDA, so asking about a capture is safe on a CPU-only build
        return None if not key or torch.cuda.is_current_stream_capturing() else tuple(key)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """torch's `zero_grad`; with `set_to_none` (what a commit calls every step) the same `p.grad = None` for
        every parameter, without the profiler range and compiler guard torch wraps around it (host time)."""
        if not set_to_none:
            super().zero_grad(set_to_none=False)
            return
        for group in self.param_groups:
            for p in group["params"]:
                p.grad = None

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        out = self._step_once(closure)
        for lazy in self._lazy.values():
            lazy.stepped()
        return out

    def _step_once(self, closure: Callable[[], float] | None) -> float | None:
        if self.tensor_lr:
            self._write_lrs()
        if self.graph and closure is None:
            key = self._work_key()
            if key is not None and key == self._graph_key:
                self._folds, self._last_key = {}, key
                self._graph.replay()
                self.graph_replays += 1
                for t in self._casts.values():
                    t.mark_cast()
                return None
            if key is not None and key == self._last_key:
                return self._capture(key)
            self._last_key = key
        return self._step(closure)

    def _capture(self, key: tuple) -> None:
        """Capture this step (the same work as the last eager one: its kernels are compiled) on a side
        stream, then replay it: capturing runs nothing."""
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            graph.capture_begin(capture_error_mode="thread_local")
            try:
                self._step(None)
            finally:
                graph.capture_end()
        torch.cuda.current_stream().wait_stream(stream)
        self._graph, self._graph_key = graph, key
        self.graph_captures += 1
        graph.replay()
        self.graph_replays += 1

    def _step(self, closure: Callable[[], float] | None) -> float | None:
        folds, self._folds = self._folds, {}
        casts = dict(self._casts)
        if casts:  # every cast's atomic max starts from 0
            foreach_zero_([t.pending_amax for t in casts.values()])
        if folds:
            strangers = sum(self._group_of(p) is None for p in folds)
            if strangers:
                raise ValueError(f"fold_into_step for {strangers} parameter(s) not in this optimizer's groups")
        groups = []
        for group in self.param_groups:
            params: list[torch.Tensor] = []
            grads: list[torch.Tensor] = []
            exp_avgs: list[torch.Tensor] = []
            exp_avg_sqs: list[torch.Tensor] = []
            steps: list[torch.Tensor] = []
            live = [p for p in group["params"] if p.grad is not None]
            if closure is not None or not self._covered(group, live, [p.grad for p in live]):
                if self._lazy:
                    raise RuntimeError("a row-lazy table's group must take the Triton pass (CUDA, fp32, "
                                       "no closure): torch's step would update it densely")
                _fold_first(folds)
                loss = super().step(closure)
                _cast_alone(list(casts.values()), zeroed=True)
                return loss
            adamw_init_group(self, group, params, grads, exp_avgs, exp_avg_sqs, [], steps)
            groups.append((group, params, grads, exp_avgs, exp_avg_sqs, steps))
        kernel = _kernel()
        for group, *lists in groups:
            if not lists[0]:
                continue
            foreach_add_(lists[-1], 1.0)  # every step count, as torch's fused step does first
            beta1, beta2 = group["betas"]
            lr, wd, eps = float(group["lr"]), float(group["weight_decay"]), float(group["eps"])
            # `use_tensor_lr`: the device scalar `_write_lrs` wrote, read by every kernel below
            lr_t = (self._lr_buffer(next(i for i, g in enumerate(self.param_groups) if g is group))
                    if self.tensor_lr else None)
            large = [i for i, p in enumerate(lists[0]) if p.numel() >= MIN_NUMEL or p in self._lazy]
            small = [i for i in range(len(lists[0])) if i not in large]
            if small:
                p, g, m, v, s = ([lst[i] for i in small] for lst in lists)
                _fold_first({t: folds.pop(t) for t in p if t in folds})
                fused_adamw_(p, g, m, v, [], s, amsgrad=False, lr=lr if lr_t is None else lr_t, beta1=beta1,
                             beta2=beta2, weight_decay=wd, eps=eps, maximize=False)
            if large:
                p, g, m, v, s = ([lst[i] for i in large] for lst in lists)
                bc1, bc2_sqrt = bias_corrections(s, beta1, beta2)
                for pi, gi, mi, vi, b1, b2 in zip(p, g, m, v, bc1, bc2_sqrt, strict=True):
                    n = pi.numel()
                    fold = folds.pop(pi, None)
                    if fold is not None and not _fusable(fold[0]):
                        _fold_first({pi: fold})
                        fold = None
                    lazy = self._lazy.get(pi)
                    if lazy is not None:
                        if fold is not None or pi in casts:
                            raise RuntimeError("a row-lazy table takes no staged fold and no FP8 cast")
                        lazy.update(gi, b1, b2, lr=lr, betas=(beta1, beta2), weight_decay=wd, eps=eps, lr_ptr=lr_t)
                        continue
                    block, count, init = fold if fold is not None else (gi, 0, False)
                    target = casts.pop(pi, None)
                    if target is not None:
                        _launch_cast(target, (gi, block, block.stride(0), mi, vi, b1, b2, lr, beta1, beta2, wd, eps),
                                     count=count, init=init, lr_ptr=lr_t)
                        continue
                    size, warps = (FOLD_BLOCK, FOLD_WARPS) if count else (BLOCK, NUM_WARPS)
                    kernel[(-(-n // size),)](pi, gi, block, block.stride(0), mi, vi, b1, b2, n, lr, beta1, beta2,
                                             wd, eps, pi, pi, pi, pi, 0.0, COUNT=count, INIT=init, DECAY=wd != 0,
                                             UPDATE=True, CAST=False, BLOCK=size, num_warps=warps,
                                             **_lr_args(lr_t, pi))
        _cast_alone(list(casts.values()), zeroed=True)  # weights the fused pass did not cover (or had no .grad)
        return None  # a fold left in `folds` is a parameter whose .grad was dropped since: nothing to update


def _lr_args(lr_t: torch.Tensor | None, dummy: torch.Tensor) -> dict:
    """The kernel's learning-rate arguments: the device scalar, or (None) the ``lr`` argument, as before
    `use_tensor_lr`, with `dummy` (any tensor of the launch) as the unread pointer: no launch relies on
    how a Triton version takes a None argument."""
    return {"lr_ptr": dummy if lr_t is None else lr_t, "LR_PTR": lr_t is not None}


def _launch_cast(t: WeightCastTarget, update: tuple | None, count: int = 0, init: bool = False,
                 lr_ptr: torch.Tensor | None = None) -> None:
    """One pass over `t.weight`: the update (``update``: the AdamW arguments after the weight) and the
    cast, or (``None``) the cast alone; then the cast's transpose as its own byte pass (Triton's in-kernel
    transposes of fp32-born tiles wrote wrong bytes on the H200: `fp8.fused_quantize`'s history, and
    again for this cast). `t.pending_amax` must be 0."""
    p = t.weight
    g, block, stride, m, v, b1, b2, lr, beta1, beta2, wd, eps = update or (p, p, 0, p, p, p, p, 0.0, 0.0, 0.0, 0.0, 0.0)
    n = p.numel()
    size, warps = (FOLD_BLOCK, FOLD_WARPS) if count else (BLOCK, NUM_WARPS)
    data, per = t.data.view(torch.uint8), size * CAST_ITER
    with torch.cuda.device(p.device):
        _kernel()[(-(-n // per),)](p, g, block, stride, m, v, b1, b2, n, lr, beta1, beta2, wd, eps, data, t.scale,
                                   t.scale_inv, t.pending_amax.view(torch.int32), fp8_max(torch.float8_e4m3fn),
                                   COUNT=count, INIT=init, DECAY=wd != 0, UPDATE=update is not None, CAST=True,
                                   BLOCK=size, ITER=CAST_ITER, num_warps=warps,
                                   **_lr_args(lr_ptr if update is not None else None, p))
    if t.transpose is not None:
        transpose_bytes(t.data, out=t.transpose, block=CAST_TRANSPOSE_BLOCK)
    t.mark_cast()


def _cast_alone(targets: list[WeightCastTarget], zeroed: bool = False) -> None:
    """The cast of each target as its own pass (its pending amax zeroed first unless `zeroed`)."""
    if targets and not zeroed:
        foreach_zero_([t.pending_amax for t in targets])
    for t in targets:
        _launch_cast(t, None)


def _fusable(block: torch.Tensor) -> bool:
    """The fused pass reads slots at 32-bit offsets ``j * stride`` from a contiguous-row block."""
    return block.is_cuda and block.stride(1) == 1 and block.numel() < 2**31


def _placeholder(g: torch.Tensor) -> bool:
    """Whether `g` is `TritonAdamW.fold_without_region`'s placeholder: every element the one fp32 zero (no
    gradient a backward writes has all strides 0)."""
    return g.dtype == torch.float32 and g.numel() > 1 and not any(g.stride())


def _fold_first(folds: dict[torch.Tensor, tuple[torch.Tensor, int, bool]]) -> None:
    """Finish deferred folds as their own pass, into each parameter's ``.grad`` (the unfused route)."""
    for p in folds:
        if _placeholder(p.grad):
            raise RuntimeError(f"a staged fold of a {tuple(p.shape)} parameter has no region to fold into (lazy "
                               "regions): it was handed over for the Triton pass, and this step takes torch's route")
    for p, (block, count, init) in folds.items():
        fold_staged(p.grad, block, count, init)
