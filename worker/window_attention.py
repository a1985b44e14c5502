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
    """q: [T, Hq, D]; k_cache/v_cache: [num_blocks, block_size, Hkv, D]; returns [T, Hq, D].
    ``memo``: the step's segment memo; the decode rows' gather is computed once per window."""
    T, hq, d = q.shape
    nb, bs, hkv, _ = k_cache.shape
    kf, vf = k_cache.view(nb * bs, hkv, d), v_cache.view(nb * bs, hkv, d)
    R = len(q_lens_host)
    if T == R:  # all decode rows: each reads the last min(ctx, window) keys
        key = ("window", window)
        ent = memo.get(key) if memo is not None else None
        if ent is None:
            n = ctx_lens.clamp(max=window)
            width = min(max(ctx_lens_host), window)
            slots, valid = _window_slots(block_tables, ctx_lens - n, n, width, bs)
            ent = (slots.reshape(-1), valid[:, None, None, :], width)
            if memo is not None:
                memo[key] = ent
        flat, mask, width = ent
        k = kf.index_select(0, flat).view(R, width, hkv, d).transpose(1, 2)
        v = vf.index_select(0, flat).view(R, width, hkv, d).transpose(1, 2)
        o = F.scaled_dot_product_attention(q.unsqueeze(2), k.to(q.dtype), v.to(q.dtype), attn_mask=mask,
                                           scale=scale, enable_gqa=hq != hkv)
        return o[:, :, 0]
    out = torch.empty_like(q)
    start = 0
    for r in range(R):  # a row with several queries: its keys from its first query's window on
        n, L = q_lens_host[r], ctx_lens_host[r]
        lo = max(0, L - n - window + 1)
        slots, _ = _window_slots(block_tables[r:r + 1], torch.tensor([lo], device=q.device),
                                 torch.tensor([L - lo], device=q.device), L - lo, bs)
        k = kf.index_select(0, slots[0]).transpose(0, 1).unsqueeze(0)  # [1, Hkv, L - lo, D]
        v = vf.index_select(0, slots[0]).transpose(0, 1).unsqueeze(0)
        qpos = torch.arange(L - n, L, device=q.device).unsqueeze(1)
        kpos = torch.arange(lo, L, device=q.device).unsqueeze(0)
        mask = (kpos <= qpos) & (kpos > qpos - window)
        qq = q[start:start + n].transpose(0, 1).unsqueeze(0)  # [1, Hq, n, D]
        o = F.scaled_dot_product_attention(qq, k.to(q.dtype), v.to(q.dtype), attn_mask=mask, scale=scale,
                                           enable_gqa=hq != hkv)
        out[start:start + n] = o[0].transpose(0, 1)
        start += n
    return out
