"""Weight-only quantized serving on CPU: the packed formats, and the swap that puts them into a loaded
model after its weights (and any precipitation delta) are final.

Owns:
* :class:`Int8Linear` — int8 per output channel: on an AVX2 or AVX-512 CPU our operator ``mfs::int8_gemv``
  (``kernels/cpu_gemv.cpp``: fp32 activations, ~2x torch's kernel's speed at one row on both machines),
  else ``torch._weight_int8pack_mm`` (or, for the LM head under ``compile_decode`` on an AVX-512 CPU
  where our operator does not build, a compiled fp32-activation kernel: ``rows_kernel``).
* :class:`Int4Linear` — 4-bit, group-wise scale and zero along K, ``torch._weight_int4pack_mm_for_cpu``.
  The kernel dequantizes ``w = fma(q - 8, scale, zero)`` (checked in tests against its own output).

Both torch kernels are vectorized only for bf16 activations (torch 2.13 CPU, AVX2 and AVX-512
dispatch alike); with fp32 activations they run a scalar loop that re-reads the weights for every row
of the batch, 10-60x slower than fp32 ``F.linear`` (``mfs bench linears``). So serving casts the
activations to bf16 at each quantized linear and the result back to fp32, and the scales are bf16.
Int4Linear also keeps its scales and zeros in fp32: the exact form, which the fp32 kernel
dequantizes bit for bit (``exact=True``: tests and the perplexity reference, not for speed).
* :class:`worker.quant_w8a8.Int8DynamicLinear` (``w8a8``) — the same int8 weights times int8 activations
  quantized per row (fbgemm): a batch's rows cost a quarter of the arithmetic, so a step is nearly flat
  in its rows; slower than int4 at one row (twice the bytes).
* :class:`Int8Embedding` — int8 rows with one scale per 32 values (GGUF's Q8_0 layout); a lookup
  dequantizes only the rows it reads.
* :class:`Q4A8Linear` (``w4a8``, CPU with AVX2; AVX-512 VNNI used where present) — the GGUF's own Q4_1 blocks (or fp32 weights quantized
  the same way) times activations quantized to 8 bits per 32 values, as llama.cpp runs such a model:
  our operators ``mfs::w4a8_tile_gemv`` (16 output rows interleaved, a register lane per output: the
  linears whose outputs are a multiple of 16, all of the models') and ``mfs::w4a8_gemv`` (the rest) sum
  each block's products exactly in integers. Fewest bytes and the
  least arithmetic per weight of the CPU modes: the fastest mode on both machines (``--weights auto``).
  Its LM head is :class:`Int8A8Linear`: int8 per row times the same 8-bit activations.
* On CUDA (``layout="groups"``): :class:`worker.quant_groups.GroupQuantLinear`, GGUF-style codes with an
  fp16 (scale, min) per group of 32, served by a Triton dequantize-matmul; Q4_1 blocks load as they ship.
* :func:`fuse_projections` — each decoder layer's q/k/v and gate/up linears of one quantized kind
  become one linear each (their packed rows concatenated: the outputs are the same bit for bit, checked
  on a random input at fusion time): per layer 4 matmuls and 4 activation casts instead of 7 and 7.
* :func:`quantize_model` — replaces every ``nn.Linear`` and ``nn.Embedding`` of a model, whatever
  submodule holds it, then fuses. Where the source GGUF ships a tensor as Q4_1 or Q8_0 and the model still holds
  exactly its dequantized values, the GGUF's own blocks are repacked (no second rounding): Q4_1's
  ``d * q + m`` becomes ``scale = d, zero = m + 8 d``, which the int4 kernel dequantizes bit for bit to
  what transformers' GGUF loader produces. Anything else (HF checkpoints, tensors a delta changed, new
  exit blocks) is quantized from its fp32 values.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Callable, Iterator

import structlog
import torch
from torch import nn

from kernels.cpu_gemv import (int8_gemv_kernel, load as load_cpu_gemv, pack_q4_rows, tile_int8_rows, tile_q4_rows,
                               unpack_q4_rows, untile_int8_rows, untile_q4_rows)
from worker.quant_groups import GroupQuantLinear
from worker.quant_w8a8 import Int8DynamicLinear

log = structlog.get_logger(__name__)

MODES = ("auto", "fp32", "int8", "int4", "w8a8", "w4a8")
_GGUF_LAYER_NAMES = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
                     "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}
_Q4_1_BYTES, _Q8_0_BYTES, _GGUF_BLOCK = 20, 34, 32
_INT4_PACK_ROWS = 64  # _convert_weight_to_int4pack_for_cpu lays rows out in blocks of this many


# ---- packed modules -------------------------------------------------------------------------
def _tiles(out_features: int) -> bool:
    """w4a8's linears and head in tiles of 16 rows: where N % 16 == 0, unless MFS_W4A8_TILES=0."""
    return out_features % 16 == 0 and os.environ.get("MFS_W4A8_TILES", "1") != "0"


