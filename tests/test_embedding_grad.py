"""The token table's row-sparse gradient (stage/embedding_grad.py) against autograd's dense one, bitwise."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from qeffect.config import load_config
from qeffect.runtime.build import build_chunks_for
from qeffect.stage.actions import EXTRA, input_grad_body
from qeffect.stage.embedding_grad import TokenEmbeddingGrad
from qeffect.verify.state import bitwise_equal

DEVICES = ["cpu", pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                                                  reason="needs CUDA")])]


def dense_reference(weight: torch.Tensor, tokens: list[torch.Tensor], grads: list[torch.Tensor]) -> torch.Tensor:
    """What autograd leaves in `.grad`: one embedding backward per microbatch, AccumulateGrad over them."""
    w = weight.detach().clone().requires_grad_(True)
    for t, g in zip(tokens, grads, strict=True):
        torch.nn.functional.embedding(t, w).backward(g)
    return w.grad


def sparse(weight: torch.Tensor, tokens: list[torch.Tensor], grads: list[torch.Tensor]) -> torch.Tensor:
    acc = TokenEmbeddingGrad(weight, tokens[0].numel(), len(tokens))
    acc.buffer.fill_(7.0)  # leftovers of an earlier step: microbatch 0 must clear them
    for m, (t, g) in enumerate(zip(tokens, grads, strict=True)):
        out = acc.accumulate(m, t, g)
    assert out.data_ptr() == acc.buffer.data_ptr() and out.shape == weight.shape
    return out


def random_case(device: str, seed: int, vocab: int, microbatches: int, tokens: int) -> tuple:
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(vocab, 8, generator=g).to(device)
    toks = [torch.randint(0, vocab, (1, tokens), generator=g).to(device) for _ in range(microbatches)]
    grads = [torch.randn(1, tokens, 8, generator=g).to(device) for _ in range(microbatches)]
    return weight, toks, grads


@pytest.mark.parametrize("pairwise", [True, False], ids=["pairwise", "sorted"])
@pytest.mark.parametrize("device", DEVICES)
@settings(max_examples=30, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), vocab=st.integers(1, 40), microbatches=st.integers(1, 4),
       tokens=st.integers(1, 24))
def test_sparse_accumulation_has_the_dense_bits(device: str, pairwise: bool, seed: int, vocab: int,
                                                microbatches: int, tokens: int) -> None:
    from qeffect.stage import embedding_grad

    weight, toks, grads = random_case(device, seed, vocab, microbatches, tokens)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(embedding_grad, "PAIRWISE_TOKENS", tokens if pairwise else tokens - 1)
        got = sparse(weight, toks, grads)
    assert bitwise_equal(got, dense_reference(weight, toks, grads))


@pytest.mark.parametrize("tokens,vocab", [(256, 50), (3072, 600), (3073, 8192), (5000, 8192), (3073, 1000)])
@pytest.mark.parametrize("device", DEVICES)
def test_many_tokens_have_the_dense_bits(device: str, tokens: int, vocab: int) -> None:
    """Microbatches of many chunks of 32 positions (the one-kernel CUDA backward's unit of ordering),
    tokens repeated across and within chunks, on both sides of `PAIRWISE_TOKENS` (3,072: pairwise ids;
    above: sorted ids, where torch's CUDA backward sizes its grids by min(tokens, rows): a vocabulary
    larger and smaller than the microbatch). The vocabularies keep torch's two-pass kernel: with few
    distinct rows and many tokens it adds with float atomics, which the dense call does too and which
    are not repeatable."""
    weight, toks, grads = random_case(device, tokens, vocab, 3, tokens)
    assert bitwise_equal(sparse(weight, toks, grads), dense_reference(weight, toks, grads))


@pytest.mark.parametrize("device", DEVICES)
def test_both_renumberings_group_the_same_tokens(device: str) -> None:
    """`compact`'s ids: equal tokens share one, different tokens do not, and each id's row is its
    token (V on unused ids), whichever form runs; the pairwise ids are first positions."""
    from qeffect.stage import embedding_grad

    tokens = torch.tensor([5, 3, 5, 9, 3, 3, 0, 5], device=device)
    acc = TokenEmbeddingGrad(torch.zeros(10, 2, device=device), tokens.numel(), 1)
    for limit in (tokens.numel(), 0):
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(embedding_grad, "PAIRWISE_TOKENS", limit)
            cid, rows = acc.compact(tokens)
        assert torch.equal(cid[:, None] == cid[None, :], tokens[:, None] == tokens[None, :])
        assert torch.equal(rows[cid], tokens)
        unused = torch.ones(tokens.numel(), dtype=torch.bool, device=device)
        unused[cid] = False
        assert (rows[unused] == 10).all()
        if limit:
            assert cid.tolist() == [0, 1, 0, 3, 1, 1, 6, 0]


@pytest.mark.parametrize("device", DEVICES)
def test_signed_zeros_follow_the_dense_add(device: str) -> None:
    """`add_rows` against the dense copy-then-add: -0.0 from microbatch 0 in a row microbatch 1 does not
    touch becomes +0.0 (-0.0 + +0.0); in a row microbatch 1 touches with -0.0 it stays -0.0
    (-0.0 + -0.0), so the +0.0 pass must skip that row; untouched rows stay +0.0."""
    vocab, h = 6, 4
    acc = TokenEmbeddingGrad(torch.zeros(vocab, h, device=device), 3, 2)
    acc.buffer.fill_(-0.0)
    rows0 = torch.tensor([1, 2, vocab], device=device)
    rows1 = torch.tensor([2, 3, vocab], device=device)
    g0 = torch.full((3, h), -0.0, device=device)
    g1 = torch.full((3, h), -0.0, device=device)
    g1[1] = 0.5
    dense = []
    for rows, g in ((rows0, g0), (rows1, g1)):
        d = torch.zeros(vocab + 1, h, device=device)
        d[rows] = g
        dense.append(d[:vocab])
    want = dense[0].clone() + dense[1]
    acc.add_rows(0, rows0, g0)
    got = acc.add_rows(1, rows1, g1)
    assert not torch.signbit(want[1]).any() and torch.signbit(want[2]).all()  # the case is real
    assert bitwise_equal(got, want)


@pytest.mark.parametrize("device", DEVICES)
def test_upstream_negative_zeros_give_the_dense_bits(device: str) -> None:
    weight = torch.zeros(6, 4, device=device)
    toks = [torch.tensor([[1, 2, 2]], device=device), torch.tensor([[2, 3, 3]], device=device)]
    grads = [torch.full((1, 3, 4), -0.0, device=device), torch.full((1, 3, 4), -0.0, device=device)]
    assert bitwise_equal(sparse(weight, toks, grads), dense_reference(weight, toks, grads))


def test_microbatch_size_is_checked() -> None:
    acc = TokenEmbeddingGrad(torch.zeros(5, 2), 4, 2)
    with pytest.raises(ValueError, match="expected 4 tokens"):
        acc.accumulate(0, torch.zeros(3, dtype=torch.int64), torch.zeros(3, 2))


def test_first_chunk_with_sparse_token_grad_matches_autograd() -> None:
    """The first stage's chunk with `sparse_token_grad`: the same output bits, and the token table's
    gradient over 3 microbatches (dI's `extra` gradient into the accumulator) equal to autograd's."""
    cfg = load_config().with_overrides(**{"model.vocab_size": 64, "pipeline.microbatches": 3})
    dense, sparse_chunk = build_chunks_for(cfg, "cpu")[0], build_chunks_for(cfg, "cpu")[0]
    sparse_chunk.sparse_token_grad = True
    mb, t = cfg.model.microbatch_size, cfg.model.seq_len
    acc = TokenEmbeddingGrad(sparse_chunk.tok_emb.weight, mb * t, 3)
    g = torch.Generator().manual_seed(3)
    ref = got = None
    for m in range(3):
        x = torch.randint(0, 64, (mb, t), generator=g)
        out_d = dense(x, is_first_microbatch=m == 0)
        out_s = sparse_chunk(x, is_first_microbatch=m == 0)
        assert bitwise_equal(out_d, out_s)
        gout = torch.randn(out_d.shape, generator=g).to(out_d.dtype)
        _, gd = input_grad_body(dense, x, out_d, gout, retain_graph=False)
        _, gs = input_grad_body(sparse_chunk, x, out_s, gout, retain_graph=False, extra=sparse_chunk.token_out)
        assert "tok_emb.weight" in gd and "tok_emb.weight" not in gs and EXTRA in gs
        for n in gs.keys() - {EXTRA}:
            assert bitwise_equal(gd[n], gs[n]), n
        ref = gd["tok_emb.weight"] if ref is None else ref + gd["tok_emb.weight"]
        with torch.no_grad():
            got = acc.accumulate(m, x, gs[EXTRA])
    assert bitwise_equal(got, ref)


def test_accumulate_skips_the_zero_pass_only_where_torch_adds_into_zeros(monkeypatch) -> None:
    """Up to `ZERO_FILLED_TOKENS` indices torch's backward adds into a zero-filled table (no -0.0 rows):
    `accumulate` promises that to `add_rows`, which then skips the +0.0 pass; above, the pass runs."""
    from qeffect.stage import embedding_grad

    seen = []
    real = TokenEmbeddingGrad.add_rows
    monkeypatch.setattr(TokenEmbeddingGrad, "add_rows",
                        lambda self, m, rows, g, **kw: seen.append(kw["signed_zeros"]) or real(self, m, rows, g, **kw))
    limit = embedding_grad.ZERO_FILLED_TOKENS
    for n in (limit, limit + 1):
        acc = TokenEmbeddingGrad(torch.zeros(5, 2), n, 2)
        for m in range(2):
            acc.accumulate(m, torch.randint(0, 5, (n,)), torch.randn(n, 2))
    assert seen == [False, False, True, True]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tokens", [24, 3073], ids=["pairwise", "sorted"])
def test_clearing_only_the_last_steps_rows_keeps_the_dense_bits_step_after_step(device: str, tokens: int) -> None:
    """`zero_rows_only`: each step's first microbatch clears only the rows the last step recorded, the
    only ones it wrote; step after step the gradient is still autograd's, every other row +0.0. With a
    leftover the accumulator did not write (what a reduction would leave), the rows-only clear keeps it,
    which is why the runtime asks for it only where nothing else writes the table."""
    vocab, steps, microbatches = 4096 if tokens > 3072 else 40, 3, 3
    acc = full = None
    for step in range(steps):
        weight, toks, grads = random_case(device, 100 + step, vocab, microbatches, tokens)
        if acc is None:
            acc = TokenEmbeddingGrad(weight, tokens, microbatches, zero_rows_only=True)
            full = TokenEmbeddingGrad(weight, tokens, microbatches)
        for m, (t, g) in enumerate(zip(toks, grads, strict=True)):
            got, whole = acc.accumulate(m, t, g), full.accumulate(m, t, g)
        ref = dense_reference(weight, toks, grads)
        assert bitwise_equal(got, ref) and bitwise_equal(whole, ref)
        untouched = torch.ones(vocab, dtype=torch.bool, device=device)
        untouched[torch.cat([t.reshape(-1) for t in toks])] = False
        assert not got[untouched].any() and not got[untouched].signbit().any()  # +0.0 beyond this step's rows
    untouched[toks[0].reshape(-1)] = False
    row = int(untouched.nonzero()[0])  # not recorded last step, not written by the next microbatch
    acc.buffer[row].fill_(7.0)  # written from outside
    acc.accumulate(0, toks[0], grads[0])
    assert (acc.buffer[row] == 7.0).all()
