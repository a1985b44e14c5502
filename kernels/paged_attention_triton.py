"""Triton causal attention over the paged KV pool for a flattened variable-length batch.

One kernel serves every kind of row :func:`kernels.paged_attention.paged_attention_torch` serves:
decode (one query), speculative verification (a few) and prefill chunks (many, reading earlier
chunks from the pool). A program owns one row, one tile of its queries and one KV head; its M axis
packs (query, query head of that KV head's group) pairs, so a decode row with a GQA group of 4 fills
a 16-row tile with 4 queries' worth of useful work instead of 1. Keys are gathered token by token
through the block table, so any block size works. Query i of a row with n queries sits at position
``ctx_len - n + i`` and sees keys at positions ``<= ctx_len - n + i``.

When a decode batch has too few programs to fill the GPU, each row's context is split into chunks
attended separately and merged by :mod:`kernels.split_kv_merge_triton` (flash-decoding).
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels.common_triton import (check_device, check_float, check_index,
                                   check_last_dim_contiguous, interpreted, require)
from kernels.split_kv_merge_triton import EMPTY_MAX, merge_splits_triton

LOG2E = 1.4426950408889634
MAX_HEAD_DIM = 256
# Splits of fewer keys are not worth their merge (a heuristic, not yet tuned on a GPU).
MIN_SPLIT_TOKENS = 256
MAX_SPLITS = 32
PREFILL_BLOCK_M = 64


@triton.jit
def _paged_attention_kernel(
        Q, KC, VC, BT, QSL, CTX, O, M, L, scale_log2,
        stride_qt, stride_qh, stride_ot, stride_oh, stride_os, stride_bt, stride_slot,
        n_q_heads, head_dim, n_splits,
        GROUP: tl.constexpr, PAGE: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, IS_SPLIT: tl.constexpr,
        DOT_F32: tl.constexpr):
    row = tl.program_id(0)
    qb = tl.program_id(1)
    kvh = tl.program_id(2) // n_splits
    split = tl.program_id(2) % n_splits
    q_start = tl.load(QSL + row).to(tl.int64)
    q_len = (tl.load(QSL + row + 1) - q_start).to(tl.int32)
    ctx = tl.load(CTX + row).to(tl.int32)
    if qb * BLOCK_Q < q_len:
        m_offs = tl.arange(0, BLOCK_M)
        qi = qb * BLOCK_Q + m_offs // GROUP
        head = kvh * GROUP + m_offs % GROUP
        row_ok = (m_offs < BLOCK_Q * GROUP) & (qi < q_len)
        qpos = ctx - q_len + qi
        d = tl.arange(0, BLOCK_D)
        d_ok = d < head_dim
        q_ptrs = Q + ((q_start + qi) * stride_qt + head * stride_qh)[:, None] + d[None, :]
        q = tl.load(q_ptrs, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        if DOT_F32:  # the interpreter has no bf16 arithmetic
            q = q.to(tl.float32)

        # Keys this tile can see: up to its last query's position; this split's share of them.
        kv_hi = ctx - q_len + tl.minimum((qb + 1) * BLOCK_Q, q_len)
        chunk = tl.cdiv(tl.cdiv(kv_hi, n_splits), BLOCK_N) * BLOCK_N
        lo = split * chunk
        hi = tl.minimum(lo + chunk, kv_hi)

        m_i = tl.full([BLOCK_M], EMPTY_MAX, tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
        kv_col = kvh * head_dim + d
        for start in range(lo, hi, BLOCK_N):
            tok = start + tl.arange(0, BLOCK_N)
            tok_ok = tok < hi
            page = tl.load(BT + row * stride_bt + tok // PAGE, mask=tok_ok, other=0).to(tl.int64)
            kv_ptrs = (page * PAGE + tok % PAGE)[:, None] * stride_slot + kv_col[None, :]
            kv_mask = tok_ok[:, None] & d_ok[None, :]
            k = tl.load(KC + kv_ptrs, mask=kv_mask, other=0.0).to(q.dtype)
            s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale_log2
            visible = (tok[None, :] <= qpos[:, None]) & tok_ok[None, :]
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            p = tl.exp2(s - m_new[:, None])
            alpha = tl.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            v = tl.load(VC + kv_ptrs, mask=kv_mask, other=0.0).to(q.dtype)
            acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v, input_precision="ieee")
            m_i = m_new

        o_rows = (q_start + qi) * stride_ot + head * stride_oh
        o_mask = row_ok[:, None] & d_ok[None, :]
        if IS_SPLIT:
            o_rows += split * stride_os
            tl.store(O + o_rows[:, None] + d[None, :], acc, mask=o_mask)
            ml = ((q_start + qi) * n_q_heads + head) * n_splits + split
            tl.store(M + ml, m_i, mask=row_ok)
            tl.store(L + ml, l_i, mask=row_ok)
        else:
            out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
            tl.store(O + o_rows[:, None] + d[None, :], out.to(O.dtype.element_ty), mask=o_mask)


def _check(q, k_cache, v_cache, block_tables, q_start_loc, ctx_lens, q_lens_host,
           ctx_lens_host) -> None:
    require(q.dim() == 3, "q must be [T, Hq, D], got {}", q.shape)
    require(k_cache.dim() == 4 and k_cache.shape == v_cache.shape,
            "k_cache and v_cache must both be [num_blocks, block_size, Hkv, D], got {} and {}",
            k_cache.shape, v_cache.shape)
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        check_float(name, t)
    require(k_cache.dtype == v_cache.dtype, "k_cache {} != v_cache {}", k_cache.dtype, v_cache.dtype)
    hq, d = q.shape[1], q.shape[2]
    hkv = k_cache.shape[2]
    require(k_cache.shape[3] == d, "cache head dim {} != query head dim {}", k_cache.shape[3], d)
    require(hkv > 0 and hq % hkv == 0, "query heads ({}) must be a multiple of KV heads ({})", hq, hkv)
    require(d <= MAX_HEAD_DIM, "head dim {} is above the kernel's limit {}", d, MAX_HEAD_DIM)
    check_last_dim_contiguous("q", q)
    # The kernel addresses a slot as one flat row of the pool.
    require(k_cache.is_contiguous() and v_cache.is_contiguous(), "k_cache and v_cache must be contiguous")
    check_index("block_tables", block_tables, 2)
    check_index("q_start_loc", q_start_loc, 1)
    check_index("ctx_lens", ctx_lens, 1)
    r = block_tables.shape[0]
    require(q_start_loc.shape == (r + 1,), "q_start_loc must be [{}], got {}", r + 1, q_start_loc.shape)
    require(ctx_lens.shape == (r,), "ctx_lens must be [{}], got {}", r, ctx_lens.shape)
    for name, host in (("q_lens_host", q_lens_host), ("ctx_lens_host", ctx_lens_host)):
        require(host is None or len(host) == r, "{} has {} entries for {} rows", name,
                len(host or []), r)
    check_device(_paged_attention_kernel, q=q, k_cache=k_cache, v_cache=v_cache,
                 block_tables=block_tables, q_start_loc=q_start_loc, ctx_lens=ctx_lens)


@functools.lru_cache(maxsize=None)
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


@dataclass(frozen=True, slots=True)
class _Plan:
    block_m: int   # rows of a tile: (query, query head) pairs
    block_q: int   # queries a tile holds
    q_blocks: int  # query tiles of the longest row
    splits: int    # programs sharing one row's context


def _tiles(group: int, max_q: int) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_Q): a decode tile is 16 rows (tl.dot's minimum), a prefill tile 64."""
    want = min(triton.next_power_of_2(max_q * group), PREFILL_BLOCK_M)
    block_m = max(16, want, triton.next_power_of_2(group))
    return block_m, block_m // group