class Int8Linear(nn.Module):
    """y = x @ (q * scale[:, None]).T + b, q int8 [N, K], one fp32 scale per output channel."""

    def __init__(self, q: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        assert q.dtype == torch.int8 and q.dim() == 2 and scales.shape == (q.shape[0],)
        self.in_features, self.out_features = q.shape[1], q.shape[0]
        # Parameters (frozen), not buffers: weight_bytes() and .to() see them like any weight.
        self.scales = nn.Parameter(scales.to(torch.bfloat16).contiguous(), requires_grad=False)
        self.qweight = nn.Parameter(q.contiguous(), requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach().float(), requires_grad=False)

    @classmethod
    def from_float(cls, w: torch.Tensor, bias: torch.Tensor | None = None) -> "Int8Linear":
        """Symmetric per channel; q is rounded against the bf16 scale the kernel will use."""
        w = w.detach().float()
        scales = (w.abs().amax(dim=1) / 127).clamp_min(1e-30).to(torch.bfloat16).float()
        q = torch.round(w / scales[:, None]).clamp_(-127, 127).to(torch.int8)
        return cls(q, scales, bias)

    # a callable (x [M, K] fp32, qweight, scales) -> [M, N] that replaces the default kernel for this
    # module: the compiled head of ``NestedModel.compile_decode`` on AVX-512 without our operator
    # (worker/compiled_step.py: int8_rows); None: the default, :func:`kernels.cpu_gemv.int8_gemv_kernel`
    # where it serves (AVX2, AVX-512), else torch's bf16 kernel
    rows_kernel = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        kernel = self.rows_kernel or (int8_gemv_kernel() if x.device.type == "cpu" else None)
        if kernel is not None:
            y = kernel(x.reshape(-1, shape[-1]).float().contiguous(), self.qweight, self.scales)
        else:
            y = torch._weight_int8pack_mm(x.reshape(-1, shape[-1]).to(torch.bfloat16), self.qweight,
                                          self.scales).float()
        if self.bias is not None:
            y = y + self.bias
        return y.view(*shape[:-1], self.out_features)

    def dequantize(self) -> torch.Tensor:
        return self.qweight.float() * self.scales.float()[:, None]


class Int8A8Linear(Int8Linear):
    """The LM head of ``w4a8``: :class:`Int8Linear`'s weights (int8, one scale per output row) times
    activations quantized to 8 bits per 32 values as w4a8's linears quantize them (llama.cpp runs a
    Q8_0 output matrix so), served by ``mfs::int8_a8_gemv``: each block's products summed exactly in
    integers, where ``mfs::int8_gemv`` widens every weight to fp32 once per pair of activation rows.
    Same bytes, a fraction of the arithmetic per extra row (a 6-row head on the AVX-512 machine:
    docs/BENCHMARKS.md, "Both machines' kernels").

    ``tiled`` (N % 16 == 0, unless ``MFS_W4A8_TILES=0``), as :class:`Q4A8Linear`: ``qweight`` the same
    bytes interleaved 16 rows to a tile (``kernels.cpu_gemv.tile_int8_rows``, [N/16, K/32, 8, 16, 4]),
    served by ``mfs::int8_a8_tile_gemv``, a register lane per output row."""

    def __init__(self, q: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None):
        if q.shape[1] % _GGUF_BLOCK:
            raise ValueError(f"8-bit activations go per {_GGUF_BLOCK} inputs; this head has {q.shape[1]}")
        load_cpu_gemv()  # the operator forward calls (built once per machine, loaded once per process)
        super().__init__(q, scales, bias)
        self.tiled = _tiles(q.shape[0])
        if self.tiled:
            self.qweight = nn.Parameter(tile_int8_rows(self.qweight.data), requires_grad=False)

    @staticmethod
    def supports(in_features: int) -> bool:
        return in_features % _GGUF_BLOCK == 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.rows_kernel is not None:
            if self.tiled:  # rows_kernel takes [N, K] rows; compile_decode never sets it on a tiled head
                raise RuntimeError("a tiled int8 a8 head has no rows_kernel path (MFS_W4A8_TILES=0 for one)")
            return super().forward(x)
        shape = x.shape
        op = torch.ops.mfs.int8_a8_tile_gemv if self.tiled else torch.ops.mfs.int8_a8_gemv
        y = op(x.reshape(-1, shape[-1]).float().contiguous(), self.qweight, self.scales)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*shape[:-1], self.out_features)

    def dequantize(self) -> torch.Tensor:
        q = untile_int8_rows(self.qweight) if self.tiled else self.qweight
        return q.float() * self.scales.float()[:, None]


