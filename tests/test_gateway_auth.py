"""API keys, per-key rate limits and request bounds, against real gateways on a real redis-server.

This module gets its own redis-server and fake backend (tests/test_gateway.py's harness), so its
rate-limit buckets and streams never meet another module's.
"""
from __future__ import annotations

import asyncio
import time
import uuid

import httpx2 as httpx
import openai
import pytest
import redis
import redis.asyncio as aioredis
import structlog

from core import protocol as P
from gateway.__main__ import parse_args
from gateway.app import init_app
from gateway.config import GatewayConfig
from gateway.openai_api import Limits
from gateway.ratelimit import RateLimiter, duration
from tests.support.redis_server import redis_url  # noqa: F401 - the session fixture (this module's own server)
from tests.support.gateway import rds_worker, CHAT, PARIS, FakeBackend, ServerThread, _err, register_worker
from tests.support.wait import pace


@pytest.fixture(scope="module")
def rds(rds_worker):
    return rds_worker


@pytest.fixture(scope="module")
def backend(redis_url, frontend, rds):  # noqa: F811
    fb = FakeBackend(redis_url, frontend.tokenizer)
    fb.start()
    yield fb
    fb.halt.set()
    fb.join(5)
    fb.r.close()


@pytest.fixture
def gateway(redis_url, frontend, backend):  # noqa: F811
    """``gateway(**config)``: a started ServerThread, stopped after the test."""
    started = []

    def make(**kw) -> ServerThread:
        cfg = GatewayConfig(redis_url=redis_url, frontend=frontend, **kw)
        s = ServerThread(cfg).__enter__()
        started.append(s)
        return s
    yield make
    for s in started:
        s.__exit__(None, None, None)


