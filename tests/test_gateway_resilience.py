"""The gateway's part of resilience: a broken token stream or a Redis outage never leaves a client hanging.

Each test gets its own redis-server (``service.launch.EmbeddedRedis``, AOF on) and a real gateway; the
test plays scheduler + worker by hand (:class:`Peer`): it reads the Submit/Cancel records on
``mfs:req`` and XADDs TokenEvents to ``mfs:out:{gateway}``. A Redis restart is ``stop()`` then
``start()`` on the same port and data directory.
"""
from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from concurrent.futures import ThreadPoolExecutor

import httpx2 as httpx
import pytest
import redis

from core import protocol as P
from gateway.config import GatewayConfig
from service.launch import EmbeddedRedis
from tests.support.gateway import CHAT, ServerThread, _err, register_worker
from tests.support.wait import pace, wait_for

pytestmark = pytest.mark.timeout(40)  # each test; a hang is a failure, never a stuck run

STALL_S = 1.5
WORDS = " one two three four five six seven eight"


class Peer:
    """The scheduler + worker, by hand."""

    def __init__(self, url: str):
        self.r = redis.Redis.from_url(url, socket_timeout=5)
        self.last = "0-0"
        self.submits: list[P.Submit] = []
        self.cancels: dict[str, str] = {}

    def read(self, block_ms: int = 100) -> None:
        for _, entries in self.r.xread({P.REQ_STREAM: self.last}, block=block_ms) or ():
            for self.last, fields in entries:
                rec = P.decode(fields)
                if isinstance(rec, P.Submit):
                    self.submits.append(rec)
                elif isinstance(rec, P.Cancel):
                    self.cancels[rec.request_id] = rec.reason

    def until(self, pred, timeout: float, what: str):
        """Reads mfs:req until pred() holds; a read while Redis is down (this test stopped it) is "not yet"."""
        return wait_for(lambda: pred() or (self.read() or pred()), timeout, what, poll=0)

    def next_submit(self, timeout: float = 10.0) -> P.Submit:
        n = len(self.submits)
        self.until(lambda: len(self.submits) > n, timeout, "a Submit on mfs:req")
        return self.submits[n]

    def wait_cancel(self, request_id: str, timeout: float = 10.0) -> str:
        return self.until(lambda: self.cancels.get(request_id), timeout, f"a Cancel of {request_id}")

    def send(self, sub: P.Submit, seq: int, ids: list[int], finish: str | None = None) -> None:
        ev = P.TokenEvent(sub.request_id, seq, ids, finish is not None, finish, tier=sub.tier, worker="w0",
                          prompt_tokens=len(sub.prompt_ids))
        self.r.xadd(P.out_stream(sub.gateway_id), ev.encode())


@pytest.fixture
def srv(tmp_path):
    s = EmbeddedRedis(data_dir=str(tmp_path / "redis")).start()
    yield s
    s.stop()


@pytest.fixture
def peer(srv):
    p = Peer(srv.url)
    register_worker(p.r)
    yield p
    p.r.close()


@pytest.fixture
def gw(srv, frontend, peer):
    with ServerThread(GatewayConfig(redis_url=srv.url, frontend=frontend, stall_timeout_s=STALL_S)) as s:
        yield s


@pytest.fixture
def ids(frontend):
    return frontend.tokenizer.encode(WORDS, add_special_tokens=False)


@pytest.fixture
def pool():
    with ThreadPoolExecutor(4) as ex:
        yield ex


def completion(stream: bool = False, max_tokens: int = 20) -> dict:
    return {"model": "smollm2-135m-small", "prompt": "count", "max_tokens": max_tokens, "stream": stream}


def post(gw, body: dict, path: str = "/v1/completions", timeout: float = 30) -> httpx.Response:
    return httpx.post(gw.url + path, json=body, timeout=timeout)


@dataclass
class Streamed:
    status_code: int
    text: str


def post_stream(gw, body: dict, began: threading.Event, path: str = "/v1/completions") -> Streamed:
    """A streamed request read as it comes: ``began`` is set once its first data line has arrived."""
    text = ""
    with httpx.stream("POST", gw.url + path, json=body, timeout=30) as r:
        for chunk in r.iter_text():
            text += chunk
            if "data: " in text:
                began.set()
    return Streamed(r.status_code, text)


def sse(r: httpx.Response) -> list:
    """The data lines of an SSE body: parsed JSON, or the string "[DONE]"."""
    out = [ln[6:] for ln in r.text.split("\n\n") if ln.startswith("data: ")]
    return [x if x == "[DONE]" else json.loads(x) for x in out]