class Q4A8Linear(nn.Module):
    """``w4a8``: 4-bit weight blocks as GGUF's Q4_1 ships them (per 32 inputs 16 bytes of codes u and
    an fp16 (d, m), the weight d * u + m) times activations quantized to 8 bits per 32 values, as
    llama.cpp runs a Q4_1 model on a CPU, on our operators (``kernels/cpu_gemv.cpp``, AVX2 or AVX-512
    VNNI): the 32 products of a block summed exactly in integers. The weights are the GGUF's own (bit
    for bit what transformers' loader dequantizes) or quantized from fp32 the same way.

    ``tiled`` (N % 16 == 0, unless ``MFS_W4A8_TILES=0``): the same bytes interleaved 16 rows to a tile
    (``kernels.cpu_gemv.tile_q4_rows``: ``qweight`` [N/16, K/32, 4, 16, 4], ``dm`` [N/16, K/32, 2, 16]),
    served by ``mfs::w4a8_tile_gemv``, where a register lane is one output row: about half the
    instructions per activation row of ``mfs::w4a8_gemv``, which serves the row layout
    (``qweight`` [N, K/2], ``dm`` [N, K/32, 2]) otherwise. The two sum in different orders (each the
    same at any batch size), so their outputs differ in the last bits."""

    def __init__(self, u: torch.Tensor, d: torch.Tensor, m: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        N, K = u.shape
        assert K % _GGUF_BLOCK == 0 and d.shape == m.shape == (N, K // _GGUF_BLOCK)
        load_cpu_gemv()  # the operator forward calls (built once per machine, loaded once per process)
        self.in_features, self.out_features = K, N
        packed, dm = pack_q4_rows(u), torch.stack([d, m], dim=-1).half().contiguous()
        self.tiled = _tiles(N)
        if self.tiled:
            packed, dm = tile_q4_rows(packed, dm)
        self.qweight = nn.Parameter(packed, requires_grad=False)
        self.dm = nn.Parameter(dm, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach().float(), requires_grad=False)

    @staticmethod
    def supports(in_features: int) -> bool:
        return in_features % _GGUF_BLOCK == 0

    @classmethod
    def from_q4_1(cls, u: torch.Tensor, d: torch.Tensor, m: torch.Tensor,
                  bias: torch.Tensor | None = None) -> "Q4A8Linear":
        """The GGUF's Q4_1 blocks as they ship (d and m were read from fp16)."""
        assert torch.equal(d.half().float(), d.float()) and torch.equal(m.half().float(), m.float())
        return cls(u, d, m, bias)

    @classmethod
    def from_float(cls, w: torch.Tensor, bias: torch.Tensor | None = None) -> "Q4A8Linear":
        """Q4_1's recipe per 32 inputs: m = min, d = (max - min) / 15, both rounded to fp16 first,
        u = round((w - m) / d) in 0..15."""
        w = w.detach().float()
        N, K = w.shape
        g = w.view(N, K // _GGUF_BLOCK, _GGUF_BLOCK)
        lo, hi = g.amin(dim=-1), g.amax(dim=-1)
        m = lo.half().float()
        d = ((hi - m) / 15).clamp_min(1e-7).half().float()
        u = torch.round((g - m[..., None]) / d[..., None]).clamp_(0, 15).view(N, K)
        return cls(u, d, m, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        op = torch.ops.mfs.w4a8_tile_gemv if self.tiled else torch.ops.mfs.w4a8_gemv
        y = op(x.reshape(-1, shape[-1]).float().contiguous(), self.qweight, self.dm)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*shape[:-1], self.out_features)

    def dequantize(self) -> torch.Tensor:
        packed, dm = untile_q4_rows(self.qweight, self.dm) if self.tiled else (self.qweight, self.dm)
        u = unpack_q4_rows(packed).float().view(self.out_features, -1, _GGUF_BLOCK)
        d, m = dm.float().unbind(-1)
        return (d[..., None] * u + m[..., None]).view(self.out_features, self.in_features)


class Int4Linear(nn.Module):
    """4-bit weights packed for ``_weight_int4pack_mm_for_cpu``: ``w = fma(q - 8, scale, zero)`` with
    one (scale, zero) per group of ``group`` input features per output channel."""

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group: int,
                 bias: torch.Tensor | None, exact: bool = False):
        super().__init__()
        N, K = q.shape
        assert scale.shape == zero.shape == (N, K // group) and K % group == 0 and N % 16 == 0
        self.in_features, self.out_features, self.group = K, N, group
        self.exact = exact  # fp32 scales/zeros and the fp32 kernel: bit-exact weights, slow
        sz = torch.stack([scale.float().t(), zero.float().t()], dim=-1).contiguous()  # [K/g, N, 2]
        self.scales_zeros = nn.Parameter(sz if exact else sz.to(torch.bfloat16), requires_grad=False)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 1)
        self.qweight = nn.Parameter(packed, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach().float(), requires_grad=False)

    @staticmethod
    def supports(out_features: int, in_features: int, group: int) -> bool:
        return out_features % 16 == 0 and in_features % group == 0

    @classmethod
    def from_float(cls, w: torch.Tensor, group: int, bias: torch.Tensor | None = None) -> "Int4Linear":
        """Asymmetric min/max per group, as Q4_1 does: q = round((w - min) / d), d = (max - min) / 15;
        d and the zero are rounded to bf16 first, so the fast kernel serves what was quantized."""
        w = w.detach().float()
        N, K = w.shape
        g = w.view(N, K // group, group)
        lo, hi = g.amin(dim=-1), g.amax(dim=-1)
        d = ((hi - lo) / 15).clamp_min(1e-30).to(torch.bfloat16).float()
        zero = (lo + 8 * d).to(torch.bfloat16).float()
        q = torch.round((g - (zero - 8 * d)[..., None]) / d[..., None]).clamp_(0, 15).view(N, K)
        return cls(q, d, zero, group, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).to(self.scales_zeros.dtype).contiguous()
        y = torch._weight_int4pack_mm_for_cpu(x2, self.qweight, self.group, self.scales_zeros).float()
        if self.bias is not None:
            y = y + self.bias
        return y.view(*shape[:-1], self.out_features)

    def dequantize(self) -> torch.Tensor:
        """The weights as the kernel itself sees them: it multiplies the identity (one product per
        output, no accumulation rounding)."""
        eye = torch.eye(self.in_features, dtype=self.scales_zeros.dtype, device=self.qweight.device)
        return torch._weight_int4pack_mm_for_cpu(eye, self.qweight, self.group, self.scales_zeros).t().float()


class Int8Embedding(nn.Module):
    """int8 rows, one fp32 scale per ``group`` values (GGUF's Q8_0 layout); d * q is exact in fp32."""

    def __init__(self, q: torch.Tensor, scales: torch.Tensor, group: int = _GGUF_BLOCK):
        super().__init__()
        V, H = q.shape
        assert q.dtype == torch.int8 and scales.shape == (V, H // group)
        self.num_embeddings, self.embedding_dim, self.group = V, H, group
        # scales first: the runner takes the KV cache dtype from the model's first parameter.
        self.scales = nn.Parameter(scales.float().contiguous(), requires_grad=False)
        self.qweight = nn.Parameter(q.contiguous(), requires_grad=False)

    @classmethod
    def from_float(cls, w: torch.Tensor, group: int = _GGUF_BLOCK) -> "Int8Embedding":
        w = w.detach().float()
        V, H = w.shape
        g = w.view(V, H // group, group)
        d = (g.abs().amax(dim=-1) / 127).clamp_min(torch.finfo(torch.float32).tiny)
        q = torch.round(g / d[..., None]).clamp_(-127, 127).to(torch.int8).view(V, H)
        return cls(q, d, group)

    @property
    def weight(self) -> torch.Tensor:
        """Only dtype and device are meaningful (model code allocates its outputs from them)."""
        return self.scales

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        q = self.qweight[ids].view(*ids.shape, self.embedding_dim // self.group, self.group)
        return (q.float() * self.scales[ids][..., None]).view(*ids.shape, self.embedding_dim)

    def dequantize(self) -> torch.Tensor:
        return self.forward(torch.arange(self.num_embeddings, device=self.qweight.device))


# ---- fusion ---------------------------------------------------------------------------------
def concat_linears(mods: list[nn.Module]) -> nn.Module | None:
    """One module computing ``cat([m(x) for m in mods], -1)``, for linears of one quantized kind and
    layout (both kernels' packed weights are laid out by output row); None when they differ."""
    first = mods[0]
    if any(type(m) is not type(first) for m in mods) or any(m.in_features != first.in_features for m in mods):
        return None
    if any((m.bias is None) != (first.bias is None) for m in mods):
        return None
    bias = None if first.bias is None else torch.cat([m.bias for m in mods])
    out = type(first).__new__(type(first))
    nn.Module.__init__(out)
    out.in_features, out.out_features = first.in_features, sum(m.out_features for m in mods)
    if isinstance(first, Int4Linear):
        if any(m.group != first.group or m.exact != first.exact for m in mods):
            return None
        if any(m.out_features % _INT4_PACK_ROWS for m in mods[:-1]):
            return None  # the CPU int4 pack interleaves rows in blocks of 64: pieces must not split one
        out.group, out.exact = first.group, first.exact
        out.scales_zeros = nn.Parameter(torch.cat([m.scales_zeros for m in mods], dim=1), requires_grad=False)
    elif isinstance(first, Int8Linear):
        if isinstance(first, Int8A8Linear):  # tiles of 16 rows concatenate as rows do; two layouts do not
            if any(m.tiled != first.tiled for m in mods):
                return None
            out.tiled = first.tiled
        out.scales = nn.Parameter(torch.cat([m.scales for m in mods]), requires_grad=False)
    elif isinstance(first, Q4A8Linear):  # rows (tiles of 16 rows) are independent
        if any(m.tiled != first.tiled for m in mods):
            return None
        out.tiled = first.tiled
        out.dm = nn.Parameter(torch.cat([m.dm for m in mods]), requires_grad=False)
    elif isinstance(first, Int8DynamicLinear):
        return Int8DynamicLinear.concat(mods)
    elif isinstance(first, GroupQuantLinear):  # rows are independent: every tensor concatenates by row
        if any(m.group != first.group or m.bits != first.bits for m in mods):
            return None
        out.group, out.bits = first.group, first.bits
        out.scales = nn.Parameter(torch.cat([m.scales for m in mods]), requires_grad=False)
        out.mins = nn.Parameter(torch.cat([m.mins for m in mods]), requires_grad=False)
    else:
        return None
    out.qweight = nn.Parameter(torch.cat([m.qweight for m in mods]), requires_grad=False)
    out.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)
    return out


_FUSIONS = (("qkv_proj", ("q_proj", "k_proj", "v_proj")), ("gate_up_proj", ("gate_proj", "up_proj")))


def fuse_projections(model: nn.Module) -> int:
    """Fuses q/k/v and gate/up of every decoder layer (trunk and exit blocks) whose linears
    :func:`concat_linears` can join and whose fused output equals the separate ones bit for bit on a
    random input; returns how many groups were fused."""
    fused = 0
    g = torch.Generator().manual_seed(0)
    for layer in model.modules():
        for target, names in _FUSIONS:
            if getattr(layer, target, "absent") is not None or not all(hasattr(layer, n) for n in names):
                continue
            mods = [getattr(layer, n) for n in names]
            f = concat_linears(mods)
            if f is None:
                continue
            x = torch.randn(3, f.in_features, generator=g).to(next(mods[0].parameters()).device)
            with torch.no_grad():
                if not torch.equal(f(x), torch.cat([m(x) for m in mods], dim=-1)):
                    log.warning("fusion changed the output: kept separate", linears=names)
                    continue
            setattr(layer, target, f)
            for n in names:
                delattr(layer, n)
            fused += 1
    return fused


# ---- GGUF blocks ----------------------------------------------------------------------------
def q4_1_blocks(raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q4_1 rows [N, G * 20] bytes -> q [N, K] uint8 (0..15), d [N, G] and m [N, G] fp32;
    w = d * q + m. A block: fp16 d, fp16 m, 16 bytes holding values j (low nibble) and j + 16 (high)."""
    N = raw.shape[0]
    b = raw.view(N, -1, _Q4_1_BYTES)
    d = b[..., 0:2].contiguous().view(torch.float16).squeeze(-1).float()
    m = b[..., 2:4].contiguous().view(torch.float16).squeeze(-1).float()
    qs = b[..., 4:]
    q = torch.cat([qs & 0x0F, qs >> 4], dim=-1).reshape(N, -1)
    return q, d, m


def q8_0_blocks(raw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q8_0 rows [N, G * 34] bytes -> q [N, K] int8 and d [N, G] fp32; w = d * q."""
    N = raw.shape[0]
    b = raw.view(N, -1, _Q8_0_BYTES)
    d = b[..., 0:2].contiguous().view(torch.float16).squeeze(-1).float()
    q = b[..., 2:].contiguous().view(torch.int8).reshape(N, -1)
    return q, d


def dequant_q4_1(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    N = q.shape[0]
    w = d[..., None] * q.view(N, d.shape[1], -1).float() + m[..., None]
    return w.view(N, -1)


def dequant_q8_0(q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    N = q.shape[0]
    return (d[..., None] * q.view(N, d.shape[1], -1).float()).view(N, -1)


def q4_1_to_int4(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor,
                 bias: torch.Tensor | None = None, exact: bool = False) -> Int4Linear | None:
    """Q4_1 blocks as an Int4Linear with the same values: d * (q - 8) + (m + 8 d) = d * q + m, and the
    kernel's single fma rounds it exactly as the loader's d * q + m does (d * q is exact: an fp16 times a
    4-bit integer). None when some m + 8 d is not exact in fp32 (it is for every block we have met)."""
    zero64 = m.double() + 8 * d.double()
    zero = zero64.float()
    if not torch.equal(zero.double(), zero64):
        return None
    return Int4Linear(q, d, zero, _GGUF_BLOCK, bias, exact)


@dataclass(slots=True)
class GGUFTensor:
    kind: str  # "Q4_1" | "Q8_0"
    raw: torch.Tensor  # [rows, bytes per row] uint8


class GGUFSource:
    """The quantized tensors of one GGUF file, by name, read with the ``gguf`` package."""

    def __init__(self, path: str):
        from gguf import GGUFReader  # noqa: PLC0415
        self.path = path
        self.tensors: dict[str, GGUFTensor] = {}
        for t in GGUFReader(path).tensors:
            if t.tensor_type.name in ("Q4_1", "Q8_0"):
                self.tensors[t.name] = GGUFTensor(t.tensor_type.name, torch.from_numpy(t.data.copy()))

    def blocks(self, gguf_name: str, like: torch.Tensor):
        """(kind, row permutation, blocks) when tensor ``gguf_name`` dequantizes exactly to ``like``
        up to an order of rows (llama.cpp stores q/k rows permuted for its rotary layout), else None."""
        t = self.tensors.get(gguf_name)
        if t is None or t.raw.shape[0] != like.shape[0]:
            return None
        blocks = q4_1_blocks(t.raw) if t.kind == "Q4_1" else q8_0_blocks(t.raw)
        deq = dequant_q4_1(*blocks) if t.kind == "Q4_1" else dequant_q8_0(*blocks)
        if deq.shape != like.shape:
            return None
        perm = match_rows(deq, like.detach().float().cpu())
        return None if perm is None else (t.kind, perm, blocks)


def match_rows(src: torch.Tensor, dst: torch.Tensor) -> torch.Tensor | None:
    """perm with src[perm] == dst bit for bit, or None."""
    if torch.equal(src, dst):
        return torch.arange(src.shape[0])
    coef = torch.randint(1, 2**31, (src.shape[1],), generator=torch.Generator().manual_seed(0))
    ks = (src.view(torch.int32).long() * coef).sum(1)
    kd = (dst.view(torch.int32).long() * coef).sum(1)
    ss, si = ks.sort()
    if ss.unique().numel() != ss.numel():
        return None
    pos = torch.searchsorted(ss, kd).clamp_(max=ss.numel() - 1)
    perm = si[pos]
    return perm if torch.equal(src[perm], dst) else None


# ---- the swap -------------------------------------------------------------------------------
_auto_logged = False


def resolve_mode(mode: str, device: str = "cpu") -> str:
    """'auto': on a CPU where torch reports AVX2 or AVX-512 and our operators build, w4a8 (the fastest
    mode on both machines for one request and for batches: docs/BENCHMARKS.md, "Kernels of our own");
    where they do not build there, int4 (torch's int4 kernel); else fp32. On CUDA 'auto' stays fp32 until
    the Triton kernel's speed is measured there (int4 / int8 ask for it). Logged once per process."""
    global _auto_logged
    if mode not in MODES:
        raise ValueError(f"--weights {mode!r}: expected one of {', '.join(MODES)}")
    if mode != "auto":
        if mode == "w8a8" and not str(device).startswith("cpu"):
            raise ValueError(f"--weights w8a8: fbgemm's int8 kernels are CPU only, not {device}")
        if mode == "w4a8":
            if not str(device).startswith("cpu"):
                raise ValueError(f"--weights w4a8: its kernel is for CPUs with AVX2, not {device}")
            try:
                load_cpu_gemv()
            except (RuntimeError, OSError) as e:
                raise ValueError(f"--weights w4a8 needs our CPU operators (kernels/cpu_gemv.py), which did not "
                                 f"build here: {e}") from e
        if mode != "fp32" and not str(device).startswith(("cpu", "cuda")):
            raise ValueError(f"--weights {mode}: quantized kernels exist for CPU and CUDA, not {device}")
        return mode
    cap = torch.backends.cpu.get_cpu_capability()
    choice = "fp32"
    if str(device).startswith("cpu") and cap in ("AVX2", "AVX512"):
        choice = "w4a8" if int8_gemv_kernel() is not None else "int4"
    if not _auto_logged:
        log.info("weights auto", choice=choice, cpu_capability=cap, device=str(device))
        _auto_logged = True
    return choice


@dataclass(slots=True)
class QuantReport:
    mode: str
    from_gguf: list[str] = field(default_factory=list)
    from_float: list[str] = field(default_factory=list)
    fused: int = 0  # q/k/v and gate/up groups fused (fuse_projections)
    smoothed: int = 0  # linears whose input range was folded into their weights (w8a8: worker/smoothing.py)


def _gguf_name(module_name: str) -> str | None:
    parts = module_name.split(".")
    if module_name == "embed_tokens":
        return "token_embd.weight"
    if module_name == "lm_head":
        return "output.weight"
    if len(parts) == 3 and parts[0] == "layers" and parts[2] in _GGUF_LAYER_NAMES:
        return f"blk.{parts[1]}.{_GGUF_LAYER_NAMES[parts[2]]}.weight"
    return None


def _targets(model: nn.Module) -> Iterator[tuple[str, nn.Module, nn.Module, str]]:
    for name, mod in list(model.named_modules()):
        if isinstance(mod, (nn.Linear, nn.Embedding)):
            parent_name, _, child = name.rpartition(".")
            yield name, mod, model.get_submodule(parent_name) if parent_name else model, child


LAYOUTS = ("cpu", "groups")


def quantize_model(model: nn.Module, mode: str, gguf_path: str | None = None, group: int = _GGUF_BLOCK,
                   device: str = "cpu", fuse: bool = True, layout: str | None = None,
                   load_tokenizer: Callable[[], object] | None = None) -> QuantReport:
    """Swaps every nn.Linear / nn.Embedding of ``model`` for its quantized form, in place.

    int8: linears int8 per channel. w4a8: linears as Q4_1 blocks (the GGUF's own where they still
    match) times 8-bit activations (:class:`Q4A8Linear`; K % 32 != 0 falls back to int8), the head int8 times
    8-bit activations (:class:`Int8A8Linear`). w8a8: the same int8 weights run by fbgemm on int8 activations
    (:class:`worker.quant_w8a8.Int8DynamicLinear`, the head too; CPU only). int4: linears 4-bit groups of ``group`` (the GGUF's Q4_1 blocks when
    they still match; group 32 then), falling back to int8 for shapes the int4 kernel can't take (N % 16).
    Both: the LM head int8 per channel; embeddings int8 per 32 values (the GGUF's Q8_0 blocks when
    they match). A tied head/embedding pair becomes two modules (the head needs per-channel scales).
    ``fuse``: then join q/k/v and gate/up (:func:`fuse_projections`; False only to measure it).
    ``layout``: "cpu" (torch's CPU packs) or "groups" (:class:`GroupQuantLinear`, the Triton kernel's);
    None picks "groups" on CUDA, "cpu" elsewhere. In "groups" int4 and int8 are both group-wise (32),
    and the head is 8-bit groups. ``load_tokenizer``: called by w8a8 only, which first smooths the
    activations (:mod:`worker.smoothing`) calibrated on its text in that tokenizer (None, or a model
    without one: random ids, with a warning); w8a8 needs a nested model (it runs its tiers to calibrate)."""
    mode = resolve_mode(mode, device)
    layout = layout or ("groups" if str(device).startswith("cuda") else "cpu")
    if layout not in LAYOUTS:
        raise ValueError(f"layout {layout!r}: expected one of {', '.join(LAYOUTS)}")
    report = QuantReport(mode)
    if mode == "fp32":
        return report
    if mode == "w4a8" and group != _GGUF_BLOCK:
        raise ValueError(f"--weights w4a8 uses Q4_1's blocks of {_GGUF_BLOCK} inputs; group {group} was asked")
    floats = {p.dtype for p in model.parameters() if p.is_floating_point()}
    if floats - {torch.float32}:
        raise ValueError(f"quantized weights serve an fp32 model, this one holds {sorted(map(str, floats))}")
    if mode == "w8a8":
        from worker.smoothing import calibration_windows, input_amax, smooth  # noqa: PLC0415
        if not hasattr(model, "exit_hidden"):
            raise ValueError(f"--weights w8a8 smooths a nested model's activations; got {type(model).__name__}")
        windows = calibration_windows(load_tokenizer() if load_tokenizer else None, model.cfg.vocab_size)
        report.smoothed = smooth(model, input_amax(model, windows))
    src = GGUFSource(gguf_path) if gguf_path and str(gguf_path).endswith(".gguf") else None
    make = _quantized_groups if layout == "groups" else _quantized
    for name, mod, parent, child in _targets(model):
        gname = _gguf_name(name) if isinstance(mod, nn.Embedding) or mode in ("int4", "w4a8") else None
        found = src.blocks(gname, mod.weight) if src is not None and gname else None
        new, exact = make(mod, mode, group, found, is_head=child == "lm_head")
        new = new.to(mod.weight.device)
        (report.from_gguf if exact else report.from_float).append(name)
        setattr(parent, child, new)
    _detach_from_shared_storage(model)
    report.fused = fuse_projections(model) if fuse else 0
    if any(isinstance(m, Int8Linear) for m in model.modules()):
        int8_gemv_kernel()  # decided (and built) at load, not in the first request
    log.info("quantized weights", mode=mode, from_gguf=len(report.from_gguf),
             from_float=len(report.from_float), fused=report.fused, smoothed=report.smoothed, source=gguf_path)
    return report


def _detach_from_shared_storage(model: nn.Module) -> None:
    """The loader's tensors share one memory-mapped safetensors file: one small norm weight left
    viewing it keeps the mapping, and every page of the dropped fp32 weights, resident. Copy the
    float parameters that remain (norms, biases: small)."""
    with torch.no_grad():
        for p in model.parameters():
            if p.is_floating_point():
                p.data = p.data.clone()


def _quantized(mod: nn.Module, mode: str, group: int, found, is_head: bool) -> tuple[nn.Module, bool]:
    """(replacement, whether it holds the GGUF's own blocks)."""
    if isinstance(mod, nn.Embedding):
        if found and found[0] == "Q8_0":
            _, perm, (q, d) = found
            return Int8Embedding(q[perm], d[perm]), True
        return Int8Embedding.from_float(mod.weight), False
    if mode == "w8a8":
        return Int8DynamicLinear.from_float(mod.weight, mod.bias), False
    if mode == "w4a8" and not is_head and Q4A8Linear.supports(mod.in_features):
        if found and found[0] == "Q4_1":
            _, perm, (q, d, m) = found
            return Q4A8Linear.from_q4_1(q[perm], d[perm], m[perm], mod.bias), True
        return Q4A8Linear.from_float(mod.weight, mod.bias), False
    if mode == "int4" and not is_head and Int4Linear.supports(mod.out_features, mod.in_features, group):
        if found and found[0] == "Q4_1":
            _, perm, (q, d, m) = found
            lin = q4_1_to_int4(q[perm], d[perm], m[perm], mod.bias)
            if lin is not None:
                return lin, True
        return Int4Linear.from_float(mod.weight, group, mod.bias), False
    if mode == "w4a8" and is_head and Int8A8Linear.supports(mod.in_features):
        return Int8A8Linear.from_float(mod.weight, mod.bias), False
    return Int8Linear.from_float(mod.weight, mod.bias), False


def _quantized_groups(mod: nn.Module, mode: str, group: int, found, is_head: bool) -> tuple[nn.Module, bool]:
    """As :func:`_quantized`, in the GPU layout: int4 linears from the GGUF's Q4_1 blocks as they ship
    (or quantized from fp32 likewise), 8-bit groups for int8 and the head; a row whose K is not a multiple
    of ``group`` is one group."""
    if isinstance(mod, nn.Embedding):
        return _quantized(mod, mode, group, found, is_head)
    g = group if mod.in_features % group == 0 else mod.in_features
    if mode == "int4" and not is_head:
        if found and found[0] == "Q4_1" and g == _GGUF_BLOCK:
            _, perm, (q, d, m) = found
            return GroupQuantLinear.from_q4_1(q[perm], d[perm], m[perm], g, mod.bias), True
        return GroupQuantLinear.from_float(mod.weight, g, 4 if g % 2 == 0 else 8, mod.bias), False
    return GroupQuantLinear.from_float(mod.weight, g, 8, mod.bias), False


def linear_bytes_per_step(model: nn.Module) -> int:
    """Bytes a decode step streams through the linears (the head included)."""
    total = 0
    for m in model.modules():
        if isinstance(m, nn.Linear):
            total += m.weight.numel() * m.weight.element_size()
        elif isinstance(m, (Int8Linear, Int4Linear, Q4A8Linear, GroupQuantLinear)):
            total += sum(p.numel() * p.element_size() for p in m.parameters())
        elif isinstance(m, Int8DynamicLinear):
            total += m.packed_bytes() + sum(p.numel() * p.element_size() for p in m.parameters())
    return total


__all__ = ["MODES", "LAYOUTS", "GroupQuantLinear", "Int8DynamicLinear", "Int8Linear", "Int8A8Linear", "Int4Linear", "Int8Embedding", "GGUFSource", "QuantReport",
           "quantize_model", "resolve_mode", "Q4A8Linear", "concat_linears", "fuse_projections", "q4_1_blocks", "q8_0_blocks", "q4_1_to_int4",
           "dequant_q4_1", "dequant_q8_0", "match_rows", "linear_bytes_per_step"]
