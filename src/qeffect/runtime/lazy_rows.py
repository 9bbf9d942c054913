"""AdamW for the token table, exact and row-lazy: a row's update waits until something reads the row.

Why: a step touches under 2,000 of the table's 32,768 rows, yet AdamW updates every row (a zero
gradient still moves the moments and the weight), a fifth of the optimizer's memory pass at h4096
(134M of 898M parameters, about 1.1 ms of a 27.6 ms captured step on the H200).

Bits: a row untouched for k steps gets, when it is next read, those k updates one after another with
a +0.0 gradient and each step's own learning rate, decay, betas, epsilon and bias corrections, in the
arithmetic every Triton update shares (`runtime.adamw_math`): the bits the dense passes would
have left, step by step. Rows are brought up to date (`catch_up`):

- before a forward reads them: the first stage's captured `F` graphs catch up their microbatch's
  tokens before the lookup (`graphs.captured`);
- in the step: `update` runs the step on every row the step touched (`stage.embedding_grad`'s rows),
  after catching it up if it was not;
- `settle` catches up every row: before anything else reads the table or its moments (the optimizer's
  `state_dict`, verification, checkpoints, evaluation, the end of a run: `QEffectRank.settle`), and
  every `capacity - 1` steps, because the per-step scalars live in a ring of `capacity` steps.

A token repeated in a catch-up's tokens is caught up by its first position only, one program per token
and 256 columns (the catch-up is every skipped step's arithmetic: compute-bound); a row repeated in a
step's rows is updated once, by the program that swaps the step into its claim word first. `last[r]`
is the step row r is current at; `done` the steps completed. Both are device tensors: everything here
runs inside CUDA graphs.

Only where one process owns the whole gradient of the table (no data parallelism: a reduction would
bring other ranks' rows the local tokens do not name).
"""

from __future__ import annotations

import os

import torch
from torch import Tensor

from qeffect.runtime.adamw_math import adamw_math
from qeffect.triton_lazy import on_device, triton_kernel

CAPACITY = 1024  # steps of per-step scalars kept: a row may fall at most this many steps minus one behind
BLOCK = 1024  # `update`: columns per block (one program per touched row)
CATCH_UP_BLOCK, CATCH_UP_WARPS = 256, 2  # `catch_up`: one program per token and 256 columns (compute-bound:
# every skipped step's arithmetic, so as many programs as the columns allow)
MAX_TOKENS = 16384  # per `catch_up` launch: each program compares its token with the earlier ones
FIELDS = ("lr", "weight_decay", "eps", "beta1", "beta2", "bc1", "bc2_sqrt")


