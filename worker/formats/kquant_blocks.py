"""GGUF's block types beyond Q4_1 (Q4_0, Q5_0, Q5_1, Q8_0 and the K-quants Q4_K, Q5_K, Q6_K): their sizes and
their dequantization to fp32 in torch, bit for bit what ``gguf.quants.dequantize`` (gguf-py) gives,
the same multiplications in the same order (what transformers fills a GGUF model's weights with).

A tensor's rows are ``uint8 [N, bytes per row]``, each row whole blocks of :data:`BLOCKS` ``[kind]``.
Layouts (one block; fp16 values little-endian):

* Q4_0 (32 values, 18 bytes): d, 16 bytes of codes (value j in byte j's low nibble, j + 16 in its
  high one); w = d * (q - 8).
* Q5_0 (32, 22): d, 4 bytes of high bits (bit j of the little-endian uint32 is value j's), then Q4_0's
  16 bytes of low nibbles; w = d * (q - 16).
* Q5_1 (32, 24): d, m, then Q5_0's 4 bytes of high bits and 16 of low nibbles; w = d * q + m.
* Q8_0 (32, 34): d, 32 int8; w = d * q.
* Q4_K (256, 144): d, dmin, 12 bytes of eight 6-bit scales and eight 6-bit mins (:func:`k_scales`),
  128 bytes of codes: byte j of chunk c (32 bytes) holds sub-block 2c's value j (low nibble) and
  sub-block 2c + 1's (high); w = (d * sc) * q - (dmin * m), one (sc, m) per sub-block of 32.
* Q5_K (256, 176): Q4_K's header, 32 bytes of high bits (bit s of byte j: sub-block s, value j), then
  Q4_K's 128 bytes of low nibbles; the same w with q in 0..31.
* Q6_K (256, 210): 128 bytes of low nibbles, 64 of high bit pairs, 16 int8 scales (one per 16 values),
  d; w = (d * scale) * (q - 32) with q in 0..63 (:func:`q6_k_codes` says where each bit lives).
"""
from __future__ import annotations

import torch

# kind -> (values per block, bytes per block), as gguf's GGML_QUANT_SIZES
BLOCKS: dict[str, tuple[int, int]] = {"Q4_0": (32, 18), "Q5_0": (32, 22), "Q8_0": (32, 34), "Q4_K": (256, 144),
                                      "Q5_K": (256, 176), "Q6_K": (256, 210), "Q5_1": (32, 24)}


def _half(b: torch.Tensor) -> torch.Tensor:
    """uint8 [..., 2] little-endian fp16 -> fp32 [...]."""
    return b.contiguous().view(torch.float16).squeeze(-1).float()


def _nibbles(qs: torch.Tensor, chunk: int = 16) -> torch.Tensor:
    """uint8 [n, chunk * c] -> [n, 2 * chunk * c]: per ``chunk`` bytes their low nibbles, then their high ones."""
    n = qs.shape[0]
    b = qs.reshape(n, -1, 1, chunk)
    return torch.cat([b & 0x0F, b >> 4], dim=2).reshape(n, -1)


def _bits(qh: torch.Tensor, count: int) -> torch.Tensor:
    """uint8 [n, 4] (a little-endian uint32) -> uint8 [n, count]: bit i of the word at i."""
    word = qh.contiguous().view(torch.int32).long() & 0xFFFFFFFF  # [n, 1]
    return ((word >> torch.arange(count)) & 1).to(torch.uint8)


def rows_to_blocks(raw: torch.Tensor, kind: str) -> torch.Tensor:
    """uint8 [N, G * bytes] -> uint8 [N * G, bytes] (ValueError when the rows are not whole blocks)."""
    if kind not in BLOCKS:
        raise ValueError(f"GGUF block kind {kind!r}: expected one of {', '.join(BLOCKS)}")
    size = BLOCKS[kind][1]
    if raw.dim() != 2 or raw.dtype != torch.uint8 or raw.shape[1] % size:
        raise ValueError(f"{kind} rows must be uint8 [N, a multiple of {size}], got {raw.dtype} {list(raw.shape)}")
    return raw.reshape(-1, size)


