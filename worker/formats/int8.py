"""int8 weights on CPU: :class:`Int8Linear` (per output channel; our ``mfs::int8_gemv`` on AVX2 / AVX-512,
else torch's ``_weight_int8pack_mm``), :class:`Int8A8Linear` (w4a8's LM head: the same weights times
8-bit activations) and :class:`Int8Embedding` (GGUF's Q8_0 layout, every quantized format's embedding);
``FORMAT``, ``--weights int8`` (on CUDA the Triton kernel's groups: worker/formats/groups.py).

torch's int8 kernel is vectorized only for bf16 activations (torch 2.13 CPU): with fp32 activations it
runs a scalar loop 10-60x slower than fp32 ``F.linear`` (``mfs bench linears``), so it is fed bf16
activations and the scales are bf16."""
from __future__ import annotations

import torch
from torch import nn

from kernels import switches
from kernels.cpu_gemv import int8_gemv_kernel, load as load_cpu_gemv, tile_int8_rows, untile_int8_rows
from worker.formats.groups import GroupQuantLinear
from worker.formats.scheme import GGUF_BLOCK, Scheme, WeightConfig, found_kind
from worker.formats.weightformat import TWO_DEVICES, Layout, WeightFormat


def tiles(out_features: int, tiled: bool | None = None) -> bool:
    """w4a8's linears and head in tiles of 16 rows: where N % 16 == 0, unless the config (or, for a
    module built directly, MFS_W4A8_TILES=0) says rows."""
    want = switches.current().w4a8_tiles if tiled is None else tiled
    return out_features % 16 == 0 and want


class Int8Linear(Scheme):
    """y = x @ (q * scale[:, None]).T + b, q int8 [N, K], one bf16 scale per output channel."""
    name, backend = "int8-cpu", "cpu"
    row_tensors = ("qweight", "scales")

    def __init__(self, q: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None):
        super().__init__()
        assert q.dtype == torch.int8 and q.dim() == 2 and scales.shape == (q.shape[0],)
        self.in_features, self.out_features = q.shape[1], q.shape[0]
        # Parameters (frozen), not buffers: weight_bytes() and .to() see them like any weight.
        self.scales = nn.Parameter(scales.to(torch.bfloat16).contiguous(), requires_grad=False)
        self.qweight = nn.Parameter(q.contiguous(), requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach().float(), requires_grad=False)

    @classmethod
    def from_float(cls, w: torch.Tensor, bias: torch.Tensor | None = None, **kw) -> "Int8Linear":
        """Symmetric per channel; q is rounded against the bf16 scale the kernel will use."""
        w = w.detach().float()
        scales = (w.abs().amax(dim=1) / 127).clamp_min(1e-30).to(torch.bfloat16).float()
        q = torch.round(w / scales[:, None]).clamp_(-127, 127).to(torch.int8)
        return cls(q, scales, bias, **kw)

    @classmethod
    def load(cls, mod: nn.Module, found, cfg: WeightConfig) -> tuple[nn.Module, bool]:
        return cls.from_float(mod.weight, mod.bias), False

    # a callable (x [M, K] fp32, qweight, scales) -> [M, N] that replaces the default kernel for this
    # module: the compiled head of the inductor path on AVX-512 without our operator
    # (worker/compiled_step.py: int8_rows); None: the default, :func:`kernels.cpu_gemv.int8_gemv_kernel`
    # where it serves (AVX2, AVX-512), else torch's bf16 kernel
    rows_kernel = None

    def takes_rows_kernel(self) -> bool:
        return True

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
    Same bytes, a fraction of the arithmetic per extra row (docs/BENCHMARKS.md, "Both machines' kernels").

    ``tiled`` (N % 16 == 0, unless ``MFS_W4A8_TILES=0``), as w4a8's linears: ``qweight`` the same bytes
    interleaved 16 rows to a tile (``kernels.cpu_gemv.tile_int8_rows``, [N/16, K/32, 8, 16, 4]), served
    by ``mfs::int8_a8_tile_gemv``, a register lane per output row."""
    name = "int8a8-cpu"
    same = ("tiled",)  # tiles of 16 rows concatenate as rows do; two layouts do not

    def __init__(self, q: torch.Tensor, scales: torch.Tensor, bias: torch.Tensor | None, tiled: bool | None = None):
        if q.shape[1] % GGUF_BLOCK:
            raise ValueError(f"8-bit activations go per {GGUF_BLOCK} inputs; this head has {q.shape[1]}")
        load_cpu_gemv()  # the operator forward calls (built once per machine, loaded once per process)
        super().__init__(q, scales, bias)
        self.tiled = tiles(q.shape[0], tiled)
        if self.tiled:
            self.qweight = nn.Parameter(tile_int8_rows(self.qweight.data), requires_grad=False)

    @classmethod
    def supports(cls, mod: nn.Module, cfg: WeightConfig) -> bool:
        return isinstance(mod, nn.Linear) and mod.in_features % GGUF_BLOCK == 0

    @classmethod
    def load(cls, mod: nn.Module, found, cfg: WeightConfig) -> tuple[nn.Module, bool]:
        return cls.from_float(mod.weight, mod.bias, tiled=cfg.tiles), False

    def takes_rows_kernel(self) -> bool:
        return not self.tiled  # rows_kernel takes [N, K] rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.rows_kernel is not None:
            if self.tiled:
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


class Int8Embedding(Scheme):
    """int8 rows, one fp32 scale per ``group`` values (GGUF's Q8_0 layout); d * q is exact in fp32.
    A lookup dequantizes only the rows it reads."""
    name, backend, gguf_kinds, graphable = "int8-embedding", "any", ("Q8_0",), True

    def __init__(self, q: torch.Tensor, scales: torch.Tensor, group: int = GGUF_BLOCK):
        super().__init__()
        V, H = q.shape
        assert q.dtype == torch.int8 and scales.shape == (V, H // group)
        self.num_embeddings, self.embedding_dim, self.group = V, H, group
        # scales first: the runner takes the KV cache dtype from the model's first parameter.
        self.scales = nn.Parameter(scales.float().contiguous(), requires_grad=False)
        self.qweight = nn.Parameter(q.contiguous(), requires_grad=False)

    @classmethod
    def supports(cls, mod: nn.Module, cfg: WeightConfig) -> bool:
        return isinstance(mod, nn.Embedding) and mod.embedding_dim % GGUF_BLOCK == 0

    @classmethod
    def load(cls, mod: nn.Module, found, cfg: WeightConfig) -> tuple[nn.Module, bool]:
        if found_kind(found, "Q8_0"):
            _, perm, (q, d) = found
            return cls(q[perm], d[perm]), True
        return cls.from_float(mod.weight), False

    @classmethod
    def concat(cls, mods):
        return None  # an embedding is never fused

    def step_bytes(self) -> int:
        return 0  # a decode step reads its rows' few bytes, not the table

    @classmethod
    def from_float(cls, w: torch.Tensor, group: int = GGUF_BLOCK) -> "Int8Embedding":
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


FORMAT = WeightFormat("int8", "int8 per channel", TWO_DEVICES, layouts={
    "cpu": Layout((Int8Linear,), (Int8Linear,), (Int8Embedding,)),
    "groups": Layout((GroupQuantLinear,), (GroupQuantLinear,), (Int8Embedding,))})

__all__ = ["FORMAT", "Int8A8Linear", "Int8Embedding", "Int8Linear", "tiles"]