@triton_kernel
def _kernels(triton, tl):  # noqa: ANN001, ANN202 - builds Triton JIT functions
    _adamw_update, _adamw_step = adamw_math()
    globals()["_adamw_update"] = _adamw_update  # Triton resolves module globals (see `adamw_math`)
    globals()["_adamw_step"] = _adamw_step

    @triton.jit
    def _catch_up_cols(r, last, target, cols, p_ptr, m_ptr, v_ptr, zero_ptr, tab_ptr, cap, h):
        """Steps last+1..target of row r's columns `cols` with a +0.0 gradient, each with its own scalars."""
        mask = cols < h
        offs = r * h + cols
        p = tl.load(p_ptr + offs, mask=mask)
        m = tl.load(m_ptr + offs, mask=mask)
        v = tl.load(v_ptr + offs, mask=mask)
        g = tl.load(zero_ptr + cols, mask=mask)  # +0.0 from memory: what the dense pass reads there
        for k in range(last + 1, target + 1):
            slot = k % cap
            lr = tl.load(tab_ptr + slot)
            wd = tl.load(tab_ptr + cap + slot)
            eps = tl.load(tab_ptr + 2 * cap + slot)
            beta1 = tl.load(tab_ptr + 3 * cap + slot)
            beta2 = tl.load(tab_ptr + 4 * cap + slot)
            bc1 = tl.load(tab_ptr + 5 * cap + slot)
            bc2 = tl.load(tab_ptr + 6 * cap + slot)
            if wd != 0.0:  # the dense pass decays only with a nonzero decay (-0.0 stays -0.0 without)
                p, m, v = _adamw_step(p, g, m, v, lr, beta1, beta2, wd, eps, bc1, bc2, True)
            else:
                p, m, v = _adamw_step(p, g, m, v, lr, beta1, beta2, wd, eps, bc1, bc2, False)
        tl.store(p_ptr + offs, p, mask=mask)
        tl.store(m_ptr + offs, m, mask=mask)
        tl.store(v_ptr + offs, v, mask=mask)

    @triton.jit
    def catch_up(tok_ptr, ntok, vocab, last_ptr, done_ptr, p_ptr, m_ptr, v_ptr, zero_ptr, tab_ptr, cap, h,
                 ALL: tl.constexpr, TOK_BLOCK: tl.constexpr, BLOCK: tl.constexpr):
        """Columns ``BLOCK * program_id(1)`` on of the rows of the tokens (``ALL``: every row) up to the
        steps completed. A repeated token is caught up by its first position only; `mark` then records
        the rows current (a separate launch: every program here reads `last` first)."""
        i = tl.program_id(0)
        if ALL:
            r = i.to(tl.int64)
            go = r < vocab
        else:
            r = tl.load(tok_ptr + i)
            idx = tl.arange(0, TOK_BLOCK)
            toks = tl.load(tok_ptr + idx, mask=idx < ntok, other=-1)
            go = (tl.sum(((toks == r) & (idx < i)).to(tl.int32), axis=0) == 0) & (r < vocab)
        if go:
            target = tl.load(done_ptr)
            last = tl.load(last_ptr + r)
            if last < target:
                cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
                _catch_up_cols(r, last, target, cols, p_ptr, m_ptr, v_ptr, zero_ptr, tab_ptr, cap, h)

    @triton.jit
    def mark(tok_ptr, vocab, last_ptr, done_ptr, ALL: tl.constexpr):
        """`last` of the tokens' rows (``ALL``: every row) = the steps completed."""
        i = tl.program_id(0)
        if ALL:
            r = i.to(tl.int64)
        else:
            r = tl.load(tok_ptr + i)
        if r < vocab:
            tl.store(last_ptr + r, tl.load(done_ptr))

    @triton.jit
    def update(rows_ptr, vocab, last_ptr, claim_ptr, done_ptr, p_ptr, g_ptr, m_ptr, v_ptr, zero_ptr, tab_ptr, cap,
               h, bc1_ptr, bc2_sqrt_ptr, lr, beta1, beta2, weight_decay, eps, DECAY: tl.constexpr,
               BLOCK: tl.constexpr, lr_ptr=None, LR_PTR: tl.constexpr = False):
        """This step (done + 1) on every row in ``rows`` (each once; the vocabulary size where none), as
        the dense pass updates it; program 0 records the step's scalars. ``LR_PTR``: the learning rate is
        the fp32 at ``lr_ptr`` (`TritonAdamW.use_tensor_lr`), not ``lr``."""
        if LR_PTR:
            lr = tl.load(lr_ptr)
        i = tl.program_id(0)
        t = tl.load(done_ptr) + 1
        if i == 0:
            slot = t % cap
            tl.store(tab_ptr + slot, lr)
            tl.store(tab_ptr + cap + slot, weight_decay)
            tl.store(tab_ptr + 2 * cap + slot, eps)
            tl.store(tab_ptr + 3 * cap + slot, beta1)
            tl.store(tab_ptr + 4 * cap + slot, beta2)
            tl.store(tab_ptr + 5 * cap + slot, tl.load(bc1_ptr))
            tl.store(tab_ptr + 6 * cap + slot, tl.load(bc2_sqrt_ptr))
        r = tl.load(rows_ptr + i)
        if r < vocab:
            stamp = t.to(tl.int64)
            if tl.atomic_xchg(claim_ptr + r, stamp) != stamp:
                last = tl.load(last_ptr + r)
                for c0 in range(0, h, BLOCK):
                    cols = c0 + tl.arange(0, BLOCK)
                    if last < t - 1:  # not read since: its earlier steps first
                        _catch_up_cols(r, last, t - 1, cols, p_ptr, m_ptr, v_ptr, zero_ptr, tab_ptr, cap, h)
                    _adamw_update(p_ptr, g_ptr, g_ptr, 0, m_ptr, v_ptr, bc1_ptr, bc2_sqrt_ptr, r * h + cols, cols < h,
                                  lr, beta1, beta2, weight_decay, eps, 0, False, DECAY)  # the dense pass's update
                tl.store(last_ptr + r, t)

    globals()["_catch_up_cols"] = _catch_up_cols
    return catch_up, update, mark


def available(param: Tensor) -> bool:
    """A 2-D contiguous fp32 CUDA table (any device under Triton's interpreter), and Triton."""
    return ((param.is_cuda or os.environ.get("TRITON_INTERPRET") == "1") and param.dtype == torch.float32
            and param.dim() == 2 and param.is_contiguous() and _kernels() is not None)


