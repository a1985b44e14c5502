"""The gateway against a real redis-server, with the test playing scheduler + worker.

The fake backend reads the Submit/Cancel records the gateway XADDs to ``mfs:req`` and answers with
TokenEvent records on ``mfs:out:{gateway}``, exactly as core/protocol.py describes; clients are the
official ``openai`` package and ``httpx`` (for raw bodies and disconnects) against a real port.
"""
from __future__ import annotations

import json
import threading
import time

import httpx2 as httpx  # what openai 3.x ships (the httpx API)
import msgpack
import openai
import pytest

from core import protocol as P
from gateway.config import GatewayConfig
from tests.support.gateway import CHAT, PARIS, ServerThread, _err, register_worker
from tests.support.gateway import backend, rds  # noqa: F401 - the fixtures
from tests.support.redis_server import redis_url  # noqa: F401 - the session fixture


@pytest.fixture(scope="session")
def gw(redis_url, frontend, backend):  # noqa: F811
    cfg = GatewayConfig(redis_url=redis_url, gateway_id="gw-test", frontend=frontend,
                        max_body_bytes=1 << 20)
    with ServerThread(cfg) as s:
        yield s


@pytest.fixture(autouse=True)
def fresh(rds, backend):
    register_worker(rds)
    backend.script = backend.reply(PARIS)
    yield


# ---- happy paths ------------------------------------------------------------------------------
def test_models_lists_tiers_and_family(gw):
    ids = [m.id for m in gw.client().models.list().data]
    assert ids == ["smollm2-135m-small", "smollm2-135m-medium", "smollm2-135m-large", "smollm2-135m"]
    assert gw.client().models.retrieve("smollm2-135m-large").id == "smollm2-135m-large"
    with pytest.raises(openai.NotFoundError):
        gw.client().models.retrieve("smollm2-135m-huge")


def test_chat_non_stream(gw, backend, frontend):
    r = gw.client().chat.completions.create(
        model="smollm2-135m-medium", messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=50, temperature=0.7, top_p=0.9, seed=7, extra_body={"top_k": 20, "typical_p": 0.6})
    assert r.choices[0].message.content == PARIS
    assert r.choices[0].finish_reason == "stop"
    assert r.model == "smollm2-135m-medium"
    sub = backend.submits[r.id]
    p = sub.params
    assert (sub.tier, p.max_tokens, p.temperature, p.top_p, p.top_k, p.seed) == (1, 50, 0.7, 0.9, 20, 7)
    assert p.typical_p == 0.6
    assert sub.gateway_id == "gw-test" and sub.model_id == "smollm2-135m-medium"
    assert frontend.tokenizer.eos_token_id in sub.params.stop_token_ids
    expect = frontend.tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True,
        tokenize=True)["input_ids"]
    assert sub.prompt_ids == list(expect)
    n = len(frontend.tokenizer.encode(PARIS)) + 1  # + the eos the worker sampled
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(expect), n)
    assert r.usage.total_tokens == len(expect) + n


