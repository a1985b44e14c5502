"""Tiny random-weight models saved as Hugging Face directories, built inside the tests."""
from __future__ import annotations

from pathlib import Path

import torch


def tiny_llama(path: Path, *, layers: int = 6, tie: bool = False, kv_heads: int = 2,
               rope_scaling: dict | None = None, vocab: int = 160, seed: int = 0) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    rope = {"rope_type": "default", "rope_theta": 10000.0}
    if rope_scaling:
        rope = {"rope_theta": 10000.0, **rope_scaling}
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=kv_heads, max_position_embeddings=512,
                      tie_word_embeddings=tie, rope_parameters=rope, eos_token_id=2, bos_token_id=1)
    model = LlamaForCausalLM(cfg)
    _spread_norms(model)
    model.save_pretrained(path)
    return path


def tiny_llama_with_tokenizer(path: Path, tokenizer, *, layers: int = 6, seed: int = 0,
                              max_positions: int = 512) -> Path:
    """A tiny random Llama over a real tokenizer's vocabulary, saved with that tokenizer: a family the
    whole service (gateway included) can serve in seconds, texts in and out. ``max_positions`` is its
    context (longer for tests whose streams must outlast some event)."""
    from transformers import LlamaConfig, LlamaForCausalLM
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max_positions,
                      tie_word_embeddings=False, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
                      eos_token_id=tokenizer.eos_token_id, bos_token_id=tokenizer.bos_token_id)
    model = LlamaForCausalLM(cfg)
    _spread_norms(model)
    with torch.no_grad():  # the default init's head makes every token about equally likely: sharpen it
        model.lm_head.weight.normal_(0, 0.5)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def tiny_service(path: Path, tokenizer, gateway_args: list[str] | None = None):
    """The whole service (gateway, scheduler, one worker, redis-server) over :func:`tiny_llama_with_tokenizer`
    at tiers 2,4,6 in float64: a context manager (``service.launch.Service``) for tests that talk HTTP.
    ``gateway_args``: more flags for ``python -m gateway``."""
    from service.launch import Service
    family = tiny_llama_with_tokenizer(path, tokenizer)
    return Service(str(family), tiers="2,4,6", workers=1, dtype="float64", gateway_args=gateway_args,
                   worker_args=["--num-blocks", "256", "--block-size", "4", "--threads", "1"])


def tiny_qwen2(path: Path, *, layers: int = 6, seed: int = 0) -> Path:
    from transformers import Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(seed)
    cfg = Qwen2Config(vocab_size=160, hidden_size=96, intermediate_size=160, num_hidden_layers=layers,
                      num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=512,
                      tie_word_embeddings=True, rope_parameters={"rope_type": "default", "rope_theta": 1e6},
                      eos_token_id=2, bos_token_id=1, use_sliding_window=False)
    model = Qwen2ForCausalLM(cfg)
    _spread_norms(model)
    with torch.no_grad():  # random init leaves biases at zero: make them matter
        for layer in model.model.layers:
            for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                proj.bias.normal_(0, 0.5)
    model.save_pretrained(path)
    return path


def _spread_norms(model) -> None:
    """Norm weights initialise to ones; random ones catch a norm applied in the wrong place."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)


def tiny_mistral(path: Path, *, layers: int = 6, seed: int = 0, window: int | None = 64) -> Path:
    from transformers import MistralConfig, MistralForCausalLM
    torch.manual_seed(seed)
    cfg = MistralConfig(vocab_size=160, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                        num_attention_heads=4, num_key_value_heads=1, max_position_embeddings=512,
                        sliding_window=window, tie_word_embeddings=False, eos_token_id=2, bos_token_id=1,
                        rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    model = MistralForCausalLM(cfg)
    _spread_norms(model)
    model.save_pretrained(path)
    return path


def default_family_every_tier_routable(path: Path) -> Path:
    """A nested checkpoint directory serving exactly the default family (same base package, the same
    exit-block weights by symlink) whose manifest has no quality record, so the family id may route
    to every tier: service tests of routing and the cascade need the lower tiers reachable."""
    import json  # noqa: PLC0415

    from family.manifest import DEFAULT_FAMILY, family_dir  # noqa: PLC0415
    src = family_dir(DEFAULT_FAMILY)
    path.mkdir(parents=True, exist_ok=True)
    m = json.loads((src / "mfs.json").read_text())
    m["quality"] = None
    (path / "mfs.json").write_text(json.dumps(m))
    if m.get("weights"):
        (path / m["weights"]["file"]).symlink_to(src / m["weights"]["file"])
    return path


def perturb_exits(fam, seed: int) -> None:
    """Makes a family's exit blocks and exit norms look trained (random ones are near the identity)."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in fam.model.exit_blocks.parameters():
            p.add_(torch.randn_like(p) * 0.05)
        for t in fam.model.tiers[:-1]:
            fam.model.exit_norms[t.index].uniform_(0.5, 1.5)