def _pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


class LazyRows:
    """The row-lazy state of one table under `TritonAdamW` (see the module docstring). `rows`: the rows
    a step touches, each at least once, the vocabulary size in unused slots; read by every `update`."""

    def __init__(self, param: Tensor, exp_avg: Tensor, exp_avg_sq: Tensor, rows: Tensor, *,
                 done: int = 0, capacity: int = CAPACITY) -> None:
        if not available(param):
            raise ValueError("LazyRows needs a 2-D contiguous fp32 CUDA table and Triton")  # see `available`
        if rows.dtype != torch.int64 or not rows.is_contiguous() or rows.device != param.device:
            raise ValueError("LazyRows: rows must be a contiguous int64 tensor on the table's device")
        self.param, self.exp_avg, self.exp_avg_sq, self.rows = param, exp_avg, exp_avg_sq, rows
        self.vocab, self.hidden = param.shape
        self.capacity = capacity
        dev = param.device
        self.done = torch.full((), done, dtype=torch.int32, device=dev)
        self.last = torch.full((self.vocab,), done, dtype=torch.int32, device=dev)
        self.claim = torch.full((self.vocab,), -1, dtype=torch.int64, device=dev)  # `update`'s stamps
        self.table = torch.zeros(len(FIELDS), capacity, dtype=torch.float32, device=dev)
        self.zero = torch.zeros(self.hidden, dtype=torch.float32, device=dev)
        self.behind = 0  # steps since every row was last current (host count, `stepped`)

    def reset(self, done: int) -> None:
        """Every row current at step `done` (after the table and its moments were loaded)."""
        self.done.fill_(done)
        self.last.fill_(done)
        self.claim.fill_(-1)
        self.behind = 0

    def _launch(self, tokens: Tensor | None) -> None:
        n = self.vocab if tokens is None else tokens.numel()
        tok = self.rows if tokens is None else tokens.reshape(-1)
        catch_up, _, mark = _kernels()
        tok_block = 16 if tokens is None else max(16, _pow2(n))  # the tokens each program compares with
        with on_device(self.param.device):
            catch_up[(n, -(-self.hidden // CATCH_UP_BLOCK))](
                tok, n, self.vocab, self.last, self.done, self.param, self.exp_avg, self.exp_avg_sq, self.zero,
                self.table, self.capacity, self.hidden, ALL=tokens is None, TOK_BLOCK=tok_block,
                BLOCK=CATCH_UP_BLOCK, num_warps=CATCH_UP_WARPS)
            mark[(n,)](tok, self.vocab, self.last, self.done, ALL=tokens is None, num_warps=1)

    def catch_up(self, tokens: Tensor) -> None:
        """Bring the rows of `tokens` (int64, any shape; at most `MAX_TOKENS`) up to the steps completed."""
        if tokens.numel() > MAX_TOKENS:
            raise ValueError(f"catch_up takes at most {MAX_TOKENS} tokens per launch, got {tokens.numel()}")
        self._launch(tokens)

    def settle(self) -> None:
        """Every row up to the steps completed; nothing to launch when no step was counted since the
        last settle or reset (`stepped`): a catch-up before a forward only brings rows up to date."""
        if self.behind:
            self._launch(None)
            self.behind = 0

    def update(self, grad: Tensor, bc1: Tensor, bc2_sqrt: Tensor, *, lr: float, betas: tuple[float, float],
               weight_decay: float, eps: float, lr_ptr: Tensor | None = None) -> None:
        """This step on the rows in `rows` (their earlier steps first where they are behind), then count
        the step done. `grad`: the table's gradient (only those rows are read). `lr_ptr`: the learning
        rate as a device fp32 scalar instead of `lr` (each step's rate under one graph)."""
        extra = {"lr_ptr": self.zero if lr_ptr is None else lr_ptr, "LR_PTR": lr_ptr is not None}  # zero: unread
        with on_device(self.param.device):
            _kernels()[1][(self.rows.numel(),)](
                self.rows, self.vocab, self.last, self.claim, self.done, self.param, grad, self.exp_avg,
                self.exp_avg_sq, self.zero, self.table, self.capacity, self.hidden, bc1, bc2_sqrt, lr, betas[0],
                betas[1], weight_decay, eps, DECAY=weight_decay != 0, BLOCK=BLOCK, num_warps=4, **extra)
        self.done.add_(1)

    def stepped(self) -> None:
        """Count a step the host ran or replayed; settle when a row could otherwise fall out of the ring."""
        self.behind += 1
        if self.behind >= self.capacity - 1:
            self.settle()
