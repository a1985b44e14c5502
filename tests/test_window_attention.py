"""Sliding-window attention over the paged pool (worker/window_attention.py) against dense float64
attention with the window's mask, over scattered blocks and mixed rows."""
import pytest
import torch

from worker.window_attention import paged_window_attention


def reference(q, k_ctx, v_ctx, n: int, window: int, scale: float) -> torch.Tensor:
    """n queries (the last n of the L positions of k_ctx [L, Hkv, D]) of one row, in float64."""
    L, g = k_ctx.shape[0], q.shape[1] // k_ctx.shape[1]
    k, v = k_ctx.double().repeat_interleave(g, 1), v_ctx.double().repeat_interleave(g, 1)
    qpos = torch.arange(L - n, L)[:, None]
    kpos = torch.arange(L)[None, :]
    allowed = (kpos <= qpos) & (kpos > qpos - window)
    w = torch.einsum("nhd,lhd->hnl", q.double(), k) * scale
    w = w.masked_fill(~allowed, float("-inf")).softmax(-1)
    return torch.einsum("hnl,lhd->nhd", w, v)


@pytest.mark.parametrize("rows", [
    [(1, 30), (1, 3), (1, 9)],           # decode rows only, contexts past and inside the window
    [(1, 30), (12, 20), (3, 25), (1, 2)],  # decode rows beside a prefill chunk and a few queries
    [(17, 17)],                          # a whole prompt longer than the window
])
def test_window_attention_equals_the_masked_dense_one(rows):
    torch.manual_seed(0)
    bs, nb, hq, hkv, d, window, scale = 4, 40, 4, 2, 8, 7, 0.3
    k_cache, v_cache = torch.randn(nb, bs, hkv, d), torch.randn(nb, bs, hkv, d)
    free = torch.randperm(nb).tolist()  # each row's blocks scattered over the pool
    width = max(-(-L // bs) for _, L in rows)
    tables = [[free.pop() for _ in range(-(-L // bs))] for _, L in rows]
    tables = torch.tensor([t + [0] * (width - len(t)) for t in tables])
    q = torch.randn(sum(n for n, _ in rows), hq, d)
    starts = torch.tensor([0] + [n for n, _ in rows]).cumsum(0)
    memo: dict = {}
    for _ in range(2):  # the second call reads the decode rows' gather from the memo
        out = paged_window_attention(q, k_cache, v_cache, tables, starts, torch.tensor([L for _, L in rows]), scale,
                                     window, [n for n, _ in rows], [L for _, L in rows], memo)
        for r, (n, L) in enumerate(rows):
            slots = [tables[r, p // bs].item() * bs + p % bs for p in range(L)]
            k_ctx = k_cache.view(-1, hkv, d)[slots]
            v_ctx = v_cache.view(-1, hkv, d)[slots]
            ref = reference(q[starts[r]:starts[r] + n], k_ctx, v_ctx, n, window, scale)
            torch.testing.assert_close(out[starts[r]:starts[r] + n].double(), ref, rtol=1e-5, atol=1e-5)


def test_blocks_before_every_window_are_never_read():
    """Tables whose entries before each row's window are RELEASED (-1, which no gather can read) give
    the same output, bit for bit, as the full tables: decode rows and rows of several queries."""
    from scheduler.window import RELEASED
    torch.manual_seed(1)
    bs, nb, hq, hkv, d, window, scale = 4, 40, 4, 2, 8, 7, 0.3
    rows = [(1, 30), (5, 37), (1, 11), (1, 8)]
    k_cache, v_cache = torch.randn(nb, bs, hkv, d), torch.randn(nb, bs, hkv, d)
    free = torch.randperm(nb).tolist()
    width = max(-(-L // bs) for _, L in rows)
    full = [[free.pop() for _ in range(-(-L // bs))] for _, L in rows]
    # a row's first query reads from position L - n - window + 1 on: every block wholly before it goes
    cut = [[RELEASED if (i + 1) * bs <= L - n - window + 1 else b for i, b in enumerate(t)]
           for t, (n, L) in zip(full, rows)]
    assert sum(t.count(RELEASED) for t in cut) >= 8
    q = torch.randn(sum(n for n, _ in rows), hq, d)
    starts = torch.tensor([0] + [n for n, _ in rows]).cumsum(0)
    outs = [paged_window_attention(q, k_cache, v_cache, torch.tensor([t + [0] * (width - len(t)) for t in ts]),
                                   starts, torch.tensor([L for _, L in rows]), scale, window,
                                   [n for n, _ in rows], [L for _, L in rows], {}) for ts in (full, cut)]
    assert torch.equal(outs[0], outs[1])
    with pytest.raises((IndexError, RuntimeError)):  # a released entry inside a window fails loudly
        early = [[RELEASED] * len(t) for t in full]
        paged_window_attention(q, k_cache, v_cache, torch.tensor([t + [0] * (width - len(t)) for t in early]),
                               starts, torch.tensor([L for _, L in rows]), scale, window,
                               [n for n, _ in rows], [L for _, L in rows], {})