def _num_splits(device: torch.device, programs: int, q_blocks: int, max_ctx: int) -> int:
    """Split the context only when a decode batch leaves most of the GPU idle."""
    if device.type != "cuda" or q_blocks > 1:
        return 1
    want = triton.cdiv(2 * _sm_count(device.index or 0), max(programs, 1))
    return max(1, min(want, MAX_SPLITS, max_ctx // MIN_SPLIT_TOKENS))


def _plan(q: torch.Tensor, hkv: int, rows: int, max_q: int, max_ctx: int,
          num_splits: int | None) -> _Plan:
    block_m, block_q = _tiles(q.shape[1] // hkv, max_q)
    q_blocks = triton.cdiv(max_q, block_q)
    splits = num_splits or _num_splits(q.device, rows * q_blocks * hkv, q_blocks, max_ctx)
    return _Plan(block_m, block_q, q_blocks, splits)


def _launch(plan: _Plan, q, k_cache, v_cache, block_tables, q_start_loc, ctx_lens, scale,
            out: torch.Tensor) -> None:
    t, hq, d = q.shape
    hkv, page = k_cache.shape[2], k_cache.shape[1]
    interp = interpreted(_paged_attention_kernel)
    if plan.splits > 1:
        dst = torch.empty((t, hq, plan.splits, d), dtype=torch.float32, device=q.device)
        m = torch.empty((t, hq, plan.splits), dtype=torch.float32, device=q.device)
        l = torch.empty_like(m)
        strides = dst.stride()[:3]
    else:
        dst, m, l = out, None, None
        strides = (out.stride(0), out.stride(1), 0)
    grid = (block_tables.shape[0], plan.q_blocks, hkv * plan.splits)
    _paged_attention_kernel[grid](
        q, k_cache, v_cache, block_tables, q_start_loc, ctx_lens, dst, m, l, scale * LOG2E,
        q.stride(0), q.stride(1), *strides, block_tables.stride(0), hkv * d, hq, d, plan.splits,
        GROUP=hq // hkv, PAGE=page, BLOCK_Q=plan.block_q, BLOCK_M=plan.block_m,
        # small key tiles in the interpreter so tests cross several tiles on small contexts
        BLOCK_N=16 if interp else 64, BLOCK_D=max(16, triton.next_power_of_2(d)),
        IS_SPLIT=plan.splits > 1, DOT_F32=interp, num_warps=4)
    if plan.splits > 1:
        merge_splits_triton(dst, m, l, out)


def paged_attention_triton(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, q_start_loc: torch.Tensor,
                           ctx_lens: torch.Tensor, scale: float,
                           q_lens_host: list[int] | None = None,
                           ctx_lens_host: list[int] | None = None, *,
                           num_splits: int | None = None) -> torch.Tensor:
    """Same contract as :func:`kernels.paged_attention.paged_attention_torch`. Returns [T, Hq, D].
    Lengths are trusted (0 < q_len <= ctx_len, block tables covering ctx_len): checking them would
    sync the device. One exception is relied on: a row of one query and context 0 (a CUDA graph's padding
    row, worker/decode_graphs.py) reads no key and gets zeros. ``num_splits`` forces the split-KV count (tests); None picks it."""
    _check(q, k_cache, v_cache, block_tables, q_start_loc, ctx_lens, q_lens_host, ctx_lens_host)
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    rows = block_tables.shape[0]
    if rows == 0 or q.shape[0] == 0:
        return out
    if q_lens_host is None:
        q_lens_host = (q_start_loc[1:] - q_start_loc[:-1]).tolist()
    if ctx_lens_host is None:
        ctx_lens_host = ctx_lens.tolist()
    plan = _plan(q, k_cache.shape[2], rows, max(q_lens_host), max(ctx_lens_host), num_splits)
    _launch(plan, q, k_cache, v_cache, block_tables, q_start_loc, ctx_lens, scale, out)
    return out
