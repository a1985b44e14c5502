"""The OpenAI parameters tools depend on (issue 15), through the whole service: gateway, scheduler and
worker processes over a real redis-server, serving a tiny random model over a real tokenizer (float64),
checked against the in-process engine and a dense forward of the same weights. Clients: the official
``openai`` package and ``httpx``."""
from __future__ import annotations

import httpx2 as httpx
import openai
import pytest
import torch

from mfs.family import load_family
from mfs.launch import Service
from tests.factories import tiny_llama_with_tokenizer
from worker.engine import Engine
from worker.sampling import SamplingParams

TIERS = "2,4,6"
MSG = [{"role": "user", "content": "Name a colour."}]
TOL = 1e-4


@pytest.fixture(scope="module")
def family_dir(tmp_path_factory, frontend):
    return tiny_llama_with_tokenizer(tmp_path_factory.mktemp("tinytok"), frontend.tokenizer)


@pytest.fixture(scope="module")
def service(family_dir):
    with Service(str(family_dir), tiers=TIERS, workers=1, dtype="float64",
                 worker_args=["--num-blocks", "256", "--block-size", "4", "--threads", "1"]) as svc:
        yield svc


@pytest.fixture(scope="module")
def fam(family_dir):
    return load_family(str(family_dir), tiers=TIERS, dtype="float64")


@pytest.fixture(scope="module")
def client(service):
    return openai.OpenAI(base_url=service.url + "/v1", api_key="unused", max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def models(client):
    ids = sorted(m.id for m in client.models.list().data)
    family = min(ids, key=len)
    return [f"{family}-small", f"{family}-medium", f"{family}-large"]


def post(service, path: str, body: dict) -> httpx.Response:
    return httpx.post(service.url + path, json=body, timeout=60)


def chat_ids(fam, messages) -> list[int]:
    out = fam.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    if hasattr(out, "keys"):
        out = out["input_ids"]
    return list(out)


def engine_logprobs(fam, prompt: list[int], tier: int, n: int) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy tokens of the in-process engine and the log-softmax of its logits at each."""
    eng = Engine(fam.model, block_size=4, num_blocks=256, keep_logits=True)
    eng.add_request("ref", prompt, tier, SamplingParams(max_tokens=n, ignore_eos=True))
    toks, lps = [], []
    while eng.has_unfinished():
        for o in eng.step():
            toks += o.new_token_ids
            lps.append(torch.log_softmax(o.logits.double(), -1))
    return toks, lps


# ---- log-probabilities --------------------------------------------------------------------------
@pytest.mark.parametrize("tier", [0, 2])
def test_chat_logprobs_with_the_openai_client_equal_the_engines(client, models, fam, tier):
    r = client.chat.completions.create(model=models[tier], messages=MSG, max_tokens=6, temperature=0,
                                       logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    toks, ref = engine_logprobs(fam, chat_ids(fam, MSG), tier, 6)
    content = r.choices[0].logprobs.content
    assert len(content) == 6 == r.usage.completion_tokens
    dec = fam.tokenizer.decode
    for tok, lp, entry in zip(toks, ref, content):
        assert entry.token == dec([tok]) and entry.bytes == list(dec([tok]).encode())
        assert abs(entry.logprob - float(lp[tok])) < TOL
        top = torch.topk(lp, 3)
        assert [t.token for t in entry.top_logprobs] == [dec([i]) for i in top.indices.tolist()]
        assert max(abs(t.logprob - v) for t, v in zip(entry.top_logprobs, top.values.tolist())) < TOL
    assert r.choices[0].message.content == dec(toks)
    # streamed: the same entries, spread over the chunks
    chunks = list(client.chat.completions.create(model=models[tier], messages=MSG, max_tokens=6, temperature=0,
                                                 logprobs=True, top_logprobs=3, stream=True,
                                                 extra_body={"ignore_eos": True}))
    streamed = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.model_dump() for e in streamed] == [e.model_dump() for e in content]
    # not asked: null
    plain = client.chat.completions.create(model=models[tier], messages=MSG, max_tokens=2, temperature=0)
    assert plain.choices[0].logprobs is None


def test_completion_logprobs_in_the_legacy_shape(service, models, fam):
    prompt = fam.tokenizer("The sky is")["input_ids"]
    body = {"model": models[1], "prompt": prompt, "max_tokens": 5, "temperature": 0, "logprobs": 2,
            "ignore_eos": True}
    r = post(service, "/v1/completions", body).json()
    lp = r["choices"][0]["logprobs"]
    toks, ref = engine_logprobs(fam, prompt, 1, 5)
    dec = fam.tokenizer.decode
    assert lp["tokens"] == [dec([t]) for t in toks]
    assert max(abs(a - float(x[t])) for a, x, t in zip(lp["token_logprobs"], ref, toks)) < TOL
    for top, x in zip(lp["top_logprobs"], ref):
        want = torch.topk(x, 2)
        assert list(top) == [dec([i]) for i in want.indices.tolist()]
    offsets = [0]
    for t in lp["tokens"][:-1]:
        offsets.append(offsets[-1] + len(t))
    assert lp["text_offset"] == offsets
    # streamed: the same four lists, chunk by chunk, offsets counted across chunks
    with httpx.stream("POST", service.url + "/v1/completions", json={**body, "stream": True}, timeout=60) as s:
        import json
        events = [json.loads(line[6:]) for line in s.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    merged = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for e in events:
        for k in merged:
            merged[k] += e["choices"][0]["logprobs"][k]
    assert merged == lp


@pytest.mark.parametrize("body,param", [
    ({"logprobs": 3}, "logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"logprobs": True, "top_logprobs": -1}, "top_logprobs"),
])
def test_bad_chat_logprobs_are_400(service, models, body, param):
    r = post(service, "/v1/chat/completions", {"model": models[0], "messages": MSG, **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


@pytest.mark.parametrize("value", [21, -1, True, "2"])
def test_bad_completion_logprobs_are_400(service, models, value):
    r = post(service, "/v1/completions", {"model": models[0], "prompt": "hi", "logprobs": value})
    assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs", r.text

