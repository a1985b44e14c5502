"""Triton write of a step's new K/V rows into a segment's paged pool, one token a program.

Same contract as :func:`kernels.kv_write.write_kv_torch`, plus one tolerance: a negative slot is
skipped (a padded token of a fixed-shape batch has nowhere to go), where the reference would fail.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.common_triton import (check_device, check_float, check_index,
                                   check_last_dim_contiguous, require, round_to)


@triton.jit
def _cast(x, dtype: tl.constexpr):
    # Same dtype: copy the bits untouched (the interpreter cannot do arithmetic on bf16 anyway).
    if x.dtype == dtype:
        return x
    return round_to(x.to(tl.float32), dtype)


@triton.jit
def _write_kv_kernel(K, V, KC, VC, SLOTS, stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_slot, n_heads, head_dim, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    slot = tl.load(SLOTS + t).to(tl.int64)
    if slot >= 0:
        h = tl.arange(0, BLOCK_H)[:, None]
        d = tl.arange(0, BLOCK_D)[None, :]
        mask = (h < n_heads) & (d < head_dim)
        dst = slot * stride_slot + h * head_dim + d
        k = tl.load(K + t * stride_kt + h * stride_kh + d, mask=mask)
        tl.store(KC + dst, _cast(k, KC.dtype.element_ty), mask=mask)
        v = tl.load(V + t * stride_vt + h * stride_vh + d, mask=mask)
        tl.store(VC + dst, _cast(v, VC.dtype.element_ty), mask=mask)


def _check(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
           slot_mapping: torch.Tensor) -> None:
    require(k.dim() == 3 and k.shape == v.shape, "k and v must both be [T, Hkv, D], got {} and {}",
            k.shape, v.shape)
    require(k_cache.dim() == 4 and k_cache.shape == v_cache.shape,
            "k_cache and v_cache must both be [num_blocks, block_size, Hkv, D], got {} and {}",
            k_cache.shape, v_cache.shape)
    require(k.shape[1:] == k_cache.shape[2:], "k rows {} do not fit cache rows {}", k.shape[1:],
            k_cache.shape[2:])
    for name, t in (("k", k), ("v", v), ("k_cache", k_cache), ("v_cache", v_cache)):
        check_float(name, t)
    check_last_dim_contiguous("k", k)
    check_last_dim_contiguous("v", v)
    # The kernel addresses a slot as one flat row of the pool.
    require(k_cache.is_contiguous() and v_cache.is_contiguous(), "k_cache and v_cache must be contiguous")
    check_index("slot_mapping", slot_mapping, 1)
    require(slot_mapping.shape[0] == k.shape[0], "slot_mapping has {} entries for {} tokens",
            slot_mapping.shape[0], k.shape[0])
    check_device(_write_kv_kernel, k=k, v=v, k_cache=k_cache, v_cache=v_cache,
                 slot_mapping=slot_mapping)


def write_kv_triton(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    slot_mapping: torch.Tensor) -> None:
    """k, v: [T, Hkv, D]; caches [num_blocks, block_size, Hkv, D]; slot_mapping [T] (slot =
    block_id * block_size + offset, below num_blocks * block_size: not checked, that would sync).
    Writes in place, casting to the cache dtype."""
    _check(k, v, k_cache, v_cache, slot_mapping)
    t, h, d = k.shape
    if t:
        _write_kv_kernel[(t,)](k, v, k_cache, v_cache, slot_mapping, k.stride(0), k.stride(1),
                               v.stride(0), v.stride(1), h * d, h, d,
                               BLOCK_H=triton.next_power_of_2(h), BLOCK_D=triton.next_power_of_2(d))