def metric(gw, line: str) -> float:
    for ln in httpx.get(gw.url + "/metrics").text.splitlines():
        if ln.startswith(line + " "):
            return float(ln.rsplit(" ", 1)[1])
    raise AssertionError(f"{line} not in /metrics")


def restart(srv: EmbeddedRedis, down_s: float = 0.3) -> None:
    srv.stop()
    pace(down_s)  # the outage's length
    srv.start()


# ---- (a) lost tokens --------------------------------------------------------------------------
def test_sequence_gap_fails_cleanly_and_cancels(gw, peer, ids, pool, frontend):
    # non-streaming: 503 in OpenAI's shape, retryable
    fut = pool.submit(post, gw, completion())
    sub = peer.next_submit()
    peer.send(sub, 0, ids[:2])
    peer.send(sub, 1, ids[1:2])  # a duplicate: dropped silently, as before
    peer.send(sub, 4, ids[4:6])  # tokens 2 and 3 never came
    r = fut.result(15)
    err = _err(r, 503, "stream_interrupted")
    assert err["type"] == "service_unavailable" and "retry" in err["message"]
    assert "expected token 2, got 4" in err["message"]
    assert int(r.headers["Retry-After"]) >= 1
    assert peer.wait_cancel(sub.request_id) == "stream_interrupted"

    # streaming, after the 200 went out: an error event, then [DONE]
    fut = pool.submit(post, gw, {**CHAT, "stream": True, "max_tokens": 20}, "/v1/chat/completions")
    sub = peer.next_submit()
    peer.send(sub, 0, ids[:2])
    peer.send(sub, 3, ids[3:5])
    r = fut.result(15)
    assert r.status_code == 200
    data = sse(r)
    assert data[-1] == "[DONE]"
    assert data[-2]["error"]["code"] == "stream_interrupted"
    assert set(data[-2]["error"]) == {"message", "type", "param", "code"}
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in data[:-2])
    assert text == frontend.tokenizer.decode(ids[:2])  # what came before the hole
    assert not any(c["choices"][0].get("finish_reason") for c in data[:-2])
    assert peer.wait_cancel(sub.request_id) == "stream_interrupted"
    assert metric(gw, 'mfs_requests_interrupted_total{reason="gap"}') == 2


# ---- (b) Redis restarts under requests in flight ----------------------------------------------
def test_redis_restart_in_flight_requests_complete_or_fail_retryable(gw, peer, srv, ids, pool, frontend):
    fa = pool.submit(post, gw, completion())                 # gets the rest of its tokens: completes
    a = peer.next_submit()
    b_began = threading.Event()
    fb = pool.submit(post_stream, gw, completion(stream=True), b_began)  # stream: nothing more comes
    b = peer.next_submit()
    fc = pool.submit(post, gw, completion())                 # nothing more comes
    c = peer.next_submit()
    for sub in (a, c, b):
        peer.send(sub, 0, ids[:2])
    # the gateway has read them: b has answered 200 and sent its first chunk (b's tokens came last)
    wait_for(b_began.is_set, 10, "the stream's first chunk at its client")
    restart(srv)
    t_back = time.monotonic()
    peer.send(a, 2, ids[2:], finish="length")
    ra = fa.result(15)
    assert ra.status_code == 200, ra.text
    assert ra.json()["choices"][0]["text"] == WORDS
    assert ra.json()["usage"]["completion_tokens"] == len(ids)

    rc = fc.result(15)
    waited = time.monotonic() - t_back
    err = _err(rc, 503, "redis_interrupted")
    assert "retry" in err["message"] and rc.headers["Retry-After"]
    assert STALL_S - 0.5 <= waited <= STALL_S + 6, waited  # the grace period, not the 600 s deadline
    rb = fb.result(15)
    assert rb.status_code == 200
    data = sse(rb)
    assert data[-1] == "[DONE]" and data[-2]["error"]["code"] == "redis_interrupted"
    assert "".join(d["choices"][0]["text"] for d in data[:-2]) == frontend.tokenizer.decode(ids[:2])
    for sub in (b, c):
        assert peer.wait_cancel(sub.request_id) == "redis_interrupted"
    assert a.request_id not in peer.cancels
    assert metric(gw, 'mfs_requests_interrupted_total{reason="redis"}') == 2
    assert metric(gw, "mfs_redis_outages_total") >= 1
    assert metric(gw, "mfs_redis_up") == 1


