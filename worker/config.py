"""The model's shape, read from a Hugging Face config, and the tiers cut from it."""
from __future__ import annotations

import difflib
from dataclasses import dataclass, field

import torch

from family.hfconfig import global_rope_type, rope_params
from worker.arch import ARCHS

SUPPORTED_TYPES = tuple(ARCHS)


@dataclass(slots=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_eps: float
    max_position: int
    tie_embeddings: bool
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    inv_freq: torch.Tensor | None = field(default=None, repr=False)
    rope_attention_scaling: float = 1.0
    rope: dict = field(default_factory=dict)
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    # what the architecture changes in the Llama layer (worker/arch.py)
    qk_norm: str | None = None
    norms: str = "pre"
    act: str = "silu"
    embed_scale: float = 1.0
    attn_scale: float = 0.0  # 0: head_dim ** -0.5
    logit_softcap: float | None = None
    rotary_dim: int = 0  # 0: head_dim (the first rotary_dim dims of each head are rotated)
    layer_windows: tuple[int | None, ...] = ()  # per decoder layer: its attention window, None for full
    local_inv_freq: torch.Tensor | None = field(default=None, repr=False)  # the windowed layers' rope
    local_rope_scaling: float = 1.0
    long_inv_freq: torch.Tensor | None = field(default=None, repr=False)  # LongRoPE: from rope_long_from on
    rope_long_from: int = 0

    @classmethod
    def from_hf(cls, hf_config, state_keys: set[str] | None = None) -> "ModelConfig":
        mt = getattr(hf_config, "model_type", None)
        if mt not in SUPPORTED_TYPES:
            raise ValueError(unsupported_message(mt))
        arch = ARCHS[mt]
        keys = state_keys or set()
        heads = hf_config.num_attention_heads
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
        windows = layer_windows(hf_config)
        if getattr(hf_config, "attn_logit_softcapping", None) is not None:
            raise ValueError(f"{mt}: attention logit softcapping is not served")
        if getattr(hf_config, "use_bidirectional_attention", False):
            raise ValueError(f"{mt}: bidirectional attention is not served")
        eos = hf_config.eos_token_id
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
        scalar = getattr(hf_config, "query_pre_attn_scalar", None)
        act = getattr(hf_config, "hidden_act", None) or getattr(hf_config, "hidden_activation", None) or "silu"
        return cls(
            model_type=mt,
            vocab_size=hf_config.vocab_size,
            hidden_size=hf_config.hidden_size,
            intermediate_size=hf_config.intermediate_size,
            num_layers=hf_config.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(hf_config, "num_key_value_heads", None) or heads,
            head_dim=head_dim,
            rms_eps=hf_config.rms_norm_eps,
            max_position=hf_config.max_position_embeddings,
            tie_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            qkv_bias=("model.layers.0.self_attn.q_proj.bias" in keys) or mt == "qwen2",
            o_bias="model.layers.0.self_attn.o_proj.bias" in keys,
            mlp_bias="model.layers.0.mlp.gate_proj.bias" in keys,
            eos_token_ids=eos_ids,
            bos_token_id=getattr(hf_config, "bos_token_id", None),
            qk_norm=arch.qk_norm,
            norms=arch.norms,
            act=_activation(mt, act),
            embed_scale=hf_config.hidden_size ** 0.5 if arch.embed_scale else 1.0,
            attn_scale=scalar ** -0.5 if scalar else head_dim ** -0.5,
            logit_softcap=getattr(hf_config, "final_logit_softcapping", None),
            layer_windows=windows if any(windows) else (),
            **_rope_fields(hf_config, head_dim, any(windows)),
        )

    @property
    def llama_layers(self) -> bool:
        """Every decoder layer is Llama's (what the compiled decode paths are written for)."""
        return (self.qk_norm is None and self.norms == "pre" and self.act == "silu" and not self.layer_windows
                and self.rotary_dim in (0, self.head_dim) and self.attn_scale in (0.0, self.head_dim ** -0.5))

    def param_count_layers(self, n: int) -> int:
        """Parameters of the first n decoder layers."""
        h, i, d = self.hidden_size, self.intermediate_size, self.head_dim
        attn = h * d * (self.num_heads * 2 + self.num_kv_heads * 2)
        if self.qkv_bias:
            attn += d * (self.num_heads + 2 * self.num_kv_heads)
        attn += {"head": 2 * d, "proj": d * (self.num_heads + self.num_kv_heads)}.get(self.qk_norm, 0)
        norms = 4 * h if self.norms == "sandwich" else 2 * h
        return n * (attn + 3 * h * i + norms)

    def kv_bytes_per_token(self, n_layers: int, dtype: torch.dtype) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * n_layers * self.num_kv_heads * self.head_dim * elem


def unsupported_message(model_type) -> str:
    near = difflib.get_close_matches(str(model_type), SUPPORTED_TYPES, n=1, cutoff=0.0)
    return (f"unsupported architecture {model_type!r}: MFS serves {', '.join(SUPPORTED_TYPES)}"
            + (f" (nearest: {near[0]})" if near else ""))


def layer_windows(hf_config) -> tuple[int | None, ...]:
    """Each decoder layer's attention window (None: full attention): by ``layer_types`` where the config
    has them (Gemma 3, Qwen2/3), else the one ``sliding_window`` for every layer (Mistral, Phi-3). A
    window no shorter than the model's context is none (Phi-4-mini's 262144 over 131072 positions)."""
    window = getattr(hf_config, "sliding_window", None) or None
    if window is not None and window >= hf_config.max_position_embeddings:
        window = None
    n = hf_config.num_hidden_layers
    types = getattr(hf_config, "layer_types", None)
    if types:
        return tuple(window if t == "sliding_attention" else None for t in types[:n])
    if getattr(hf_config, "model_type", None) == "qwen2" and not getattr(hf_config, "use_sliding_window", False):
        window = None
    return (window,) * n


def _activation(model_type: str, act: str) -> str:
    if act not in ("silu", "gelu_pytorch_tanh"):
        raise ValueError(f"{model_type}: activation {act!r} is not served (silu, gelu_pytorch_tanh)")
    return act


def _rope_fields(hf_config, head_dim: int, windowed: bool) -> dict:
    """The rope fields of a ModelConfig: the global layers' frequencies (over the rotated dims), the
    local layers' where the config gives them their own (Gemma 3), LongRoPE's long ones and where they
    start."""
    glob = global_rope_type(hf_config)
    inv_freq, scaling = _rope_inv_freq(hf_config, head_dim, glob)
    rp = rope_params(hf_config, glob)
    out = dict(inv_freq=inv_freq, rope_attention_scaling=scaling, rope=rp, rotary_dim=2 * inv_freq.numel())
    if glob and windowed:
        out["local_inv_freq"], out["local_rope_scaling"] = _rope_inv_freq(hf_config, head_dim, "sliding_attention")
    if rp["rope_type"] == "longrope":
        start = int(rp.get("original_max_position_embeddings") or hf_config.original_max_position_embeddings)
        out["long_inv_freq"], _ = _rope_inv_freq(hf_config, head_dim, glob, seq_len=start + 1)
        out["rope_long_from"] = start
    return out


def _rope_inv_freq(hf_config, head_dim: int, layer_type: str | None = None,
                   seq_len: int | None = None) -> tuple[torch.Tensor, float]:
    """Inverse frequencies exactly as transformers computes them, for every rope type it knows (over the
    rotated dims only, where ``partial_rotary_factor`` rotates part of each head)."""
    rp = rope_params(hf_config, layer_type)
    rope_type = rp["rope_type"]
    if rope_type == "default":
        base = rp["rope_theta"]
        factor = rp.get("partial_rotary_factor") or getattr(hf_config, "partial_rotary_factor", None) or 1.0
        dim = int(head_dim * factor)
        inv = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        return inv, 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: PLC0415
    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"unsupported rope type {rope_type!r}")
    if rope_type == "dynamic":
        raise ValueError("dynamic NTK rope changes with sequence length; MFS does not serve it yet")
    kw = {"layer_type": layer_type} if layer_type else {}
    if seq_len is not None:
        kw["seq_len"] = seq_len
    inv, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config, None, **kw)
    return inv.float(), float(scaling)
