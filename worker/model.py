"""MFS's nested model, its structure and weights: one Llama-style decoder (other architectures' pieces:
worker/layer_parts.py) whose first layers, with their own exits, are the smaller tiers of the family.

Two forwards share the weights:
* :meth:`NestedModel.forward_step` — serving (worker/step_forward.py): a flattened variable-length batch
  whose rows are ordered by tier, highest first, over the tier-segmented paged KV cache.
* :meth:`NestedModel.exit_hidden` — training and evaluation, here: dense causal attention, no cache, and
  the exit hidden state of every tier.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from kernels import TORCH_OPS, KernelOps
from worker.arch import rope_tables
from worker.config import ModelConfig
from worker.layer_parts import NORM_KEYS, ArchParts, add_arch_parts
from worker.step_forward import StepForward


@dataclass(frozen=True, slots=True)
class Tier:
    index: int
    name: str
    layers: int  # the tier's exit is after this many trunk (shared) decoder layers
    block: int = 0  # decoder layers of the tier's private exit block (0: norm + head only)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, index: int | None = None):
        """``index``: which decoder layer of the architecture this is (its attention window and rope)."""
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        self.q_proj = nn.Linear(h, cfg.num_heads * d, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(h, cfg.num_kv_heads * d, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(h, cfg.num_kv_heads * d, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.num_heads * d, h, bias=cfg.o_bias)
        self.gate_proj = nn.Linear(h, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(h, cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, h, bias=cfg.mlp_bias)
        self.input_layernorm = nn.Parameter(torch.ones(h))
        self.post_attention_layernorm = nn.Parameter(torch.ones(h))
        # Serving may fuse q/k/v and gate/up into one linear each (worker/formats/swap.py: fuse_projections):
        # one matmul and one activation cast instead of three and two. Then the separate ones are gone.
        self.qkv_proj: nn.Module | None = None
        self.gate_up_proj: nn.Module | None = None
        self.qkv_sizes = (cfg.num_heads * d, cfg.num_kv_heads * d, cfg.num_kv_heads * d)
        add_arch_parts(self, cfg, index)  # what the architecture adds (worker/layer_parts.py)

    def qkv(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        if self.qkv_proj is not None:
            return self.qkv_proj(x).split(self.qkv_sizes, dim=-1)
        return self.q_proj(x), self.k_proj(x), self.v_proj(x)

    def mlp(self, x: torch.Tensor, silu_mul=None) -> torch.Tensor:  # silu_mul: the serving ops' silu(g) * u
        act = silu_mul if silu_mul is not None and self.act is F.silu else (lambda g, u: self.act(g) * u)
        if self.gate_up_proj is not None:
            g, u = self.gate_up_proj(x).chunk(2, dim=-1)
            return self.down_proj(act(g, u))
        return self.down_proj(act(self.gate_proj(x), self.up_proj(x)))


# HF parameter name (after "model.layers.{i}.") -> our attribute path.
_LAYER_KEYS = {
    "self_attn.q_proj": "q_proj", "self_attn.k_proj": "k_proj", "self_attn.v_proj": "v_proj",
    "self_attn.o_proj": "o_proj", "mlp.gate_proj": "gate_proj", "mlp.up_proj": "up_proj",
    "mlp.down_proj": "down_proj",
}


class NestedModel(ArchParts, StepForward, nn.Module):
    def __init__(self, cfg: ModelConfig, tiers: list[Tier], max_positions: int | None = None,
                 ops: KernelOps = TORCH_OPS):
        super().__init__()
        if not tiers:
            raise ValueError("a nested model needs at least one tier")
        layers = [t.layers for t in tiers]
        if layers != sorted(set(layers)) or layers[0] < 1 or layers[-1] > cfg.num_layers:
            raise ValueError(f"tier layers must be strictly increasing within 1..{cfg.num_layers}, "
                             f"got {layers}")
        self.cfg = cfg
        self.tiers = tiers
        self.ops = ops
        self.boundaries = [0] + layers  # segment s = layers [boundaries[s], boundaries[s+1])
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(layers[-1]))
        self.exit_norms = nn.ParameterList(nn.Parameter(torch.ones(cfg.hidden_size)) for _ in tiers)
        # A tier's private exit block: decoder layers between its trunk boundary and its exit norm.
        # They read the trunk's hidden state and never feed it: higher tiers go on from the trunk.
        # (each block layer attends as the model's last layers, which copy:last starts it from, whatever the cut)
        self.exit_blocks = nn.ModuleDict({str(t.index): nn.ModuleList(
            DecoderLayer(cfg, cfg.num_layers - t.block + j) for j in range(t.block)) for t in tiers if t.block})
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.tie_weights()
        self.max_positions = min(max_positions or cfg.max_position, cfg.max_position)
        self.register_buffer("cos_sin", torch.empty(0), persistent=False)
        self.register_buffer("cos_sin_local", None, persistent=False)  # the windowed layers' own rope
        self.rebuild_buffers()
        self.scale = cfg.attn_scale or cfg.head_dim ** -0.5
        # how all-decode rows run their segments and exit blocks another way than the eager layers below
        # (worker/execution.py: compiled graphs, applied from outside); None: eager
        self.execution = None

    # ---- construction ------------------------------------------------------------------------
    def tie_weights(self) -> None:
        """Tied embeddings share one tensor (re-done after meta init, where to_empty unties them)."""
        if self.cfg.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def rebuild_buffers(self) -> None:
        """(Re)computes the rotary table in fp32 on the weights' device (after meta init or .to())."""
        dev = self.embed_tokens.weight.device
        if dev.type == "meta":
            return
        table, local = rope_tables(self.cfg, self.max_positions)
        self.cos_sin = table.to(dev)
        self.cos_sin_local = local.to(dev) if local is not None else None

    @property
    def num_segments(self) -> int:
        return len(self.tiers)

    def segment_layers(self, s: int) -> range:
        return range(self.boundaries[s], self.boundaries[s + 1])

    def exit_block(self, s: int) -> nn.ModuleList | None:
        return self.exit_blocks[str(s)] if str(s) in self.exit_blocks else None

    @property
    def exit_block_segments(self) -> tuple[int, ...]:
        """The segments whose tier leaves through an exit block (its KV layers are in their pools)."""
        return tuple(t.index for t in self.tiers if t.block and t.index < self.num_segments - 1)

    @property
    def kv_window(self) -> int:
        """The widest attention window over every layer a row may run (each tier's trunk and exit-block
        layers) when all of them have one: no position further back is ever read, so the scheduler may
        give those blocks back (scheduler/window.py); 0 when a layer attends to every position."""
        wins = [layer.window for layer in self.layers] + [layer.window for b in self.exit_blocks.values()
                                                           for layer in b]
        return 0 if None in wins else max(wins)

    def segment_kv_layers(self, s: int) -> int:
        """KV layers of segment s's pool: its trunk layers, then tier s's exit-block layers (written
        by the tokens whose request reads exit s, see :meth:`_exit`; a cached block missing them is
        filled before a reader reuses it: scheduler/core.py, lazy exits)."""
        return len(self.segment_layers(s)) + self.tiers[s].block

    def init_exit_blocks(self, init: str = "copy:last") -> None:
        """``copy:last`` (each block layer a copy of the model's last layers, in order) or
        ``copy:N`` (a copy of decoder layer N, 0-based). Exit norms become the last trunk norm's copy
        by construction (see adopt_base_state)."""
        with torch.no_grad():
            for key, blk in self.exit_blocks.items():
                n = len(blk)
                if init == "copy:last":
                    srcs = range(len(self.layers) - n, len(self.layers))
                elif init.startswith("copy:") and init[5:].isdigit():
                    srcs = [int(init[5:])] * n
                else:
                    raise ValueError(f"unknown exit-block init {init!r} (copy:last or copy:N)")
                for dst, si in zip(blk, srcs):
                    for name, p in self.layers[si].named_parameters():
                        dst.get_parameter(name).copy_(p)

    def adopt_base_state(self, sd: dict[str, torch.Tensor]) -> None:
        """Loads HF-named weights: the model takes the loader's tensors as its parameters instead
        of copying them (a meta-initialised model needs no memory of its own: loading peaks at one
        copy of the weights, not two). The exit norms start as copies of the final norm."""
        def take(module: nn.Module, name: str, key: str) -> None:
            module._parameters[name] = nn.Parameter(sd[key], requires_grad=False)

        take(self.embed_tokens, "weight", "model.embed_tokens.weight")
        if not self.cfg.tie_embeddings:
            take(self.lm_head, "weight", "lm_head.weight")
        for i, layer in enumerate(self.layers):
            p = f"model.layers.{i}."
            for hf, ours in _LAYER_KEYS.items():
                lin = getattr(layer, ours)
                take(lin, "weight", p + hf + ".weight")
                if lin.bias is not None:
                    take(lin, "bias", p + hf + ".bias")
            for key, ours in NORM_KEYS.items():
                if getattr(layer, ours) is not None:
                    take(layer, ours, p + key)
        for t in self.tiers:
            self.exit_norms[t.index] = nn.Parameter(sd["model.norm.weight"].clone(), requires_grad=False)
        for blk in self.exit_blocks.values():  # copy:last until trained weights are applied
            for dst, src in zip(blk, self.layers[len(self.layers) - len(blk):]):
                for name, p in src.named_parameters():
                    mod, _, leaf = name.rpartition(".")
                    (dst.get_submodule(mod) if mod else dst)._parameters[leaf] = nn.Parameter(
                        p.detach().clone(), requires_grad=False)
        self.tie_weights()
        self.rebuild_buffers()

    def exit_param_name(self, tier: int) -> str:
        return f"exit_norms.{tier}"

    # ---- training / evaluation forward ------------------------------------------------------
    def _dense_layer(self, layer: DecoderLayer, x: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """One decoder layer over x [B, S, H] with dense causal attention (no cache)."""
        cfg = self.cfg
        B, S, _ = x.shape
        h = self._norm(x, layer.input_layernorm)
        q, k, v = self._qk_norm(layer, *layer.qkv(h))
        q = q.reshape(B * S, cfg.num_heads, cfg.head_dim)
        k = k.reshape(B * S, cfg.num_kv_heads, cfg.head_dim)
        v = v.reshape(B, S, cfg.num_kv_heads, cfg.head_dim)
        q, k = self._rotary(layer, q, k, pos.repeat(B), None)
        q = q.view(B, S, cfg.num_heads, cfg.head_dim).transpose(1, 2)
        k = k.view(B, S, cfg.num_kv_heads, cfg.head_dim).transpose(1, 2)
        a = self._dense_attention(layer, q, k, v.transpose(1, 2))
        x = x + self._norm(layer.o_proj(a.transpose(1, 2).reshape(B, S, -1)), layer.attn_out_norm)
        return x + self._norm(layer.mlp(self._norm(x, layer.post_attention_layernorm)), layer.mlp_out_norm)

    def trunk_states(self, input_ids: torch.Tensor, upto_tier: int | None = None) -> list[torch.Tensor]:
        """input_ids [B, S] -> the trunk's residual stream [B, S, H] at boundary 0..upto_tier (after
        the last trunk layer of each segment, before any exit block or norm)."""
        top = self.num_segments - 1 if upto_tier is None else upto_tier
        pos = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.embed(input_ids)
        outs = []
        for s in range(top + 1):
            for li in self.segment_layers(s):
                x = self._dense_layer(self.layers[li], x, pos)
            outs.append(x)
        return outs

    def exit_from_trunk(self, s: int, x: torch.Tensor) -> torch.Tensor:
        """Tier s's exit over its trunk boundary state x [B, S, H] (positions 0..S-1): its exit block
        (if any), then its norm. Training on cached trunk features calls this alone."""
        blk = self.exit_block(s)
        if blk is not None:
            pos = torch.arange(x.shape[1], device=x.device)
            for layer in blk:
                x = self._dense_layer(layer, x, pos)
        return self.ops.rms_norm(x, self.exit_norms[s], self.cfg.rms_eps)

    def exit_hidden(self, input_ids: torch.Tensor, upto_tier: int | None = None) -> list[torch.Tensor]:
        """input_ids [B, S] -> the normed exit hidden state [B, S, H] of tiers 0..upto_tier."""
        return [self.exit_from_trunk(s, x) for s, x in enumerate(self.trunk_states(input_ids, upto_tier))]

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.softcap(self.head()(hidden))

    def head(self) -> nn.Module:
        """The LM head module the model's execution path runs (worker/execution.py): its own, or the
        path's copy of it on another kernel."""
        return self.lm_head if self.execution is None else self.execution.head(self)


_INITS = ("normal_", "uniform_", "kaiming_uniform_", "trunc_normal_", "xavier_uniform_", "zeros_", "ones_",
          "constant_")


@contextlib.contextmanager
def skeleton():
    """Modules built inside hold meta tensors (no memory) and skip their random initialisation, which
    means nothing on meta and would import ``torch._dynamo`` (~1.5 s of a worker's start on 2 cores).
    The weights come later (``adopt_base_state``, ``to_empty`` + copies)."""
    saved = {n: getattr(nn.init, n) for n in _INITS}
    try:
        for n in _INITS:
            setattr(nn.init, n, lambda tensor, *a, **k: tensor)
        with torch.device("meta"):
            yield
    finally:
        for n, f in saved.items():
            setattr(nn.init, n, f)


def standalone_tier(model: NestedModel, tier: int) -> NestedModel:
    """One tier as its own model with its own copy of the weights: the "separate deployments"
    baseline that MFS replaces (benchmarks and ``mfs up --layout independent``)."""
    t = model.tiers[tier]
    dev = model.embed_tokens.weight.device
    with skeleton():
        m = NestedModel(model.cfg, [Tier(0, t.name, t.layers, t.block)], model.max_positions, model.ops)
    m = m.to_empty(device=dev).to(model.embed_tokens.weight.dtype)
    m.tie_weights()
    with torch.no_grad():
        m.embed_tokens.weight.copy_(model.embed_tokens.weight)
        if not model.cfg.tie_embeddings:
            m.lm_head.weight.copy_(model.lm_head.weight)
        for i in range(t.layers):
            m.layers[i].load_state_dict(model.layers[i].state_dict())
        m.exit_norms[0].copy_(model.exit_norms[tier])
        if t.block:
            m.exit_blocks["0"].load_state_dict(model.exit_blocks[str(tier)].state_dict())
    m.rebuild_buffers()
    return m.eval()


def weight_bytes(model: nn.Module) -> int:
    """Bytes of distinct parameter storage (tied tensors counted once), plus weights a module keeps
    packed outside its parameters (``packed_bytes()``: worker/formats/w8a8.py)."""
    seen, total = set(), 0
    for p in model.parameters():
        key = p.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            total += p.untyped_storage().nbytes()
    return total + sum(m.packed_bytes() for m in model.modules() if hasattr(m, "packed_bytes"))
