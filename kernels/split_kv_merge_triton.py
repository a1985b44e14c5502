"""Merging split-KV partial attention results (flash-decoding's second pass).

When a decode batch is too small to fill the GPU, :mod:`kernels.paged_attention_triton` splits each
row's context into chunks attended by separate programs. Each chunk leaves an unnormalised output
``acc`` with its running max ``m`` (log2 units) and denominator ``l``; this kernel merges them.
:func:`merge_splits_torch` is its reference.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.common_triton import check_device, require

# Running max of a chunk that saw no visible key: finite so exp2(m - max) is 0, never NaN.
EMPTY_MAX = tl.constexpr(-1.0e30)


@triton.jit
def _merge_kernel(ACC, M, L, O, stride_ot, stride_oh, n_heads, n_splits, head_dim,
                  BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    s_ok = s < n_splits
    base = (t * n_heads + h) * n_splits
    m = tl.load(M + base + s, mask=s_ok, other=EMPTY_MAX)
    l = tl.load(L + base + s, mask=s_ok, other=0.0)
    w = tl.exp2(m - tl.max(m, 0))
    denom = tl.sum(w * l, 0)
    d = tl.arange(0, BLOCK_D)
    mask = s_ok[:, None] & (d[None, :] < head_dim)
    acc = tl.load(ACC + (base + s)[:, None] * head_dim + d[None, :], mask=mask, other=0.0)
    out = tl.sum(acc * w[:, None], 0) / tl.where(denom > 0, denom, 1.0)
    tl.store(O + t * stride_ot + h * stride_oh + d, out.to(O.dtype.element_ty), mask=d < head_dim)


def merge_splits_torch(acc: torch.Tensor, m: torch.Tensor, l: torch.Tensor,
                       out: torch.Tensor) -> torch.Tensor:
    """acc [T, H, S, D], m and l [T, H, S] (fp32) -> out [T, H, D] (written and returned)."""
    w = torch.exp2(m - m.amax(-1, keepdim=True))
    denom = (w * l).sum(-1, keepdim=True)
    out.copy_((acc * w.unsqueeze(-1)).sum(-2) / torch.where(denom > 0, denom, 1.0))
    return out


def merge_splits_triton(acc: torch.Tensor, m: torch.Tensor, l: torch.Tensor,
                        out: torch.Tensor) -> torch.Tensor:
    """Same contract as :func:`merge_splits_torch`."""
    require(acc.dim() == 4 and acc.is_contiguous() and acc.dtype == torch.float32,
            "acc must be a contiguous fp32 [T, H, S, D], got {} {}", acc.shape, acc.dtype)
    t, h, s, d = acc.shape
    for name, x in (("m", m), ("l", l)):
        require(x.shape == (t, h, s) and x.is_contiguous() and x.dtype == torch.float32,
                "{} must be a contiguous fp32 [{}, {}, {}], got {} {}", name, t, h, s, x.shape, x.dtype)
    require(out.shape == (t, h, d) and out.stride(-1) == 1,
            "out must be [{}, {}, {}] with a unit last stride, got {}", t, h, d, out.shape)
    check_device(_merge_kernel, acc=acc, m=m, l=l, out=out)
    if t and h:
        _merge_kernel[(t, h)](acc, m, l, out, out.stride(0), out.stride(1), h, s, d,
                              BLOCK_S=triton.next_power_of_2(s), BLOCK_D=triton.next_power_of_2(d))
    return out
