"""Precipitated weights on disk: low-rank (LoRA) adapters for training, and the two checkpoint kinds.

* ``full``: every parameter of the nested model (HF-independent names of :class:`NestedModel`).
* ``delta``: only what precipitation changed over the base: ``layers.{i}.{proj}.lora_A`` [r, in] and
  ``lora_B`` [out, r] per adapted linear (already scaled: W' = W + B @ A), the layer norms that were
  trained and every tier's exit norm (stored as values, not differences: they are tiny).

:func:`apply_weights` is the loader's hook (worker/family.py). It merges low-rank updates into the plain
``nn.Linear`` weights, so a served model pays nothing for them.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from worker.model import NestedModel

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
_NORMS = ("input_layernorm", "post_attention_layernorm")


class LoRALinear(nn.Module):
    """A frozen ``nn.Linear`` plus a trainable rank-r update ``scale * B @ A`` (B starts at zero)."""

    def __init__(self, base: nn.Linear, rank: int, alpha: float | None = None):
        super().__init__()
        self.base = base
        self.rank = rank
        self.scale = (alpha if alpha is not None else rank) / rank
        w = base.weight
        self.lora_A = nn.Parameter(torch.empty(rank, w.shape[1], dtype=w.dtype, device=w.device))
        self.lora_B = nn.Parameter(torch.zeros(w.shape[0], rank, dtype=w.dtype, device=w.device))
        nn.init.kaiming_uniform_(self.lora_A, a=math.sqrt(5))
        self.enabled = True  # False = the original linear (the distillation teacher)

    @property
    def weight(self) -> torch.Tensor:
        return self.base.weight

    @property
    def bias(self) -> torch.Tensor | None:
        return self.base.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        if self.enabled:
            y = y + (x @ self.lora_A.t() @ self.lora_B.t()) * self.scale
        return y

    def delta(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(A, scaled B): W' = W + B @ A."""
        return self.lora_A.detach(), (self.lora_B * self.scale).detach()


def add_lora(model: NestedModel, rank: int, alpha: float | None = None,
             targets: tuple[str, ...] = LINEARS) -> list[LoRALinear]:
    """Wraps the target linears of every layer in place; freezes their base weights."""
    out = []
    for layer in model.layers:
        for name in targets:
            lin = getattr(layer, name)
            assert isinstance(lin, nn.Linear), f"{name} is already wrapped"
            lin.weight.requires_grad_(False)
            if lin.bias is not None:
                lin.bias.requires_grad_(False)
            w = LoRALinear(lin, rank, alpha)
            setattr(layer, name, w)
            out.append(w)
    return out


def set_lora_enabled(model: NestedModel, enabled: bool) -> None:
    for m in model.modules():
        if isinstance(m, LoRALinear):
            m.enabled = enabled


def lora_modules(model: NestedModel) -> dict[str, LoRALinear]:
    return {f"layers.{i}.{n}": getattr(layer, n) for i, layer in enumerate(model.layers)
            for n in LINEARS if isinstance(getattr(layer, n), LoRALinear)}


# ---- the two checkpoint kinds ------------------------------------------------------------------
def plain_state(model: NestedModel) -> dict[str, torch.Tensor]:
    """Every parameter under its serving name (adapters merged into a copy, the model untouched)."""
    sd = {}
    loras = lora_modules(model)
    for k, v in model.state_dict().items():
        if ".lora_" in k:
            continue
        k2 = k.replace(".base.", ".")
        sd[k2] = v.detach().clone()
    for name, m in loras.items():
        a, b = m.delta()
        sd[name + ".weight"] = sd[name + ".weight"] + (b.float() @ a.float()).to(sd[name + ".weight"].dtype)
    if model.cfg.tie_embeddings:
        sd.pop("lm_head.weight", None)
    return sd


