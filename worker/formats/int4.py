"""int4 on CPU (``--weights int4``): :class:`Int4Linear`, 4-bit with a (scale, zero) per group along K,
run by ``torch._weight_int4pack_mm_for_cpu`` on bf16 activations (its only vectorized form). The
kernel dequantizes ``w = fma(q - 8, scale, zero)`` (checked in tests against its own output). A GGUF's
Q4_1 blocks load as they ship: Q4_1's ``d * q + m`` becomes ``scale = d, zero = m + 8 d``, which the
kernel dequantizes bit for bit to what transformers' GGUF loader produces. ``FORMAT`` declares it (its
LM head int8; on CUDA the Triton kernel's groups: worker/formats/groups.py)."""
from __future__ import annotations

import torch
from torch import nn

from worker.formats.groups import Group4Linear, GroupQuantLinear
from worker.formats.int8 import Int8Embedding, Int8Linear
from worker.formats.scheme import GGUF_BLOCK, Scheme, WeightConfig, found_kind
from worker.formats.weightformat import TWO_DEVICES, Layout, WeightFormat

_INT4_PACK_ROWS = 64  # _convert_weight_to_int4pack_for_cpu lays rows out in blocks of this many


class Int4Linear(Scheme):
    """4-bit weights packed for ``_weight_int4pack_mm_for_cpu``: ``w = fma(q - 8, scale, zero)`` with
    one (scale, zero) per group of ``group`` input features per output channel. ``exact``: the scales
    and zeros kept in fp32, which the fp32 kernel dequantizes bit for bit (tests and the perplexity
    reference, not for speed)."""
    name, backend, gguf_kinds = "int4-cpu", "cpu", ("Q4_1",)
    row_tensors, same = ("qweight", "scales_zeros"), ("group", "exact")

    def __init__(self, q: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group: int,
                 bias: torch.Tensor | None, exact: bool = False):
        super().__init__()
        N, K = q.shape
        assert scale.shape == zero.shape == (N, K // group) and K % group == 0 and N % 16 == 0
        self.in_features, self.out_features, self.group = K, N, group
        self.exact = exact
        sz = torch.stack([scale.float().t(), zero.float().t()], dim=-1).contiguous()  # [K/g, N, 2]
        self.scales_zeros = nn.Parameter(sz if exact else sz.to(torch.bfloat16), requires_grad=False)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 1)
        self.qweight = nn.Parameter(packed, requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach().float(), requires_grad=False)

    @classmethod
    def supports(cls, mod: nn.Module, cfg: WeightConfig) -> bool:
        return isinstance(mod, nn.Linear) and mod.out_features % 16 == 0 and mod.in_features % cfg.group == 0

    @classmethod
    def load(cls, mod: nn.Module, found, cfg: WeightConfig) -> tuple[nn.Module, bool]:
        if found_kind(found, "Q4_1"):
            _, perm, (q, d, m) = found
            lin = q4_1_to_int4(q[perm], d[perm], m[perm], mod.bias)
            if lin is not None:
                return lin, True
        return cls.from_float(mod.weight, cfg.group, mod.bias), False

    @classmethod
    def row_dim(cls, tensor: str) -> int:
        return 1 if tensor == "scales_zeros" else 0  # [K/g, N, 2]

    @classmethod
    def concat(cls, mods):
        if any(m.out_features % _INT4_PACK_ROWS for m in mods[:-1]):
            return None  # the CPU int4 pack interleaves rows in blocks of 64: pieces must not split one
        return super().concat(mods)

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


def q4_1_to_int4(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor,
                 bias: torch.Tensor | None = None, exact: bool = False) -> Int4Linear | None:
    """Q4_1 blocks as an Int4Linear with the same values: d * (q - 8) + (m + 8 d) = d * q + m, and the
    kernel's single fma rounds it exactly as the loader's d * q + m does (d * q is exact: an fp16 times a
    4-bit integer). None when some m + 8 d is not exact in fp32 (it is for every block we have met)."""
    zero64 = m.double() + 8 * d.double()
    zero = zero64.float()
    if not torch.equal(zero.double(), zero64):
        return None
    return Int4Linear(q, d, zero, GGUF_BLOCK, bias, exact)


FORMAT = WeightFormat("int4", "int4 in groups of 32 (a GGUF's own Q4_1 blocks where they match)", TWO_DEVICES,
                      layouts={"cpu": Layout((Int4Linear, Int8Linear), (Int8Linear,), (Int8Embedding,)),
                               "groups": Layout((Group4Linear,), (GroupQuantLinear,), (Int8Embedding,))},
                      takes_group=True)

__all__ = ["FORMAT", "Int4Linear", "q4_1_to_int4"]