def auth(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


# ---- keys -------------------------------------------------------------------------------------
def test_keys_guard_every_route_but_health(gateway):
    gw = gateway(api_keys=["sk-one", "sk-two"])
    assert httpx.get(gw.url + "/health").status_code == 200
    page = httpx.get(gw.url + "/")  # the status page's HTML is open; its numbers are not
    assert page.status_code == 200 and "status.json" in page.text
    for method, path in (("GET", "/v1/models"), ("GET", "/v1/models/smollm2-135m"), ("GET", "/metrics"),
                         ("GET", "/status.json"),
                         ("POST", "/v1/chat/completions"), ("POST", "/v1/completions"), ("GET", "/nope")):
        for headers in ({}, auth("sk-three"), auth("sk-one-"), {"Authorization": "Basic sk-one"},
                        {"Authorization": "Bearer"}):
            r = httpx.request(method, gw.url + path, headers=headers, json=CHAT)
            err = _err(r, 401, "invalid_api_key")
            assert err["type"] == "authentication_error"
            assert r.headers["WWW-Authenticate"] == "Bearer"
    for key in ("sk-one", "sk-two"):
        assert httpx.get(gw.url + "/v1/models", headers=auth(key)).status_code == 200
        assert httpx.get(gw.url + "/metrics", headers=auth(key)).status_code == 200
        assert httpx.get(gw.url + "/status.json", headers=auth(key)).json()["tiers"]
        r = openai.OpenAI(base_url=gw.url + "/v1", api_key=key, max_retries=0).chat.completions.create(**CHAT)
        assert r.choices[0].message.content == PARIS
    with pytest.raises(openai.AuthenticationError) as e:
        openai.OpenAI(base_url=gw.url + "/v1", api_key="sk-no", max_retries=0).chat.completions.create(**CHAT)
    assert e.value.code == "invalid_api_key"


def test_revoked_key_in_file_stops_working_without_restart(gateway, tmp_path):
    path = tmp_path / "keys"
    path.write_text("# operators\nsk-alice\n\nsk-bob   # until Friday\n")
    gw = gateway(api_keys_file=str(path))
    ok = lambda key: httpx.get(gw.url + "/v1/models", headers=auth(key)).status_code  # noqa: E731
    assert (ok("sk-alice"), ok("sk-bob"), ok("sk-carol"), ok("# operators")) == (200, 200, 401, 401)
    path.write_text("sk-bob\nsk-carol\n")  # alice revoked, carol added
    assert (ok("sk-alice"), ok("sk-bob"), ok("sk-carol")) == (401, 200, 200)
    path.unlink()  # a vanished file lets nobody in; it does not open the gateway
    assert (ok("sk-bob"), ok("sk-carol")) == (401, 401)
    path.write_text("sk-carol\n")
    assert (ok("sk-bob"), ok("sk-carol")) == (401, 200)


def test_missing_keys_file_fails_at_start(frontend, tmp_path):
    with pytest.raises(ValueError, match="api-keys-file"):
        init_app(GatewayConfig(frontend=frontend, api_keys_file=str(tmp_path / "absent")))


def test_open_gateway_warns_once_and_binds_loopback(frontend, monkeypatch):
    with structlog.testing.capture_logs() as logs:
        init_app(GatewayConfig(frontend=frontend))
        init_app(GatewayConfig(frontend=frontend, api_keys=["sk-x"]))
    assert [e["event"] for e in logs if e["log_level"] == "warning"] == ["gateway.open"]
    assert GatewayConfig().host == "127.0.0.1" and parse_args([]).host == "127.0.0.1"
    monkeypatch.setenv("MFS_API_KEYS", " sk-a, sk-b ,,")
    cfg = parse_args(["--rpm", "5", "--tpm", "900", "--api-keys-file", "k.txt", "--max-tokens-cap", "64",
                      "--max-stop", "2", "--max-prompt-tokens", "99"])
    assert (cfg.api_keys, cfg.api_keys_file, cfg.rpm, cfg.tpm) == (["sk-a", "sk-b"], "k.txt", 5, 900)
    assert (cfg.limits.max_tokens_cap, cfg.limits.max_stop, cfg.max_prompt_tokens) == (64, 2, 99)


# ---- rate limits ------------------------------------------------------------------------------
def test_request_rate_limit_is_429_with_headers(gateway, rds):
    gw = gateway(api_keys=["sk-rpm", "sk-other"], rpm=3)
    left = []
    for path in ("/v1/chat/completions", "/v1/models", "/v1/models"):  # a stream gets them too
        r = httpx.request("POST" if "chat" in path else "GET", gw.url + path, headers=auth("sk-rpm"),
                          json={**CHAT, "stream": True})
        assert r.status_code == 200
        assert r.headers["x-ratelimit-limit-requests"] == "3"
        assert r.headers["x-ratelimit-reset-requests"].endswith("s")
        left.append(r.headers["x-ratelimit-remaining-requests"])
        assert "x-ratelimit-limit-tokens" not in r.headers  # --tpm 0: unlimited, nothing to say
    assert left == ["2", "1", "0"]
    r = httpx.post(gw.url + "/v1/chat/completions", headers=auth("sk-rpm"), json=CHAT)
    err = _err(r, 429, "rate_limit_exceeded")
    assert err["type"] == "rate_limit_error" and "requests per minute" in err["message"]
    assert 1 <= int(r.headers["Retry-After"]) <= 20  # one request refills in 60/3 s
    assert r.headers["x-ratelimit-remaining-requests"] == "0"
    # another key has its own bucket; /health is never counted
    assert httpx.get(gw.url + "/v1/models", headers=auth("sk-other")).status_code == 200
    assert httpx.get(gw.url + "/health").status_code == 200
    # the bucket lives in Redis under the key's id, never the key, and expires
    names = [k.decode() for k in rds.scan_iter(P.ratelimit_key("*"))]
    assert len(names) == 2 and not any("sk-" in n for n in names)
    assert all(0 < rds.pttl(n) <= 61000 for n in names)


def test_token_rate_limit_counts_prompt_and_max_tokens(gateway, backend):
    gw = gateway(api_keys=["sk-tpm"], tpm=100)
    client = openai.OpenAI(base_url=gw.url + "/v1", api_key="sk-tpm", max_retries=0)
    raw = client.chat.completions.with_raw_response.create(max_tokens=50, **CHAT)
    prompt = len(backend.submits[raw.parse().id].prompt_ids)
    assert raw.headers["x-ratelimit-limit-tokens"] == "100"
    left = int(raw.headers["x-ratelimit-remaining-tokens"])
    assert 100 - (prompt + 50) - 1 <= left <= 100 - (prompt + 50) + 1  # + what refilled meanwhile
    with pytest.raises(openai.RateLimitError) as e:
        client.chat.completions.create(max_tokens=50, **CHAT)
    assert e.value.code == "rate_limit_exceeded" and "tokens per minute" in e.value.message
    assert int(e.value.response.headers["Retry-After"]) >= 1
    assert e.value.response.headers["x-ratelimit-limit-tokens"] == "100"
    r = httpx.post(gw.url + "/v1/chat/completions", headers=auth("sk-tpm"), json={**CHAT, "max_tokens": 500})
    assert "Request too large" in _err(r, 429, "rate_limit_exceeded")["message"]


def test_rate_limit_is_shared_by_gateways(gateway):
    a = gateway(api_keys=["sk-shared"], rpm=2)
    b = gateway(api_keys=["sk-shared"], rpm=2)
    assert httpx.get(a.url + "/v1/models", headers=auth("sk-shared")).status_code == 200
    assert httpx.get(b.url + "/v1/models", headers=auth("sk-shared")).status_code == 200
    _err(httpx.get(a.url + "/v1/models", headers=auth("sk-shared")), 429, "rate_limit_exceeded")


def test_open_gateway_limits_all_traffic_as_one_client(gateway):
    gw = gateway(rpm=1)
    assert httpx.get(gw.url + "/v1/models").status_code == 200
    _err(httpx.get(gw.url + "/v1/models"), 429, "rate_limit_exceeded")


def test_bucket_refills_over_time(redis_url):  # noqa: F811
    key = f"refill-{uuid.uuid4().hex[:8]}"

    async def go():
        client = aioredis.Redis.from_url(redis_url)
        try:
            lim = RateLimiter(client, rpm=120, tpm=6000)  # 2 requests, 100 tokens a second
            first = await lim.admit(key, 120, 6000)
            assert first.allowed and first.requests_left == 0 and first.tokens_left == 0
            assert first.headers()["x-ratelimit-reset-requests"] == "1m0s"
            denied = await lim.admit(key, 1, 0)
            assert not denied.allowed and 0.4 <= denied.wait_s <= 0.5
            t0 = time.monotonic()
            await asyncio.to_thread(pace, 0.6)  # the buckets refill for 0.6 s: the time is the subject
            again = await lim.admit(key, 1, 50)
            dt = time.monotonic() - t0
            assert again.allowed
            assert again.requests_left == pytest.approx(2 * dt - 1, abs=0.1)
            assert again.tokens_left == pytest.approx(100 * dt - 50, abs=5)
        finally:
            await client.aclose()
    asyncio.run(go())


@pytest.mark.parametrize("s,text", [(0, "0s"), (0.02, "20ms"), (1.5, "1.5s"), (360, "6m0s"), (61.4, "1m1s")])
def test_duration_format(s, text):
    assert duration(s) == text


# ---- bounds -----------------------------------------------------------------------------------
def test_bounds_are_400_naming_the_parameter(gateway):
    lim = Limits(max_prompt_chars=200, max_messages=3, max_stop=2, max_stop_chars=8, max_stop_token_ids=4,
                 max_tokens_cap=64, max_session_chars=16)
    gw = gateway(limits=lim, max_prompt_tokens=50)
    user = {"role": "user", "content": "hi"}
    cases = [
        ("/v1/chat/completions", {**CHAT, "max_tokens": 65}, "max_tokens"),
        ("/v1/chat/completions", {**CHAT, "max_completion_tokens": 1000}, "max_completion_tokens"),
        ("/v1/chat/completions", {**CHAT, "messages": [user] * 4}, "messages"),
        ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "x" * 201}]}, "messages"),
        ("/v1/chat/completions", {**CHAT, "stop": ["a", "b", "c"]}, "stop"),
        ("/v1/chat/completions", {**CHAT, "stop": "123456789"}, "stop"),
        ("/v1/chat/completions", {**CHAT, "stop_token_ids": [1, 2, 3, 4, 5]}, "stop_token_ids"),
        ("/v1/chat/completions", {**CHAT, "user": "u" * 17}, "user"),
        ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "word " * 39}]},
         "messages"),  # 195 characters, 70 tokens
        ("/v1/completions", {"model": CHAT["model"], "prompt": "y" * 201}, "prompt"),
        ("/v1/completions", {"model": CHAT["model"], "prompt": list(range(51))}, "prompt"),
        ("/v1/completions", {"model": CHAT["model"], "prompt": "ok", "max_tokens": 100}, "max_tokens"),
    ]
    for path, body, param in cases:
        _err(httpx.post(gw.url + path, json=body), 400, param=param)
    r = httpx.post(gw.url + "/v1/chat/completions", json={**CHAT, "max_tokens": 64, "stop": ["12345678"],
                                                          "messages": [user] * 3, "user": "u" * 16})
    assert r.status_code == 200, r.text


def test_max_tokens_cap_bounds_the_default(gateway, backend):
    gw = gateway(limits=Limits(max_tokens_cap=48))
    assert httpx.post(gw.url + "/v1/chat/completions", json=CHAT).status_code == 200
    assert backend.last_submit().params.max_tokens == 48
