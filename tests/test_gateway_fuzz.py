"""Fuzzing the completion endpoints with hypothesis: valid bodies, valid bodies with one field broken,
any JSON value and bytes that are no JSON at all against a real gateway on a real redis-server, a live worker
registered and the test's fake backend answering every Submit. No input may get a 5xx, and every
error must be in OpenAI's shape (also inside a stream).

Bounded: ~150 examples per endpoint, no per-example deadline, well under a minute in all.
"""
from __future__ import annotations

import json

import httpx2 as httpx
import pytest
import redis
from hypothesis import HealthCheck, event, example, given, settings
from hypothesis import strategies as st

from gateway.app import GatewayConfig
from tests.redis_server import redis_url  # noqa: F401 - the session fixture (this module's own server)
from tests.test_gateway import rds_worker, FakeBackend, ServerThread, register_worker

KEY = "sk-fuzz"
MODELS = ["smollm2-135m-small", "smollm2-135m-medium", "smollm2-135m-large", "smollm2-135m", "auto"]
FUZZ = settings(max_examples=150, deadline=None, database=None, derandomize=False,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

# any JSON value (NaN and infinities included: the gateway's json.loads accepts them); text with lone
# surrogates too (JSON can escape them, tokenizers choke on them)
chars = st.text(st.characters(exclude_categories=()), max_size=40)
scalars = st.none() | st.booleans() | st.integers(-(1 << 70), 1 << 70) | st.floats() | chars
anything = st.recursive(scalars, lambda c: st.lists(c, max_size=4) | st.dictionaries(chars, c, max_size=4),
                        max_leaves=10)
words = st.text(st.characters(exclude_categories=()), max_size=200)

# values a real client could send
VALID = {
    "max_tokens": st.integers(1, 64), "max_completion_tokens": st.integers(1, 64),
    "temperature": st.floats(0, 2), "top_p": st.floats(0, 1), "top_k": st.integers(-1, 50),
    "seed": st.integers(-(1 << 63), (1 << 63) - 1), "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "stop": st.text(min_size=1, max_size=5) | st.lists(st.text(min_size=1, max_size=5), max_size=4),
    "stop_token_ids": st.lists(st.integers(0, 49151), max_size=3), "ignore_eos": st.booleans(),
    "n": st.just(1), "user": st.text(max_size=20), "session_id": st.text(max_size=20),
    "frequency_penalty": st.just(0), "logprobs": st.just(False), "echo": st.just(False),
}
EXTRA = ["best_of", "suffix", "tools", "functions", "presence_penalty", "response_format", "logit_bias"]
text_part = st.fixed_dictionaries({"type": st.just("text"), "text": words})
message = st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]),
                                 "content": words | st.lists(text_part, min_size=1, max_size=3)})
valid_chat = st.fixed_dictionaries({"model": st.sampled_from(MODELS),
                                    "messages": st.lists(message, min_size=1, max_size=4)}, optional=VALID)
prompt = words | st.lists(st.integers(0, 49151), min_size=1, max_size=8)
valid_completion = st.fixed_dictionaries({"model": st.sampled_from(MODELS), "prompt": prompt}, optional=VALID)


def mutated(valid, required: list[str]):
    """A valid body with one field set to any JSON value, or dropped."""
    names = st.sampled_from(required + sorted(VALID) + EXTRA)

    def mutate(args):
        body, name, value, drop = args
        body = dict(body)
        if drop:
            body.pop(name, None)
        else:
            body[name] = value
        return body
    return st.tuples(valid, names, anything, st.booleans()).map(mutate)


def raw(valid, required: list[str]):
    """Valid bodies, bodies with one field broken, any JSON value at all, and bytes."""
    dump = lambda b: json.dumps(b).encode()  # noqa: E731
    return st.one_of(valid.map(dump), mutated(valid, required).map(dump), anything.map(dump),
                     st.binary(max_size=64))


@pytest.fixture(scope="module")
def gw(redis_url, rds):  # noqa: F811
    from mfs.family import load_frontend
    frontend = load_frontend("default")
    fb = FakeBackend(redis_url, frontend.tokenizer)
    fb.start()
    cfg = GatewayConfig(redis_url=redis_url, gateway_id="gw-fuzz", frontend=frontend, api_keys=[KEY],
                        rpm=1_000_000, tpm=1 << 40, request_timeout_s=20)
    try:
        with ServerThread(cfg) as s, httpx.Client(base_url=s.url, timeout=20,
                                                  headers={"Authorization": f"Bearer {KEY}"}) as http:
            yield http
    finally:
        fb.halt.set()
        fb.join(5)
        fb.r.close()


@pytest.fixture(scope="module")
def rds(rds_worker):
    return rds_worker


def check_error(err) -> None:
    assert isinstance(err, dict) and set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str)
    assert err["param"] is None or isinstance(err["param"], str)
    assert err["code"] is None or isinstance(err["code"], str)


def check(r: httpx.Response, obj: str) -> None:
    event(f"status {r.status_code}")  # pytest --hypothesis-show-statistics shows the mix
    assert r.status_code < 500, r.text
    if r.status_code >= 400:
        check_error(r.json()["error"])
        return
    assert r.status_code == 200, r.text
    if not r.headers["Content-Type"].startswith("text/event-stream"):
        assert r.json()["object"] == obj
        return
    events = [e[6:] for e in r.text.split("\n\n") if e.startswith("data: ")]
    assert events and events[-1] == "[DONE]", r.text
    for e in map(json.loads, events[:-1]):
        if "error" in e:
            check_error(e["error"])
        else:
            assert e["object"] == obj + (".chunk" if obj == "chat.completion" else "")


@FUZZ
@given(body=raw(valid_chat, ["model", "messages"]))
@example(body=b'{"model": "auto", "messages": [{"role": "user", "content": "a\\ud800"}]}')
@example(body=b'{"model": "auto", "messages": [{"role": "user", "content": "hi"}], "user": "\\udfff"}')
# ^ a lone surrogate in `user` was a 500 (msgpack cannot encode it)
def test_fuzz_chat_completions(gw, body):
    check(gw.post("/v1/chat/completions", content=body, headers={"Content-Type": "application/json"}),
          "chat.completion")


@FUZZ
@given(body=raw(valid_completion, ["model", "prompt"]))
@example(body=b'{"model": "smollm2-135m-small", "prompt": "a\\ud800b"}')  # was a 500 (the tokenizer)
def test_fuzz_completions(gw, body):
    check(gw.post("/v1/completions", content=body, headers={"Content-Type": "application/json"}),
          "text_completion")
