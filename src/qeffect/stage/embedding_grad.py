"""The token embedding's gradient, accumulated over the rows a step touched, with autograd's bits.

Autograd gives the [V, H] table a dense gradient per microbatch: `embedding_dense_backward` zero-fills
all V rows and adds the microbatch's output gradients into the rows of its tokens, then AccumulateGrad
copies the first microbatch's and adds each later one over all V rows. With a 32k vocabulary and 256
tokens per microbatch that is four passes over the whole table per microbatch for under 1% of its
rows (about 1 ms of a 13 ms captured h2048 step on the H200).

`TokenEmbeddingGrad` gets the same numbers from the touched rows only:

- per microbatch the tokens are renumbered, with no host synchronization, so it runs inside a CUDA
  graph, and `embedding_dense_backward` runs on the compact table. Up to `PAIRWISE_TOKENS` (3,072)
  torch's CUDA backward is one kernel that orders the additions into a row by token positions and token
  equality only, so any ids that keep equality will do: each token gets the position of its first
  occurrence (all pairs compared, then the first match: four kernels where a sort took eleven, one of
  them a 64-bit radix sort of 27 us at h4096 on the H200), on an [n, H] table. Above, torch sorts and
  sizes its grids, and picks between a two-pass and an atomic kernel, by min(n, number of rows): the
  ids are then ranks by value (a stable sort, the run starts, a cumsum) on a [min(n, V), H] table, which
  gives that choice the dense call's operands. Either way every touched row gets the bits the dense
  call gives it (the GPU and CPU tests compare them bitwise);
- the first microbatch zero-fills the accumulator and writes its rows (AccumulateGrad's copy: the other
  rows of g0 are +0.0);
- a later microbatch m adds its rows: acc[r] + G[r] for its rows, and acc[r] + 0.0 for the rows only
  earlier microbatches touched, which is what the dense add does there (-0.0 + +0.0 = +0.0; every other
  value is unchanged). New values for m's rows are computed from the accumulator BEFORE the +0.0 pass
  and written after it, so no row gets both. Rows nobody touched stay +0.0 in both. With at most
  3072 tokens per microbatch (`ZERO_FILLED_TOKENS`) torch's kernels add into a zero-filled table, so
  a row's gradient is never -0.0 (nor a NaN other than the one its adds make); no accumulated row is
  then -0.0 either, and the pass would change nothing: `accumulate` skips it (at h4096 it was seven
  gathers, adds and scatters per step over up to 1,792 rows). With more tokens torch writes sums, which
  can be -0.0: the pass runs.

Unused compact slots point at a scratch row V of the accumulator ([V + 1, H]); `.grad` is its first
V rows. Microbatches must come in order 0, 1, ... (the captured dI graphs run in microbatch order).

The first microbatch of a step clears the accumulator: the whole table (512 MB at h4096, ~0.13 ms on
the H200), or with `zero_rows_only` the rows the last step recorded, the only ones it can have written.
That holds while nothing else writes the buffer between steps; a data-parallel reduction writes rows no
local token names, so the runtime asks for it only where no reduction touches the table.
"""

from __future__ import annotations

import torch
from torch import Tensor

ZERO_FILLED_TOKENS = 3072  # up to this many indices torch's embedding backward adds into a zero-filled table


def needs_signed_zeros(tokens_per_microbatch: int) -> bool:
    """Whether a microbatch of this many tokens needs the +0.0 pass (`TokenEmbeddingGrad.signed_zeros`)."""
    return tokens_per_microbatch > ZERO_FILLED_TOKENS
PAIRWISE_TOKENS = ZERO_FILLED_TOKENS  # up to this many tokens (torch's one-kernel backward) `compact` compares
# all pairs


