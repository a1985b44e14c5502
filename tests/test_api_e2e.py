"""The OpenAI parameters tools depend on, through the whole service: gateway, scheduler and
worker processes over a real redis-server, serving a tiny random model over a real tokenizer (float64),
checked against the in-process engine and a dense forward of the same weights. Clients: the official
``openai`` package and ``httpx``."""
from __future__ import annotations

import json
import re
from typing import Literal

import httpx2 as httpx
import openai
import pydantic
import pytest
import torch

from worker.family import load_family
from service.launch import Service
from tests.support.factories import tiny_llama_with_tokenizer
from engine import Engine
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


# ---- echo ---------------------------------------------------------------------------------------
def dense_logprobs(fam, ids: list[int], tier: int) -> torch.Tensor:
    """[len(ids), V]: a dense teacher-forced forward of tier `tier`, log-softmax at every position."""
    with torch.no_grad():
        h = fam.model.exit_hidden(torch.tensor([ids]), upto_tier=tier)[tier]
        return torch.log_softmax(fam.model.logits(h)[0].double(), -1)


@pytest.mark.parametrize("tier", [0, 2])
def test_echo_with_max_tokens_0_scores_the_prompt_as_a_dense_forward(service, models, fam, tier):
    """What lm-evaluation-harness's local-completions sends for loglikelihood (a batch of one token-id
    prompt), with max_tokens 0 and 1."""
    prompt = fam.tokenizer("Paris is the capital of France, and Rome")["input_ids"]
    ref = dense_logprobs(fam, prompt, tier)
    dec = fam.tokenizer.decode
    body = {"model": models[tier], "prompt": [prompt], "echo": True, "max_tokens": 0, "logprobs": 1,
            "temperature": 0}
    r = post(service, "/v1/completions", body).json()
    c = r["choices"][0]
    lp = c["logprobs"]
    assert c["text"] == dec(prompt) and c["finish_reason"] == "length"
    assert r["usage"]["completion_tokens"] == 0 and r["usage"]["prompt_tokens"] == len(prompt)
    assert lp["tokens"] == [dec([t]) for t in prompt]
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    got = lp["token_logprobs"][1:]
    assert max(abs(g - float(ref[p, prompt[p + 1]])) for p, g in enumerate(got)) < TOL
    for p, top in enumerate(lp["top_logprobs"][1:]):
        assert list(top) == [dec([int(torch.argmax(ref[p]))])]
    # max_tokens 1: the prompt, then the generated token (lm-eval slices [ctxlen:-1])
    one = post(service, "/v1/completions", {**body, "max_tokens": 1}).json()["choices"][0]
    assert one["logprobs"]["token_logprobs"][:-1] == lp["token_logprobs"]
    nxt = int(torch.argmax(ref[-1]))
    assert one["text"] == dec(prompt) + dec([nxt]) and one["logprobs"]["tokens"][-1] == dec([nxt])
    assert abs(one["logprobs"]["token_logprobs"][-1] - float(ref[-1, nxt])) < TOL


