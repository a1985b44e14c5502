"""Thin HTTP views: body -> typed request (openai_api) -> Job (serving) -> admission (auth) -> Generations
(generation) -> JSON or SSE. Everything that reads the HTTP request is here; the serving layer gets plain values."""
from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from aiohttp import web
from redis.exceptions import RedisError

from gateway import openai_api as api
from gateway import openapi, responses, status
from gateway.auth import admit
from gateway.errors import APIError, invalid, model_not_found
from gateway.generation import ClientGone, Generation, Piece
from gateway.keys import CONFIG, HISTORY, KEYS, SERVICE


async def read_json(request: web.Request):
    raw = await request.read()  # raises 413 past client_max_size
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
        raise invalid(f"The body is not valid JSON: {e}") from None


async def list_models(request: web.Request) -> web.Response:
    return web.json_response(responses.models_list(request.app[SERVICE].model_ids))


async def get_model(request: web.Request) -> web.Response:
    svc, name = request.app[SERVICE], request.match_info["model"]
    if name not in svc.model_ids:
        raise model_not_found(name, svc.model_ids)
    return web.json_response(responses.models_list([name])["data"][0])


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _serve(request, api.parse_chat(await read_json(request), request.app[CONFIG].limits))


async def completions(request: web.Request) -> web.StreamResponse:
    return await _serve(request, api.parse_completion(await read_json(request), request.app[CONFIG].limits))


async def health(request: web.Request) -> web.Response:
    svc = request.app[SERVICE]
    try:
        n = len(await svc.backend.live_workers())
    except RedisError as e:
        return web.json_response({"status": "error", "workers": 0, "error": f"redis: {e}"}, status=503)
    svc.metrics.live_workers.set(n)
    return web.json_response({"status": "ok" if n else "no_workers", "workers": n,
                              "gateway_id": request.app[CONFIG].gateway_id}, status=200 if n else 503)


async def _refresh_scheduler(svc) -> None:
    """The scheduler gauges from ``mfs:stats``, before ``/metrics`` or ``/status.json`` reads them."""
    try:
        svc.metrics.refresh_scheduler(await svc.backend.scheduler_stats(), svc.tier_names)
    except RedisError:
        pass  # the request metrics are still worth a scrape


async def metrics(request: web.Request) -> web.Response:
    svc = request.app[SERVICE]
    await _refresh_scheduler(svc)
    return web.Response(body=svc.metrics.render(), content_type="text/plain",
                        headers={"X-Content-Type-Options": "nosniff"})


async def status_page(request: web.Request) -> web.FileResponse:
    """The live status page: static HTML whose script polls ``/status.json`` every second."""
    return web.FileResponse(status.PAGE, headers={"Cache-Control": "no-cache"})


async def status_json(request: web.Request) -> web.Response:
    """The status page's numbers: the registry ``/metrics`` renders, plus workers and leaders."""
    svc = request.app[SERVICE]
    await _refresh_scheduler(svc)
    try:
        workers = await svc.backend.live_workers()
        beats = await svc.backend.worker_heartbeats([w.worker_id for w in workers])
        shards = await svc.backend.shard_stats()
        svc.metrics.live_workers.set(len(workers))
    except RedisError:
        workers, beats, shards = [], {}, {}  # redis_up says why
    doc = status.snapshot(svc.metrics.registry, tier_names=svc.tier_names, tier_ids=svc.tier_ids,
                          gateway_id=request.app[CONFIG].gateway_id, workers=workers, heartbeats=beats,
                          shards=shards, now=time.time())
    doc["history"] = request.app[HISTORY].series()
    return web.json_response(doc, headers={"Cache-Control": "no-store"})


async def openapi_json(request: web.Request) -> web.Response:
    """This gateway's OpenAPI 3.1 description (its models, bounds and ``mfs`` defaults), built on each
    call: it is cheap, and always current."""
    app = request.app
    return web.json_response(openapi.build(app[SERVICE], app[CONFIG], auth=app[KEYS].enabled))


# ---- completions ----------------------------------------------------------------------------
@asynccontextmanager
async def _generation(request: web.Request, req) -> AsyncIterator[list[Generation]]:
    """The request's choices, submitted once the caller's token rate limit admits the prepared job."""
    svc = request.app[SERVICE]
    async with svc.job(req) as job:
        await admit(request, tokens=job.charged_tokens)
        async with svc.generation(job, session_id=request.headers.get("X-Session-ID"),
                                  client_gone=lambda: _closed(request)) as gens:
            yield gens


def _closed(request: web.Request) -> bool:
    t = request.transport
    return t is None or t.is_closing()


async def _serve(request: web.Request, req) -> web.StreamResponse:
    async with _generation(request, req) as gens:
        if req.params.stream:
            return await _stream(request, gens)
        texts: list[list[str]] = [[] for _ in gens]
        lps: list[list[responses.TokenInfo]] = [[] for _ in gens]
        finish: list[str | None] = [None] * len(gens)
        async for i, piece in _merged(gens):
            texts[i].append(piece.text)
            lps[i] += piece.logprobs
            finish[i] = piece.finish
        job = gens[0].job
        if job.prompt_text is not None:  # echo: every choice repeats the prompt, scored once (choice 0)
            echoed = gens[0].echo_infos()
            for i in range(len(gens)):
                texts[i].insert(0, job.prompt_text)
                lps[i] = echoed + lps[i]
        choices = [responses.Choice(i, "".join(texts[i]), finish[i], _logprobs(job, lps[i])) for i in range(len(gens))]
        return web.json_response(_final(gens, choices))