def tiny_arch(path: Path, arch: str, *, layers: int = 6, seed: int = 0, **over) -> Path:
    """A tiny random model of one of the architectures beyond Llama's layer (Qwen3, OLMo 2, Phi-3 with
    LongRoPE, Gemma 3 text with windowed local layers, Mistral windowed on every layer), saved as a HF
    directory. ``over``: config
    fields to change."""
    import transformers  # noqa: PLC0415
    torch.manual_seed(seed)
    common = dict(vocab_size=160, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  eos_token_id=2, bos_token_id=1)
    if arch == "qwen3":
        cfg = transformers.Qwen3Config(**common, head_dim=16, tie_word_embeddings=True,
                                       rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    elif arch == "olmo2":
        cfg = transformers.Olmo2Config(**common, tie_word_embeddings=False,
                                       rope_parameters={"rope_type": "default", "rope_theta": 5e5})
    elif arch == "phi3":  # Phi-4-mini's shape of rope: LongRoPE over 3/4 of each head
        rot = int(16 * 0.75) // 2
        cfg = transformers.Phi3Config(**{**common, "max_position_embeddings": 128}, tie_word_embeddings=True,
                                      pad_token_id=0, original_max_position_embeddings=32, rope_parameters={
                                          "rope_type": "longrope", "rope_theta": 10000.0,
                                          "partial_rotary_factor": 0.75, "original_max_position_embeddings": 32,
                                          "short_factor": [1.0 + 0.1 * i for i in range(rot)],
                                          "long_factor": [2.0 + 0.5 * i for i in range(rot)]})
    elif arch == "gemma3":  # every other layer local, with a window shorter than the test's context
        cfg = transformers.Gemma3TextConfig(**common, head_dim=16, tie_word_embeddings=True,
                                            hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=24,
                                            sliding_window=8, final_logit_softcapping=30.0, pad_token_id=0,
                                            layer_types=["sliding_attention", "full_attention"] * (layers // 2),
                                            rope_parameters={
                                                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                                                "full_attention": {"rope_type": "linear", "factor": 2.0,
                                                                   "rope_theta": 1e6}})
    elif arch == "mistral":  # a window of 8 on every layer: blocks behind it go back to the pool
        cfg = transformers.MistralConfig(**{**common, "num_key_value_heads": 1}, sliding_window=8,
                                         tie_word_embeddings=False,
                                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    else:
        raise ValueError(arch)
    for k, v in over.items():
        setattr(cfg, k, v)
    model = transformers.AutoModelForCausalLM.from_config(cfg)
    _spread_norms(model)
    model.save_pretrained(path)
    return path


def write_gguf(hf_dir: Path, out: Path, kinds=None) -> Path:
    """The HF model in ``hf_dir`` as a GGUF file written with gguf-py: llama.cpp's metadata and
    tensor names, Gemma's norms as 1 + weight, Llama's q/k rows permuted as llama.cpp's converter
    does, and a placeholder vocabulary (a token per id). Llama, Qwen3, Phi-3, Gemma 3. ``kinds``: GGUF
    tensor name -> a block kind ("Q4_K", ...: tests/support/kquant.py quantizes it) or None (fp32)."""
    import gguf  # noqa: PLC0415

    from tests.support.kquant import quantize  # noqa: PLC0415
    from transformers import AutoModelForCausalLM  # noqa: PLC0415
    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    c = model.config
    arch = {"llama": gguf.MODEL_ARCH.LLAMA, "qwen3": gguf.MODEL_ARCH.QWEN3, "phi3": gguf.MODEL_ARCH.PHI3,
            "gemma3_text": gguf.MODEL_ARCH.GEMMA3}[c.model_type]
    w = gguf.GGUFWriter(str(out), gguf.MODEL_ARCH_NAMES[arch])
    w.add_block_count(c.num_hidden_layers)
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    rope = c.rope_parameters.get("full_attention", c.rope_parameters)
    w.add_rope_freq_base(float(rope["rope_theta"]))
    if c.model_type == "gemma3_text":
        w.add_key_length(c.head_dim)
        w.add_value_length(c.head_dim)
        w.add_sliding_window(c.sliding_window)
    w.add_vocab_size(c.vocab_size)
    w.add_bos_token_id(c.bos_token_id)
    w.add_eos_token_id(c.eos_token_id)
    w.add_pad_token_id(c.pad_token_id or 0)
    w.add_tokenizer_model("llama")
    w.add_token_list([f"<t{i}>" for i in range(c.vocab_size)])
    w.add_token_scores([0.0] * c.vocab_size)
    w.add_token_types([1] * c.vocab_size)
    names = gguf.get_tensor_name_map(arch, c.num_hidden_layers)
    for k, v in model.state_dict().items():
        if k == "lm_head.weight" and c.tie_word_embeddings:
            continue
        if c.model_type == "gemma3_text" and k.endswith("norm.weight"):
            v = v + 1  # llama.cpp keeps Gemma's norms as 1 + weight
        if c.model_type == "llama" and k.endswith(("q_proj.weight", "k_proj.weight")):
            heads = c.num_attention_heads if "q_proj" in k else c.num_key_value_heads
            v = v.reshape(heads, 2, v.shape[0] // heads // 2, -1).swapaxes(1, 2).reshape(v.shape)
        name = names.get_name(k, try_suffixes=(".weight", ".bias"))
        kind = kinds(name) if kinds else None
        if kind is None:
            w.add_tensor(name, v.numpy())
        else:
            w.add_tensor(name, quantize(v.numpy(), kind), raw_dtype=gguf.GGMLQuantizationType[kind])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return out