# ---- (c) while Redis is down, and after ---------------------------------------------------------
def test_redis_down_health_and_new_requests_then_recovery(gw, peer, srv, ids, pool):
    assert httpx.get(gw.url + "/health").status_code == 200
    fd = pool.submit(post, gw, completion())  # in flight through a long outage: fails while it lasts
    d = peer.next_submit()
    srv.stop()
    t_down = time.monotonic()

    h = httpx.get(gw.url + "/health", timeout=10)
    assert h.status_code == 503 and "redis" in h.json()["error"]
    t0 = time.monotonic()
    r = post(gw, completion(), timeout=10)
    assert time.monotonic() - t0 < 3  # refused at once, no hang
    err = _err(r, 503, "backend_unavailable")
    assert "Redis" in err["message"] and int(r.headers["Retry-After"]) >= 1
    r = post(gw, {**CHAT, "stream": True}, "/v1/chat/completions", timeout=10)
    _err(r, 503, "backend_unavailable")

    rd = fd.result(15)  # Redis still down: the grace period runs from the outage's start
    _err(rd, 503, "redis_interrupted")
    assert time.monotonic() - t_down <= STALL_S + 6
    pace(0.2)  # the outage lasts a little longer
    srv.start()

    h = wait_for(lambda: (got := httpx.get(gw.url + "/health", timeout=10)).status_code == 200 and [got], 10,
                 "/health to recover by itself", poll=0.1)[0]
    assert h.json()["status"] == "ok"
    # the Cancel that could not be written while Redis was down is written now
    assert peer.wait_cancel(d.request_id) == "redis_interrupted"

    fe = pool.submit(post, gw, completion())
    e = peer.next_submit()
    peer.send(e, 0, ids[:3])
    peer.send(e, 3, ids[3:], finish="length")
    re_ = fe.result(15)
    assert re_.status_code == 200 and re_.json()["choices"][0]["text"] == WORDS
    # nothing stayed registered: the refused requests left no queue behind
    wait_for(lambda: not json.loads(peer.r.get(P.gateway_key(gw.cfg.gateway_id)))["waiting"], 5,  # the next
             "no request registered at the gateway")                                           # heartbeat says so
    assert metric(gw, "mfs_inflight_requests") == 0
    assert metric(gw, "mfs_redis_up") == 1
    assert metric(gw, 'mfs_requests_interrupted_total{reason="redis"}') == 1


# ---- the bookkeeping, without a network ---------------------------------------------------------
def test_backoff_and_suspect_bookkeeping(monkeypatch):
    import asyncio

    from gateway import backend as B
    from gateway.__main__ import parse_args
    from gateway.metrics import Metrics

    b = B.Backoff()
    assert [b.next() for _ in range(7)] == [0.1, 0.2, 0.4, 0.8, 1.6, 2.0, 2.0]
    b.reset()
    assert b.next() == 0.1
    assert parse_args([]).stall_timeout_s == 15.0 and parse_args(["--stall-timeout", "4"]).stall_timeout_s == 4

    now = [100.0]
    monkeypatch.setattr(B.time, "monotonic", lambda: now[0])
    m = Metrics()
    be = B.Backend(None, "gw-x", stall_timeout_s=5, metrics=m)
    be._queues.update(a=asyncio.Queue(), b=asyncio.Queue())
    be._redis_failed("reader", redis.ConnectionError("gone"))
    be._redis_failed("heartbeat", redis.ConnectionError("gone"))  # one outage, logged once
    assert be.redis_down and be.outages == 1 and set(be._suspect) == {"a", "b"}
    now[0] = 104.0
    be._redis_ok("reader")  # back after 4 s: the grace period starts again
    assert not be.redis_down
    now[0] = 108.0
    assert not be.stalled("a")
    be._route(P.TokenEvent("a", 0, [1]).encode())  # an event: its stream is alive
    now[0] = 109.5
    assert not be.stalled("a") and be.stalled("b")
    be.release("b")
    assert not be.stalled("b") and not be._suspect
    # a restart the client rode over without an error: noticed by the server's run_id
    be._check_run_id("r1")
    be._check_run_id("r1")
    assert not be._suspect
    be._check_run_id("r2")
    assert set(be._suspect) == {"a"} and be.outages == 2
    be._redis_failed("reader", redis.ConnectionError("gone"))
    be._redis_ok("reader")
    be._check_run_id("r3")  # the outage was this restart: counted once
    assert be.outages == 3
    text = m.render().decode()
    assert "mfs_redis_up 1.0" in text and "mfs_redis_outages_total 3.0" in text
