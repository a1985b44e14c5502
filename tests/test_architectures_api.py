"""The architectures beyond Llama's layer (Qwen3, OLMo 2, Phi-3 with LongRoPE, Gemma 3 text with windowed
local layers, Mistral windowed on every layer) served through the whole service: gateway, scheduler and
a worker over a real redis-server, a tiny random model of each over a real tokenizer. Every tier's greedy
tokens through ``/v1/completions`` equal the in-process engine's holding every KV block, and their
log-probabilities agree (the engine's own parity with transformers is tests/test_model_parity.py)."""
from __future__ import annotations

import httpx2 as httpx
import pytest
import torch

from engine import Engine
from service.launch import Service
from tests.support.factories import tiny_arch
from worker.family import load_family
from worker.sampling import SamplingParams

TIERS = "2,4,6"
TOKENS = 24  # past the Gemma 3 and Mistral models' 8-token window: their windowed layers drop the prompt's
#             start (Mistral's, on every layer, give those blocks back to the pool)
TOL = 1e-6


def engine_greedy(fam, prompt: list[int], tier: int) -> tuple[list[int], list[float]]:
    eng = Engine(fam.model, block_size=4, num_blocks=256, keep_logits=True, release_outside_window=False)
    eng.add_request("ref", prompt, tier, SamplingParams(max_tokens=TOKENS, ignore_eos=True))
    toks, lps = [], []
    while eng.has_unfinished():
        for o in eng.step():
            toks += o.new_token_ids
            lps.append(float(torch.log_softmax(o.logits.double(), -1)[o.new_token_ids[0]]))
    return toks, lps


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["qwen3", "olmo2", "phi3", "gemma3", "mistral"])
def test_each_architecture_serves_every_tier_through_the_api(tmp_path, frontend, arch):
    tok = frontend.tokenizer
    path = tiny_arch(tmp_path / arch, arch, vocab_size=len(tok), eos_token_id=tok.eos_token_id,
                     bos_token_id=tok.bos_token_id)
    tok.save_pretrained(path)
    fam = load_family(str(path), tiers=TIERS, dtype="float64")
    prompt = tok("The sky over the old harbour is")["input_ids"]
    with Service(str(path), tiers=TIERS, workers=1, dtype="float64",
                 worker_args=["--num-blocks", "256", "--block-size", "4", "--threads", "1"]) as svc:
        ids = sorted(m["id"] for m in httpx.get(svc.url + "/v1/models", timeout=30).json()["data"])
        family = min(ids, key=len)
        for tier, name in enumerate(("small", "medium", "large")):
            body = {"model": f"{family}-{name}", "prompt": prompt, "max_tokens": TOKENS, "temperature": 0,
                    "logprobs": 1, "ignore_eos": True}
            r = httpx.post(svc.url + "/v1/completions", json=body, timeout=120)
            assert r.status_code == 200, r.text
            lp = r.json()["choices"][0]["logprobs"]
            toks, ref = engine_greedy(fam, prompt, tier)
            assert lp["tokens"] == [tok.decode([t]) for t in toks], f"{arch} {name}"
            assert max(abs(a - b) for a, b in zip(lp["token_logprobs"], ref)) < TOL, f"{arch} {name}"