def test_chat_stream_with_usage(gw, backend):
    chunks = list(gw.client().chat.completions.create(
        model="smollm2-135m-large", messages=[{"role": "system", "content": "Be brief."},
                                              {"role": "user", "content": [{"type": "text", "text": "Capital?"}]}],
        max_completion_tokens=40, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == PARIS
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == ["stop"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens > 0
    assert all(c.model == "smollm2-135m-large" for c in chunks)
    assert backend.last_submit().params.max_tokens == 40


def test_completions_length_and_stream(gw, backend):
    c = gw.client()
    r = c.completions.create(model="smollm2-135m-small", prompt="Once upon a time", max_tokens=3)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 3
    assert r.choices[0].text == "The capital of"
    assert r.model == "smollm2-135m-small"
    chunks = list(c.completions.create(model="smollm2-135m-small", prompt="Once upon a time", stream=True,
                                       max_tokens=100, extra_body={"ignore_eos": True}))
    assert "".join(ch.choices[0].text for ch in chunks) == PARIS
    assert backend.last_submit().params.ignore_eos is True
    r = c.completions.create(model="smollm2-135m-small", prompt=[504, 3458], max_tokens=5)  # token ids
    assert backend.submits[r.id].prompt_ids == [504, 3458]


def test_completions_default_max_tokens_is_16(gw, backend):
    gw.client().completions.create(model="smollm2-135m-small", prompt="Hi")
    assert backend.last_submit().params.max_tokens == 16


def test_unicode_streams_whole_characters(gw, backend):
    text = "Café ☕ — 日本語 🎉 done"
    backend.script = backend.reply(text, chunk=1)
    chunks = list(gw.client().chat.completions.create(
        model="smollm2-135m-small", messages=[{"role": "user", "content": "hi"}], stream=True))
    pieces = [c.choices[0].delta.content for c in chunks if c.choices[0].delta.content]
    assert "".join(pieces) == text
    assert all("\ufffd" not in p for p in pieces)


@pytest.mark.parametrize("model,prompt,tier", [
    ("smollm2-135m", "What is the capital of France?", 0),
    ("auto", "Explain step by step why the sky is blue.", 1),
    ("smollm2-135m", "Explain why this Python function has a bug and how to fix it:\n```python\n"
                     "def f(x):\n    return x +\n```", 2),
])
def test_family_id_routes_by_complexity(gw, backend, frontend, model, prompt, tier):
    """The scored tier, raised to the next tier the family's quality floor allows."""
    tier = min(t for t in frontend.usable_tiers() if t >= tier)
    r = gw.client().chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}])
    assert backend.submits[r.id].tier == tier
    assert r.model == f"smollm2-135m-{['small', 'medium', 'large'][tier]}"


def test_family_id_never_routes_below_the_quality_floor(redis_url, frontend, backend):  # noqa: F811
    """A tier whose recorded quality fails the floor serves only requests that name it."""
    import copy

    from family.manifest import Frontend
    m = copy.deepcopy(frontend.manifest)
    m.quality = {"small": {"ppl_vs_top": 1.49, "agree_top": 0.73, "answers_of_top": 0.51},
                 "medium": {"ppl_vs_top": 1.03, "agree_top": 0.84, "answers_of_top": 0.74}}
    cfg = GatewayConfig(redis_url=redis_url, gateway_id="gw-floor", frontend=Frontend(m, frontend.tokenizer),
                        max_body_bytes=1 << 20)
    q = [{"role": "user", "content": "What is the capital of France?"}]  # scores 0: small
    with ServerThread(cfg) as s:
        r = s.client().chat.completions.create(model="smollm2-135m", messages=q)
        assert backend.submits[r.id].tier == 1 and r.model == "smollm2-135m-medium"
        r = s.client().chat.completions.create(model="smollm2-135m-small", messages=q)
        assert backend.submits[r.id].tier == 0


def test_concurrent_requests_get_their_own_tokens(gw, backend):
    backend.script = backend.reply(lambda sub: f"answer for {sub.request_id[-8:]} ok", chunk=1, delay=0.005)
    results: dict[int, tuple] = {}

    def one(i: int):
        c = gw.client()
        if i % 2:
            chunks = list(c.chat.completions.create(stream=True, **CHAT))
            results[i] = (chunks[0].id, "".join(ch.choices[0].delta.content or "" for ch in chunks))
        else:
            r = c.chat.completions.create(**CHAT)
            results[i] = (r.id, r.choices[0].message.content)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(results) == 8
    for rid, text in results.values():
        assert text == f"answer for {rid[-8:]} ok"