def k_scales(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K / Q5_K's 12 scale bytes [n, 12] -> (sc, m), each uint8 [n, 8] in 0..63. Bytes 0..3 hold
    sc 0..3 (low 6 bits) and the top 2 bits of sc 4..7; bytes 4..7 m 0..3 and the top bits of m 4..7;
    bytes 8..11 the low 4 bits of sc 4..7 (low nibble) and of m 4..7 (high)."""
    d, m, md = scales[:, 0:4], scales[:, 4:8], scales[:, 8:12]
    sc = torch.cat([d & 0x3F, (md & 0x0F) | ((d >> 2) & 0x30)], dim=-1)
    mn = torch.cat([m & 0x3F, (md >> 4) | ((m >> 2) & 0x30)], dim=-1)
    return sc, mn


def q6_k_codes(ql: torch.Tensor, qh: torch.Tensor) -> torch.Tensor:
    """Q6_K's codes: ql [n, 128], qh [n, 64] -> uint8 [n, 256] in 0..63. Per half h of 128 values:
    value v's low nibble is byte 64h + v % 64 of ql (low nibble for v < 64, high otherwise), its high
    two bits are bits 2 (v // 32) of byte 32h + v % 32 of qh."""
    n = ql.shape[0]
    lo = (ql.reshape(n, 2, 1, 64) >> torch.tensor([0, 4], dtype=torch.uint8).view(1, 1, 2, 1)) & 0x0F
    hi = (qh.reshape(n, 2, 1, 32) >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(1, 1, 4, 1)) & 0x03
    return (lo.reshape(n, 256) | (hi.reshape(n, 256) << 4))


def codes(raw: torch.Tensor, kind: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Rows of ``kind`` -> (q, scale, mins) with w = scale * q - mins exactly in real arithmetic, per
    group of 32 values (16 for Q6_K): q int8 [N, K] (the offset already taken: Q4_0's q - 8, ...),
    scale fp32 [N, K / g] (d, or d * sc), mins fp32 [N, K / 32] (dmin * m; Q5_1's -m, which less is
    exactly plus m; None for kinds without)."""
    N = raw.shape[0]
    b = rows_to_blocks(raw, kind)
    if kind == "Q5_1":
        q = _nibbles(b[:, 8:24]) | (_bits(b[:, 4:8], 32) << 4)
        return q.to(torch.int8).reshape(N, -1), _half(b[:, 0:2]).view(N, -1), -_half(b[:, 2:4]).view(N, -1)
    if not kind.endswith("_K"):
        d = _half(b[:, 0:2]).view(N, -1)
        if kind == "Q8_0":
            q = b[:, 2:].contiguous().view(torch.int8)
        elif kind == "Q4_0":
            q = _nibbles(b[:, 2:18]).to(torch.int8) - 8
        else:
            q = (_nibbles(b[:, 6:22]) | (_bits(b[:, 2:6], 32) << 4)).to(torch.int8) - 16
        return q.reshape(N, -1), d, None
    n = b.shape[0]
    if kind == "Q6_K":
        q = q6_k_codes(b[:, 0:128], b[:, 128:192]).to(torch.int8) - 32
        scale = _half(b[:, 208:210])[:, None] * b[:, 192:208].contiguous().view(torch.int8).float()
        return q.reshape(N, -1), scale.reshape(N, -1), None
    d, dmin = _half(b[:, 0:2])[:, None], _half(b[:, 2:4])[:, None]
    sc, m = k_scales(b[:, 4:16])
    q = _nibbles(b[:, -128:], 32).view(n, 8, 32)
    if kind == "Q5_K":
        q = q | (((b[:, 16:48].reshape(n, 1, 32) >> torch.arange(8, dtype=torch.uint8).view(1, 8, 1)) & 1) << 4)
    return q.to(torch.int8).reshape(N, -1), (d * sc.float()).reshape(N, -1), (dmin * m.float()).reshape(N, -1)


def dequantize(raw: torch.Tensor, kind: str) -> torch.Tensor:
    """uint8 rows [N, G * bytes] of ``kind`` -> fp32 [N, G * values], bit for bit gguf-py's: the same
    products in the same order ((d * sc) * q, then less dmin * m)."""
    q, scale, mins = codes(raw, kind)
    N, K = q.shape
    g = K // scale.shape[1]
    w = scale.view(N, -1, 1) * q.view(N, -1, g).float()
    if mins is not None:
        w = w - mins.view(N, -1, 1)
    return w.reshape(N, K)


__all__ = ["BLOCKS", "codes", "dequantize", "k_scales", "q6_k_codes", "rows_to_blocks"]
