"""The gateway under test and what plays its backend: a gateway app on a thread (ServerThread), a fake
scheduler + worker answering over a real Redis (FakeBackend), their fixtures, and the error check of
an OpenAI-shaped answer. The fixtures need a ``redis_url`` (tests.support.redis_server) and, for the
backend, ``frontend`` (tests/conftest.py) where they are used."""
from __future__ import annotations

import asyncio
import threading

import httpx2 as httpx  # what openai 3.x ships (the httpx API)
import openai
import pytest
import redis
import uvloop
from aiohttp import web

from core import protocol as P
from gateway.app import init_app
from gateway.config import GatewayConfig
from tests.support.wait import pace, wait_for

MAX_LEN = 4096
PARIS = "The capital of France is Paris."


class ServerThread:
    """One gateway app on its own (uvloop) event loop in a thread, on a free port."""

    def __init__(self, cfg: GatewayConfig):
        self.cfg, self.port = cfg, None
        self.ready = threading.Event()
        self.loop = uvloop.new_event_loop()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        asyncio.set_event_loop(self.loop)
        runner = web.AppRunner(init_app(self.cfg), handler_cancellation=True, access_log=None)
        self.loop.run_until_complete(runner.setup())
        self.loop.run_until_complete(web.TCPSite(runner, "127.0.0.1", 0).start())
        self.port = runner.addresses[0][1]
        self.ready.set()
        self.loop.run_forever()
        self.loop.run_until_complete(runner.cleanup())
        self.loop.close()

    def __enter__(self):
        self.thread.start()
        assert self.ready.wait(30), "gateway did not start"
        return self

    def __exit__(self, *exc):
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(15)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def client(self, **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="x", max_retries=0, **kw)


class FakeBackend(threading.Thread):
    """Plays scheduler + worker: every Submit is answered by ``self.script(submit)``."""

    def __init__(self, url: str, tokenizer):
        super().__init__(daemon=True)
        self.r = redis.Redis.from_url(url)
        self.tok = tokenizer
        self.submits: dict[str, P.Submit] = {}
        self.cancels: dict[str, str] = {}
        self.halt = threading.Event()
        self.script = self.reply(PARIS)

    def run(self):
        last = self.r.xrevrange(P.REQ_STREAM, count=1)
        last_id = last[0][0] if last else "0-0"
        while not self.halt.is_set():
            for _, entries in self.r.xread({P.REQ_STREAM: last_id}, block=50) or ():
                for last_id, fields in entries:
                    rec = P.decode(fields)
                    if isinstance(rec, P.Cancel):
                        self.cancels[rec.request_id] = rec.reason
                    elif isinstance(rec, P.Submit):
                        self.submits[rec.request_id] = rec
                        threading.Thread(target=self._play, args=(rec, self.script), daemon=True).start()

    def _play(self, sub: P.Submit, script):
        for delay, ev in script(sub):
            pace(delay)  # the scripted peer's own rhythm
            if sub.request_id in self.cancels or self.halt.is_set():
                return
            try:
                self.r.xadd(P.out_stream(sub.gateway_id), ev.encode())
            except redis.RedisError:
                return  # the session is over

    def last_submit(self) -> P.Submit:
        return list(self.submits.values())[-1]

    def submit_after(self, seen: int, timeout: float = 5.0) -> P.Submit:
        """The first Submit read after the ``seen`` this backend had already read: a test that counted
        ``len(backend.submits)`` before its request cannot pick up an earlier test's Submit when its own
        has not been read yet (the session-scoped backend reads on its own thread)."""
        wait_for(lambda: len(self.submits) > seen, timeout, f"a Submit after the first {seen}", poll=0.01)
        return list(self.submits.values())[seen]

    def wait_cancel(self, request_id: str, timeout: float = 5.0) -> str:
        """The reason of the request's Cancel, once the backend has read it."""
        return wait_for(lambda: self.cancels.get(request_id), timeout, f"a Cancel of {request_id}", poll=0.02)

    # scripts: submit -> [(delay_s, TokenEvent)]
    def reply(self, text, chunk: int = 2, delay: float = 0.0, duplicate: bool = True):
        """``text``: a string, or a function of the Submit that returns one."""
        def script(sub: P.Submit):
            ids = self.tok.encode(text(sub) if callable(text) else text, add_special_tokens=False)
            toks = ids + ([] if sub.params.ignore_eos else [self.tok.eos_token_id])
            finish = "stop"
            if len(toks) >= sub.params.max_tokens:
                toks, finish = toks[:sub.params.max_tokens], "length"
            out = []
            for s in range(0, len(toks), chunk):
                last = s + chunk >= len(toks)
                ev = P.TokenEvent(sub.request_id, s, toks[s:s + chunk], last, finish if last else None,
                                  tier=sub.tier, worker="w0", prompt_tokens=len(sub.prompt_ids),
                                  logprobs=fake_logprobs(toks[s:s + chunk], sub.params.logprobs),
                                  prompt_logprobs=fake_logprobs(sub.prompt_ids[1:], sub.params.prompt_logprobs)
                                  if s == 0 else [])
                out.append((delay, ev))
                if duplicate and not last:
                    out.append((0.0, ev))  # at-least-once delivery: the gateway drops it by seq
            return out
        return script

    def endless(self, delay: float = 0.05):
        def script(sub: P.Submit):
            return [(delay, P.TokenEvent(sub.request_id, i, [self.tok.encode(" la")[0]], tier=sub.tier))
                    for i in range(400)]
        return script

    def error(self, status: int, code: str, message: str, after_tokens: int = 0):
        def script(sub: P.Submit):
            out = [(0.0, P.TokenEvent(sub.request_id, i, self.tok.encode(" ok")[:1], tier=sub.tier))
                   for i in range(after_tokens)]
            out.append((0.05, P.TokenEvent(sub.request_id, after_tokens, [], True, "error", tier=sub.tier,
                                           error=message, error_code=code, status=status)))
            return out
        return script


