"""Causal attention over a paged KV pool, for a flattened variable-length batch.

One call serves every row of a step in one segment layer: decode rows (one query), speculative
verification rows (a few queries) and prefill chunks (many queries that also read earlier chunks from
the pool). Row r owns queries ``q[q_start_loc[r]:q_start_loc[r+1]]``; its context (earlier tokens plus
this step's, already written to the pool) has ``ctx_lens[r]`` tokens found through
``block_tables[r]``; its last query sits at position ``ctx_lens[r] - 1``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

# Rows whose query count is at most this are attended together through one padded gather.
SMALL_Q = 8


def gather_index(block_tables: torch.Tensor, lengths: torch.Tensor, block_size: int,
                  max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Slots [R, max_len] of each row's first max_len tokens (slot 0 past a row's length), and the
    validity mask [R, max_len]. Plain torch ops: the compiled decode graph traces it too
    (worker/compiled_step.py: decode_slots)."""
    pos = torch.arange(max_len, device=block_tables.device)
    blk = torch.div(pos, block_size, rounding_mode="floor")
    blk = blk.clamp(max=block_tables.shape[1] - 1)
    slots = block_tables[:, blk] * block_size + (pos % block_size)
    valid = pos.unsqueeze(0) < lengths.unsqueeze(1)
    slots = torch.where(valid, slots, torch.zeros_like(slots))
    return slots, valid


def paged_attention_torch(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                          block_tables: torch.Tensor, q_start_loc: torch.Tensor,
                          ctx_lens: torch.Tensor, scale: float,
                          q_lens_host: list[int] | None = None,
                          ctx_lens_host: list[int] | None = None, memo: dict | None = None) -> torch.Tensor:
    """q: [T, Hq, D]; k_cache/v_cache: [num_blocks, block_size, Hkv, D];
    block_tables: [R, max_blocks] int; q_start_loc: [R+1] int; ctx_lens: [R] int.
    Returns [T, Hq, D]. ``*_host`` are the same lengths as Python lists (saves device syncs).
    ``memo``: a dict that lives for one step of one segment (its layers share block tables and lengths):
    the decode path's gather indices are computed by its first layer and reused by the others."""
    T, hq, d = q.shape
    nb, bs, hkv, _ = k_cache.shape
    assert hq % hkv == 0, "query heads must be a multiple of KV heads"
    R = block_tables.shape[0]
    assert q_start_loc.shape == (R + 1,) and ctx_lens.shape == (R,)
    if q_lens_host is None:
        q_lens_host = (q_start_loc[1:] - q_start_loc[:-1]).tolist()
    if ctx_lens_host is None:
        ctx_lens_host = ctx_lens.tolist()
    kv = (k_cache.view(nb * bs, hkv, d), v_cache.view(nb * bs, hkv, d), bs)
    if T == R and max(q_lens_host, default=0) == 1:  # all decode rows: row r is token r
        return _attend_decode(q, None, kv, block_tables, ctx_lens, list(range(R)), list(range(R)),
                              ctx_lens_host, scale, memo)
    starts = [0]
    for n in q_lens_host:
        starts.append(starts[-1] + n)
    out = torch.empty_like(q)
    small = [r for r in range(R) if q_lens_host[r] <= SMALL_Q]
    if small and max(q_lens_host[r] for r in small) == 1:
        _attend_decode(q, out, kv, block_tables, ctx_lens, small, starts, ctx_lens_host, scale, memo)
    elif small:
        _attend_small(q, out, kv, block_tables, ctx_lens, small, starts, q_lens_host, ctx_lens_host, scale)
    for r in range(R):
        if q_lens_host[r] > SMALL_Q:
            _attend_row(q, out, kv, block_tables, ctx_lens, r, starts, q_lens_host, ctx_lens_host, scale)
    return out


def _gather(kv, block_tables, ctx_lens, rows: list[int], lmax: int):
    """K, V [B, Hkv, lmax, D] of the given rows (zero-padded past each length) and the mask."""
    kflat, vflat, bs = kv
    idx = torch.tensor(rows, dtype=torch.long, device=block_tables.device)
    lens = ctx_lens.index_select(0, idx)
    slots, valid = gather_index(block_tables.index_select(0, idx), lens, bs, lmax)
    B, hkv, d = len(rows), kflat.shape[1], kflat.shape[2]
    k = kflat.index_select(0, slots.reshape(-1)).view(B, lmax, hkv, d).transpose(1, 2)
    v = vflat.index_select(0, slots.reshape(-1)).view(B, lmax, hkv, d).transpose(1, 2)
    return k, v, valid, lens


