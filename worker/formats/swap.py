"""Putting a format into a loaded model after its weights (and any precipitation delta) are final,
fusing its projections, and asking a model's schemes what they allow.

* :func:`quantize_model` -- every ``nn.Linear`` and ``nn.Embedding``, whatever submodule holds it, for
  the first scheme of its format's layout that supports it (worker/formats/registry.py); where the
  source GGUF ships a tensor in blocks the scheme takes and the model still holds exactly their
  dequantized values, those blocks (no second rounding); anything else (HF checkpoints, tensors a delta
  changed, new exit blocks) from its fp32 values. A tied head/embedding pair becomes two modules.
* :func:`fuse_projections` -- each decoder layer's q/k/v and gate/up of one scheme become one linear
  each (the scheme's ``concat``; outputs the same bit for bit, checked on a random input at fusion
  time): per layer 4 matmuls instead of 7.
* :func:`linear_bytes_per_step`, :func:`uncompilable`, :func:`ungraphable`, :func:`rows_kernel_head`.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterator

import structlog
import torch
from torch import nn

from kernels.cpu_gemv import int8_gemv_kernel
from worker.formats.gguf import GGUFSource, gguf_name
from worker.formats.int8 import Int8Linear
from worker.formats.registry import FORMATS, resolve, served
from worker.formats.scheme import GGUF_BLOCK, Scheme, WeightConfig
from worker.formats.weightformat import Layout

log = structlog.get_logger(__name__)


@dataclass(slots=True)
class QuantReport:
    mode: str
    from_gguf: list[str] = field(default_factory=list)
    from_float: list[str] = field(default_factory=list)
    fused: int = 0  # q/k/v and gate/up groups fused (fuse_projections)
    smoothed: int = 0  # linears whose input range was folded into their weights (w8a8: worker/smoothing.py)
    schemes: dict[str, int] = field(default_factory=dict)  # modules per scheme name
    kinds: dict[str, str] = field(default_factory=dict)  # module -> the GGUF block kind it kept (from_gguf ones)


def quantize_model(model: nn.Module, mode: str, gguf_path: str | None = None, group: int = GGUF_BLOCK,
                   device: str = "cpu", fuse: bool = True, layout: str | None = None,
                   load_tokenizer: Callable[[], object] | None = None) -> QuantReport:
    """Swaps ``model``'s linears and embeddings for format ``mode`` (``--weights``; ``auto`` resolved and
    the combination checked by :func:`worker.formats.registry.resolve`; for a GGUF, ``auto`` as
    :func:`worker.formats.kquant.served` says), in place. ``gguf_path``: the GGUF whose own blocks are
    taken where they match. ``group``: int4's along K. ``fuse``: then join
    q/k/v and gate/up (False only to measure it). ``layout``: "cpu" or "groups" (None: "groups" on CUDA).
    ``load_tokenizer``: called by a format that calibrates first (w8a8: None, or a model without one,
    random ids with a warning)."""
    cfg = resolve(served(mode, device, gguf_path), device, layout, group)
    fmt = FORMATS[cfg.weights]
    report = QuantReport(cfg.weights)
    if not fmt.quantizes:
        return report
    floats = {p.dtype for p in model.parameters() if p.is_floating_point()}
    if floats - {torch.float32}:
        raise ValueError(f"quantized weights serve an fp32 model, this one holds {sorted(map(str, floats))}")
    if fmt.prepare is not None:
        report.smoothed = fmt.prepare(model, cfg, load_tokenizer)
    src = GGUFSource(gguf_path) if gguf_path and str(gguf_path).endswith(".gguf") else None
    plan = fmt.layouts[cfg.layout]
    for name, mod, parent, child in _targets(model):
        scheme = _pick(plan, mod, child == "lm_head", cfg)
        if scheme is None:
            continue  # no scheme of this format holds it: it stays as loaded
        gname = gguf_name(name) if scheme.gguf_kinds and src is not None else None
        found = src.blocks(gname, mod.weight, scheme.gguf_kinds) if gname else None
        new, exact = scheme.load(mod, found, cfg)
        (report.from_gguf if exact else report.from_float).append(name)
        if exact:
            report.kinds[name] = found[0]
        report.schemes[type(new).name] = report.schemes.get(type(new).name, 0) + 1
        setattr(parent, child, new.to(mod.weight.device))
    _detach_from_shared_storage(model)
    report.fused = fuse_projections(model) if fuse else 0
    if any(isinstance(m, Int8Linear) for m in model.modules()):
        int8_gemv_kernel()  # decided (and built) at load, not in the first request
    log.info("quantized weights", mode=cfg.weights, layout=cfg.layout, schemes=report.schemes,
             from_gguf=len(report.from_gguf), from_float=len(report.from_float), fused=report.fused,
             smoothed=report.smoothed, source=gguf_path)
    return report


def _pick(plan: Layout, mod: nn.Module, is_head: bool, cfg: WeightConfig) -> type[Scheme] | None:
    choices = plan.embedding if isinstance(mod, nn.Embedding) else plan.head if is_head else plan.linear
    return next((s for s in choices if s.supports(mod, cfg)), None)


def pack(mod: nn.Module, cfg: WeightConfig, is_head: bool = False) -> nn.Module:
    """One ``nn.Linear`` / ``nn.Embedding`` in format ``cfg`` from its fp32 values, as
    :func:`quantize_model` packs it (``mod`` itself where no scheme of the format holds it)."""
    fmt = FORMATS[cfg.weights]
    scheme = _pick(fmt.layouts[cfg.layout], mod, is_head, cfg) if fmt.quantizes else None
    return mod if scheme is None else scheme.load(mod, None, cfg)[0]


def _targets(model: nn.Module) -> Iterator[tuple[str, nn.Module, nn.Module, str]]:
    for name, mod in list(model.named_modules()):
        if isinstance(mod, (nn.Linear, nn.Embedding)):
            parent_name, _, child = name.rpartition(".")
            yield name, mod, model.get_submodule(parent_name) if parent_name else model, child


def _detach_from_shared_storage(model: nn.Module) -> None:
    """The loader's tensors share one memory-mapped safetensors file: one small norm weight left
    viewing it keeps the mapping, and every page of the dropped fp32 weights, resident. Copy the
    float parameters that remain (norms, biases: small)."""
    with torch.no_grad():
        for p in model.parameters():
            if p.is_floating_point():
                p.data = p.data.clone()


def concat_linears(mods: list[nn.Module]) -> nn.Module | None:
    """One module computing ``cat([m(x) for m in mods], -1)``, for linears of one scheme (its
    ``concat``); None when they differ or the scheme cannot join them."""
    first = mods[0]
    if not isinstance(first, Scheme) or any(type(m) is not type(first) for m in mods):
        return None
    return type(first).concat(mods)


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


def linear_bytes_per_step(model: nn.Module) -> int:
    """Bytes a decode step streams through the linears (the head included): each scheme counts its own."""
    total = 0
    for m in model.modules():
        if isinstance(m, nn.Linear):
            total += m.weight.numel() * m.weight.element_size()
        elif isinstance(m, Scheme):
            total += m.step_bytes()
    return total


def uncompilable(model: nn.Module) -> list[str]:
    """The schemes in ``model`` that an inductor graph cannot hold (their names; [] when it can)."""
    return sorted({type(m).name for m in model.modules() if isinstance(m, Scheme) and not m.compilable})


def ungraphable(model: nn.Module) -> list[str]:
    """The schemes in ``model`` that a CUDA graph cannot capture (their names; [] when it can)."""
    return sorted({type(m).name for m in model.modules() if isinstance(m, Scheme) and not m.graphable})


def rows_kernel_head(model: nn.Module) -> bool:
    """Whether the model's LM head lets the execution layer swap its kernel for a compiled one."""
    head = getattr(model, "lm_head", None)
    return isinstance(head, Scheme) and head.takes_rows_kernel()


__all__ = ["QuantReport", "concat_linears", "pack", "fuse_projections", "linear_bytes_per_step", "quantize_model",
           "rows_kernel_head", "uncompilable", "ungraphable"]
