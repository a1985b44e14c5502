"""RMSNorm and fused residual-add + RMSNorm (the hot-path norms of every layer and every tier exit).

The torch versions are the references; a Triton version of each lives beside them (issue: Triton
kernels) and is chosen by :mod:`kernels.ops`.
"""
from __future__ import annotations

import torch


def rms_norm_torch(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """y = x / rms(x) * weight, computed in fp32 like Llama's reference and cast back."""
    dtype = x.dtype
    xf = x.float()
    var = xf.pow(2).mean(-1, keepdim=True)
    y = xf * torch.rsqrt(var + eps)
    return weight * y.to(dtype)


def fused_add_rms_norm_torch(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rms_norm(x + residual), x + residual). With residual None, the sum is x."""
    if residual is not None:
        x = x + residual
    return rms_norm_torch(x, weight, eps), x
