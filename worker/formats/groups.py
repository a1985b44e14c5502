"""Weight-only quantized linears for CUDA: codes and fp16 (scale, min) per group, as GGUF ships Q4_1 and
Q8_0, served by the Triton dequantize-matmul of :mod:`kernels.quant_matmul_triton`.

The CPU schemes (torch's int4 / int8 packs, our operators) are laid out for torch's CPU kernels
and only run there; this one is the GPU's. :class:`GroupQuantLinear` runs its Triton kernel on CUDA
tensors (and on CPU tensors in triton's interpreter, for tests) and the torch reference otherwise, so a
model quantized this way computes the same thing on any device.
"""
from __future__ import annotations

import functools

import torch
from torch import nn

from kernels.quant_matmul import dequantize, pack_int4, quant_matmul_torch, quantize_groups
from worker.formats.scheme import GGUF_BLOCK, Scheme, WeightConfig, found_kind


@functools.cache
def _kernel():
    """The Triton matmul when it can run on this process's tensors; None when triton is missing."""
    try:
        from kernels.quant_matmul_triton import _quant_matmul_kernel, quant_matmul_triton  # noqa: PLC0415
    except ImportError:
        return None, False
    from kernels.common_triton import interpreted  # noqa: PLC0415
    return quant_matmul_triton, interpreted(_quant_matmul_kernel)


class GroupQuantLinear(Scheme):
    """y = x @ W.T + b with W as 4- or 8-bit codes, one fp16 (scale, min) per ``group`` input features of
    each output row: ``w = q * scale + min`` (see :mod:`kernels.quant_matmul`). As a scheme: 8-bit
    groups (``int8`` and every head in this layout); :class:`Group4Linear` is ``int4``'s. A row whose K
    is not a multiple of the group is one group. Rows are independent: every tensor concatenates by row."""
    name, backend, graphable = "int8-groups", "any", True
    row_tensors, same = ("qweight", "scales", "mins"), ("group", "bits")

    @staticmethod
    def group_for(mod: nn.Module, cfg: WeightConfig) -> int:
        return cfg.group if mod.in_features % cfg.group == 0 else mod.in_features

    @classmethod
    def load(cls, mod: nn.Module, found, cfg: WeightConfig) -> tuple[nn.Module, bool]:
        return cls.from_float(mod.weight, cls.group_for(mod, cfg), 8, mod.bias), False

    def __init__(self, qweight: torch.Tensor, scales: torch.Tensor, mins: torch.Tensor, group: int,
                 bits: int, bias: torch.Tensor | None):
        super().__init__()
        N = qweight.shape[0]
        K = qweight.shape[1] * (2 if bits == 4 else 1)
        assert scales.shape == mins.shape == (N, K // group) and K % group == 0
        self.in_features, self.out_features, self.group, self.bits = K, N, group, bits
        # scales first: like every quantized module here, a float parameter leads (dtype and device).
        self.scales = nn.Parameter(scales.half().contiguous(), requires_grad=False)
        self.mins = nn.Parameter(mins.half().contiguous(), requires_grad=False)
        self.qweight = nn.Parameter(qweight.contiguous(), requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach().float(), requires_grad=False)

    @classmethod
    def from_float(cls, w: torch.Tensor, group: int, bits: int,
                   bias: torch.Tensor | None = None) -> "GroupQuantLinear":
        return cls(*quantize_groups(w, group, bits), group, bits, bias)

    @classmethod
    def from_q4_1(cls, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor, group: int,
                  bias: torch.Tensor | None = None) -> "GroupQuantLinear":
        """GGUF Q4_1 blocks (codes 0..15, d and m read from fp16): stored as they ship."""
        assert torch.equal(d.half().float(), d.float()) and torch.equal(m.half().float(), m.float())
        return cls(pack_int4(q), d, m, group, 4, bias)

    @classmethod
    def from_q8_0(cls, q: torch.Tensor, d: torch.Tensor, group: int,
                  bias: torch.Tensor | None = None) -> "GroupQuantLinear":
        assert torch.equal(d.half().float(), d.float())
        return cls(q.to(torch.int8), d, torch.zeros_like(d), group, 8, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        args = (self.qweight, self.scales, self.mins, self.group, self.bits)
        fn, interp = _kernel()
        if fn is not None and (x.is_cuda or interp):
            y = fn(x.contiguous(), *args)
        else:
            y = quant_matmul_torch(x, *args)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def dequantize(self) -> torch.Tensor:
        return dequantize(self.qweight, self.scales, self.mins, self.group, self.bits)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, bits={self.bits}, group={self.group}"


class Group4Linear(GroupQuantLinear):
    """``int4`` in the groups layout: the GGUF's Q4_1 blocks as they ship where the group is theirs, else
    4-bit codes quantized from fp32 (8-bit where the group is odd: two 4-bit codes fill a byte)."""
    name, gguf_kinds = "int4-groups", ("Q4_1",)

    @classmethod
    def load(cls, mod: nn.Module, found, cfg: WeightConfig) -> tuple[nn.Module, bool]:
        g = cls.group_for(mod, cfg)
        if found_kind(found, "Q4_1") and g == GGUF_BLOCK:
            _, perm, (q, d, m) = found
            return cls.from_q4_1(q[perm], d[perm], m[perm], g, mod.bias), True
        return cls.from_float(mod.weight, g, 4 if g % 2 == 0 else 8, mod.bias), False


__all__ = ["Group4Linear", "GroupQuantLinear"]