def test_overlapping_events_and_served_tier(gw, backend, frontend):
    ids = frontend.tokenizer.encode(" one two three four", add_special_tokens=False)

    def script(sub):  # at-least-once, re-batched redelivery; the scheduler escalated it to tier 2
        ev = lambda seq, toks, fin=False: (0.0, P.TokenEvent(sub.request_id, seq, toks, fin,  # noqa: E731
                                                             "stop" if fin else None, tier=2))
        return [ev(0, ids[:2]), ev(1, ids[1:3]), ev(0, ids[:1]), ev(2, ids[2:]), ev(4, [], True)]
    backend.script = script
    r = gw.client().completions.create(model="smollm2-135m-small", prompt="count", max_tokens=20)
    assert r.choices[0].text == " one two three four"
    assert r.usage.completion_tokens == len(ids)
    assert r.model == "smollm2-135m-large"


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_truncates_and_cancels(gw, backend, stream):
    backend.script = backend.reply("Hello world. STOP and then a lot more text that is never sent.",
                                   chunk=1, delay=0.01)
    c = gw.client()
    kw = dict(model="smollm2-135m-small", messages=[{"role": "user", "content": "hi"}],
              stop=["never", "STOP"], stream=stream)
    if stream:
        chunks = list(c.chat.completions.create(**kw))
        text = "".join(ch.choices[0].delta.content or "" for ch in chunks)
        finish, rid = chunks[-1].choices[0].finish_reason, chunks[-1].id
    else:
        r = c.chat.completions.create(**kw)
        text, finish, rid = r.choices[0].message.content, r.choices[0].finish_reason, r.id
    assert text == "Hello world. " and finish == "stop"
    assert backend.wait_cancel(rid) == "stop"


# ---- errors -----------------------------------------------------------------------------------


@pytest.mark.parametrize("body,param", [
    (b"{not json", None),
    (b"[1, 2]", None),
    (json.dumps({"model": "smollm2-135m-small"}).encode(), "messages"),
    (json.dumps({**CHAT, "messages": [{"role": "robot", "content": "x"}]}).encode(), "messages[0].role"),
    (json.dumps({**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]}).encode(),
     "messages[0].content"),
    (json.dumps({**CHAT, "temperature": 5}).encode(), "temperature"),
    (json.dumps({**CHAT, "max_tokens": 0}).encode(), "max_tokens"),
    (json.dumps({**CHAT, "max_tokens": "ten"}).encode(), "max_tokens"),
    (json.dumps({**CHAT, "stop": [1, 2]}).encode(), "stop"),
    (json.dumps({**CHAT, "top_p": 1.5}).encode(), "top_p"),
    (json.dumps({**CHAT, "typical_p": -0.5}).encode(), "typical_p"),
    (json.dumps({**CHAT, "stream": "yes"}).encode(), "stream"),
    (json.dumps({"messages": CHAT["messages"]}).encode(), "model"),
    (json.dumps({**CHAT, "seed": 2 ** 70}).encode(), "seed"),
    (json.dumps({**CHAT, "max_tokens": 2 ** 40}).encode(), "max_tokens"),
    (b'{"model": "smollm2-135m-small", "messages": [{"role": "user", "content": "x"}], "temperature": NaN}',
     "temperature"),
    (b"[" * 100000 + b"]" * 100000, None),
])
def test_bad_chat_input_is_400(gw, body, param):
    r = httpx.post(gw.url + "/v1/chat/completions", content=body, headers={"Content-Type": "application/json"})
    err = _err(r, 400, param=param)
    assert err["type"] == "invalid_request_error"


@pytest.mark.parametrize("body,param", [
    ({"model": "smollm2-135m-small"}, "prompt"),
    ({"model": "smollm2-135m-small", "prompt": ["a", "b"]}, "prompt"),
    ({"model": "smollm2-135m-small", "prompt": [10 ** 9]}, "prompt"),
    ({"model": "smollm2-135m-small", "prompt": "x", "echo": "yes"}, "echo"),
    ({"model": "smollm2-135m-small", "prompt": "x", "max_tokens": 0}, "max_tokens"),  # 0 only with echo
])
def test_bad_completion_input_is_400(gw, body, param):
    _err(httpx.post(gw.url + "/v1/completions", json=body), 400, param=param)


def test_n_above_the_cap_is_400_with_openai_client(gw):
    with pytest.raises(openai.BadRequestError) as e:
        gw.client().chat.completions.create(n=17, **CHAT)
    assert e.value.status_code == 400 and e.value.code == "unsupported_parameter" and e.value.param == "n"
    assert "at most 16" in e.value.message


