"""Triton rotary embedding (neox "rotate half" layout) for q and k of one step, one token a program.

Returns new tensors like :func:`kernels.rotary.rotary_torch`, and rounds like it: cos/sin are cast
to the query dtype, each product is rounded to that dtype before the sum is, so bf16 results match
the reference bit for bit rather than within a tolerance that cancellation would break.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.common_triton import (check_device, check_float, check_index,
                                   check_last_dim_contiguous, needs_autograd, require, round_to)
from kernels.rotary import rotary_torch


@triton.jit
def _rounded(x, dtype: tl.constexpr):
    return round_to(x, dtype).to(tl.float32)


@triton.jit
def _rotate_heads(X, XO, stride_h, stride_oh, n_heads, half, cos, sin,
                  BLOCK_H: tl.constexpr, BLOCK_HALF: tl.constexpr):
    h = tl.arange(0, BLOCK_H)[:, None]
    d = tl.arange(0, BLOCK_HALF)[None, :]
    mask = (h < n_heads) & (d < half)
    dt = XO.dtype.element_ty
    x1 = tl.load(X + h * stride_h + d, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(X + h * stride_h + half + d, mask=mask, other=0.0).to(tl.float32)
    o1 = _rounded(x1 * cos, dt) - _rounded(x2 * sin, dt)
    o2 = _rounded(x2 * cos, dt) + _rounded(x1 * sin, dt)
    tl.store(XO + h * stride_oh + d, round_to(o1, dt), mask=mask)
    tl.store(XO + h * stride_oh + half + d, round_to(o2, dt), mask=mask)


@triton.jit
def _rotary_kernel(Q, K, QO, KO, POS, CS, stride_qt, stride_qh, stride_kt, stride_kh,
                   stride_qot, stride_qoh, stride_kot, stride_koh, stride_cs, n_qh, n_kh, half,
                   BLOCK_QH: tl.constexpr, BLOCK_KH: tl.constexpr, BLOCK_HALF: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(POS + t).to(tl.int64)
    d = tl.arange(0, BLOCK_HALF)[None, :]
    dt = QO.dtype.element_ty
    cos = _rounded(tl.load(CS + pos * stride_cs + d, mask=d < half, other=0.0).to(tl.float32), dt)
    sin = _rounded(tl.load(CS + pos * stride_cs + half + d, mask=d < half, other=0.0).to(tl.float32),
                   dt)
    _rotate_heads(Q + t * stride_qt, QO + t * stride_qot, stride_qh, stride_qoh, n_qh, half, cos,
                  sin, BLOCK_QH, BLOCK_HALF)
    _rotate_heads(K + t * stride_kt, KO + t * stride_kot, stride_kh, stride_koh, n_kh, half, cos,
                  sin, BLOCK_KH, BLOCK_HALF)


def _check(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cache: torch.Tensor) -> None:
    require(q.dim() == 3 and k.dim() == 3, "q and k must be [T, H, D], got {} and {}", q.shape,
            k.shape)
    check_float("q", q)
    check_float("cos_sin_cache", cache)
    require(k.dtype == q.dtype, "k dtype {} != q dtype {}", k.dtype, q.dtype)
    t, _, d = q.shape
    require(k.shape[0] == t and k.shape[2] == d,
            "k {} does not match q {} in tokens and head dim", k.shape, q.shape)
    require(d % 2 == 0, "head dim must be even, got {}", d)
    check_index("positions", positions, 1)
    require(positions.shape[0] == t, "positions has {} entries for {} tokens", positions.shape[0], t)
    require(cache.dim() == 2 and cache.shape[1] == d,
            "cos_sin_cache must be [max_positions, {}], got {}", d, cache.shape)
    for name, x in (("q", q), ("k", k), ("cos_sin_cache", cache)):
        check_last_dim_contiguous(name, x)
    check_device(_rotary_kernel, q=q, k=k, positions=positions, cos_sin_cache=cache)


def rotary_triton(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                  cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as :func:`kernels.rotary.rotary_torch`: q [T, Hq, D], k [T, Hkv, D],
    positions [T] (each below the cache's rows: not checked, that would sync the device).
    Returns rotated (q, k) as new contiguous tensors; the inputs are untouched."""
    if needs_autograd(q, k):
        return rotary_torch(q, k, positions, cos_sin_cache)
    _check(q, k, positions, cos_sin_cache)
    qo = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    ko = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    t, hq, d = q.shape
    hk = k.shape[1]
    if t:
        _rotary_kernel[(t,)](q, k, qo, ko, positions, cos_sin_cache, q.stride(0), q.stride(1),
                             k.stride(0), k.stride(1), qo.stride(0), qo.stride(1), ko.stride(0),
                             ko.stride(1), cos_sin_cache.stride(0), hq, hk, d // 2,
                             BLOCK_QH=triton.next_power_of_2(hq), BLOCK_KH=triton.next_power_of_2(hk),
                             BLOCK_HALF=triton.next_power_of_2(d // 2))
    return qo, ko