def delta_state(model: NestedModel, train_layer_norms: bool = True) -> dict[str, torch.Tensor]:
    sd = {}
    for name, m in lora_modules(model).items():
        a, b = m.delta()
        sd[name + ".lora_A"], sd[name + ".lora_B"] = a.clone(), b.clone()
    for t in model.tiers:
        sd[model.exit_param_name(t.index)] = model.exit_norms[t.index].detach().clone()
    if train_layer_norms:
        for i, layer in enumerate(model.layers):
            for n in _NORMS:
                if getattr(layer, n) is not None:  # OLMo 2's layers have no norm before attention or MLP
                    sd[f"layers.{i}.{n}"] = getattr(layer, n).detach().clone()
    return sd


def save_weights(model: NestedModel, path: str | Path, kind: str, dtype: torch.dtype = torch.float32,
                 metadata: dict | None = None) -> Path:
    if kind == "full":
        sd = plain_state(model)
    elif kind == "delta":
        if not lora_modules(model):
            raise ValueError("a delta checkpoint needs low-rank adapters (train with --lora-rank > 0)")
        sd = delta_state(model)
    else:
        raise ValueError(f"unknown weights kind {kind!r} (full | delta)")
    sd = {k: v.to(dtype).contiguous() for k, v in sd.items()}
    meta = {"kind": kind, "format": "mfs-weights", **{k: json.dumps(v) for k, v in (metadata or {}).items()}}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(sd, str(path), metadata=meta)
    return path


def apply_weights(model: NestedModel, path: str | Path, kind: str) -> None:
    """Loads a ``full`` or ``delta`` weights file into a NestedModel built from the base weights."""
    sd = load_file(str(path))
    own = dict(model.named_parameters())
    with torch.no_grad():
        if kind == "full":
            missing = [k for k in own if k not in sd and not (k == "lm_head.weight" and model.cfg.tie_embeddings)]
            if missing:
                raise ValueError(f"{path}: full weights lack {missing[:3]}...")
            for k, v in sd.items():
                if k not in own:
                    raise ValueError(f"{path}: unexpected tensor {k!r}")
                own[k].copy_(v.to(own[k].dtype))
            return
        if kind == "exit":
            _apply_exit(model, sd, own, path)
            return
        if kind != "delta":
            raise ValueError(f"unknown weights kind {kind!r} (full | delta | exit)")
        for k, v in sd.items():
            if k.startswith("layers.") and int(k.split(".")[1]) >= len(model.layers):
                continue  # layers above the top tier the caller built
            if k.endswith(".lora_A"):
                name = k[: -len(".lora_A")]
                w = own[name + ".weight"]
                b = sd[name + ".lora_B"]
                w.add_((b.float() @ v.float()).to(w.dtype))
            elif k.endswith(".lora_B"):
                continue
            elif k.startswith("exit_norms."):
                idx = int(k.split(".")[1])
                if idx >= len(model.exit_norms):
                    continue  # a tier the caller did not build
                own[k].copy_(v.to(own[k].dtype))
            elif k in own:
                own[k].copy_(v.to(own[k].dtype))
            else:
                raise ValueError(f"{path}: unexpected tensor {k!r}")


def _apply_exit(model: NestedModel, sd: dict, own: dict, path) -> None:
    """An ``exit`` file holds only exit norms and exit blocks (the trunk is the base, unchanged);
    every exit block the model was built with must be in it."""
    want = {k for k in own if k.startswith("exit_blocks.")}
    missing = sorted(want - set(sd))
    if missing:
        raise ValueError(f"{path}: exit weights lack {missing[:3]} (does the manifest's exit block "
                         "match the weights?)")
    for k, v in sd.items():
        if k.startswith("exit_norms.") and int(k.split(".")[1]) >= len(model.exit_norms):
            continue  # a tier the caller did not build
        if k.startswith("exit_blocks.") and k not in own:
            if int(k.split(".")[1]) >= len(model.exit_norms):
                continue
            raise ValueError(f"{path}: unexpected tensor {k!r}")
        if not k.startswith(("exit_norms.", "exit_blocks.")):
            raise ValueError(f"{path}: unexpected tensor {k!r} in exit weights")
        own[k].copy_(v.to(own[k].dtype))