def test_n_choices_are_n_submits_following_the_first(gw, backend):
    r = gw.client().chat.completions.create(n=3, seed=7, temperature=0.5, **CHAT)
    assert [c.index for c in r.choices] == [0, 1, 2] and all(c.message.content == PARIS for c in r.choices)
    subs = [backend.submits[r.id]] + [backend.submits[f"{r.id}-{i}"] for i in (1, 2)]
    assert [s.params.seed for s in subs] == [7, 8, 9]
    assert [s.follow for s in subs] == [None, r.id, r.id]
    assert r.usage.prompt_tokens == len(subs[0].prompt_ids)
    one = gw.client().chat.completions.create(**CHAT)
    assert r.usage.completion_tokens == 3 * one.usage.completion_tokens


def test_unknown_model_is_404(gw):
    with pytest.raises(openai.NotFoundError) as e:
        gw.client().chat.completions.create(model="gpt-4", messages=CHAT["messages"])
    assert e.value.code == "model_not_found"
    _err(httpx.post(gw.url + "/v1/completions", json={"model": "nope", "prompt": "x"}), 404, "model_not_found")
    _err(httpx.get(gw.url + "/v1/nothing-here"), 404)


def test_context_overflow_is_400(gw, rds):
    register_worker(rds, "w1", 2048)  # the smallest live worker decides
    try:
        r = httpx.post(gw.url + "/v1/chat/completions", json={**CHAT, "max_tokens": 2040})
        err = _err(r, 400, "context_length_exceeded")
        assert "maximum context length is 2048 tokens" in err["message"]
        assert "asks for 2040 more" in err["message"]
        r = httpx.post(gw.url + "/v1/completions", json={"model": "smollm2-135m-small",
                                                         "prompt": "word " * 3000})
        assert "maximum context length is 2048" in _err(r, 400, "context_length_exceeded")["message"]
    finally:
        rds.delete(P.worker_key("w1"))
        rds.srem(P.WORKERS_SET, "w1")


def test_body_too_large_is_413(gw):
    big = json.dumps({**CHAT, "messages": [{"role": "user", "content": "x" * (2 << 20)}]})
    _err(httpx.post(gw.url + "/v1/chat/completions", content=big), 413, "request_too_large")


def test_no_live_worker_is_503_and_health_follows(gw, rds):
    h = httpx.get(gw.url + "/health")
    assert h.status_code == 200 and h.json()["status"] == "ok" and h.json()["workers"] == 1
    rds.delete(P.worker_key("w0"))  # registered, but its key expired: not live
    r = httpx.post(gw.url + "/v1/chat/completions", json=CHAT)
    _err(r, 503, "no_live_worker")
    assert r.headers["Retry-After"]
    assert httpx.get(gw.url + "/health").status_code == 503


def test_backend_error_event_keeps_its_status(gw, backend):
    backend.script = backend.error(400, "context_length_exceeded", "too long for worker w0")
    r = httpx.post(gw.url + "/v1/chat/completions", json={**CHAT, "stream": True})
    assert _err(r, 400, "context_length_exceeded")["message"] == "too long for worker w0"
    backend.script = backend.error(500, "worker_failed", "worker w0 died", after_tokens=2)
    r = httpx.post(gw.url + "/v1/chat/completions", json={**CHAT, "stream": True})
    assert r.status_code == 200
    lines = [ln[6:] for ln in r.text.split("\n\n") if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    assert json.loads(lines[-2])["error"]["code"] == "worker_failed"
    backend.script = backend.error(503, "gateway_lost", "the scheduler cancelled it")  # retryable: says when
    r = httpx.post(gw.url + "/v1/chat/completions", json=CHAT)
    assert _err(r, 503, "gateway_lost")["message"] == "the scheduler cancelled it" and r.headers["Retry-After"] == "1"


def test_overload_is_429(redis_url, frontend, backend, rds):  # noqa: F811
    cfg = GatewayConfig(redis_url=redis_url, gateway_id="gw-limited", frontend=frontend, max_inflight=1)
    backend.script = backend.endless()
    with ServerThread(cfg) as s, httpx.Client(timeout=10) as http:
        with http.stream("POST", s.url + "/v1/chat/completions", json={**CHAT, "stream": True}) as first:
            lines = first.iter_lines()  # keep a reference: a collected iterator closes the response
            next(lines)
            r = httpx.post(s.url + "/v1/chat/completions", json=CHAT)
            _err(r, 429, "too_many_requests")
            assert r.headers["Retry-After"] == "1"
            rid = backend.last_submit().request_id
        assert backend.wait_cancel(rid) == "disconnect"


# ---- cancellation -----------------------------------------------------------------------------
def test_stream_disconnect_sends_cancel(gw, backend):
    backend.script = backend.endless()
    with httpx.Client(timeout=10) as http, \
            http.stream("POST", gw.url + "/v1/chat/completions", json={**CHAT, "stream": True}) as r:
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]
        assert any(ln.startswith("data: ") for ln in got)
        rid = backend.last_submit().request_id
    assert backend.wait_cancel(rid) == "disconnect"


