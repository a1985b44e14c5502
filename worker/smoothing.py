"""Activation smoothing for ``--weights w8a8`` (SmoothQuant, Xiao et al. 2023, with alpha = 0.5).

Owns :func:`calibration_windows`, :func:`input_amax` and :func:`smooth`.

Why: w8a8 quantizes each activation row to 8 bits with one scale (worker/formats/w8a8.py), so a few
input channels that run far larger than the rest (LLMs have them) take the whole range and the others
lose precision: unsmoothed, SmolLM2-135M's held-out perplexity rose 2.6 %. Smoothing moves that range
into the weights before they are quantized: for a linear whose input channel j peaks at ``a_j`` (over
calibration text) and whose weight column j at ``w_j``, ``s_j = sqrt(a_j / w_j)``; the input is divided
by ``s`` and the column multiplied by it, so the product is unchanged in exact arithmetic (fp32: the
last bits). The division is folded into what produces the input, so serving runs nothing new:

* q/k/v and gate/up read an RMSNorm's output: its weight is divided;
* down_proj reads ``silu(gate) * up``: up_proj's output rows are divided;
* o_proj reads the attention output, each channel a mix of v_proj's same channel: v_proj's rows are
  divided (one ``s`` per kv-head channel, shared by the query heads of its group);
* the LM head reads the exit norms' outputs (every tier's): each exit norm's weight is divided and the
  head becomes its own tensor (it was the embedding's, tied).

Calibration: the model's own forward over ``w8a8_calibration.txt`` (a few chat turns written for it
and the start of the ``json`` module's pydoc — neither in any held-out text) in windows of 256 tokens.
"""
from __future__ import annotations

from pathlib import Path

import structlog
import torch
from torch import nn

log = structlog.get_logger(__name__)

ALPHA = 0.5
CALIBRATION_TEXT = Path(__file__).with_name("w8a8_calibration.txt")


def calibration_windows(tokenizer, vocab_size: int, seq_len: int = 256, max_tokens: int = 1024,
                        ) -> list[list[int]]:
    """Token windows of the calibration text; without a tokenizer (a bare test model), seeded random
    ids, with a warning: any text calibrates the arithmetic, only real text calibrates it well."""
    if tokenizer is not None:
        ids = tokenizer.encode(CALIBRATION_TEXT.read_text())[:max_tokens]
        ids = [i for i in ids if i < vocab_size]
    else:
        log.warning("w8a8 calibration without a tokenizer: random token ids")
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(0, vocab_size, (max_tokens,), generator=g).tolist()
    return [ids[i:i + seq_len] for i in range(0, len(ids), seq_len) if len(ids[i:i + seq_len]) > 1]


@torch.inference_mode()
def input_amax(model, windows: list[list[int]]) -> dict[str, torch.Tensor]:
    """Per nn.Linear of ``model`` (by name): the largest |input| of each input channel over the windows
    run through every tier (each exit's hidden states through the head)."""
    amax: dict[str, torch.Tensor] = {}

    def hook(name):
        def record(_mod, inputs):
            a = inputs[0].detach().reshape(-1, inputs[0].shape[-1]).abs().amax(0).float()
            amax[name] = torch.maximum(amax[name], a) if name in amax else a
        return record

    handles = [m.register_forward_pre_hook(hook(n)) for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    try:
        dev = model.embed_tokens.weight.device
        for w in windows:
            hidden = model.exit_hidden(torch.tensor([w], device=dev))
            model.logits(torch.cat(list(hidden), dim=1))
    finally:
        for h in handles:
            h.remove()
    return amax


def _scale(a: torch.Tensor, w: torch.Tensor, alpha: float) -> torch.Tensor:
    s = a.clamp_min(1e-5) ** alpha / w.clamp_min(1e-5) ** (1 - alpha)
    return s.clamp(1e-3, 1e3)


@torch.no_grad()
def smooth(model, amax: dict[str, torch.Tensor], alpha: float = ALPHA) -> int:
    """Folds the smoothing scales into ``model`` (fp32, unquantized, unfused), in place; returns how
    many linears were smoothed."""
    cfg, done = model.cfg, 0
    layers = [(f"layers.{i}", layer) for i, layer in enumerate(model.layers)]
    layers += [(f"exit_blocks.{k}.{j}", layer) for k, blk in model.exit_blocks.items() for j, layer in enumerate(blk)]
    for pre, layer in layers:
        if f"{pre}.q_proj" not in amax:
            continue  # a layer the calibration never ran (none in a nested model: every tier ran)
        qkv, gu = (layer.q_proj, layer.k_proj, layer.v_proj), (layer.gate_proj, layer.up_proj)
        done += _into_norm(layer.input_layernorm, qkv, amax[f"{pre}.q_proj"], alpha)
        done += _into_norm(layer.post_attention_layernorm, gu, amax[f"{pre}.gate_proj"], alpha)
        s = _scale(amax[f"{pre}.down_proj"], layer.down_proj.weight.abs().amax(0), alpha)
        _divide_rows(layer.up_proj, s)
        layer.down_proj.weight.mul_(s)
        hq, hk, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        g = hq // hk  # query heads per kv head: they read the same v channels
        a = amax[f"{pre}.o_proj"].view(hk, g, d).amax(1)
        w = layer.o_proj.weight.abs().amax(0).view(hk, g, d).amax(1)
        s = _scale(a, w, alpha)  # [hk, d]
        _divide_rows(layer.v_proj, s.reshape(-1))
        layer.o_proj.weight.mul_(s[:, None, :].expand(hk, g, d).reshape(-1))
        done += 2
    if "lm_head" in amax:
        s = _scale(amax["lm_head"], model.lm_head.weight.abs().amax(0), alpha)
        model.lm_head.weight = nn.Parameter(model.lm_head.weight * s, requires_grad=False)  # untied
        for norm in model.exit_norms:
            norm.div_(s)
        done += 1
    return done


def _into_norm(norm: torch.Tensor | None, lins: tuple[nn.Linear, ...], amax: torch.Tensor, alpha: float) -> int:
    """Smooths linears that read one RMSNorm's output, the division folded into its weight; none where
    they read the residual stream itself (OLMo 2: no norm to fold into). Returns how many."""
    if norm is None:
        return 0
    s = _scale(amax, torch.stack([m.weight.abs().amax(0) for m in lins]).amax(0), alpha)
    norm.div_(s)
    for m in lins:
        m.weight.mul_(s)
    return len(lins)


def _divide_rows(lin: nn.Linear, s: torch.Tensor) -> None:
    lin.weight.div_(s[:, None])
    if lin.bias is not None:
        lin.bias.div_(s)


__all__ = ["ALPHA", "CALIBRATION_TEXT", "calibration_windows", "input_amax", "smooth"]
