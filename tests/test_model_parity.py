"""MFS's own model code against transformers, tier by tier, prefill and 32 decode steps (fp32)."""
import copy

import pytest
import torch

from worker.family import load_family
from tests.support.factories import tiny_arch, tiny_llama, tiny_mistral, tiny_qwen2
from engine import Engine
from worker.model import _LAYER_KEYS
from worker.sampling import SamplingParams

PROMPT = [1, 17, 33, 90, 5, 61, 7, 120, 44, 3, 19]
DECODE_STEPS = 32


def hf_model(path):
    from transformers import AutoModelForCausalLM
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def truncated_hf(hf, layers: int, exit_norm: torch.Tensor):
    """The reference for a lower tier: the HF model cut to its layers, with the tier's exit norm (less
    the 1 MFS adds to a Gemma norm's weights at load)."""
    if hf.config.model_type == "gemma3_text":
        exit_norm = exit_norm - 1.0
    t = copy.deepcopy(hf)
    t.model.layers = t.model.layers[:layers]
    t.config.num_hidden_layers = layers
    if hasattr(t.config, "layer_types") and t.config.layer_types:
        t.config.layer_types = t.config.layer_types[:layers]
    with torch.no_grad():
        t.model.norm.weight.copy_(exit_norm)
    return t


def engine_logits(model, tier: int):
    """Prefill + DECODE_STEPS greedy steps through the paged engine: (tokens, logits per step)."""
    eng = Engine(model, block_size=4, num_blocks=64, keep_logits=True)
    eng.add_request("r", PROMPT, tier, SamplingParams(max_tokens=DECODE_STEPS + 1, ignore_eos=True))
    outs = []
    while eng.has_unfinished():
        outs += eng.step()
    return [o.new_token_ids[0] for o in outs], torch.stack([o.logits for o in outs])


def hf_step_logits(hf, tokens):
    """HF's logits for the prefill and each decode step, using its own KV cache."""
    ids = torch.tensor([PROMPT])
    out = []
    with torch.no_grad():
        r = hf(ids, use_cache=True)
        out.append(r.logits[0, -1])
        past = r.past_key_values
        for tok in tokens[:-1]:
            r = hf(torch.tensor([[tok]]), past_key_values=past, use_cache=True)
            past = r.past_key_values
            out.append(r.logits[0, -1])
    return torch.stack(out)


@pytest.mark.parametrize("arch", ["llama-gqa-untied", "llama-mha-tied-llama3rope", "qwen2-bias-tied",
                                  "mistral-mqa-window", "qwen3", "olmo2", "phi3", "gemma3"])
def test_every_tier_matches_transformers(tmp_path, arch):
    if arch == "llama-gqa-untied":
        path = tiny_llama(tmp_path / arch, kv_heads=2, tie=False)
    elif arch == "llama-mha-tied-llama3rope":
        path = tiny_llama(tmp_path / arch, kv_heads=4, tie=True, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64})
    elif arch == "mistral-mqa-window":
        path = tiny_mistral(tmp_path / arch, window=16)  # prompt + 32 steps: past the 16-token window
    elif arch == "qwen2-bias-tied":
        path = tiny_qwen2(tmp_path / arch)
    else:  # gemma3: a window of 8 on every other layer; phi3: LongRoPE past its original 32 positions
        path = tiny_arch(tmp_path / arch, arch)
    fam = load_family(str(path), tiers="2,4,6", dtype="float32")
    model = fam.model
    torch.manual_seed(1)
    with torch.no_grad():  # own exit norms for the lower tiers, as precipitation would give them
        for t in model.tiers[:-1]:
            model.exit_norms[t.index].uniform_(0.5, 1.5)
    hf = hf_model(path)
    for tier in model.tiers:
        ref_model = hf if tier.index == len(model.tiers) - 1 else truncated_hf(
            hf, tier.layers, model.exit_norms[tier.index].detach())
        tokens, ours = engine_logits(model, tier.index)
        assert len(tokens) == DECODE_STEPS + 1
        ref = hf_step_logits(ref_model, tokens)
        diff = (ours - ref).abs().max().item()
        assert diff <= 1e-4, f"{arch} tier {tier.name}: max |logit diff| {diff:.2e}"
        assert ref.argmax(-1).tolist() == tokens, f"{arch} tier {tier.name}: greedy tokens differ"


