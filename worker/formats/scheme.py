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

:class:`WeightConfig` is the resolved request (format, device, layout, group) plus the ``MFS_*``
switches, read once (:meth:`WeightConfig.switches`).
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import ClassVar

import torch
from torch import nn

GGUF_BLOCK = 32  # GGUF's Q4_1 / Q8_0 blocks: 32 inputs


@dataclass(frozen=True, slots=True)
class Switches:
    """The environment overrides of the weight formats and their kernels, as documented in README.md:

    * ``MFS_W4A8_TILES=0`` -- w4a8's linears and head keep the row layouts (default: tiles of 16 rows);
    * ``MFS_CPU_GEMV=0|1`` -- our int8 CPU operator off / required (read by kernels/cpu_gemv.py);
    * ``MFS_CPU_GEMV_ISA=avx2|avx512-vnni`` -- which build of our CPU operators (kernels/cpu_gemv.py);
    * ``MFS_KERNELS=auto|torch|triton`` -- the op table (kernels/ops.py);
    * ``MFS_CPU_ATTENTION=0`` -- the graph's gather and SDPA instead of our attention operator;
    * ``MFS_CPU_ARGMAX=0`` -- greedy sampling through ``torch.argmax`` instead of our operator.

    The kernel layer reads its own four when it builds or picks an operator (it sits below worker/);
    this record is where the formats read theirs and where every one is listed and checked."""
    w4a8_tiles: bool = True
    cpu_gemv: str = ""
    cpu_gemv_isa: str = ""
    kernels: str = ""
    cpu_attention: str = ""
    cpu_argmax: str = ""

    @classmethod
    def from_env(cls) -> "Switches":
        env = os.environ
        s = cls(w4a8_tiles=env.get("MFS_W4A8_TILES", "1") != "0", cpu_gemv=env.get("MFS_CPU_GEMV", ""),
                cpu_gemv_isa=env.get("MFS_CPU_GEMV_ISA", ""), kernels=env.get("MFS_KERNELS", ""),
                cpu_attention=env.get("MFS_CPU_ATTENTION", ""), cpu_argmax=env.get("MFS_CPU_ARGMAX", ""))
        for name, value, allowed in (("MFS_W4A8_TILES", env.get("MFS_W4A8_TILES", "1"), ("0", "1")),
                                     ("MFS_CPU_GEMV_ISA", s.cpu_gemv_isa, ("", "avx2", "avx512-vnni")),
                                     ("MFS_KERNELS", s.kernels.lower(), ("", "auto", "torch", "triton"))):
            if value not in allowed:
                raise ValueError(f"{name}={value!r}: expected one of {', '.join(a or '(unset)' for a in allowed)}")
        return s


@dataclass(frozen=True, slots=True)
class WeightConfig:
    """One resolved ``--weights`` request (worker/formats/registry.py: :func:`resolve` builds it)."""
    weights: str  # a registered format, never "auto"
    device: str = "cpu"
    layout: str = "cpu"  # "cpu" (torch's / our CPU packs) or "groups" (the Triton kernel's)
    group: int = GGUF_BLOCK  # int4's group along K
    switches: Switches = field(default_factory=Switches)

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
