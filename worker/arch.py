"""What each served architecture changes in the Llama decoder layer, and its weights in the layout
:class:`worker.model.NestedModel` reads.

The nested model has one layer body (worker/model.py: ``_layer``, ``_dense_layer``); an architecture
switches on the pieces it needs:

* ``qk_norm`` -- an RMSNorm on q and k before the rotary: over each head's dims (Qwen3, Gemma 3) or
  over the whole projection (OLMo 2);
* ``norms`` -- where the layer norms sit: ``pre`` (Llama: before attention and MLP), ``post`` (OLMo 2:
  on the attention and MLP outputs only) or ``sandwich`` (Gemma 3: both);
* ``fused`` -- q/k/v and gate/up stored as one matrix each (Phi-3), split here at load;
* ``norm_offset`` -- Gemma's RMSNorm multiplies by ``1 + weight``: the 1 is added to the weights at
  load, so the one RMSNorm op serves (in fp32 the same product, bit for bit);
* ``embed_scale`` -- embeddings multiplied by sqrt(hidden) (Gemma 3).

Per-layer attention windows, the activation, partial rotary, LongRoPE and a second rope base for local
layers are read from the config (worker/config.py: ``ModelConfig.from_hf``).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels.rotary import build_cos_sin_cache


@dataclass(frozen=True, slots=True)
class Arch:
    qk_norm: str | None = None  # None, "head" or "proj"
    norms: str = "pre"          # "pre", "post" or "sandwich"
    fused: bool = False
    norm_offset: float = 0.0
    embed_scale: bool = False


ARCHS: dict[str, Arch] = {
    "llama": Arch(),
    "qwen2": Arch(),
    "mistral": Arch(),
    "qwen3": Arch(qk_norm="head"),
    "olmo2": Arch(qk_norm="proj", norms="post"),
    "phi3": Arch(fused=True),
    "gemma3_text": Arch(qk_norm="head", norms="sandwich", norm_offset=1.0, embed_scale=True),
}

# the extra per-layer norms, by the name the nested model gives them
QK_NORMS = ("self_attn.q_norm", "self_attn.k_norm")
OUT_NORMS = ("attn_out_norm", "mlp_out_norm")


def to_llama_layout(model_type: str, sd: dict[str, torch.Tensor], num_layers: int, q_size: int,
                    kv_size: int) -> dict[str, torch.Tensor]:
    """A transformers state dict of ``model_type`` -> the names the nested model adopts: q/k/v and
    gate/up apart, ``input_layernorm`` and ``post_attention_layernorm`` the norms before attention and
    MLP (absent where there are none), ``attn_out_norm`` and ``mlp_out_norm`` those after them. A new
    dict; the tensors are the given ones or views of them."""
    arch = ARCHS[model_type]
    out = dict(sd)
    for i in range(num_layers):
        p = f"model.layers.{i}."
        if arch.fused:
            q, k, v = out.pop(p + "self_attn.qkv_proj.weight").split((q_size, kv_size, kv_size))
            out[p + "self_attn.q_proj.weight"], out[p + "self_attn.k_proj.weight"] = q, k
            out[p + "self_attn.v_proj.weight"] = v
            g, u = out.pop(p + "mlp.gate_up_proj.weight").chunk(2)
            out[p + "mlp.gate_proj.weight"], out[p + "mlp.up_proj.weight"] = g, u
        if arch.norms == "post":  # OLMo 2's post_attention_layernorm normalises the attention's output
            out[p + "attn_out_norm.weight"] = out.pop(p + "post_attention_layernorm.weight")
            out[p + "mlp_out_norm.weight"] = out.pop(p + "post_feedforward_layernorm.weight")
        elif arch.norms == "sandwich":
            out[p + "attn_out_norm.weight"] = out.pop(p + "post_attention_layernorm.weight")
            out[p + "post_attention_layernorm.weight"] = out.pop(p + "pre_feedforward_layernorm.weight")
            out[p + "mlp_out_norm.weight"] = out.pop(p + "post_feedforward_layernorm.weight")
    if arch.norm_offset:
        for k in out:
            if k.endswith("norm.weight"):
                out[k] = out[k] + arch.norm_offset
    return out


def rope_tables(cfg, max_positions: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The rotary tables [max_positions, rotary_dim] (cos, sin) of the global layers and, where they
    differ, of the local (sliding-window) layers. LongRoPE: positions before the original context use
    the short factors, later ones the long factors (what transformers computes for a token first seen
    there, prompt within the original context, decoded past it)."""
    table = build_cos_sin_cache(cfg.inv_freq, max_positions, cfg.rope_attention_scaling)
    if cfg.long_inv_freq is not None and max_positions > cfg.rope_long_from:
        long = build_cos_sin_cache(cfg.long_inv_freq, max_positions, cfg.rope_attention_scaling)
        table[cfg.rope_long_from:] = long[cfg.rope_long_from:]
    local = None
    if cfg.local_inv_freq is not None:
        local = build_cos_sin_cache(cfg.local_inv_freq, max_positions, cfg.local_rope_scaling)
    return table, local
