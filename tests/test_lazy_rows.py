"""The token table's row-lazy AdamW (runtime/lazy_rows.py) against the dense update, bitwise.

On CPU the kernels run under Triton's interpreter (Triton 3.9 or later: its loops take runtime bounds);
on the GPU the whole optimizer is compared with torch's fused AdamW, which native eager keeps.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from qeffect.runtime.adamw import TritonAdamW

HYPER = dict(lr=3e-4, betas=(0.9, 0.95), eps=1e-8)

INTERPRETED = textwrap.dedent("""
    import os
    os.environ["TRITON_INTERPRET"] = "1"
    import torch
    from qeffect.runtime import adamw, lazy_rows
    V, H = 12, lazy_rows.BLOCK + 5
    # scalars exact in fp32: the interpreter multiplies a kernel's float arguments in double precision
    # (the GPU in single), the catch-up its fp32 table of them
    b1, b2, eps = 0.875, 0.9375, 2.0**-27
    for wd in (0.0, 0.125):
        torch.manual_seed(0)
        p0 = torch.randn(V, H) * 0.02
        dense = [p0.clone(), torch.zeros(V, H), torch.zeros(V, H)]
        p, m, v = p0.clone(), torch.zeros(V, H), torch.zeros(V, H)
        rows = torch.full((6,), V, dtype=torch.int64)
        lazy = lazy_rows.LazyRows(p, m, v, rows, capacity=4)
        step = torch.zeros(())
        touched_each = [[1, 1, 3], [3, 5], [0, 11, 11], [2], [5, 7, 1], [], [9, 3], [10, 4, 4]]
        for k, touched in enumerate(touched_each, 1):
            lr = 2.0**-12 * (1 + k / 8)  # a schedule: each step's own learning rate
            tokens = torch.tensor(touched, dtype=torch.int64)
            if touched:  # before the forward reads them: the rows as the dense run left them
                lazy.catch_up(tokens)
                assert all(torch.equal(a[tokens], b[tokens]) for a, b in zip((p, m, v), dense)), (wd, k)
            g = torch.zeros(V, H)
            for r in touched:
                g[r] += torch.randn(H) * 1e-3
            step += 1
            bc1, bc2 = adamw.bias_corrections([step], b1, b2)
            adamw._kernel()[(-(-V * H // adamw.BLOCK),)](dense[0], g, g, 0, dense[1], dense[2], bc1[0], bc2[0], V * H,
                                                        lr, b1, b2, wd, eps, g, g, g, g, 0.0, COUNT=0, INIT=False,
                                                        DECAY=wd != 0, UPDATE=True, CAST=False, BLOCK=adamw.BLOCK)
            rows.fill_(V)
            rows[: len(touched)] = tokens
            lazy.update(g, bc1[0], bc2[0], lr=lr, betas=(b1, b2), weight_decay=wd, eps=eps)
            lazy.stepped()  # capacity 4: settles every third step
        assert not torch.equal(p, dense[0])  # rows behind: the case is real
        lazy.settle()
        for a, b in zip((p, m, v), dense):
            assert torch.equal(a, b), wd
        assert int(lazy.done) == len(touched_each) and bool((lazy.last == lazy.done).all())
    # the optimizer's side: state created at registration, kept across load_state_dict, rows current
    from qeffect.runtime.adamw import TritonAdamW
    table = torch.nn.Parameter(torch.zeros(V, 8))
    opt = TritonAdamW([table], lr=1e-3)
    lz = opt.lazy_rows(table, torch.full((4,), V, dtype=torch.int64))
    assert opt.state[table]["exp_avg"] is lz.exp_avg and int(lz.done) == 0
    sd = opt.state_dict()
    sd["state"][0] = {"step": torch.tensor(5.0), "exp_avg": torch.full((V, 8), 2.0),
                      "exp_avg_sq": torch.full((V, 8), 3.0)}
    opt.load_state_dict(sd)
    st = opt.state[table]
    assert st["exp_avg"] is lz.exp_avg and st["exp_avg_sq"] is lz.exp_avg_sq and bool((lz.exp_avg == 2).all())
    assert int(lz.done) == 5 and bool((lz.last == 5).all())
    sd["state"] = {}
    opt.load_state_dict(sd)  # saved before any step: fresh state, in the same tensors
    st = opt.state[table]
    assert st["exp_avg"] is lz.exp_avg and bool((lz.exp_avg == 0).all()) and int(lz.done) == 0
    print("ok")
""")


def test_lazy_rows_give_the_dense_bits_under_the_interpreter():
    """Rows caught up before a forward, updated in their step, settled at the end and by the ring's
    capacity: the dense pass's bits each time (a repeated token, an empty step, decay on and off)."""
    triton = pytest.importorskip("triton")
    if tuple(int(x) for x in triton.__version__.split(".")[:2]) < (3, 9):
        pytest.skip("the interpreter takes runtime loop bounds from Triton 3.9")
    out = subprocess.run([sys.executable, "-c", INTERPRETED], capture_output=True, text=True, timeout=900)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


def test_lazy_rows_refuse_what_the_pass_does_not_cover():
    table = torch.nn.Parameter(torch.zeros(4, 8))
    opt = TritonAdamW([table], **HYPER)
    with pytest.raises(ValueError, match="does not cover"):  # a CPU table
        opt.lazy_rows(table, torch.zeros(3, dtype=torch.int64))
    with pytest.raises(ValueError, match="not in this optimizer"):
        opt.lazy_rows(torch.nn.Parameter(torch.zeros(4, 8)), torch.zeros(3, dtype=torch.int64))


def _steps(opt_lazy: bool, wd: float, graph: bool = False, seed: int = 0):
    """8 steps of a [V, H] table and a dense matrix, 2 "microbatches" of tokens per step from a small
    part of the vocabulary (rows untouched for several steps), lr changing every step (not with `graph`:
    the optimizer's graph replays only the same work, hyper-parameters included)."""
    V, H, n, mbs = 300, 1536, 24, 2
    gen = torch.Generator(device="cuda").manual_seed(seed)
    table = torch.nn.Parameter(torch.randn(V, H, device="cuda", generator=gen) * 0.02)
    other = torch.nn.Parameter(torch.randn(64, 32, device="cuda", generator=gen) * 0.02)
    if opt_lazy:
        opt = TritonAdamW([table, other], weight_decay=wd, **HYPER)
        rows = torch.full((mbs * n,), V, dtype=torch.int64, device="cuda")
        lazy = opt.lazy_rows(table, rows)
        opt.use_graph(graph)
    else:
        opt = torch.optim.AdamW([table, other], weight_decay=wd, fused=True, **HYPER)
    reads = []
    g = torch.zeros(V + 1, H, device="cuda")  # the scratch row V, as TokenEmbeddingGrad's buffer
    g_other = torch.zeros_like(other)  # fixed gradient buffers, as the pipeline's: the graph's key holds them
    for k in range(8):
        toks = torch.randint(0, 40 + 30 * k, (mbs, n), device="cuda", generator=gen)
        if opt_lazy:
            for m in range(mbs):
                lazy.catch_up(toks[m])
            rows.copy_(toks.reshape(-1))
        reads.append(table.detach()[toks.reshape(-1)].clone())  # what a forward reads
        g.zero_()
        touched = toks.unique()  # one value per row (index_add_ with repeats adds in no fixed order)
        g[touched] = torch.randn(touched.numel(), H, device="cuda", generator=gen) * 1e-3
        table.grad = g[:V]
        g_other.copy_(torch.randn(other.shape, device="cuda", generator=gen) * 1e-3)
        other.grad = g_other
        for group in opt.param_groups:
            group["lr"] = 3e-4 * (1 + (0 if graph else 0.05 * k))
        opt.step()
    return table, other, opt, reads


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("graph", [False, True], ids=["eager", "graphed"])
@pytest.mark.parametrize("wd", [0.0, 0.1])
def test_lazy_table_is_bitwise_torch_fused_on_cuda(wd, graph):
    """Every row a forward reads, and after `state_dict` (which settles) the table, its moments and the
    other parameters: torch's fused AdamW's bits; the optimizer's own graph replays the lazy step too."""
    from qeffect.runtime import lazy_rows

    if lazy_rows._kernels() is None:
        pytest.skip("needs Triton")
    t_ref, o_ref, ref, reads_ref = _steps(False, wd, graph=graph)
    t_got, o_got, got, reads_got = _steps(True, wd, graph=graph)
    for k, (a, b) in enumerate(zip(reads_got, reads_ref, strict=True)):
        assert torch.equal(a, b), f"rows read at step {k + 1}"
    assert not torch.equal(t_got, t_ref)  # some rows behind before settling: the case is real
    sd_got, sd_ref = got.state_dict(), ref.state_dict()
    assert torch.equal(t_got, t_ref) and torch.equal(o_got, o_ref)
    for i in (0, 1):
        for key in ("step", "exp_avg", "exp_avg_sq"):
            assert torch.equal(sd_got["state"][i][key], sd_ref["state"][i][key]), (i, key)
    if graph:
        assert got.graph_replays >= 5


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_loading_state_keeps_the_lazy_tensors_and_makes_every_row_current():
    from qeffect.runtime import lazy_rows

    if lazy_rows._kernels() is None:
        pytest.skip("needs Triton")
    table, _, opt, _ = _steps(True, 0.1)
    lazy = opt._lazy[table]
    saved = {k: v for k, v in opt.state_dict().items()}
    m_ptr = lazy.exp_avg.data_ptr()
    opt.load_state_dict(saved)
    assert opt.state[table]["exp_avg"].data_ptr() == m_ptr
    assert int(lazy.done) == 8 and bool((lazy.last == 8).all())