def test_non_stream_client_gone_sends_cancel(gw, backend):
    backend.script = backend.endless()
    seen = len(backend.submits)
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(gw.url + "/v1/chat/completions", json=CHAT, timeout=0.5)
    rid = backend.submit_after(seen).request_id
    assert backend.wait_cancel(rid) == "disconnect"


def test_deadline_sends_cancel_and_504(redis_url, frontend, backend):  # noqa: F811
    cfg = GatewayConfig(redis_url=redis_url, gateway_id="gw-deadline", frontend=frontend,
                        request_timeout_s=0.6)
    backend.script = backend.endless(delay=0.1)
    seen = len(backend.submits)
    with ServerThread(cfg) as s:
        _err(httpx.post(s.url + "/v1/chat/completions", json=CHAT), 504, "timeout")
        assert backend.wait_cancel(backend.submit_after(seen).request_id) == "deadline"


# ---- health, metrics, heartbeat ---------------------------------------------------------------
def test_metrics_and_heartbeat(gw, rds):
    gw.client().chat.completions.create(**CHAT)
    stats = {"waiting": {0: 2, 2: 1}, "running": {1: 3}, "kv_blocks_used": {"w0": [5, 4, 1]},
             "kv_blocks_total": {"w0": [100, 100, 100]}, "path_switches": 7}  # no escalations key
    rds.hset(P.STATS_KEY, "scheduler", msgpack.packb(stats))
    try:
        text = httpx.get(gw.url + "/metrics").text
    finally:
        rds.delete(P.STATS_KEY)
    assert 'mfs_requests_total{finish_reason="stop",model="smollm2-135m-small"}' in text
    assert 'mfs_time_to_first_token_seconds_count{model="smollm2-135m-small"}' in text
    assert "mfs_e2e_request_latency_seconds_bucket" in text and "mfs_inflight_requests " in text
    assert 'mfs_scheduler_waiting{tier="small"} 2.0' in text
    assert 'mfs_scheduler_running{tier="medium"} 3.0' in text
    assert 'mfs_kv_blocks_used{segment="1",worker="w0"} 4.0' in text
    assert "mfs_scheduler_path_switches 7.0" in text and "mfs_scheduler_escalations 0.0" in text
    assert httpx.get(gw.url + "/metrics").status_code == 200  # the hash gone: still fine
    ttl = rds.ttl(P.gateway_key("gw-test"))
    assert 0 < ttl <= P.WORKER_TTL_S
    beat = json.loads(rds.get(P.gateway_key("gw-test")))
    assert beat["port"] and beat["pid"] and beat["t"] > 0


