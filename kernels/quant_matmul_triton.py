"""Triton weight-only group-quantized matmul: ``y = x @ W.T`` with W held as 4- or 8-bit codes and one
fp16 (scale, min) per group of input features (the layout of :mod:`kernels.quant_matmul`).

The weights are dequantized in registers, tile by tile, and never written out: a decode step streams
the packed bytes (Q4_1: 20 bytes per 32 weights, 5 bits a weight) instead of fp32's 32. The dequantized
tile is ``q * scale + min`` in fp32, the value the torch reference and transformers' GGUF loader give.

Accumulation is fp32. With fp32 activations the dot runs in full fp32 (``ieee``: no tf32, so it matches
the reference up to summation order); with bf16/fp16 activations the dequantized tile is rounded to the
activations' dtype for the tensor cores, as weight-only GPU kernels do. Each output row's sum runs over
the same K tiles in the same order whatever the batch (fixed tiles, no split-K atomics), so a row's
result does not depend on which other rows share the batch: speculation stays exact.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.common_triton import (check_device, check_float, check_last_dim_contiguous, interpreted,
                                   needs_autograd, require)
from kernels.quant_matmul import BITS, quant_matmul_torch


@triton.jit
def _quant_matmul_kernel(X, Q, S, MN, Y, M, N, K, stride_xm, stride_ym, n_groups,
                         GROUP: tl.constexpr, BITS: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, DOT_F32: tl.constexpr,
                         INTERP: tl.constexpr):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = (tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)).to(tl.int64)
    rk = tl.arange(0, BLOCK_K)
    m_ok = rm < M
    n_ok = rn < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + rk
        k_ok = kk < K
        x = tl.load(X + rm[:, None].to(tl.int64) * stride_xm + kk[None, :],
                    mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w_ok = n_ok[:, None] & k_ok[None, :]
        if BITS == 4:
            b = tl.load(Q + rn[:, None] * (K // 2) + (kk[None, :] // 2), mask=w_ok, other=0).to(tl.int32)
            q = (b >> ((kk[None, :] % 2) * 4)) & 0xF
        else:
            q = tl.load(Q + rn[:, None] * K + kk[None, :], mask=w_ok, other=0).to(tl.int32)
        g = rn[:, None] * n_groups + (kk[None, :] // GROUP)
        s = tl.load(S + g, mask=w_ok, other=0.0).to(tl.float32)
        mn = tl.load(MN + g, mask=w_ok, other=0.0).to(tl.float32)
        w = q.to(tl.float32) * s + mn  # [BLOCK_N, BLOCK_K]
        if INTERP:  # the CPU interpreter: products and a sum whose order never depends on the row's
            # place in the tile (its tl.dot is numpy's BLAS, which on some CPUs - AVX2 OpenBLAS -
            # sums row 7 of a tile in another order than row 0)
            acc += tl.sum(x.to(tl.float32)[:, None, :] * w[None, :, :], axis=2)
        elif DOT_F32:
            acc += tl.dot(x.to(tl.float32), tl.trans(w), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w.to(x.dtype)))
    tl.store(Y + rm[:, None].to(tl.int64) * stride_ym + rn[None, :], acc.to(Y.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def _check(x, qweight, scales, mins, group: int, bits: int) -> tuple[int, int]:
    check_float("x", x)
    check_last_dim_contiguous("x", x)
    require(bits in BITS, "bits must be 4 or 8, got {}", bits)
    require(qweight.dim() == 2, "qweight must be 2-D, got shape {}", qweight.shape)
    N = qweight.shape[0]
    K = qweight.shape[1] * (2 if bits == 4 else 1)
    want = torch.uint8 if bits == 4 else torch.int8
    require(qweight.dtype == want, "{}-bit qweight must be {}, got {}", bits, want, qweight.dtype)
    require(qweight.is_contiguous(), "qweight must be contiguous")
    require(group > 0 and K % group == 0, "K {} must be a multiple of the group {}", K, group)
    require(x.shape[-1] == K, "x's last dim {} != the weight's K {}", x.shape[-1], K)
    for name, t in (("scales", scales), ("mins", mins)):
        require(t.shape == (N, K // group), "{} must be [{}, {}], got {}", name, N, K // group, t.shape)
        require(t.dtype == torch.float16, "{} must be float16, got {}", name, t.dtype)
        require(t.is_contiguous(), "{} must be contiguous", name)
    return N, K


def _tiles(N: int, interp: bool) -> tuple[int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K). Decode batches are a few rows: narrow N tiles put more programs on
    the SMs for the small projections (576 outputs -> 36 programs). The tiles depend on the weight's
    shape only, never on the batch, so a row's sums run in one order whatever shares its batch (a
    prefill of thousands of rows pays for it by re-reading each weight tile every 16 rows)."""
    if interp:  # small tiles so tests cross several tiles on tiny shapes
        return 16, 16, 32
    return 16, (16 if N <= 4096 else 64), 64


def quant_matmul_triton(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                        mins: torch.Tensor, group: int, bits: int) -> torch.Tensor:
    """Same contract as :func:`kernels.quant_matmul.quant_matmul_torch`: x [..., K] -> [..., N] in x's
    dtype. Calls that must record gradients go to the reference (the kernel is forward-only)."""
    N, K = _check(x, qweight, scales, mins, group, bits)
    check_device(_quant_matmul_kernel, x=x, qweight=qweight, scales=scales, mins=mins)
    if needs_autograd(x):
        return quant_matmul_torch(x, qweight, scales, mins, group, bits)
    lead = x.shape[:-1]
    x2 = x.reshape(-1, K)
    M = x2.shape[0]
    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    if M == 0:
        return y.view(*lead, N)
    interp = interpreted(_quant_matmul_kernel)
    bm, bn, bk = _tiles(N, interp)
    grid = (triton.cdiv(M, bm), triton.cdiv(N, bn))
    _quant_matmul_kernel[grid](x2, qweight, scales, mins, y, M, N, K, x2.stride(0), y.stride(0),
                               K // group, GROUP=group, BITS=bits, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk,
                               DOT_F32=interp or x.dtype == torch.float32, INTERP=interp, num_warps=4)
    return y.view(*lead, N)


__all__ = ["quant_matmul_triton"]