class TokenEmbeddingGrad:
    """Row-sparse, bitwise-equal accumulation of one token embedding's gradient over M microbatches."""

    def __init__(self, weight: Tensor, tokens_per_microbatch: int, microbatches: int, *,
                 zero_rows_only: bool = False) -> None:
        self.vocab, self.hidden = weight.shape
        self.n = tokens_per_microbatch
        self.zero_rows_only = zero_rows_only  # see the module docstring: only this writes the buffer
        self.buffer = torch.zeros((self.vocab + 1, self.hidden), dtype=weight.dtype, device=weight.device)
        self.grad = self.buffer[: self.vocab]  # what `.grad` is bound to
        # the rows each microbatch touched (each once; unused slots: the scratch row V)
        self.rows_all = torch.full((microbatches, self.n), self.vocab, dtype=torch.int64, device=weight.device)
        self._positions = torch.arange(self.n, device=weight.device)

    def compact(self, tokens: Tensor) -> tuple[Tensor, Tensor]:
        """(compact ids in the tokens' order, the row of each compact id; V where unused). Equal tokens
        get equal ids and different tokens different ones; the ids are first positions up to
        `PAIRWISE_TOKENS` tokens, ranks by value above."""
        idx = tokens.reshape(-1)
        if idx.numel() != self.n:
            raise ValueError(f"expected {self.n} tokens per microbatch, got {idx.numel()}")
        if self.n <= PAIRWISE_TOKENS:
            same = idx[:, None] == idx[None, :]
            first = same.view(torch.uint8).argmax(1)  # argmax returns the first of equal maxima
            return first, torch.where(first == self._positions, idx, self.vocab)
        values, perm = torch.sort(idx, stable=True)
        starts = torch.ones_like(values, dtype=torch.bool)
        starts[1:] = values[1:] != values[:-1]
        cid_sorted = torch.cumsum(starts, 0) - 1
        cid = torch.empty_like(idx)
        cid[perm] = cid_sorted
        rows = torch.full_like(idx, self.vocab)
        rows[cid_sorted] = values  # every duplicate writes the same value
        return cid, rows

    @property
    def signed_zeros(self) -> bool:
        """Whether `accumulate` runs the +0.0 pass over the rows of microbatches 0..m-1 (a slice that
        depends on m, so a captured dI graph then serves one microbatch only)."""
        return needs_signed_zeros(self.n)

    def accumulate(self, m: int, tokens: Tensor, grad_out: Tensor, index: Tensor | None = None) -> Tensor:
        """Add microbatch `m`'s gradient (`grad_out`: the embedding output's gradient, [..., H]) into
        the accumulator; returns `.grad`'s tensor. Inside a capture this is all device work. `index`: see
        `add_rows`."""
        cid, rows = self.compact(tokens)
        rows_out = self.n if self.n <= PAIRWISE_TOKENS else min(self.n, self.vocab)  # see the module docstring
        g = torch.ops.aten.embedding_dense_backward(grad_out.reshape(self.n, self.hidden), cid, rows_out, -1, False)
        return self.add_rows(m, rows[:rows_out], g, signed_zeros=self.signed_zeros, index=index)

    def add_rows(self, m: int, rows: Tensor, g: Tensor, *, signed_zeros: bool = True,
                 index: Tensor | None = None) -> Tensor:
        """Microbatch `m`'s dense add, on its rows (`g[k]` belongs to row `rows[k]`; unique rows, V
        where unused) and the rows earlier microbatches touched; returns `.grad`'s tensor.
        `signed_zeros=False` promises that no row of `g` is -0.0 (torch's zero-filled backward): the
        +0.0 pass over the earlier rows is then skipped. `index` (m > 0, no +0.0 pass, a full row of
        `n` rows): a 1-element int64 tensor on the device holding m, read when the work runs, so one
        captured graph records the rows of any microbatch > 0 (the same write)."""
        buf = self.buffer
        if m == 0:  # clear the last step's rows (before they are overwritten below) or the whole table
            if self.zero_rows_only:
                buf.index_fill_(0, self.rows_all.view(-1), 0.0)
            else:
                buf.zero_()
        if index is not None and m > 0:
            if signed_zeros or rows.numel() != self.n:
                raise ValueError("a device microbatch index needs a full row of rows and no +0.0 pass")
            self.rows_all.index_copy_(0, index, rows.view(1, -1))
        else:
            self.rows_all[m, : rows.numel()].copy_(rows)  # any slots after: the scratch row, as initialized
        if m == 0:
            buf.index_copy_(0, rows, g)  # only the scratch row repeats: its value does not matter
            return self.grad
        new = buf.index_select(0, rows) + g  # from the accumulator before the +0.0 pass
        if signed_zeros:
            earlier = self.rows_all[:m].reshape(-1)  # contiguous: a view
            buf.index_copy_(0, earlier, buf.index_select(0, earlier) + 0.0)  # repeats write equal values
        buf.index_copy_(0, rows, new)
        return self.grad
