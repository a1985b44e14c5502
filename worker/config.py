"""The model's shape, read from a Hugging Face config, and the tiers cut from it."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

SUPPORTED_TYPES = ("llama", "qwen2", "mistral")


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

    @classmethod
    def from_hf(cls, hf_config, state_keys: set[str] | None = None) -> "ModelConfig":
        mt = getattr(hf_config, "model_type", None)
        if mt not in SUPPORTED_TYPES:
            raise ValueError(f"unsupported architecture {mt!r}: MFS serves {', '.join(SUPPORTED_TYPES)}")
        keys = state_keys or set()
        heads = hf_config.num_attention_heads
        head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // heads
        inv_freq, scaling = _rope_inv_freq(hf_config, head_dim)
        # A sliding attention window is not implemented: serve at most one window of context, where
        # full attention and the window agree exactly.
        window = getattr(hf_config, "sliding_window", None)
        if mt == "qwen2" and not getattr(hf_config, "use_sliding_window", False):
            window = None
        max_pos = hf_config.max_position_embeddings
        if window:
            max_pos = min(max_pos, int(window))
        eos = hf_config.eos_token_id
        eos_ids = tuple(eos) if isinstance(eos, (list, tuple)) else ((eos,) if eos is not None else ())
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
            max_position=max_pos,
            tie_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
            qkv_bias=("model.layers.0.self_attn.q_proj.bias" in keys) or mt == "qwen2",
            o_bias="model.layers.0.self_attn.o_proj.bias" in keys,
            mlp_bias="model.layers.0.mlp.gate_proj.bias" in keys,
            inv_freq=inv_freq,
            rope_attention_scaling=scaling,
            rope=dict(rope_params(hf_config)),
            eos_token_ids=eos_ids,
            bos_token_id=getattr(hf_config, "bos_token_id", None),
        )

    def param_count_layers(self, n: int) -> int:
        """Parameters of the first n decoder layers."""
        h, i, d = self.hidden_size, self.intermediate_size, self.head_dim
        attn = h * d * (self.num_heads * 2 + self.num_kv_heads * 2)
        if self.qkv_bias:
            attn += d * (self.num_heads + 2 * self.num_kv_heads)
        return n * (attn + 3 * h * i + 2 * h)

    def kv_bytes_per_token(self, n_layers: int, dtype: torch.dtype) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * n_layers * self.num_kv_heads * self.head_dim * elem


def rope_params(hf_config) -> dict:
    """A config's rope parameters (rope_type, rope_theta, any scaling) from either spelling:
    ``rope_parameters`` or the older ``rope_scaling`` + ``rope_theta``."""
    rp = getattr(hf_config, "rope_parameters", None)
    if rp is None:  # older configs
        rp = dict(getattr(hf_config, "rope_scaling", None) or {})
        rp.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    rp = dict(rp)
    rp.setdefault("rope_type", rp.get("type", "default"))
    return rp


def _rope_inv_freq(hf_config, head_dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies exactly as transformers computes them, for every rope type it knows."""
    rp = rope_params(hf_config)
    rope_type = rp["rope_type"]
    if rope_type == "default":
        base = rp["rope_theta"]
        inv = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        return inv, 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: PLC0415
    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"unsupported rope type {rope_type!r}")
    if rope_type == "dynamic":
        raise ValueError("dynamic NTK rope changes with sequence length; MFS does not serve it yet")
    inv, scaling = ROPE_INIT_FUNCTIONS[rope_type](hf_config)
    return inv.float(), float(scaling)
