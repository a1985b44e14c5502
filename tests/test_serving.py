"""The serving layer driven without HTTP: a typed request -> ``Service.job`` -> ``Service.generation``
-> pieces, against a real Redis with the test playing scheduler + worker (tests/test_gateway.py's
FakeBackend). What the views would read from the HTTP request arrives as plain values."""
from __future__ import annotations

import asyncio

import pytest
import redis.asyncio as aioredis

from gateway.backend import Backend, stop_tasks
from gateway.complexity import ComplexityConfig
from gateway.metrics import Metrics
from gateway.openai_api import parse_chat
from gateway.generation import ClientGone
from gateway.serving import Service
from tests.support.redis_server import redis_url  # noqa: F401 - the session fixture
from tests.support.gateway import PARIS, backend, rds, register_worker  # noqa: F401 - fixtures

CHAT = {"model": "smollm2-135m-medium", "messages": [{"role": "user", "content": "Capital of France?"}],
        "max_tokens": 40, "n": 2, "session_id": "from-the-body"}


async def _served(url: str, frontend, body: dict, **generation) -> tuple[Service, list, list[list]]:
    """Serves ``body`` to the end (or the first error) on a fresh Service; returns it, the Generations and
    each choice's pieces."""
    client = aioredis.Redis.from_url(url)
    svc = Service(frontend, Metrics(), complexity_cfg=ComplexityConfig(), gateway_id="gw-serving")
    svc.backend = Backend(client, "gw-serving", block_ms=100, metrics=svc.metrics)
    reader = asyncio.create_task(svc.backend.run_reader())
    pieces: list[list] = []
    try:
        async with svc.job(parse_chat(body)) as job:
            assert svc.inflight == 1
            assert job.charged_tokens == len(job.prompt_ids) + job.params.n * 40
            async with svc.generation(job, **generation) as gens:
                for gen in gens:
                    pieces.append([p async for p in gen.pieces()])
        return svc, gens, pieces
    finally:
        assert not await stop_tasks([reader])
        await client.aclose()


def test_service_serves_without_a_request_object(redis_url, frontend, backend, rds):  # noqa: F811
    register_worker(rds)
    backend.script = backend.reply(PARIS)
    svc, gens, pieces = asyncio.run(_served(redis_url, frontend, CHAT, session_id="from-the-header"))
    assert ["".join(p.text for p in ps) for ps in pieces] == [PARIS, PARIS]
    assert [ps[-1].finish for ps in pieces] == ["stop", "stop"]
    assert svc.inflight == 0
    subs = [backend.submits[g.rid] for g in gens]
    assert [s.session_id for s in subs] == ["from-the-header"] * 2  # the caller's value beats the body's
    assert subs[1].follow == gens[0].rid and subs[1].params.seed is None


def test_session_id_falls_back_to_the_body(redis_url, frontend, backend, rds):  # noqa: F811
    register_worker(rds)
    backend.script = backend.reply(PARIS)
    _, gens, _ = asyncio.run(_served(redis_url, frontend, CHAT))
    assert backend.submits[gens[0].rid].session_id == "from-the-body"


def test_a_gone_client_cancels_the_request(redis_url, frontend, backend, rds):  # noqa: F811
    register_worker(rds)
    backend.script = backend.endless()
    seen = len(backend.submits)
    with pytest.raises(ClientGone):
        asyncio.run(_served(redis_url, frontend, dict(CHAT, n=1, max_tokens=40), client_gone=lambda: True))
    rid = backend.submit_after(seen).request_id  # the Submit may not have been read yet: the client left at once
    assert backend.wait_cancel(rid) == "disconnect"