def test_training_forward_matches_serving_forward(llama_family):
    """exit_hidden (dense, used by precipitation/eval) agrees with the paged serving path."""
    model = llama_family.model
    ids = torch.tensor([PROMPT])
    with torch.no_grad():
        dense = [model.logits(h)[0, -1] for h in model.exit_hidden(ids)]
    for tier in model.tiers:
        eng = Engine(model, block_size=4, num_blocks=32, keep_logits=True)
        eng.add_request("r", PROMPT, tier.index, SamplingParams(max_tokens=1))
        (out,) = eng.step()
        torch.testing.assert_close(out.logits, dense[tier.index], rtol=1e-9, atol=1e-9)


def test_a_sliding_window_does_not_cap_the_context(tmp_path):
    fam = load_family(str(tiny_mistral(tmp_path / "m", window=48)), tiers="3,6")
    assert fam.model.max_positions == 512
    assert [layer.window for layer in fam.model.layers] == [48] * 6
    eng = Engine(fam.model, block_size=4, num_blocks=64)
    assert eng.scheduler.cfg.max_model_len == 512


def with_exit_blocks(hf, layers: int, block: list, exit_norm: torch.Tensor):
    """The reference for a tier with an exit block, from transformers layers: the HF model cut to
    its trunk layers, then HF decoder layers holding the block's weights, then the tier's norm."""
    t = truncated_hf(hf, layers, exit_norm)
    names = {ours: hf_name for hf_name, ours in _LAYER_KEYS.items()}
    for j, ours_layer in enumerate(block):
        ref = copy.deepcopy(hf.model.layers[0])
        ref.self_attn.layer_idx = layers + j
        with torch.no_grad():
            for name, p in ours_layer.named_parameters():
                key = names.get(name.rpartition(".")[0], None)
                dst = ref.get_parameter(f"{key}.{name.rpartition('.')[2]}" if key else f"{name}.weight")
                dst.copy_(p)
        t.model.layers.append(ref)
    t.config.num_hidden_layers = layers + len(block)
    if hasattr(t.config, "layer_types") and t.config.layer_types:
        t.config.layer_types = t.config.layer_types[:1] * (layers + len(block))
    return t


@pytest.mark.parametrize("block", [1, 2])
def test_exit_blocks_match_transformers_layers(tmp_path, block):
    """A tier with an exit block = its trunk layers + the block's layers + its norm, as transformers
    computes it, through prefill and 32 paged decode steps; the top tier stays the original."""
    path = tiny_llama(tmp_path / "m", kv_heads=2, tie=False)
    fam = load_family(str(path), tiers=f"2+{block},4+{block},6", dtype="float32")
    model = fam.model
    torch.manual_seed(2)
    with torch.no_grad():  # trained blocks differ from their copy:last initialisation
        for p in model.exit_blocks.parameters():
            p.add_(torch.randn_like(p) * 0.05)
        for t in model.tiers[:-1]:
            model.exit_norms[t.index].uniform_(0.5, 1.5)
    hf = hf_model(path)
    for tier in model.tiers:
        blk = model.exit_block(tier.index)
        ref_model = hf if blk is None else with_exit_blocks(hf, tier.layers, list(blk),
                                                            model.exit_norms[tier.index].detach())
        tokens, ours = engine_logits(model, tier.index)
        ref = hf_step_logits(ref_model, tokens)
        diff = (ours - ref).abs().max().item()
        assert diff <= 1e-4, f"tier {tier.name} (block {block}): max |logit diff| {diff:.2e}"