def test_reuse_metrics_from_scheduler_stats(gw, rds):
    stats = {"prefill_computed": {0: 1200, 1: 900, 2: 300}, "prefill_reused": {0: 3000, 1: 2000, 2: 0},
             "cache_queries": {0: 200, 1: 150, 2: 0}, "cache_hits": {0: 150, 1: 75},  # no segment-2 hits
             "evictions": {0: 4, 1: 2, 2: 1}, "exit_filled": {0: 48, 1: 0}, "directory_blocks": {"w0": 42, "w1": 0},
             "affinity_preferred": 9}  # no affinity_yielded key
    rds.hset(P.STATS_KEY, "scheduler", msgpack.packb(stats))
    try:
        text = httpx.get(gw.url + "/metrics").text
    finally:
        rds.delete(P.STATS_KEY)
    for line in ('mfs_prefill_tokens_computed{segment="0"} 1200.0', 'mfs_prefill_tokens_computed{segment="2"} 300.0',
                 'mfs_prefill_tokens_reused{segment="1"} 2000.0', 'mfs_prefill_tokens_reused{segment="2"} 0.0',
                 'mfs_prefix_cache_queries{segment="0"} 200.0', 'mfs_prefix_cache_hits{segment="1"} 75.0',
                 'mfs_prefix_cache_hit_rate{segment="0"} 0.75', 'mfs_prefix_cache_hit_rate{segment="1"} 0.5',
                 'mfs_kv_evictions{segment="0"} 4.0', 'mfs_kv_evictions{segment="2"} 1.0',
                 'mfs_exit_fill_tokens{segment="0"} 48.0', 'mfs_exit_fill_tokens{segment="1"} 0.0',
                 'mfs_kv_directory_blocks{worker="w0"} 42.0', 'mfs_kv_directory_blocks{worker="w1"} 0.0',
                 "mfs_scheduler_affinity_preferred 9.0", "mfs_scheduler_affinity_yielded 0.0"):
        assert line in text, line
    assert 'mfs_prefix_cache_hit_rate{segment="2"}' not in text  # no queries: no rate
    assert 'mfs_prefix_cache_hits{segment="2"}' not in text
    # The hash gone (or an old scheduler without these keys): the series go, the scrape still works.
    text = httpx.get(gw.url + "/metrics").text
    assert "mfs_prefill_tokens_computed{" not in text and "mfs_kv_directory_blocks{" not in text


def test_status_json_has_the_metrics_numbers(gw, rds):
    """GET /status.json reads the registry /metrics renders: the same numbers, per tier, plus workers
    with their heartbeats and the leading scheduler; GET / is the page that draws it."""
    gw.client().chat.completions.create(**CHAT)
    now = time.time()
    stats = {"leader": "sched-a", "epoch": 3, "updated": now - 0.25, "workers": 1,
             "waiting": {0: 2}, "running": {1: 3}, "kv_blocks_used": {"w0": [5, 4, 1]},
             "kv_blocks_total": {"w0": [100, 100, 100]}, "cache_queries": {0: 8}, "cache_hits": {0: 6},
             "escalations": 2, "escalations_by_pair": {"0>1": 2},
             "spec": {"0>2": {"rounds": 4, "proposed": 16, "accepted": 12, "committed": 14}}}
    rds.hset(P.STATS_KEY, "scheduler", msgpack.packb(stats))
    choice = "weights int4 (auto on AVX2: not w4a8, our CPU operators are unavailable (build failed: g++))"
    rds.hset(P.worker_key("w0"), mapping={"heartbeat": now - 0.5, "weights": "int4", "choice": choice})
    try:
        st = httpx.get(gw.url + "/status.json").json()
        text = httpx.get(gw.url + "/metrics").text
    finally:
        rds.delete(P.STATS_KEY)
    small, medium, large = st["tiers"]
    assert (small["name"], small["model"], medium["model"]) == ("small", "smollm2-135m-small", "smollm2-135m-medium")
    assert (small["waiting"], medium["running"], large["running"]) == (2, 3, 0)
    assert [t["kv_blocks_used"] for t in st["tiers"]] == [5, 4, 1] and large["kv_blocks_total"] == 100
    assert small["prefix_cache_hit_rate"] == 0.75 and medium["prefix_cache_hit_rate"] is None
    assert f'mfs_completion_tokens_total{{model="smollm2-135m-small"}} {small["completion_tokens"]}' in text
    assert small["requests"] == sum(float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines()
                                    if ln.startswith("mfs_requests_total{") and 'model="smollm2-135m-small"' in ln)
    assert st["completion_tokens"] >= small["completion_tokens"] > 0
    assert 0 < small["ttft_s"]["p50"] <= small["ttft_s"]["p90"] <= small["ttft_s"]["p99"]
    assert st["speculation"] == [{"draft": "small", "target": "large", "rounds": 4, "proposed": 16,
                                  "accepted": 12, "acceptance_rate": 0.75, "tokens_per_verification": 3.5}]
    assert st["escalations"] == {"total": 2, "pairs": [{"from": "small", "to": "medium", "count": 2}]}
    w0 = next(w for w in st["workers"] if w["id"] == "w0")
    assert w0["kv_blocks_used"] == [5, 4, 1] and 0.4 < w0["age_s"] < 30
    assert (w0["weights"], w0["choice"]) == ("int4", choice)  # what it serves and why, fallback included
    (leader,) = st["schedulers"]
    assert (leader["shard"], leader["leader"], leader["epoch"]) == (P.DEFAULT_SHARD, "sched-a", 3)
    assert 0.2 < leader["age_s"] < 30 and st["redis_up"] is True and st["gateway"] == "gw-test"
    page = httpx.get(gw.url + "/")
    assert page.status_code == 200 and page.headers["Content-Type"].startswith("text/html")
    assert "status.json" in page.text and 'id="tokens-total"' in page.text


