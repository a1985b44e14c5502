"""Weight-only group-quantized matmul: the layout the GPU serves low-bit weights in, and its torch
reference (the Triton kernel beside it is :mod:`kernels.quant_matmul_triton`).

A weight ``W [N, K]`` is stored as codes ``q`` with one ``(scale, min)`` pair per group of ``group``
consecutive input features of an output row, and dequantizes as ``w = q * scale + min`` in fp32 —
GGUF's Q4_1 (``d * q + m``) and Q8_0 (``d * q``, min 0) as they ship, so their blocks load with no
second rounding, and ``q * scale`` is exact for fp16 scales, so one fp32 rounding gives the value
transformers' GGUF loader computes.

* 4 bits: ``qweight`` uint8 ``[N, K / 2]``, byte ``j`` of a row holding input feature ``2 j`` in its low
  nibble and ``2 j + 1`` in its high nibble, codes 0..15.
* 8 bits: ``qweight`` int8 ``[N, K]``, codes -127..127.
* ``scales`` and ``mins``: fp16 ``[N, K / group]`` (GGUF's own precision).
"""
from __future__ import annotations

import torch

BITS = (4, 8)


def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """Codes [N, K] in 0..15 (any integer dtype) -> uint8 [N, K / 2], even feature in the low nibble."""
    assert q.dim() == 2 and q.shape[1] % 2 == 0
    q = q.to(torch.uint8)
    return (q[:, 0::2] | (q[:, 1::2] << 4)).contiguous()


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K / 2] -> uint8 codes [N, K]."""
    lo, hi = packed & 0x0F, packed >> 4
    return torch.stack([lo, hi], dim=-1).view(packed.shape[0], -1)


def codes(qweight: torch.Tensor, bits: int) -> torch.Tensor:
    return unpack_int4(qweight) if bits == 4 else qweight


def dequantize(qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, group: int,
               bits: int) -> torch.Tensor:
    """The fp32 weight [N, K]: q * scale + min, one rounding (q * scale is exact for fp16 scales)."""
    q = codes(qweight, bits).float()
    N, K = q.shape
    g = q.view(N, K // group, group)
    return (g * scales.float()[..., None] + mins.float()[..., None]).view(N, K)


def quant_matmul_torch(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                       mins: torch.Tensor, group: int, bits: int) -> torch.Tensor:
    """y = x @ dequantize(...).T in fp32, returned in x's dtype. x [..., K]."""
    w = dequantize(qweight, scales, mins, group, bits)
    return (x.float() @ w.t()).to(x.dtype)


def quant_matmul_fp64(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor,
                      group: int, bits: int) -> torch.Tensor:
    """The exact product in fp64 (the reference kernels are checked against): every weight
    ``q * scale + min`` is exact in fp64, so the only error left is fp64's summation."""
    w = dequantize_fp64(qweight, scales, mins, group, bits)
    return x.double() @ w.t()


def dequantize_fp64(qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, group: int,
                    bits: int) -> torch.Tensor:
    q = codes(qweight, bits).double()
    N, K = q.shape
    return (q.view(N, K // group, group) * scales.double()[..., None]
            + mins.double()[..., None]).view(N, K)


# Unit roundoff of each output dtype: rounding the fp32 sum to it errs by at most u * |y|.
UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11}


def error_bound(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor,
                group: int, bits: int, out_dtype: torch.dtype, exact: torch.Tensor | None = None
                ) -> torch.Tensor:
    """The most a kernel's output may differ from :func:`quant_matmul_fp64`, element by element (fp64).

    A kernel that sums ``s * sum(q x) + m * sum(x)`` per group in fp32 adds, along any summation tree,
    at most ``depth = group + K / group + 4`` roundings of 2**-24 to terms bounded by
    ``T = |x| @ (|q s| + |m|).T`` (the magnitudes it actually adds: |x|·|W| with W's two parts apart);
    twice that allows for fp32 activations split into bf16 pieces. Then the output's one rounding:
    ``u_out * (|y| + acc)``, with u_out the output dtype's unit roundoff (half its ulp). A wrong code,
    scale or group is off by O(|y|) ~ sqrt(K)·|x||w|, orders of magnitude above this for K >= 32."""
    q = codes(qweight, bits).double()
    N, K = q.shape
    s, m = scales.double()[..., None], mins.double()[..., None]
    mag = ((q.view(N, K // group, group) * s).abs() + m.abs()).view(N, K)
    terms = x.double().abs() @ mag.t()
    acc = 2 * (group + K // group + 4) * 2.0**-24 * terms
    if exact is None:
        exact = quant_matmul_fp64(x, qweight, scales, mins, group, bits)
    tiny = torch.finfo(out_dtype).tiny
    return acc + UNIT_ROUNDOFF[out_dtype] * (exact.abs() + acc) + tiny


def within_bound(got: torch.Tensor, x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                 mins: torch.Tensor, group: int, bits: int) -> tuple[bool, float]:
    """(every element within :func:`error_bound`, the largest error / bound ratio)."""
    exact = quant_matmul_fp64(x, qweight, scales, mins, group, bits)
    bound = error_bound(x, qweight, scales, mins, group, bits, got.dtype, exact)
    ratio = float(((got.double() - exact).abs() / bound).max()) if got.numel() else 0.0
    return ratio <= 1.0, ratio


def quantize_groups(w: torch.Tensor, group: int, bits: int
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp32 W [N, K] -> (qweight, scales, mins) in the layout above. 4 bits: asymmetric min/max per
    group, as Q4_1; 8 bits: symmetric absmax per group, as Q8_0. Scale and min are rounded to fp16
    first and the codes rounded against them, so the stored triple is what was quantized."""
    assert bits in BITS and w.dim() == 2 and w.shape[1] % group == 0
    w = w.detach().float()
    N, K = w.shape
    g = w.view(N, K // group, group)
    tiny = torch.finfo(torch.float16).tiny
    if bits == 4:
        lo, hi = g.amin(dim=-1), g.amax(dim=-1)
        d = ((hi - lo) / 15).clamp_min(tiny).half()
        m = lo.half()
        q = torch.round((g - m.float()[..., None]) / d.float()[..., None]).clamp_(0, 15)
        return pack_int4(q.view(N, K)), d, m
    d = (g.abs().amax(dim=-1) / 127).clamp_min(tiny).half()
    q = torch.round(g / d.float()[..., None]).clamp_(-127, 127).to(torch.int8).view(N, K)
    return q.contiguous(), d, torch.zeros_like(d)


__all__ = ["BITS", "pack_int4", "unpack_int4", "codes", "dequantize", "quant_matmul_torch", "quantize_groups",
           "quant_matmul_fp64", "dequantize_fp64", "error_bound", "within_bound", "UNIT_ROUNDOFF"]
