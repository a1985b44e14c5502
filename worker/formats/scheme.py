"""What every packed weight module declares, so that loading, fusion, byte counts and the execution
layer ask it instead of probing (as vLLM asks a layer's ``QuantizeMethodBase``).

A *scheme* is one format on one backend (int8 on torch's CPU pack, int4 in the Triton kernel's groups,
...): an ``nn.Module`` class whose ``forward`` applies it, and whose class-level answers say

* ``name``, ``backend`` ("cpu": torch's or our CPU kernels; "any": plain torch / Triton ops);
* ``gguf_kinds`` -- the GGUF block kinds it takes as they ship (none: it always quantizes fp32);
* ``compilable`` -- whether an inductor graph (CPU) can hold it; ``graphable`` -- whether a CUDA graph can;
* ``supports(mod, cfg)`` -- whether it can hold this ``nn.Linear`` / ``nn.Embedding``;
* ``load(mod, found, cfg)`` -- the packed module, from the GGUF's own blocks when ``found`` holds some
  it takes (then ``exact``), else from the fp32 weights;
* ``concat(mods)`` -- one module computing ``cat([m(x) for m in mods], -1)``, or None;
* ``step_bytes()`` -- the bytes a decode step streams through it;
* ``takes_rows_kernel()`` -- whether the execution layer may swap its CPU kernel for a compiled one.

:class:`WeightConfig` is the resolved request (format, device, layout, group) plus the process's ``MFS_*``
switches (kernels/switches.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch import nn

from kernels.switches import Switches, current as current_switches

GGUF_BLOCK = 32  # GGUF's Q4_1 / Q8_0 blocks: 32 inputs


@dataclass(frozen=True, slots=True)
class WeightConfig:
    """One resolved ``--weights`` request (worker/formats/registry.py: :func:`resolve` builds it)."""
    weights: str  # a registered format, never "auto"
    device: str = "cpu"
    layout: str = "cpu"  # "cpu" (torch's / our CPU packs) or "groups" (the Triton kernel's)
    group: int = GGUF_BLOCK  # int4's group along K
    switches: Switches = field(default_factory=current_switches)

    @property
    def tiles(self) -> bool:
        return self.switches.w4a8_tiles


class Scheme(nn.Module):
    """Base of every packed weight module (see the module docstring). Subclasses set the class
    attributes and implement ``supports`` and ``load``; ``concat`` joins the tensors named in
    ``row_tensors`` by output row and checks the attributes named in ``same``."""
    name: ClassVar[str] = "?"
    backend: ClassVar[str] = "cpu"
    gguf_kinds: ClassVar[tuple[str, ...]] = ()
    compilable: ClassVar[bool] = True
    graphable: ClassVar[bool] = False
    row_tensors: ClassVar[tuple[str, ...]] = ("qweight",)  # concatenated along dim 0 by :meth:`concat`
    same: ClassVar[tuple[str, ...]] = ()  # attributes every piece of a concat must share
    in_features: int
    out_features: int

    @classmethod
    def supports(cls, mod: nn.Module, cfg: WeightConfig) -> bool:
        return isinstance(mod, nn.Linear)

    @classmethod
    def load(cls, mod: nn.Module, found, cfg: WeightConfig) -> tuple[nn.Module, bool]:
        raise NotImplementedError

    @classmethod
    def concat(cls, mods: list["Scheme"]) -> "Scheme | None":
        """Rows are independent in every layout here: the pieces' row tensors concatenate; None when
        the pieces differ in kind, input width, bias or any attribute in ``same``."""
        first = mods[0]
        if any(type(m) is not type(first) or m.in_features != first.in_features for m in mods):
            return None
        if any((m.bias is None) != (first.bias is None) for m in mods):
            return None
        if any(getattr(m, a) != getattr(first, a) for m in mods for a in cls.same):
            return None
        out = cls.__new__(cls)
        nn.Module.__init__(out)
        out.in_features, out.out_features = first.in_features, sum(m.out_features for m in mods)
        for a in cls.same:
            setattr(out, a, getattr(first, a))
        for t in cls.row_tensors:
            setattr(out, t, nn.Parameter(torch.cat([getattr(m, t) for m in mods], dim=cls.row_dim(t)),
                                         requires_grad=False))
        out.bias = None if first.bias is None else nn.Parameter(torch.cat([m.bias for m in mods]),
                                                                requires_grad=False)
        return out

    @classmethod
    def row_dim(cls, tensor: str) -> int:
        return 0

    def step_bytes(self) -> int:
        return sum(p.numel() * p.element_size() for p in self.parameters())

    def takes_rows_kernel(self) -> bool:
        return False


def found_kind(found, kind: str) -> bool:
    """Whether a GGUF lookup (``GGUFSource.blocks``) found blocks of ``kind``."""
    return bool(found) and found[0] == kind
