"""Activation smoothing before w8a8 (worker/smoothing.py): exact in fp32 for every tier (exit blocks,
qkv bias, grouped kv heads, a tied head), and what it is for — a large input channel no longer costs
the other channels their precision."""
from __future__ import annotations

import copy

import pytest
import torch

from worker.family import load_family
from worker.formats import quantize_model
from worker.smoothing import calibration_windows, input_amax, smooth


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory):
    from tests.support.factories import tiny_qwen2
    return tiny_qwen2(tmp_path_factory.mktemp("qwen2s"))


@pytest.fixture(scope="module")
def tied_dir(tmp_path_factory):
    from tests.support.factories import tiny_llama
    return tiny_llama(tmp_path_factory.mktemp("tieds"), tie=True)


def _logits(model, ids):
    with torch.inference_mode():
        return [model.logits(h) for h in model.exit_hidden(ids)]


@pytest.mark.parametrize("which", ["qwen2", "tied"])
def test_smoothing_leaves_every_tiers_logits_as_they_were(qwen2_dir, tied_dir, which):
    path = qwen2_dir if which == "qwen2" else tied_dir
    model = load_family(str(path), tiers="2+1,4+2,6", dtype="float32").model
    assert model.exit_blocks and (model.cfg.qkv_bias == (which == "qwen2"))
    ids = torch.randint(3, 150, (2, 20), generator=torch.Generator().manual_seed(0))
    before = _logits(model, ids)
    emb = model.embed_tokens.weight.clone()
    norm0 = model.layers[0].input_layernorm.clone()
    n = smooth(model, input_amax(model, calibration_windows(None, model.cfg.vocab_size, seq_len=32, max_tokens=96)))
    assert n == 7 * (len(model.layers) + 3) + 1  # 7 per decoder layer (3 in exit blocks), and the head
    assert not torch.equal(model.layers[0].input_layernorm, norm0)  # it did fold something
    assert torch.equal(model.embed_tokens.weight, emb)  # the head was untied, the embedding kept
    for a, b in zip(before, _logits(model, ids)):
        torch.testing.assert_close(b, a, rtol=0, atol=2e-5 * a.abs().max().item())


@pytest.mark.parametrize("arch", ["olmo2", "gemma3"])
def test_smoothing_leaves_the_logits_of_other_layers_as_they_were(tmp_path, arch):
    """OLMo 2's q/k/v and gate/up read the residual stream itself: only down_proj and o_proj are
    smoothed there. Gemma 3's norms after attention and MLP see the same outputs as before."""
    from tests.support.factories import tiny_arch
    model = load_family(str(tiny_arch(tmp_path / arch, arch)), tiers="2+1,4,6", dtype="float32").model
    ids = torch.randint(3, 150, (2, 20), generator=torch.Generator().manual_seed(0))
    before = _logits(model, ids)
    n = smooth(model, input_amax(model, calibration_windows(None, model.cfg.vocab_size, seq_len=32, max_tokens=96)))
    assert n == (2 if arch == "olmo2" else 7) * (len(model.layers) + 1) + 1
    for a, b in zip(before, _logits(model, ids)):
        torch.testing.assert_close(b, a, rtol=0, atol=2e-5 * a.abs().max().item())


def test_smoothing_is_what_keeps_a_large_channel_from_costing_w8a8_its_precision(tied_dir, monkeypatch):
    base = load_family(str(tied_dir), tiers="2,4,6", dtype="float32").model
    with torch.no_grad():
        for layer in base.layers:  # one input channel 40x the others, as LLMs have
            layer.input_layernorm[7] *= 40
            layer.post_attention_layernorm[7] *= 40
    ids = torch.randint(3, 150, (2, 24), generator=torch.Generator().manual_seed(1))
    ref = _logits(base, ids)[-1]
    smoothed = copy.deepcopy(base)
    assert quantize_model(smoothed, "w8a8").smoothed > 0
    import worker.smoothing
    monkeypatch.setattr(worker.smoothing, "smooth", lambda model, amax, alpha=0.5: 0)
    plain = copy.deepcopy(base)
    assert quantize_model(plain, "w8a8").smoothed == 0
    err_s = (_logits(smoothed, ids)[-1] - ref).norm() / ref.norm()
    err_p = (_logits(plain, ids)[-1] - ref).norm() / ref.norm()
    assert err_s < 0.6 * err_p, (err_s, err_p)