def test_echo_streamed_and_without_logprobs(service, models, fam):
    prompt = "One, two, three,"
    body = {"model": models[1], "prompt": prompt, "echo": True, "max_tokens": 3, "logprobs": 2,
            "temperature": 0, "ignore_eos": True}
    whole = post(service, "/v1/completions", body).json()["choices"][0]
    assert whole["text"].startswith(prompt)
    import json
    with httpx.stream("POST", service.url + "/v1/completions", json={**body, "stream": True}, timeout=60) as s:
        events = [json.loads(line[6:]) for line in s.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    assert events[0]["choices"][0]["text"] == prompt  # the echo comes first, in a chunk of its own
    assert "".join(e["choices"][0]["text"] for e in events) == whole["text"]
    merged = {k: [x for e in events for x in e["choices"][0]["logprobs"][k]] for k in whole["logprobs"]}
    assert merged == whole["logprobs"]
    bare = post(service, "/v1/completions", {k: v for k, v in body.items() if k != "logprobs"}).json()
    assert bare["choices"][0]["text"] == whole["text"] and bare["choices"][0]["logprobs"] is None


def test_prompt_logprobs_do_not_read_the_prefix_cache_and_leave_it_warm(service, models, fam):
    prompt = fam.tokenizer("A long shared prefix that fills several KV blocks: alpha beta gamma delta")["input_ids"]
    plain = {"model": models[2], "prompt": prompt, "max_tokens": 1, "temperature": 0}
    post(service, "/v1/completions", plain)  # its blocks are now cached
    warm = post(service, "/v1/completions", plain).json()
    assert warm["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    echo = post(service, "/v1/completions", {**plain, "echo": True, "max_tokens": 0, "logprobs": 0}).json()
    assert "prompt_tokens_details" not in echo["usage"]  # every position computed...
    ref = dense_logprobs(fam, prompt, 2)
    got = echo["choices"][0]["logprobs"]["token_logprobs"][1:]
    assert max(abs(g - float(ref[p, prompt[p + 1]])) for p, g in enumerate(got)) < TOL
    again = post(service, "/v1/completions", plain).json()  # ...and the cache still serves the others
    assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == warm["usage"]["prompt_tokens_details"][
        "cached_tokens"]


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "max_completion_tokens": 0, "max_tokens": 3}, "max_completion_tokens"),
    ("/v1/completions", {"prompt": "hi", "echo": 1}, "echo"),
    ("/v1/chat/completions", {"messages": MSG, "echo": True}, "echo"),
])
def test_bad_echo_is_400(service, models, path, body, param):
    r = post(service, path, {"model": models[0], **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


# ---- sampling parameters ------------------------------------------------------------------------
def engine_tokens(fam, prompt: list[int], tier: int, **kw) -> list[int]:
    eng = Engine(fam.model, block_size=4, num_blocks=256)
    return eng.generate([prompt], [tier], SamplingParams(ignore_eos=True, **kw))[0]


@pytest.mark.parametrize("kw", [
    {"presence_penalty": 1.5, "frequency_penalty": 0.5},
    {"repetition_penalty": 1.6},
    {"logit_bias": "ban the first plain token"},
    {"temperature": 0.8, "seed": 11, "min_p": 0.2, "repetition_penalty": 1.2},
])
def test_sampling_parameters_reach_the_worker_and_act_as_in_the_engine(service, models, fam, kw):
    prompt = fam.tokenizer("one one one two two")["input_ids"]
    plain = engine_tokens(fam, prompt, 2, max_tokens=10, temperature=kw.get("temperature", 0), seed=kw.get("seed"))
    eng_kw = {"temperature": 0, **kw}
    if "logit_bias" in kw:
        eng_kw["logit_bias"] = {plain[0]: -100.0, 100: 5.0}
        kw = {"logit_bias": {str(plain[0]): -100, "100": 5}}
    body = {"model": models[2], "prompt": prompt, "max_tokens": 10, "temperature": 0, "ignore_eos": True,
            "logprobs": 0, **kw}
    r = post(service, "/v1/completions", body).json()
    got = r["choices"][0]["logprobs"]["tokens"]
    want = engine_tokens(fam, prompt, 2, max_tokens=10, **eng_kw)
    assert got == [fam.tokenizer.decode([t]) for t in want]
    assert want != plain  # the parameter changed the output


@pytest.mark.parametrize("body,param", [
    ({"presence_penalty": 2.5}, "presence_penalty"),
    ({"frequency_penalty": -2.01}, "frequency_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"repetition_penalty": 10.5}, "repetition_penalty"),
    ({"min_p": 1.01}, "min_p"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"012": 1}}, "logit_bias"),
    ({"logit_bias": {"12": 101}}, "logit_bias"),
    ({"logit_bias": {"49152": 1}}, "logit_bias"),  # past the vocabulary
    ({"logit_bias": [1, 2]}, "logit_bias"),
    ({"logit_bias": {str(i): 1 for i in range(1025)}}, "logit_bias"),
])
def test_bad_sampling_parameters_are_400(service, models, body, param):
    r = post(service, "/v1/chat/completions", {"model": models[0], "messages": MSG, **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


# ---- n choices ----------------------------------------------------------------------------------
def stats(service):
    import redis
    from core import protocol as P
    from core.keyrecords import StatsSnapshot
    return StatsSnapshot.decode(redis.Redis.from_url(service.redis_url).hget(P.STATS_KEY, "scheduler"))


def settled_stats(service, after: float):
    """The scheduler's snapshot written after `after` with nothing running (polled, with a deadline)."""
    import redis
    from tests.support.pipeline import idle, stats_after
    return stats_after(redis.Redis.from_url(service.redis_url), idle, 30, "the scheduler to settle", since=after)


def test_n_seeded_choices_equal_the_requests_sent_one_by_one_and_share_one_prefill(service, models, fam):
    import json
    import time
    prompt = fam.tokenizer("A prompt long enough to fill a few KV blocks, shared by every choice: "
                           "red green blue cyan magenta")["input_ids"]
    body = {"model": models[1], "prompt": prompt, "max_tokens": 6, "temperature": 0.9, "seed": 40,
            "ignore_eos": True, "logprobs": 0}
    before = settled_stats(service, 0)
    r = post(service, "/v1/completions", {**body, "n": 4}).json()
    # a snapshot written after the answer came back: the scheduler counted the prefill before any
    # token was sent (one written between the POST and the request's admission would read 0)
    after = settled_stats(service, time.time())
    # one prefill: choice 0 computes the prompt, the others only what the last partial block holds
    computed = after.prefill_computed.get(0, 0) - before.prefill_computed.get(0, 0)  # empty before any work
    assert len(prompt) <= computed <= len(prompt) + 3 * 4, computed
    assert [c["index"] for c in r["choices"]] == [0, 1, 2, 3]
    alone = [post(service, "/v1/completions", {**body, "seed": 40 + i}).json() for i in range(4)]
    for c, a in zip(r["choices"], alone):
        lp, want = c["logprobs"], a["choices"][0]["logprobs"]
        assert c["text"] == a["choices"][0]["text"] and lp["tokens"] == want["tokens"]
        assert max(abs(x - y) for x, y in zip(lp["token_logprobs"], want["token_logprobs"])) < TOL  # batching
    assert len({c["text"] for c in r["choices"]}) > 1  # different seeds, different samples
    assert r["usage"]["completion_tokens"] == 4 * 6 and r["usage"]["prompt_tokens"] == len(prompt)
    # streamed: every chunk names its choice; per index the same text
    with httpx.stream("POST", service.url + "/v1/completions", json={**body, "n": 4, "stream": True,
                                                                       "stream_options": {"include_usage": True}},
                      timeout=60) as s:
        events = [json.loads(line[6:]) for line in s.iter_lines()
                  if line.startswith("data: ") and line != "data: [DONE]"]
    texts = {i: "" for i in range(4)}
    finished = set()
    for e in events[:-1]:
        (ch,) = e["choices"]
        texts[ch["index"]] += ch["text"]
        if ch["finish_reason"]:
            finished.add(ch["index"])
    assert finished == {0, 1, 2, 3} and texts == {c["index"]: c["text"] for c in r["choices"]}
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 24


def test_n_with_chat_and_echo(client, service, models, fam):
    r = client.chat.completions.create(model=models[0], messages=MSG, max_tokens=4, temperature=0, n=2,
                                       extra_body={"ignore_eos": True})
    assert len(r.choices) == 2 and r.choices[0].message.content == r.choices[1].message.content  # greedy
    prompt = "Echo me twice"
    e = post(service, "/v1/completions", {"model": models[0], "prompt": prompt, "max_tokens": 0, "echo": True,
                                          "logprobs": 1, "n": 2}).json()
    a, b = e["choices"]
    assert a["text"] == b["text"] == prompt and a["logprobs"] == b["logprobs"]
    assert a["logprobs"]["token_logprobs"][0] is None and len(a["logprobs"]["tokens"]) > 1


@pytest.mark.parametrize("n", [0, 17, "2"])
def test_bad_n_is_400(service, models, n):
    r = post(service, "/v1/chat/completions", {"model": models[0], "messages": MSG, "n": n})
    assert r.status_code == 400 and r.json()["error"]["param"] == "n", r.text


# ---- never accept a parameter and ignore it -----------------------------------------------------
REFUSED = {  # documented fields whose non-default values this server refuses (400 naming them)
    "best_of": 2, "suffix": "x", "tools": [{"type": "function", "function": {"name": "f"}}],
    "functions": [{"name": "f"}], "tool_choice": "required",
    "function_call": {"name": "f"}, "parallel_tool_calls": False, "modalities": ["text", "audio"],
    "audio": {"voice": "alloy", "format": "wav"}, "prediction": {"type": "content", "content": "x"},
    "reasoning_effort": "low", "web_search_options": {}, "store": True, "metadata": {"k": "v"},
    "service_tier": "flex", "guided_grammar": "root ::= 'a'", "structured_outputs": {"json": {}},
}
SWEEP_PROMPT = "one one one two two"
FLAG = {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"], "additionalProperties": False}
CHOICES = ["yes", "no way", "maybe \"so\""]


class Sweep:
    """One endpoint's baseline (greedy, 8 tokens at the top tier) and how to send a variation of it."""

    def __init__(self, service, models, fam, path):
        self.service, self.fam, self.path = service, fam, path
        self.chat = path.endswith("chat/completions")
        first = {"messages": [{"role": "user", "content": SWEEP_PROMPT}]} if self.chat else {"prompt": SWEEP_PROMPT}
        self.base = {"model": models[2], **first, "temperature": 0, "max_tokens": 8}
        prompt = chat_ids(fam, first["messages"]) if self.chat else fam.tokenizer(SWEEP_PROMPT)["input_ids"]
        self.ids = engine_tokens(fam, prompt, 2, max_tokens=8, temperature=0)  # what the baseline generates
        self.baseline = self.send()
        assert self.text(self.baseline) == fam.tokenizer.decode(self.ids)

    def send(self, **kw) -> dict:
        r = post(self.service, self.path, {**self.base, **kw})
        assert r.status_code == 200, r.text
        return r.json()

    def text(self, r: dict, i: int = 0) -> str:
        c = r["choices"][i]
        return c["message"]["content"] if self.chat else c["text"]

    def differs(self, **kw) -> None:
        assert self.text(self.send(**kw)) != self.text(self.baseline), kw

    def stream(self, **kw) -> tuple[str, list[dict]]:
        import json
        with httpx.stream("POST", self.service.url + self.path, json={**self.base, "stream": True, **kw},
                          timeout=60) as s:
            body = "".join(s.iter_text())
            kind = s.headers["content-type"]
        return kind, [json.loads(e[6:]) for e in body.split("\n\n") if e.startswith("data: {")]


def _session_listed(service, session: str) -> bool:
    """The session's KV directory entry, which the scheduler writes when it handles the step result that
    ended the request: the response can reach the client first (the tokens go before the result)."""
    import redis
    from core import protocol as P
    from tests.support.wait import wait_for
    r = redis.Redis.from_url(service.redis_url)
    return bool(wait_for(lambda: r.exists(P.kv_session_key(session)), 10, f"session {session!r} listed"))


def check_stop(s: Sweep) -> None:
    """A stop string taken from the baseline's text (its first occurrence, past the start): the text
    ends just before it."""
    text = s.text(s.baseline)
    k = next(k for k in range(1, len(text) - 2) if text.find(text[k:k + 3]) == k and text[k:k + 3].strip())
    r = s.send(stop=[text[k:k + 3]])
    assert r["choices"][0]["finish_reason"] == "stop" and s.text(r) == text[:k], (text, k, r)


def spec_requests(service) -> float:
    text = httpx.get(service.url + "/metrics", timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("mfs_spec_requests_total{") and 'draft="small"' in line and 'target="large"' in line)


def check_speculation(s: Sweep, models) -> bool:
    before = spec_requests(s.service)
    r = s.send(mfs={"speculative": {"draft": models[0]}})
    return s.text(r) == s.text(s.baseline) and spec_requests(s.service) == before + 1


def sweep_checks(s: Sweep, models, fam) -> dict:
    """field -> a check that sends it with a non-default value and says (True) or asserts that it acted."""
    hot = {"temperature": 1.5, "seed": 1}
    eos = fam.tokenizer.eos_token_id
    return {
        "max_tokens": lambda: s.send(max_tokens=3)["usage"]["completion_tokens"] == 3,
        "max_completion_tokens": lambda: s.send(max_completion_tokens=3)["usage"]["completion_tokens"] == 3,
        "temperature": lambda: s.differs(**hot),
        "seed": lambda: s.text(s.send(**hot)) != s.text(s.send(temperature=1.5, seed=2)),
        "top_p": lambda: s.text(s.send(**hot, top_p=1e-6)) == s.text(s.baseline),
        "top_k": lambda: s.text(s.send(**hot, top_k=1)) == s.text(s.baseline),
        "min_p": lambda: s.text(s.send(**hot, min_p=1.0)) == s.text(s.baseline),
        # typical_p=0 keeps one token (the most typical, not always the likeliest): no seed moves it
        "typical_p": lambda: s.text(s.send(**hot, typical_p=0.0)) == s.text(s.send(temperature=1.5, seed=2,
                                                                                  typical_p=0.0)),
        "stream": lambda: s.stream()[0].startswith("text/event-stream"),
        "stream_options": lambda: s.stream(stream_options={"include_usage": True})[1][-1]["usage"][
            "completion_tokens"] == 8,
        "stop": lambda: check_stop(s),
        "stop_token_ids": lambda: (lambda r: r["choices"][0]["finish_reason"] == "stop"
                                   and r["usage"]["completion_tokens"] == s.ids.index(s.ids[2]) + 1
                                  )(s.send(stop_token_ids=[s.ids[2]])),
        "ignore_eos": lambda: (s.send(logit_bias={str(eos): 100})["usage"]["completion_tokens"] == 1
                               and s.send(logit_bias={str(eos): 100}, ignore_eos=True)["usage"][
                                   "completion_tokens"] == 8),
        "session_id": lambda: (s.send(session_id=f"sweep-{s.path}") and _session_listed(s.service, f"sweep-{s.path}")),
        "user": lambda: (s.send(user=f"sweep-user-{s.path}") and _session_listed(s.service, f"sweep-user-{s.path}")),
        # speculation is exact (same text): it shows in the request's drafts, or at least in its being
        # submitted with a draft tier (the scheduler's acceptance gate may keep a poor pair from drafting)
        "mfs": lambda: check_speculation(s, models),
        "n": lambda: len(s.send(n=2)["choices"]) == 2,
        "frequency_penalty": lambda: s.differs(frequency_penalty=2),
        "presence_penalty": lambda: s.differs(presence_penalty=2),
        "repetition_penalty": lambda: s.differs(repetition_penalty=2),
        "logit_bias": lambda: s.differs(logit_bias={str(s.ids[0]): -100}),
        "logprobs": lambda: s.send(logprobs=True if s.chat else 1)["choices"][0]["logprobs"] is not None,
        "top_logprobs": (lambda: len(s.send(logprobs=True, top_logprobs=2)["choices"][0]["logprobs"]["content"][0][
            "top_logprobs"]) == 2) if s.chat else None,
        "echo": (lambda: s.text(s.send(echo=True)).startswith(SWEEP_PROMPT)) if not s.chat
        else None,
        # structured output: the text follows the grammar (the baseline's does not)
        "response_format": lambda: json.loads(s.text(s.send(max_tokens=40, response_format={
            "type": "json_schema", "json_schema": {"name": "flag", "schema": FLAG}}))) in ({"a": True}, {"a": False}),
        "guided_json": lambda: json.loads(s.text(s.send(max_tokens=40, guided_json=FLAG))) in ({"a": True}, {"a": False}),
        "guided_regex": lambda: re.fullmatch("[a-c]{1,4}", s.text(s.send(max_tokens=16, guided_regex="[a-c]{1,4}"))),
        "guided_choice": lambda: s.text(s.send(max_tokens=16, guided_choice=CHOICES)) in CHOICES,
    }


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_every_documented_field_has_an_effect_or_is_refused(service, models, fam, path):
    """Each field of the OpenAPI description's request schema, sent with a non-default value: its
    effect is observed, or it is a 400 naming it. A field documented but missing here fails the test."""
    doc = httpx.get(service.url + "/openapi.json", timeout=30).json()
    ref = doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    fields = set(doc["components"]["schemas"][ref.rsplit("/", 1)[1]]["properties"]) - {"model", "messages", "prompt"}
    s = Sweep(service, models, fam, path)
    checks = {k: v for k, v in sweep_checks(s, models, fam).items() if v is not None}
    refused = dict(REFUSED, **({"echo": True} if s.chat else {}))
    assert fields == set(checks) | set(refused), (fields ^ (set(checks) | set(refused)))
    for name in sorted(fields):
        if name in refused:
            r = post(service, path, {**s.base, name: refused[name]})
            assert r.status_code == 400 and r.json()["error"]["param"] == name, (name, r.text)
            assert r.json()["error"]["code"] == "unsupported_parameter", (name, r.text)
        else:
            assert checks[name]() is not False, f"'{name}' was accepted and changed nothing observable"


# ---- structured output ------------------------------------------------------------------------------
class Answer(pydantic.BaseModel):
    colour: Literal["red", "green", "blue"]
    sure: bool
    count: int = pydantic.Field(ge=0, le=9)


def test_the_openai_clients_parse_helper_returns_a_parsed_object(client, models):
    r = client.chat.completions.parse(model=models[1], messages=MSG, response_format=Answer, max_tokens=60,
                                      temperature=1.0, seed=5)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason == "stop" and isinstance(msg.parsed, Answer), msg
    assert msg.parsed == Answer.model_validate_json(msg.content)


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions"])
def test_structured_output_through_the_service_equals_the_engine(service, models, fam, path):
    """Sampled, seeded: the service's text is the in-process engine's under the same grammar, streamed or
    not; a json_schema, a regex and a choice each hold."""
    chat = path.endswith("chat/completions")
    prompt = chat_ids(fam, MSG) if chat else fam.tokenizer("The sky is")["input_ids"]
    first = {"messages": MSG} if chat else {"prompt": prompt}
    cases = [({"guided_regex": r"\d{2}-[a-z]{1,3}"}, ("regex", r"\d{2}-[a-z]{1,3}")),
             ({"guided_choice": CHOICES}, ("choice", json.dumps(CHOICES))),
             ({"response_format": {"type": "json_schema", "json_schema": {"name": "f", "schema": FLAG, "strict": True}}},
              ("json", json.dumps(FLAG)))]
    for extra, spec in cases:
        body = {"model": models[1], **first, "max_tokens": 40, "temperature": 1.0, "seed": 11, **extra}
        r = post(service, path, body).json()
        c = r["choices"][0]
        text = c["message"]["content"] if chat else c["text"]
        eng = Engine(fam.model, block_size=4, num_blocks=256, tokenizer=fam.tokenizer)
        eng.add_request("ref", prompt, 1, SamplingParams(max_tokens=40, temperature=1.0, seed=11, grammar=spec))
        toks = []
        while eng.has_unfinished():
            for o in eng.step():
                toks += o.new_token_ids
        eos = fam.tokenizer.eos_token_id
        assert text == fam.tokenizer.decode([t for t in toks if t != eos]) and c["finish_reason"] == "stop", (extra, r)
        if spec[0] == "regex":
            assert re.fullmatch(spec[1], text)
        elif spec[0] == "choice":
            assert text in CHOICES
        else:
            assert json.loads(text) in ({"a": True}, {"a": False})


def test_json_object_output_parses(service, models, fam):
    """json_object allows any object; a random model rarely closes its strings, so the seed is one whose
    engine output ends within max_tokens (seeded sampling is the same in the service)."""
    prompt = chat_ids(fam, MSG)
    spec = ("json", '{"type": "object"}')
    for seed in range(40):
        eng = Engine(fam.model, block_size=4, num_blocks=256, tokenizer=fam.tokenizer)
        eng.add_request("ref", prompt, 0, SamplingParams(max_tokens=30, temperature=1.0, seed=seed, grammar=spec))
        reason = None
        while eng.has_unfinished():
            reason = next((o.finish_reason for o in eng.step() if o.finished), reason)
        if reason == "stop":
            break
    else:
        pytest.fail("no seed in 0..39 ends a json_object within 30 tokens")
    r = post(service, "/v1/chat/completions", {"model": models[0], "messages": MSG, "max_tokens": 30,
                                               "temperature": 1.0, "seed": seed,
                                               "response_format": {"type": "json_object"}}).json()
    assert r["choices"][0]["finish_reason"] == "stop"
    assert isinstance(json.loads(r["choices"][0]["message"]["content"]), dict)
    # not closed within max_tokens: a prefix of an object, finish_reason length
    r = post(service, "/v1/chat/completions", {"model": models[0], "messages": MSG, "max_tokens": 3,
                                               "temperature": 0, "response_format": {"type": "json_object"}}).json()
    assert r["choices"][0]["message"]["content"].startswith("{")


@pytest.mark.parametrize("body, param", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/defs/y"}}}},
     "response_format.json_schema.schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}}, "response_format.json_schema.name"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format.json_schema.schema"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_object", "schema": {}}}, "response_format"),
    ({"guided_json": {"type": "object", "properties": 3}}, "guided_json"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_regex": "(ab"}, "guided_regex"),
    ({"guided_regex": ""}, "guided_regex"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_choice": ["a", 3]}, "guided_choice"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ({"guided_regex": "a", "ignore_eos": True}, "ignore_eos"),
])
def test_bad_structured_output_is_400_naming_the_field(service, models, body, param):
    for path, first in (("/v1/chat/completions", {"messages": MSG}), ("/v1/completions", {"prompt": "Hi"})):
        r = post(service, path, {"model": models[2], **first, **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (path, r.text)


def test_speculation_under_a_grammar_through_the_service_is_exact(service, models):
    """Greedy: the drafts are checked against the mask, so speculating changes no token."""
    body = {"model": models[2], "messages": MSG, "max_tokens": 40, "temperature": 0,
            "guided_regex": r"[a-e]{2,6}( [a-e]{2,6}){0,3}"}
    plain = post(service, "/v1/chat/completions", body).json()
    spec = post(service, "/v1/chat/completions", {**body, "mfs": {"speculative": {"draft": models[0]}}}).json()
    assert spec["choices"][0]["message"]["content"] == plain["choices"][0]["message"]["content"], (plain, spec)
    assert re.fullmatch(body["guided_regex"], spec["choices"][0]["message"]["content"])
