"""Triton weight-only group-quantized matmul: ``y = x @ W.T`` with W held as 4- or 8-bit codes and one
fp16 (scale, min) per group of input features (the layout of :mod:`kernels.quant_matmul`, GGUF's Q4_1
and Q8_0 blocks as they ship).

Per group of ``GROUP`` input features and each output row, the kernel computes
``s * sum(q * x) + m * sum(x)`` -- the same value as ``sum((q * s + m) * x)`` without ever forming the
dequantized weight:

* the codes stay exact integers (0..15 or -127..127, exact in bf16 and fp16) and go to the tensor
  cores against the activations as they are (bf16, fp16); fp32 activations are split into three bf16
  pieces (hi + mid + lo == x, each product with a small integer exact in fp32), three dots, so fp32
  keeps its precision at tensor-core speed. Every ``tl.dot`` accumulates in fp32.
* each program loads a group's codes as one contiguous run per output row (16 bytes at 4 bits, 32 at
  8: vector loads), and its scale and min once per row and group.
* split-K: the groups of K are cut into ``SPLIT_K`` contiguous ranges (:func:`split_k`, from N and K
  only); each writes its fp32 partial sums and a second kernel adds them in split order. No atomics.
* tiles: ``BLOCK_M`` is fixed at 16 rows; ``BLOCK_N`` and the warps / stages come from a per-(N, K,
  dtype) table the first call fills (timed on CUDA, :func:`_pick_config`). Nothing depends on the
  batch, so a row's sums run in the same order whatever rows share its batch: a row computed alone
  equals the same row in any batch, bit for bit (speculation and the engine's batching rely on it).
* offsets are int32 (the wrapper refuses tensors whose offsets would not fit).

In triton's CPU interpreter (tests) each group's dot is the sum of the same operands' products in fp32
(:func:`_dot_x`; fp32 x split as on the GPU, the pieces added back, exactly x, for one sum): the
interpreter's bf16 dot is wrong and its BLAS dot sums a row in an order that depends on the row's
place in the tile. Every other branch -- the code unpacking, the per-group scaling, split-K and its
reduction -- is the one the GPU runs. (Nested jit calls are few: the interpreter re-patches triton's
language module on each, most of a call's time.)
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kernels import switches
from kernels.common_triton import (check_device, check_float, check_last_dim_contiguous, interpreted,
                                   needs_autograd, require, round_to)
from kernels.quant_matmul import BITS, quant_matmul_torch

BLOCK_M = 16
INT32_MAX = 2**31 - 1


@triton.jit
def _dot_x(x, q, INTERP: tl.constexpr):
    """sum_k x[m, k] * q[n, k] in fp32, q exact integer codes: bf16 / fp16 x against the codes in its
    own dtype, or fp32 x as three bf16 pieces whose sum is x, each dotted against the same codes."""
    if x.dtype == tl.float32:
        hi = x.to(tl.bfloat16)
        r = x - hi.to(tl.float32)
        mid = r.to(tl.bfloat16)
        lo = (r - mid.to(tl.float32)).to(tl.bfloat16)
        if INTERP:  # one product sum of the pieces put back together (exactly x): see the module doc
            xs = hi.to(tl.float32) + mid.to(tl.float32) + lo.to(tl.float32)
            return tl.sum(xs[:, None, :] * q.to(tl.float32)[None, :, :], axis=2)
        qd = tl.trans(q.to(tl.bfloat16))
        return tl.dot(hi, qd) + tl.dot(mid, qd) + tl.dot(lo, qd)
    if INTERP:  # the interpreter's bf16 dot and integer -> bf16 cast are wrong; fp32 is exact here
        return tl.sum(x.to(tl.float32)[:, None, :] * q.to(tl.float32)[None, :, :], axis=2)
    return tl.dot(x, tl.trans(q.to(x.dtype)), out_dtype=tl.float32)


@triton.jit
def _quant_matmul_kernel(X, Q, S, MN, Y, WS, M, N, K, stride_xm, stride_qn, stride_ym, groups_per_split,
                         GROUP: tl.constexpr, BITS: tl.constexpr, BLOCK_M: tl.constexpr,
                         BLOCK_N: tl.constexpr, SPLIT_K: tl.constexpr, INTERP: tl.constexpr):
    rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    pid_k = tl.program_id(2)
    m_ok = rm < M
    n_ok = rn < N
    n_groups = K // GROUP
    g_lo = pid_k * groups_per_split
    g_hi = tl.minimum(g_lo + groups_per_split, n_groups)
    x_row = X + rm[:, None] * stride_xm
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for g in range(g_lo, g_hi):
        if BITS == 4:  # a group's GROUP / 2 bytes of a row are contiguous: even feature, low nibble
            rb = tl.arange(0, GROUP // 2)
            b = tl.load(Q + rn[:, None] * stride_qn + (g * (GROUP // 2) + rb[None, :]),
                        mask=n_ok[:, None], other=0)
            xe = tl.load(x_row + (g * GROUP + 2 * rb[None, :]), mask=m_ok[:, None], other=0.0)
            xo = tl.load(x_row + (g * GROUP + 2 * rb[None, :] + 1), mask=m_ok[:, None], other=0.0)
            part = (_dot_x(xe, b & 0xF, INTERP)
                    + _dot_x(xo, b >> 4, INTERP))
            xsum = tl.sum(xe.to(tl.float32) + xo.to(tl.float32), axis=1)
        else:
            rk = tl.arange(0, GROUP)
            q = tl.load(Q + rn[:, None] * stride_qn + (g * GROUP + rk[None, :]), mask=n_ok[:, None], other=0)
            xg = tl.load(x_row + (g * GROUP + rk[None, :]), mask=m_ok[:, None], other=0.0)
            part = _dot_x(xg, q, INTERP)
            xsum = tl.sum(xg.to(tl.float32), axis=1)
        s = tl.load(S + rn * n_groups + g, mask=n_ok, other=0.0).to(tl.float32)
        mn = tl.load(MN + rn * n_groups + g, mask=n_ok, other=0.0).to(tl.float32)
        acc += part * s[None, :] + xsum[:, None] * mn[None, :]
    out_mask = m_ok[:, None] & n_ok[None, :]
    if SPLIT_K == 1:
        tl.store(Y + rm[:, None] * stride_ym + rn[None, :], round_to(acc, Y.dtype.element_ty),
                 mask=out_mask)
    else:
        tl.store(WS + pid_k * (M * N) + rm[:, None] * N + rn[None, :], acc, mask=out_mask)


@triton.jit
def _split_k_sum_kernel(WS, Y, M, N, stride_ym, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr):
    """y = the split partial sums added in split order (deterministic; no atomics)."""
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < M * N
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(SPLIT_K):
        acc += tl.load(WS + s * (M * N) + offs, mask=ok, other=0.0)
    tl.store(Y + (offs // N) * stride_ym + offs % N, round_to(acc, Y.dtype.element_ty), mask=ok)


@dataclass(frozen=True, slots=True)
class Config:
    block_n: int
    num_warps: int
    num_stages: int


# Each candidate gives every thread a 16-byte run of a 4-bit group's codes to load (BLOCK_N * 16 bytes
# over 32 * num_warps threads): one cp.async of 16 bytes, as the sm_90 compile shows.
DEFAULT = Config(128, 4, 4)
# What the first CUDA call per (N, K, dtype, bits, group) times (MFS_QMM_TUNE=0: DEFAULT only).
CANDIDATES = (Config(32, 1, 4), Config(64, 2, 4), Config(64, 2, 6), Config(128, 4, 3), Config(128, 4, 5),
              Config(256, 8, 4))


def interpreter_config(N: int) -> Config:
    """The interpreter's cost is per op, not per element: tiles half of N wide (16..2048) make a test
    at serving shapes ~20x quicker than BLOCK_N 64 (N 6144: 13 s, not 290 s) and still cross tile
    edges. Tile sizes change no branch; the split is still :func:`split_k`'s."""
    return Config(max(16, min(2048, triton.next_power_of_2(N) // 2)), 4, 4)


_CHOSEN: dict[tuple, Config] = {}
TARGET_PROGRAMS = 264  # two waves of 132 SMs (H100/H200) at BLOCK_N 64
MIN_GROUPS_PER_SPLIT = 8


def split_k(N: int, K: int, group: int) -> int:
    """How many contiguous ranges K's groups are cut into: a power of two that brings the N tiles (at
    BLOCK_N 64) near TARGET_PROGRAMS, each range at least MIN_GROUPS_PER_SPLIT groups. From the weight's
    shape only -- never the batch, the device or a timing -- so every call with this weight sums in
    the same order."""
    tiles, groups = -(-N // 64), K // group
    split = 1
    while tiles * split * 2 <= TARGET_PROGRAMS and groups // (split * 2) >= MIN_GROUPS_PER_SPLIT:
        split *= 2
    return split


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
    require(group >= 32 and group & (group - 1) == 0,
            "the group must be a power of two >= 32 (the tensor cores' k), got {}", group)
    require(x.shape[-1] == K, "x's last dim {} != the weight's K {}", x.shape[-1], K)
    require(N * K <= INT32_MAX, "the weight's {} x {} elements overflow the kernel's int32 offsets", N, K)
    for name, t in (("scales", scales), ("mins", mins)):
        require(t.shape == (N, K // group), "{} must be [{}, {}], got {}", name, N, K // group, t.shape)
        require(t.dtype == torch.float16, "{} must be float16, got {}", name, t.dtype)
        require(t.is_contiguous(), "{} must be contiguous", name)
    return N, K


def _launch(cfg: Config, x2, qweight, scales, mins, y, group: int, bits: int, interp: bool) -> None:
    M, K = x2.shape
    N = y.shape[1]
    split = split_k(N, K, group)
    require(split * M * N <= INT32_MAX and M * max(x2.stride(0), y.stride(0)) <= INT32_MAX,
            "a batch of {} rows overflows the kernel's int32 offsets; split the batch", M)
    ws = y if split == 1 else torch.empty((split, M, N), dtype=torch.float32, device=y.device)
    gps = -(-(K // group) // split)
    grid = (triton.cdiv(M, BLOCK_M), triton.cdiv(N, cfg.block_n), split)
    extra = {} if interp else {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages}
    _quant_matmul_kernel[grid](x2, qweight, scales, mins, y, ws, M, N, K, x2.stride(0), qweight.stride(0),
                               y.stride(0), gps,
                               GROUP=group, BITS=bits, BLOCK_M=BLOCK_M, BLOCK_N=cfg.block_n,
                               SPLIT_K=split, INTERP=interp, **extra)
    if split > 1:
        block = 1024
        _split_k_sum_kernel[(triton.cdiv(M * N, block),)](ws, y, M, N, y.stride(0), SPLIT_K=split,
                                                          BLOCK=block)


def _pick_config(key: tuple, args: tuple, interp: bool) -> Config:
    """The tile config of one (N, K, dtype, bits, group), chosen once and kept: on CUDA the fastest
    of CANDIDATES on a one-row x (decode's batch), timed outside any graph capture; interpreter_config's in the
    interpreter; DEFAULT with MFS_QMM_TUNE=0, or when the first call is being captured into a CUDA graph."""
    cfg = _CHOSEN.get(key)
    if cfg is not None:
        return cfg
    cfg = interpreter_config(key[0]) if interp else DEFAULT
    if not interp and switches.current().qmm_tune and \
            not torch.cuda.is_current_stream_capturing():
        cfg = _time_candidates(*args)
    _CHOSEN[key] = cfg
    return cfg


def _time_candidates(x2, qweight, scales, mins, y, group: int, bits: int) -> Config:
    x1 = x2[:1].clone()
    y1 = torch.empty((1, y.shape[1]), dtype=y.dtype, device=y.device)
    best, best_ms = DEFAULT, float("inf")
    for cfg in CANDIDATES:
        try:
            run = lambda c=cfg: _launch(c, x1, qweight, scales, mins, y1, group, bits, False)  # noqa: E731
            ms = triton.testing.do_bench(run, warmup=5, rep=20)
        except Exception:  # noqa: BLE001 -- a config that does not fit this GPU is skipped
            continue
        if ms < best_ms:
            best, best_ms = cfg, ms
    return best


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
    key = (N, K, x.dtype, bits, group, x.device)
    cfg = _pick_config(key, (x2, qweight, scales, mins, y, group, bits), interp)
    _launch(cfg, x2, qweight, scales, mins, y, group, bits, interp)
    return y.view(*lead, N)


__all__ = ["quant_matmul_triton", "split_k", "Config", "CANDIDATES", "DEFAULT", "BLOCK_M"]
