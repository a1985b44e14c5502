"""Architectures beyond Llama's layer: sliding-window attention through chunked prefill and a mixed
batch (against transformers' dense forward), and the error an unsupported architecture gets. Each
architecture's parity, tier by tier, is in test_model_parity.py."""
from types import SimpleNamespace

import pytest
import torch

from engine import Engine
from tests.support.factories import tiny_arch
from worker.config import ModelConfig
from worker.execution import EAGER, choose
from worker.family import load_family
from worker.sampling import SamplingParams


def test_windows_hold_through_prefill_chunks_and_a_mixed_batch(tmp_path):
    """Gemma 3 with a window of 8 on every other layer: a 30-token prompt prefilled in chunks of 12
    (a chunk's window reaches into the previous chunk) beside a short request that decodes meanwhile."""
    from transformers import AutoModelForCausalLM
    path = tiny_arch(tmp_path / "g", "gemma3")
    fam = load_family(str(path), tiers="3,6", dtype="float32")
    assert [layer.window for layer in fam.model.layers] == [8, None] * 3
    chosen, why = choose(fam.model, "auto")  # the compiled decode layers are Llama's
    assert chosen == EAGER and "gemma3_text" in why
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    prompts = {"long": [(7 * i + 3) % 150 + 3 for i in range(30)], "short": [5, 9, 14]}
    eng = Engine(fam.model, block_size=4, num_blocks=64, max_num_batched_tokens=12, keep_logits=True)
    for rid, prompt in prompts.items():
        eng.add_request(rid, prompt, 1, SamplingParams(max_tokens=12, ignore_eos=True))
    got = {rid: ([], []) for rid in prompts}
    while eng.has_unfinished():
        for out in eng.step():
            got[out.request_id][0].extend(out.new_token_ids)
            got[out.request_id][1].append(out.logits)
    for rid, prompt in prompts.items():
        tokens, logits = got[rid]
        with torch.no_grad():
            ref = hf(torch.tensor([prompt + tokens[:-1]])).logits[0, len(prompt) - 1:]
        torch.testing.assert_close(torch.stack(logits), ref, rtol=0, atol=1e-4)
        assert ref.argmax(-1).tolist() == tokens


@pytest.mark.parametrize("model_type,nearest", [("gemma3", "gemma3_text"), ("qwen3_moe", "qwen3"),
                                                ("phi", "phi3")])
def test_an_unsupported_architecture_names_the_served_ones_and_the_nearest(model_type, nearest):
    with pytest.raises(ValueError) as e:
        ModelConfig.from_hf(SimpleNamespace(model_type=model_type))
    msg = str(e.value)
    assert "llama, qwen2, mistral, qwen3, olmo2, phi3, gemma3_text" in msg
    assert msg.endswith(f"(nearest: {nearest})")


def test_a_window_as_long_as_the_context_is_none():
    """Phi-4-mini's shape: a window longer than its context; every layer attends fully (a Phi-3 that
    rotates whole heads then has Llama's layers, which the compiled decode paths take)."""
    from transformers import Phi3Config
    cfg = ModelConfig.from_hf(Phi3Config(num_hidden_layers=2, max_position_embeddings=131072,
                                         sliding_window=262144, pad_token_id=0))
    assert cfg.layer_windows == () and cfg.llama_layers
    short = ModelConfig.from_hf(Phi3Config(num_hidden_layers=2, sliding_window=2047, pad_token_id=0))
    assert short.layer_windows == (2047, 2047) and not short.llama_layers


# what a GGUF's metadata carries of each (transformers fills the rest with the config's defaults): Qwen3's
# head dim is read as 128, Phi-3's rope as default, Gemma 3's layer pattern (5 local, 1 global), rope
# bases and query scale as the defaults
GGUF_SHAPES = {
    "qwen3": {"head_dim": 128},
    "phi3": {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 1.0}},
    "gemma3": {"query_pre_attn_scalar": 256, "final_logit_softcapping": None,
               "layer_types": ["sliding_attention"] * 5 + ["full_attention"],
               "rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                                   "full_attention": {"rope_type": "default", "rope_theta": 1e6}}},
}


@pytest.mark.parametrize("arch", list(GGUF_SHAPES))
def test_a_gguf_written_with_gguf_py_serves_as_its_hf_directory(tmp_path, monkeypatch, arch):
    """The GGUF dequantized by transformers, then read from its cache, gives the HF directory's logits
    bit for bit (Phi-3's fused tensors and Gemma's 1 + weight norms as llama.cpp stores them)."""
    from tests.support.factories import write_gguf
    monkeypatch.setenv("MFS_CACHE", str(tmp_path / "cache"))
    hf_dir = tiny_arch(tmp_path / "hf", arch, **GGUF_SHAPES[arch])
    gguf = write_gguf(hf_dir, tmp_path / "m.gguf")
    ids = torch.tensor([[1, 7, 30, 99, 5, 64, 12, 8, 41, 3, 77, 15]])  # past Gemma's 8-token window
    logits = []
    for path in (hf_dir, gguf, gguf):
        model = load_family(str(path), tiers="3,6", dtype="float32").model
        with torch.no_grad():
            logits.append(torch.stack([model.logits(h) for h in model.exit_hidden(ids)]))
    assert torch.equal(logits[1], logits[0]) and torch.equal(logits[2], logits[0])
    assert list((tmp_path / "cache").rglob("model.safetensors"))  # the third load read the cache