def test_histogram_quantile_interpolates_as_prometheus():
    from gateway.status import histogram_quantile
    buckets = [(0.1, 2.0), (0.2, 6.0), (float("inf"), 8.0)]
    assert histogram_quantile(0.5, buckets) == pytest.approx(0.15)   # rank 4: halfway into (0.1, 0.2]
    assert histogram_quantile(0.1, buckets) == pytest.approx(0.04)   # rank 0.8 of 2 in (0, 0.1]
    assert histogram_quantile(0.99, buckets) == 0.2                  # in +Inf: the highest finite bound
    assert histogram_quantile(0.5, [(0.1, 0.0), (float("inf"), 0.0)]) is None


def test_cached_tokens_counter():
    from gateway.metrics import Metrics
    m = Metrics()
    m.observe_request("smollm2-135m-large", "length", 100, 4, 0.1, 0.01, 0.2, cached_tokens=96)
    m.observe_request("smollm2-135m-large", "length", 120, 4, 0.1, 0.01, 0.2, cached_tokens=112)
    m.observe_request("smollm2-135m-small", "length", 10, 4, 0.1, 0.01, 0.2)
    text = m.render().decode()
    assert 'mfs_cached_prompt_tokens_total{model="smollm2-135m-large"} 208.0' in text
    assert 'mfs_cached_prompt_tokens_total{model="smollm2-135m-small"} 0.0' in text


def test_the_quality_floor_names_what_a_tier_misses():
    """A tier passes the floor on every figure it names; a figure nobody measured fails it; a
    manifest's own floor replaces the default whole (a family recorded against the first-sentence
    floor keeps it); an unknown key is refused."""
    import copy

    import pytest as _pytest

    from family.manifest import DEFAULT_FLOOR, floor_failures, usable_tiers
    good = {"ppl_vs_top": 1.03, "agree_top": 0.84, "answers_of_top": 0.74}
    assert floor_failures(good, DEFAULT_FLOOR) == []
    assert floor_failures({**good, "agree_top": 0.74}, DEFAULT_FLOOR) == ["agree_top 0.74 < 0.75"]
    assert floor_failures({**good, "ppl_vs_top": 1.31}, DEFAULT_FLOOR) == ["ppl_vs_top 1.31 > 1.3"]
    assert floor_failures({"ppl_vs_top": 1.0, "agree_top": 0.9}, DEFAULT_FLOOR) == ["answers_of_top not measured"]
    own = {"max_ppl_vs_top": 5.0, "min_agree_top": 0.35, "min_answer_agree": 0.5}
    assert floor_failures({"ppl_vs_top": 4.0, "agree_top": 0.48, "answer_agree": 0.5}, own) == []
    with _pytest.raises(ValueError, match="unknown keys"):
        floor_failures(good, {"min_vibes": 1.0})
    from family.manifest import Manifest, TierSpec
    m = Manifest(family="f", base={"path": "x"}, tiers=[TierSpec("small", 2), TierSpec("medium", 4), TierSpec("large", 6)])
    m.quality = {"small": {**good, "answers_of_top": 0.5}, "medium": good}
    assert usable_tiers(m) == [1, 2]
    m2 = copy.deepcopy(m)
    m2.quality["floor"] = {"min_answers_of_top": 0.5}
    assert usable_tiers(m2) == [0, 1, 2]
