"""A family's manifest (family/manifest.py) made a NestedModel: base weights loaded, cut into tiers,
precipitated weights applied, optionally quantized; and the command-line flags that say which."""
from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Literal

import torch

from core.cli import add_args, opt
from family.manifest import Manifest, TierSpec, manifest_for, parse_tiers, resolve_base, usable_tiers
from kernels import KernelOps, select_backend
from worker.arch import to_llama_layout
from worker.config import ModelConfig
from worker.formats import FORMATS, may_quantize, parse_weights
from worker.formats.fp32 import FORMAT as FP32
from family.loader import BaseWeights, load_base
from worker.model import NestedModel, Tier, skeleton

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
           "float64": torch.float64}
MODEL_HELP = "default (the embedded family), default-raw (not precipitated), a checkpoint dir, HF dir or .gguf"


@dataclass(slots=True)
class LoadedFamily:
    model: NestedModel
    manifest: Manifest
    base: BaseWeights

    @property
    def tokenizer(self):
        """Read when first asked for (see :class:`family.loader.BaseWeights`)."""
        return self.base.tokenizer

    def model_id(self, tier: Tier) -> str:
        return f"{self.manifest.family}-{tier.name}"

    def usable_tiers(self) -> list[int]:
        return usable_tiers(self.manifest)


def build_model(base: BaseWeights, tiers: list[TierSpec], dtype: torch.dtype = torch.float32,
                device: str = "cpu", max_positions: int | None = None,
                ops: KernelOps | None = None) -> NestedModel:
    cfg = ModelConfig.from_hf(base.hf_config, set(base.state_dict))
    tlist = [Tier(i, t.name, t.layers, t.block_layers) for i, t in enumerate(tiers)]
    with skeleton():
        model = NestedModel(cfg, tlist, max_positions=max_positions, ops=ops or select_backend(None, device))
    sd = to_llama_layout(cfg.model_type, base.state_dict, cfg.num_layers, *model.layers[0].qkv_sizes[:2])
    model.adopt_base_state({k: v.to(device) for k, v in sd.items()})
    model = model.to(dtype)
    model.rebuild_buffers()
    return model


def load_family(model: str = "default", tiers: str | None = None, dtype: str | None = None,
                device: str = "cpu", max_positions: int | None = 4096,
                kernels: str | None = None, weights: str = FP32.name, fuse: bool = True) -> LoadedFamily:
    """``weights``: a format of :data:`worker.formats.FORMATS` or auto: see :func:`worker.formats.quantize_model`
    (``fuse``: its q/k/v and gate/up fusion; off only to measure it)."""
    manifest, mdir = manifest_for(model, tiers)
    if tiers and mdir is not None:
        manifest.tiers = parse_tiers(tiers, max(t.layers for t in manifest.tiers))
        manifest.weights = None if manifest.weights and manifest.weights.get("kind") == "delta" else manifest.weights
    quantizes = may_quantize(weights)  # a bad name is refused before the load
    if quantizes and device == "cpu":  # our CPU operators compile while the weights are read
        from kernels.cpu_gemv import build_in_background  # noqa: PLC0415
        build_in_background()
    base = load_base(resolve_base(manifest.base, mdir))
    tdtype = _DTYPES[dtype or manifest.dtype]
    nm = build_model(base, manifest.tiers, tdtype, device, max_positions,
                     select_backend(kernels, device))
    base.state_dict = {}  # the model owns the weights now; keep no second reference
    if manifest.weights and mdir is not None:
        from worker.checkpoint import apply_weights  # noqa: PLC0415
        apply_weights(nm, mdir / manifest.weights["file"], manifest.weights["kind"])
    if quantizes:  # after any delta: quantize the weights that will be served
        from worker.formats import quantize_model  # noqa: PLC0415
        quantize_model(nm, weights, gguf_path=base.source, device=device, fuse=fuse,
                       load_tokenizer=lambda: base.tokenizer)
    nm.eval()
    return LoadedFamily(nm, manifest, base)


@dataclass(slots=True)
class ModelArgs:
    """Which family a process loads, and how: the flags of every command that loads one."""
    model: str = opt("default", MODEL_HELP)
    tiers: str | None = opt(None, "cut points, e.g. 10,20,30 or small=10,large=30")
    dtype: Literal["float32", "bfloat16", "float16", "float64"] | None = None
    device: str = "cuda" if torch.cuda.is_available() else "cpu"
    kernels: Literal["auto", "torch", "triton"] | None = None
    weights: str = opt(FP32.name, lambda: "serve weights quantized: " + "; ".join(
        f"{f.name} = {f.help}" for f in FORMATS.values()) + "; auto picks by the device and CPU", parse=parse_weights)


def add_model_args(p: argparse.ArgumentParser) -> None:
    add_args(p, ModelArgs)


def load_from_args(args):
    return load_family(args.model, tiers=args.tiers, dtype=args.dtype, device=args.device,
                       kernels=args.kernels, weights=getattr(args, "weights", FP32.name))
