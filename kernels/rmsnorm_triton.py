"""Triton RMSNorm and fused residual-add + RMSNorm: one kernel, the residual add a compile-time switch.

Matches :mod:`kernels.rmsnorm` rounding step by step: the sum ``x + residual`` is rounded to the
input dtype, the normalised value is rounded to the input dtype before the weight multiplies it,
and the product is rounded once to the output dtype (the promotion of weight and input dtypes).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.common_triton import (check_device, check_float, check_last_dim_contiguous,
                                   needs_autograd, require, round_to)
from kernels.rmsnorm import fused_add_rms_norm_torch, rms_norm_torch

# One program holds a whole row; wider rows would need a kernel that loops over the row.
MAX_HIDDEN = 65536


@triton.jit
def _rms_norm_kernel(X, R, W, Y, S, stride_x, stride_r, stride_y, stride_s, n_cols, eps,
                     HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(R + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
        s = round_to(x + r, S.dtype.element_ty)
        tl.store(S + row * stride_s + cols, s, mask=mask)
        x = s.to(tl.float32)
    var = tl.sum(x * x, axis=0) / n_cols
    y = round_to(x * tl.rsqrt(var + eps), X.dtype.element_ty).to(tl.float32)
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + row * stride_y + cols, round_to(w * y, Y.dtype.element_ty), mask=mask)


def _rows(name: str, t: torch.Tensor) -> torch.Tensor:
    """t as [rows, hidden] without a copy (the kernel writes and reads through one row stride)."""
    check_last_dim_contiguous(name, t)
    try:
        return t.view(-1, t.shape[-1])
    except RuntimeError:
        raise ValueError(f"{name} of shape {tuple(t.shape)} and strides {t.stride()} cannot be "
                         "flattened to rows without a copy; pass a contiguous tensor") from None


def _check(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor) -> None:
    check_float("x", x)
    check_float("weight", weight)
    require(x.dim() >= 1, "x must have at least one dim")
    h = x.shape[-1]
    require(weight.shape == (h,), "weight must be [{}], got {}", h, weight.shape)
    require(weight.stride(-1) == 1 or h == 1, "weight must be contiguous")
    require(h <= MAX_HIDDEN, "hidden size {} is above the kernel's limit {}", h, MAX_HIDDEN)
    if residual is not None:
        require(residual.shape == x.shape, "residual must match x {}, got {}", x.shape,
                residual.shape)
        require(residual.dtype == x.dtype, "residual dtype {} != x dtype {}", residual.dtype, x.dtype)
    check_device(_rms_norm_kernel, x=x, residual=residual, weight=weight)


def _launch(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
            eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    x2 = _rows("x", x)
    r2 = _rows("residual", residual) if residual is not None else x2
    out_dtype = torch.promote_types(weight.dtype, x.dtype)
    y = torch.empty(x.shape, dtype=out_dtype, device=x.device)
    s = torch.empty_like(x2) if residual is not None else x2
    y2 = y.view(-1, x.shape[-1])
    n_rows, h = x2.shape
    if n_rows:
        block = triton.next_power_of_2(h)
        _rms_norm_kernel[(n_rows,)](x2, r2, weight, y2, s, x2.stride(0), r2.stride(0), y2.stride(0),
                                    s.stride(0), h, eps, HAS_RESIDUAL=residual is not None,
                                    BLOCK=block, num_warps=min(max(block // 256, 1), 16))
    return y, s.view(x.shape)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Same contract as :func:`kernels.rmsnorm.rms_norm_torch`; x: [..., H], weight: [H]."""
    if needs_autograd(x, weight):
        return rms_norm_torch(x, weight, eps)
    _check(x, None, weight)
    return _launch(x, None, weight, eps)[0]


def fused_add_rms_norm_triton(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                              eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as :func:`kernels.rmsnorm.fused_add_rms_norm_torch`: (normed, x + residual),
    both new tensors; with residual None the sum is x itself."""
    if needs_autograd(x, residual, weight):
        return fused_add_rms_norm_torch(x, residual, weight, eps)
    _check(x, residual, weight)
    if residual is None:
        return _launch(x, None, weight, eps)[0], x
    return _launch(x, residual, weight, eps)
