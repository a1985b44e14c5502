"""The pieces architectures add to Llama's decoder layer (worker/arch.py says which has which), for the
one layer body of :class:`worker.model.NestedModel`: a layer's extra parameters and attributes
(:func:`add_arch_parts`), and the model's methods that apply them (:class:`ArchParts`). Each piece is
the identity, or Llama's own op, where the architecture does not have it.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from worker.window_attention import paged_window_attention

ACTS = {"silu": F.silu, "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}

# a layer's norms: name after "model.layers.{i}." (worker/arch.py's layout) -> the layer's attribute
NORM_KEYS = {"input_layernorm.weight": "input_layernorm",
             "post_attention_layernorm.weight": "post_attention_layernorm",
             "self_attn.q_norm.weight": "q_norm", "self_attn.k_norm.weight": "k_norm",
             "attn_out_norm.weight": "attn_out_norm", "mlp_out_norm.weight": "mlp_out_norm"}


def add_arch_parts(layer: nn.Module, cfg, index: int | None) -> None:
    """The layer's activation, attention window (None: full), rope kind, q/k norms and output norms
    (None where it has none); OLMo 2's layers lose their norms before attention and MLP."""
    h, d = cfg.hidden_size, cfg.head_dim
    layer.act = ACTS[cfg.act]
    layer.window = cfg.layer_windows[index] if cfg.layer_windows and index is not None else None
    layer.local_rope = layer.window is not None and cfg.local_inv_freq is not None
    qk = {"head": (d, d), "proj": layer.qkv_sizes[:2]}.get(cfg.qk_norm)
    layer.q_norm = nn.Parameter(torch.ones(qk[0])) if qk else None
    layer.k_norm = nn.Parameter(torch.ones(qk[1])) if qk else None
    layer.attn_out_norm = nn.Parameter(torch.ones(h)) if cfg.norms != "pre" else None
    layer.mlp_out_norm = nn.Parameter(torch.ones(h)) if cfg.norms != "pre" else None
    if cfg.norms == "post":  # the attention and the MLP read the residual stream itself
        layer.input_layernorm = layer.post_attention_layernorm = None


class ArchParts:
    """Methods of the nested model (which has ``cfg``, ``ops``, ``scale`` and the rope tables)."""

    def _norm(self, x: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
        """RMSNorm with ``weight``; x itself where the layer has no norm there."""
        return x if weight is None else self.ops.rms_norm(x, weight, self.cfg.rms_eps)

    def _add_norm(self, h: torch.Tensor, residual: torch.Tensor | None,
                  weight: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(h + residual), h + residual); residual None: h alone; weight None: no norm."""
        if weight is None:
            x = h if residual is None else h + residual
            return x, x
        if residual is None:
            return self.ops.rms_norm(h, weight, self.cfg.rms_eps), h
        return self.ops.fused_add_rms_norm(h, residual, weight, self.cfg.rms_eps)

    def _qk_norm(self, layer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor):
        """q [.., Hq * D] and k normed per head (Qwen3, Gemma 3) or over the projection (OLMo 2)."""
        if layer.q_norm is None:
            return q, k, v
        if self.cfg.qk_norm == "proj":
            return self._norm(q, layer.q_norm), self._norm(k, layer.k_norm), v
        d = self.cfg.head_dim
        qn = self._norm(q.reshape(*q.shape[:-1], -1, d), layer.q_norm).reshape(q.shape)
        return qn, self._norm(k.reshape(*k.shape[:-1], -1, d), layer.k_norm).reshape(k.shape), v

    def _rotary(self, layer, q: torch.Tensor, k: torch.Tensor, pos: torch.Tensor,
                memo: dict | None) -> tuple[torch.Tensor, torch.Tensor]:
        """The rotary of the layer's kind (local layers: their own table and memo) over the rotated
        dims (the first ``rotary_dim`` of each head)."""
        table = self.cos_sin
        if layer.local_rope:
            table, memo = self.cos_sin_local, (memo.setdefault("local", {}) if memo is not None else None)
        r = self.cfg.rotary_dim or self.cfg.head_dim
        if r == self.cfg.head_dim:
            return self.ops.rotary(q, k, pos, table, memo=memo)
        qr, kr = self.ops.rotary(q[..., :r].contiguous(), k[..., :r].contiguous(), pos, table, memo=memo)
        return torch.cat([qr, q[..., r:]], dim=-1), torch.cat([kr, k[..., r:]], dim=-1)

    def _attention(self, layer, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, seg) -> torch.Tensor:
        """Paged causal attention of the step's queries [T, Hq, D], within the layer's window if it has one."""
        if layer.window is None:
            return self.ops.paged_attention(q, k_cache, v_cache, seg.block_tables, seg.q_start_loc, seg.ctx_lens,
                                            self.scale, seg.q_lens_host, seg.ctx_lens_host, memo=seg.memo)
        return paged_window_attention(q, k_cache, v_cache, seg.block_tables, seg.q_start_loc, seg.ctx_lens,
                                      self.scale, layer.window, seg.q_lens_host, seg.ctx_lens_host, seg.memo)

    def _dense_attention(self, layer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention over q, k, v [B, H, S, D] (no cache), within the layer's window if it has one."""
        gqa = q.shape[1] != k.shape[1]
        if layer.window is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=self.scale, enable_gqa=gqa)
        i = torch.arange(q.shape[2], device=q.device)
        mask = (i[None, :] <= i[:, None]) & (i[None, :] > i[:, None] - layer.window)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale, enable_gqa=gqa)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        """Token embeddings, scaled where the architecture scales them (Gemma: by sqrt(hidden))."""
        x = self.embed_tokens(input_ids)
        if self.cfg.embed_scale != 1.0:
            x = x * torch.tensor(self.cfg.embed_scale, dtype=x.dtype)
        return x

    def softcap(self, logits: torch.Tensor) -> torch.Tensor:
        """cap * tanh(logits / cap) where the architecture caps its final logits."""
        cap = self.cfg.logit_softcap
        return logits if cap is None else torch.tanh(logits / cap) * cap