async def _merged(gens: list[Generation]) -> AsyncIterator[tuple[int, Piece]]:
    """(choice index, piece) as each choice's pieces come, until every choice has finished; an error of
    any choice ends it (the caller closes them all)."""
    if len(gens) == 1:
        async for piece in gens[0].pieces():
            yield 0, piece
        return
    q: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, gen: Generation) -> None:
        try:
            async for piece in gen.pieces():
                q.put_nowait((i, piece))
        except Exception as e:  # noqa: BLE001 - handed to the consumer, which raises it
            q.put_nowait((i, e))

    tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(gens)]
    try:
        left = len(gens)
        while left:
            i, item = await q.get()
            if isinstance(item, BaseException):
                raise item
            yield i, item
            left -= item.finish is not None
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


def _usage(gens: list[Generation]) -> dict:
    """The prompt once (its KV computed once: choice 0's cached tokens), every choice's completion."""
    g0 = gens[0]
    proposed = sum(g.draft_proposed for g in gens)
    d = g0.job.spec_draft
    draft = (g0.svc.tier_ids[d] if d is not None else None, proposed, sum(g.draft_accepted for g in gens))
    return responses.usage(g0.prompt_tokens, sum(g.completion_tokens for g in gens), g0.cached_tokens,
                     draft if proposed else None)


def _model(gens: list[Generation]) -> str:
    """The response's `model`: the tier of the last token (the highest over the choices)."""
    return max(gens, key=lambda g: g.tier).model


def _served(gens: list[Generation]) -> dict:
    return responses.served(list(dict.fromkeys(m for g in gens for m in g.served_by)),
                            list(dict.fromkeys(p for g in gens for p in g.paths)))


def _logprobs(job, items: list[responses.TokenInfo], offset: int = 0) -> dict | None:
    """A choice's ``logprobs`` object (None when the request did not ask)."""
    if job.params.logprobs is None:
        return None
    return responses.chat_logprobs(items) if job.kind == "chat" else responses.completion_logprobs(items, offset)


def _final(gens: list[Generation], choices: list[responses.Choice]) -> dict:
    j = gens[0].job
    build = responses.chat_response if j.kind == "chat" else responses.completion_response
    out = build(j.request_id, _model(gens), j.created, choices, _usage(gens))
    out["mfs"] = _served(gens)
    return out


def _chunk(gens: list[Generation], index: int, text: str | None, finish: str | None, role: bool = False,
           lps: list[responses.TokenInfo] | None = None, offset: int = 0) -> dict:
    j, incl, model = gens[0].job, gens[0].job.params.include_usage, _model(gens)
    lp = None if role else _logprobs(j, lps or [], offset)
    if j.kind == "completion":
        c = responses.completion_chunk(j.request_id, model, j.created, text or "", finish, incl, lp, index)
    else:
        delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
        c = responses.chat_chunk(j.request_id, model, j.created, delta, finish, incl, lp, index)
    if finish:
        c["mfs"] = _served(gens)
    return c


def _sse(obj) -> bytes:
    return b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n\n"


async def _stream(request: web.Request, gens: list[Generation]) -> web.StreamResponse:
    job = gens[0].job
    pieces = _merged(gens)
    # Wait for the first piece before committing to 200: an immediate error keeps its real status.
    first = await anext(pieces)
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                       "X-Accel-Buffering": "no", "X-Request-Id": job.request_id})
    await resp.prepare(request)
    try:
        if job.kind == "chat":
            for i in range(len(gens)):
                await resp.write(_sse(_chunk(gens, i, None, None, role=True)))
        offset = [0] * len(gens)  # completions' text_offset per choice, as the non-streamed answer counts it
        if job.prompt_text is not None:  # echo: the prompt first (its logprobs came with the first token)
            echoed = gens[0].echo_infos()
            for i in range(len(gens)):
                await resp.write(_sse(_chunk(gens, i, job.prompt_text, None, lps=echoed)))
                offset[i] = sum(len(t.text) for t in echoed)
        i, piece = first
        while True:
            if piece.text or piece.finish or piece.logprobs:
                await resp.write(_sse(_chunk(gens, i, piece.text, piece.finish, lps=piece.logprobs,
                                             offset=offset[i])))
                offset[i] += sum(len(t.text) for t in piece.logprobs)
            try:
                i, piece = await anext(pieces)
            except StopAsyncIteration:
                break
        if job.params.include_usage:
            obj = "chat.completion.chunk" if job.kind == "chat" else "text_completion"
            chunk = responses.usage_chunk(job.request_id, _model(gens), job.created, obj, _usage(gens))
            chunk["mfs"] = _served(gens)
            await resp.write(_sse(chunk))
        await resp.write(_sse(b"[DONE]"))
    except APIError as e:  # mid-stream: the status is sent already; say it in the stream
        request.app[SERVICE].metrics.errors.labels(str(e.status)).inc()
        await _write_quietly(resp, _sse(e.body()) + _sse(b"[DONE]"))
    except (ConnectionResetError, ClientGone):
        for gen in gens:
            gen.cancel_reason = "disconnect"
    finally:
        await pieces.aclose()
    return resp


async def _write_quietly(resp: web.StreamResponse, data: bytes) -> None:
    try:
        await resp.write(data)
    except ConnectionResetError:
        pass
