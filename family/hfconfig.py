"""A Hugging Face config's rope parameters, read as one dict from either of its spellings: plain values,
no torch (the loader asks whether a config needs transformers' frequencies; worker/config.py computes
them)."""
from __future__ import annotations


def global_rope_type(hf_config) -> str | None:
    """The key of the global layers' rope parameters where a config keeps one set per layer type."""
    rp = getattr(hf_config, "rope_parameters", None)
    return "full_attention" if isinstance(rp, dict) and isinstance(rp.get("full_attention"), dict) else None


def rope_params(hf_config, layer_type: str | None = None) -> dict:
    """A config's rope parameters (rope_type, rope_theta, any scaling) from either spelling:
    ``rope_parameters`` or the older ``rope_scaling`` + ``rope_theta``; ``layer_type``: that type's set,
    where the config keeps one per layer type (the global layers' by default)."""
    rp = getattr(hf_config, "rope_parameters", None)
    if isinstance(rp, dict) and isinstance(rp.get(layer_type or global_rope_type(hf_config)), dict):
        rp = rp[layer_type or global_rope_type(hf_config)]
    if rp is None:  # older configs
        rp = dict(getattr(hf_config, "rope_scaling", None) or {})
        rp.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    rp = dict(rp)
    rp.setdefault("rope_type", rp.get("type", "default"))
    return rp