def fake_logprobs(tokens: list[int], k: int | None) -> list[P.TokenLogprob]:
    """What a worker sends for `tokens` when the request asked for k alternatives (None: nothing); the
    values are made up (each token the most likely, at -0.5)."""
    if k is None:
        return []
    return [P.TokenLogprob(t, -0.5, ([t] + [3 + i for i in range(k)])[:k], [-0.5 - i for i in range(k)])
            for t in tokens]


def register_worker(r: redis.Redis, worker: str = "w0", max_len: int = MAX_LEN) -> None:
    r.hset(P.worker_key(worker), mapping={"max_model_len": str(max_len), "tiers": "3"})
    r.expire(P.worker_key(worker), 120)
    r.sadd(P.WORKERS_SET, worker)


@pytest.fixture(scope="module")
def rds_worker(redis_url):  # noqa: F811
    """A client of this module's Redis with a live worker registered."""
    r = redis.Redis.from_url(redis_url)
    register_worker(r)
    yield r
    r.close()


@pytest.fixture(scope="session")
def rds(redis_url):  # noqa: F811
    r = redis.Redis.from_url(redis_url)
    yield r
    r.close()


@pytest.fixture(scope="session")
def backend(redis_url, frontend):  # noqa: F811
    fb = FakeBackend(redis_url, frontend.tokenizer)
    fb.start()
    yield fb
    fb.halt.set()
    fb.join(5)
    fb.r.close()


def _err(resp: httpx.Response, status: int, code: str | None = None, param: str | None = None) -> dict:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    if code is not None:
        assert err["code"] == code
    if param is not None:
        assert err["param"] == param
    return err


CHAT = {"model": "smollm2-135m-small", "messages": [{"role": "user", "content": "hi"}]}
