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


def _gather_index(block_tables: torch.Tensor, lengths: torch.Tensor, block_size: int,
                  max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Slots [R, max_len] of each row's first max_len tokens, and the validity mask [R, max_len]."""
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
                          ctx_lens_host: list[int] | None = None) -> torch.Tensor:
    """q: [T, Hq, D]; k_cache/v_cache: [num_blocks, block_size, Hkv, D];
    block_tables: [R, max_blocks] int; q_start_loc: [R+1] int; ctx_lens: [R] int.
    Returns [T, Hq, D]. ``*_host`` are the same lengths as Python lists (saves device syncs)."""
    T, hq, d = q.shape
    nb, bs, hkv, _ = k_cache.shape
    assert hq % hkv == 0, "query heads must be a multiple of KV heads"
    R = block_tables.shape[0]
    assert q_start_loc.shape == (R + 1,) and ctx_lens.shape == (R,)
    if q_lens_host is None:
        q_lens_host = (q_start_loc[1:] - q_start_loc[:-1]).tolist()
    if ctx_lens_host is None:
        ctx_lens_host = ctx_lens.tolist()
    starts = q_start_loc.tolist()
    out = torch.empty_like(q)
    kflat = k_cache.view(nb * bs, hkv, d)
    vflat = v_cache.view(nb * bs, hkv, d)
    gqa = hq != hkv

    small = [r for r in range(R) if q_lens_host[r] <= SMALL_Q]
    large = [r for r in range(R) if q_lens_host[r] > SMALL_Q]
    if small:
        idx = torch.tensor(small, dtype=torch.long, device=q.device)
        qmax = max(q_lens_host[r] for r in small)
        lmax = max(ctx_lens_host[r] for r in small)
        lens = ctx_lens.index_select(0, idx)
        slots, valid = _gather_index(block_tables.index_select(0, idx), lens, bs, lmax)
        k = kflat.index_select(0, slots.reshape(-1)).view(len(small), lmax, hkv, d).transpose(1, 2)
        v = vflat.index_select(0, slots.reshape(-1)).view(len(small), lmax, hkv, d).transpose(1, 2)
        if qmax == 1:
            tok = torch.tensor([starts[r] for r in small], dtype=torch.long, device=q.device)
            qq = q.index_select(0, tok).unsqueeze(2)  # [B, Hq, 1, D]
            mask = valid[:, None, None, :]
        else:
            # Pad every row to qmax queries; query i of a row with n queries sits at ctx - n + i.
            qpos = torch.arange(qmax, device=q.device)
            nq = torch.tensor([q_lens_host[r] for r in small], device=q.device)
            tok = torch.tensor([starts[r] for r in small], device=q.device).unsqueeze(1) + qpos
            qvalid = qpos.unsqueeze(0) < nq.unsqueeze(1)
            tok = torch.where(qvalid, tok, torch.zeros_like(tok))
            qq = q.index_select(0, tok.reshape(-1)).view(len(small), qmax, hq, d).transpose(1, 2)
            abs_q = lens.unsqueeze(1) - nq.unsqueeze(1) + qpos  # [B, qmax]
            kpos = torch.arange(lmax, device=q.device)
            mask = (kpos[None, None, :] <= abs_q[:, :, None]) & valid[:, None, :]
            mask = mask.unsqueeze(1)  # [B, 1, qmax, lmax]
        o = F.scaled_dot_product_attention(qq, k.to(q.dtype), v.to(q.dtype), attn_mask=mask,
                                           scale=scale, enable_gqa=gqa)  # [B, Hq, qmax, D]
        o = o.transpose(1, 2)  # [B, qmax, Hq, D]
        if qmax == 1:
            out.index_copy_(0, tok, o[:, 0])
        else:
            for i, r in enumerate(small):
                n = q_lens_host[r]
                out[starts[r]:starts[r] + n] = o[i, :n]
    for r in large:
        n, L = q_lens_host[r], ctx_lens_host[r]
        slots, _ = _gather_index(block_tables[r:r + 1], ctx_lens[r:r + 1], bs, L)
        k = kflat.index_select(0, slots[0]).transpose(0, 1).unsqueeze(0)  # [1, Hkv, L, D]
        v = vflat.index_select(0, slots[0]).transpose(0, 1).unsqueeze(0)
        qq = q[starts[r]:starts[r] + n].transpose(0, 1).unsqueeze(0)  # [1, Hq, n, D]
        if n == L:
            o = F.scaled_dot_product_attention(qq, k.to(q.dtype), v.to(q.dtype), is_causal=True,
                                               scale=scale, enable_gqa=gqa)
        else:
            qpos = torch.arange(L - n, L, device=q.device)
            mask = torch.arange(L, device=q.device)[None, :] <= qpos[:, None]
            o = F.scaled_dot_product_attention(qq, k.to(q.dtype), v.to(q.dtype), attn_mask=mask,
                                               scale=scale, enable_gqa=gqa)
        out[starts[r]:starts[r] + n] = o[0].transpose(0, 1)
    return out
