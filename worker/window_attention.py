"""Sliding-window causal attention over the paged KV pool: the query at position p reads the keys at
positions p - window + 1 .. p (transformers' ``kv_idx > q_idx - sliding_window``).

The same arguments as :func:`kernels.paged_attention.paged_attention_torch` plus the window. Only the
slots a row's window covers are gathered: a decode row reads at most ``window`` keys however long its
context. Plain torch ops, so every device runs it.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def _window_slots(block_tables: torch.Tensor, lo: torch.Tensor, n: torch.Tensor, width: int,
                  block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Slots [R, width] of positions lo[r] .. lo[r] + n[r] - 1 of each row (slot 0 past n[r]), and the
    validity mask [R, width]."""
    j = torch.arange(width, device=block_tables.device)
    pos = lo.unsqueeze(1) + j
    valid = j.unsqueeze(0) < n.unsqueeze(1)
    blk = torch.div(pos, block_size, rounding_mode="floor").clamp(max=block_tables.shape[1] - 1)
    slots = block_tables.gather(1, blk) * block_size + pos % block_size
    return torch.where(valid, slots, torch.zeros_like(slots)), valid


def paged_window_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, q_start_loc: torch.Tensor, ctx_lens: torch.Tensor,
                           scale: float, window: int, q_lens_host: list[int], ctx_lens_host: list[int],
                           memo: dict | None = None) -> torch.Tensor:
    """q: [T, Hq, D]; k_cache/v_cache: [num_blocks, block_size, Hkv, D]; returns [T, Hq, D]. Rows of one
    query attend together (one padded gather, kept in ``memo``, the step's segment memo, for the
    segment's other layers of this window); a row of several queries attends alone."""
    T, hq, d = q.shape
    nb, bs, hkv, _ = k_cache.shape
    kv = (k_cache.view(nb * bs, hkv, d), v_cache.view(nb * bs, hkv, d), bs)
    R = len(q_lens_host)
    if T == R:  # all decode rows: row r is token r
        return _decode_rows(q, kv, block_tables, ctx_lens, list(range(R)), ctx_lens_host, scale, window, memo)
    starts = [0]
    for n in q_lens_host:
        starts.append(starts[-1] + n)
    out = torch.empty_like(q)
    single = [r for r in range(R) if q_lens_host[r] == 1]
    if single:
        tok = torch.tensor([starts[r] for r in single], dtype=torch.long, device=q.device)
        o = _decode_rows(q.index_select(0, tok), kv, block_tables, ctx_lens, single, ctx_lens_host, scale,
                         window, memo)
        out.index_copy_(0, tok, o)
    for r in range(R):  # a row with several queries: its keys from its first query's window on
        if q_lens_host[r] > 1:
            _several(q, out, kv, block_tables[r:r + 1], starts[r], q_lens_host[r], ctx_lens_host[r], scale, window)
    return out


def _decode_rows(q, kv, block_tables, ctx_lens, rows: list[int], ctx_host: list[int], scale: float, window: int,
                 memo: dict | None) -> torch.Tensor:
    """One query per row (q [len(rows), Hq, D]), each reading its last min(ctx, window) keys."""
    kf, vf, bs = kv
    key = ("window", window)
    ent = memo.get(key) if memo is not None else None
    if ent is None:
        idx = torch.tensor(rows, dtype=torch.long, device=block_tables.device)
        lens = ctx_lens.index_select(0, idx)
        n = lens.clamp(max=window)
        width = min(max(ctx_host[r] for r in rows), window)
        slots, valid = _window_slots(block_tables.index_select(0, idx), lens - n, n, width, bs)
        ent = (slots.reshape(-1), valid[:, None, None, :], width, tuple(rows))
        if memo is not None:
            memo[key] = ent
    flat, mask, width, for_rows = ent
    assert for_rows == tuple(rows), "a window memo is for one segment of one step"
    B, hkv, d = len(rows), kf.shape[1], kf.shape[2]
    k = kf.index_select(0, flat).view(B, width, hkv, d).transpose(1, 2)
    v = vf.index_select(0, flat).view(B, width, hkv, d).transpose(1, 2)
    o = F.scaled_dot_product_attention(q.unsqueeze(2), k.to(q.dtype), v.to(q.dtype), attn_mask=mask,
                                       scale=scale, enable_gqa=q.shape[1] != hkv)
    return o[:, :, 0]


def _several(q, out, kv, table, start: int, n: int, L: int, scale: float, window: int) -> None:
    """A row's n queries (the last n of its L positions) over the keys their windows cover."""
    kf, vf, bs = kv
    lo = max(0, L - n - window + 1)
    dev = q.device
    slots, _ = _window_slots(table, torch.tensor([lo], device=dev), torch.tensor([L - lo], device=dev), L - lo, bs)
    k = kf.index_select(0, slots[0]).transpose(0, 1).unsqueeze(0)  # [1, Hkv, L - lo, D]
    v = vf.index_select(0, slots[0]).transpose(0, 1).unsqueeze(0)
    qpos = torch.arange(L - n, L, device=dev).unsqueeze(1)
    kpos = torch.arange(lo, L, device=dev).unsqueeze(0)
    mask = (kpos <= qpos) & (kpos > qpos - window)
    qq = q[start:start + n].transpose(0, 1).unsqueeze(0)  # [1, Hq, n, D]
    o = F.scaled_dot_product_attention(qq, k.to(q.dtype), v.to(q.dtype), attn_mask=mask, scale=scale,
                                       enable_gqa=q.shape[1] != k.shape[1])
    out[start:start + n] = o[0].transpose(0, 1)