def decode_gather(block_tables, ctx_lens, rows: list[int], starts: list[int], ctx_host: list[int],
                  block_size: int, memo: dict | None = None) -> tuple:
    """(flat slots [B * lmax], mask [B, 1, 1, lmax], query token index [B], lmax, rows) of decode
    rows: computed by a segment's first layer, kept in ``memo`` for the others."""
    ent = memo.get("decode") if memo is not None else None
    if ent is None:
        lmax = max(ctx_host[r] for r in rows)
        idx = torch.tensor(rows, dtype=torch.long, device=block_tables.device)
        slots, valid = gather_index(block_tables.index_select(0, idx), ctx_lens.index_select(0, idx),
                                     block_size, lmax)
        tok = torch.tensor([starts[r] for r in rows], dtype=torch.long, device=block_tables.device)
        ent = (slots.reshape(-1), valid[:, None, None, :], tok, lmax, tuple(rows))
        if memo is not None:
            memo["decode"] = ent
    assert ent[4] == tuple(rows), "a decode memo is for one segment of one step"
    return ent


def _attend_decode(q, out, kv, block_tables, ctx_lens, rows, starts, ctx_host, scale, memo=None):
    """One query per row: one masked SDPA over the padded gather. ``out`` None: every token is a
    decode row, in row order, so the queries are q itself and the result is returned, not copied."""
    flat, mask, tok, lmax, _ = decode_gather(block_tables, ctx_lens, rows, starts, ctx_host, kv[2], memo)
    kflat, vflat, _ = kv
    B, hkv, d = len(rows), kflat.shape[1], kflat.shape[2]
    k = kflat.index_select(0, flat).view(B, lmax, hkv, d).transpose(1, 2)
    v = vflat.index_select(0, flat).view(B, lmax, hkv, d).transpose(1, 2)
    qq = (q if out is None else q.index_select(0, tok)).unsqueeze(2)  # [B, Hq, 1, D]
    o = F.scaled_dot_product_attention(qq, k.to(q.dtype), v.to(q.dtype), attn_mask=mask,
                                       scale=scale, enable_gqa=q.shape[1] != hkv)
    if out is None:
        return o[:, :, 0]
    out.index_copy_(0, tok, o[:, :, 0])
    return out


def _attend_small(q, out, kv, block_tables, ctx_lens, rows, starts, q_host, ctx_host, scale) -> None:
    """A few queries per row (speculative verification): pad to the longest, one masked SDPA."""
    hq, d = q.shape[1], q.shape[2]
    qmax = max(q_host[r] for r in rows)
    k, v, valid, lens = _gather(kv, block_tables, ctx_lens, rows, max(ctx_host[r] for r in rows))
    B, hkv, lmax = len(rows), k.shape[1], k.shape[2]
    qpos = torch.arange(qmax, device=q.device)
    nq = torch.tensor([q_host[r] for r in rows], device=q.device)
    tok = torch.tensor([starts[r] for r in rows], device=q.device).unsqueeze(1) + qpos
    tok = torch.where(qpos.unsqueeze(0) < nq.unsqueeze(1), tok, torch.zeros_like(tok))
    qq = q.index_select(0, tok.reshape(-1)).view(B, qmax, hq, d).transpose(1, 2)
    abs_q = lens.unsqueeze(1) - nq.unsqueeze(1) + qpos  # query i of a row with n sits at ctx - n + i
    kpos = torch.arange(lmax, device=q.device)
    mask = ((kpos[None, None, :] <= abs_q[:, :, None]) & valid[:, None, :]).unsqueeze(1)
    o = F.scaled_dot_product_attention(qq, k.to(q.dtype), v.to(q.dtype), attn_mask=mask, scale=scale,
                                       enable_gqa=hq != hkv).transpose(1, 2)  # [B, qmax, Hq, D]
    for i, r in enumerate(rows):
        out[starts[r]:starts[r] + q_host[r]] = o[i, :q_host[r]]


def _attend_row(q, out, kv, block_tables, ctx_lens, r, starts, q_host, ctx_host, scale) -> None:
    """A prefill chunk: causal attention over its whole context, earlier chunks included."""
    n, L, hq = q_host[r], ctx_host[r], q.shape[1]
    k, v, _, _ = _gather(kv, block_tables, ctx_lens, [r], L)
    hkv = k.shape[1]
    qq = q[starts[r]:starts[r] + n].transpose(0, 1).unsqueeze(0)  # [1, Hq, n, D]
    if n == L:
        o = F.scaled_dot_product_attention(qq, k.to(q.dtype), v.to(q.dtype), is_causal=True,
                                           scale=scale, enable_gqa=hq != hkv)
    else:
        qpos = torch.arange(L - n, L, device=q.device)
        mask = torch.arange(L, device=q.device)[None, :] <= qpos[:, None]
        o = F.scaled_dot_product_attention(qq, k.to(q.dtype), v.to(q.dtype), attn_mask=mask,
                                           scale=scale, enable_gqa=hq != hkv)
    out[starts[r]:starts[r] + n] = o[0].transpose(0, 1)
