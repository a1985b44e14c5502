"""``--weights w4a8`` (CPU with AVX2; AVX-512 VNNI used where present): :class:`Q4A8Linear`, the GGUF's
own Q4_1 blocks (or fp32 weights quantized the same way) times activations quantized to 8 bits per 32
values, as llama.cpp runs such a model, on our operators ``mfs::w4a8_tile_gemv`` (16 output rows
interleaved, a register lane per output: linears whose outputs are a multiple of 16, all of the
models') and ``mfs::w4a8_gemv`` (the rest), each block's products summed exactly in integers. Fewest
bytes and the least arithmetic per weight of the CPU formats: the fastest on both machines measured
(``--weights auto``). Its LM head is :class:`worker.formats.int8.Int8A8Linear`; ``FORMAT`` declares it
(CPU only, and only where our operators build)."""
from __future__ import annotations

import torch
from torch import nn

from kernels.cpu_gemv import load as load_cpu_gemv, pack_q4_rows, tile_q4_rows, unpack_q4_rows, untile_q4_rows
from worker.formats.int8 import Int8A8Linear, Int8Embedding, Int8Linear, tiles
from worker.formats.scheme import GGUF_BLOCK, Scheme, WeightConfig, found_kind
from worker.formats.weightformat import Layout, WeightFormat


class Q4A8Linear(Scheme):
    """4-bit weight blocks as GGUF's Q4_1 ships them (per 32 inputs 16 bytes of codes u and an fp16
    (d, m), the weight d * u + m) times 8-bit activations per 32 values (``kernels/cpu_gemv.cpp``).

    ``tiled`` (N % 16 == 0, unless ``MFS_W4A8_TILES=0``): the same bytes interleaved 16 rows to a tile
    (``kernels.cpu_gemv.tile_q4_rows``: ``qweight`` [N/16, K/32, 4, 16, 4], ``dm`` [N/16, K/32, 2, 16]),
    served by ``mfs::w4a8_tile_gemv``, where a register lane is one output row: about half the
    instructions per activation row of ``mfs::w4a8_gemv``, which serves the row layout
    (``qweight`` [N, K/2], ``dm`` [N, K/32, 2]) otherwise. The two sum in different orders (each the
    same at any batch size), so their outputs differ in the last bits."""
    name, backend, gguf_kinds = "w4a8-cpu", "cpu", ("Q4_1",)
    row_tensors, same = ("qweight", "dm"), ("tiled",)  # rows (tiles of 16 rows) are independent

    def __init__(self, u: torch.Tensor, d: torch.Tensor, m: torch.Tensor, bias: torch.Tensor | None,
                 tiled: bool | None = None):
        super().__init__()
        N, K = u.shape
        assert K % GGUF_BLOCK == 0 and d.shape == m.shape == (N, K // GGUF_BLOCK)
        load_cpu_gemv()  # the operator forward calls (built once per machine, loaded once per process)
        self.in_features, self.out_features = K, N
        packed, dm = pack_q4_rows(u), torch.stack([d, m], dim=-1).half().contiguous()
        self.tiled = tiles(N, tiled)
        if self.tiled:
            packed, dm = tile_q4_rows(packed, dm)
        self.qweight = nn.Parameter(packed, requires_grad=False)
        self.dm = nn.Parameter(dm, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach().float(), requires_grad=False)

    @classmethod
    def supports(cls, mod: nn.Module, cfg: WeightConfig) -> bool:
        return isinstance(mod, nn.Linear) and mod.in_features % GGUF_BLOCK == 0

    @classmethod
    def load(cls, mod: nn.Module, found, cfg: WeightConfig) -> tuple[nn.Module, bool]:
        if found_kind(found, "Q4_1"):
            _, perm, (q, d, m) = found
            return cls.from_q4_1(q[perm], d[perm], m[perm], mod.bias, tiled=cfg.tiles), True
        return cls.from_float(mod.weight, mod.bias, tiled=cfg.tiles), False

    @classmethod
    def from_q4_1(cls, u: torch.Tensor, d: torch.Tensor, m: torch.Tensor,
                  bias: torch.Tensor | None = None, tiled: bool | None = None) -> "Q4A8Linear":
        """The GGUF's Q4_1 blocks as they ship (d and m were read from fp16)."""
        assert torch.equal(d.half().float(), d.float()) and torch.equal(m.half().float(), m.float())
        return cls(u, d, m, bias, tiled)

    @classmethod
    def from_float(cls, w: torch.Tensor, bias: torch.Tensor | None = None, tiled: bool | None = None) -> "Q4A8Linear":
        """Q4_1's recipe per 32 inputs: m = min, d = (max - min) / 15, both rounded to fp16 first,
        u = round((w - m) / d) in 0..15."""
        w = w.detach().float()
        N, K = w.shape
        g = w.view(N, K // GGUF_BLOCK, GGUF_BLOCK)
        lo, hi = g.amin(dim=-1), g.amax(dim=-1)
        m = lo.half().float()
        d = ((hi - m) / 15).clamp_min(1e-7).half().float()
        u = torch.round((g - m[..., None]) / d[..., None]).clamp_(0, 15).view(N, K)
        return cls(u, d, m, bias, tiled)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        op = torch.ops.mfs.w4a8_tile_gemv if self.tiled else torch.ops.mfs.w4a8_gemv
        y = op(x.reshape(-1, shape[-1]).float().contiguous(), self.qweight, self.dm)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*shape[:-1], self.out_features)

    def dequantize(self) -> torch.Tensor:
        packed, dm = untile_q4_rows(self.qweight, self.dm) if self.tiled else (self.qweight, self.dm)
        u = unpack_q4_rows(packed).float().view(self.out_features, -1, GGUF_BLOCK)
        d, m = dm.float().unbind(-1)
        return (d[..., None] * u + m[..., None]).view(self.out_features, self.in_features)


FORMAT = WeightFormat("w4a8", "Q4_1 blocks times activations quantized per 32 as llama.cpp does (the fastest "
                      "on CPUs with AVX2 or AVX-512)", ("cpu",), "its kernel is for CPUs with AVX2",
                      {"cpu": Layout((Q4A8Linear, Int8Linear), (Int8A8Linear, Int8Linear), (Int8Embedding,))},
                      group=GGUF_BLOCK, needs_cpu_operators=True)

__all__ = ["FORMAT", "Q4A8Linear"]
