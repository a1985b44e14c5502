"""Thin HTTP views: body -> typed request (openai_api) -> Generation (serving) -> JSON or SSE."""
from __future__ import annotations

import json

from aiohttp import web
from redis.exceptions import RedisError

from gateway import openai_api as api
from gateway import openapi
from gateway.keys import CONFIG, SERVICE
from gateway.serving import ClientGone, Generation


async def read_json(request: web.Request):
    raw = await request.read()  # raises 413 past client_max_size
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
        raise api.invalid(f"The body is not valid JSON: {e}") from None


async def list_models(request: web.Request) -> web.Response:
    return web.json_response(api.models_list(request.app[SERVICE].model_ids))


async def get_model(request: web.Request) -> web.Response:
    svc, name = request.app[SERVICE], request.match_info["model"]
    if name not in svc.model_ids:
        raise api.model_not_found(name, svc.model_ids)
    return web.json_response(api.models_list([name])["data"][0])


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


async def metrics(request: web.Request) -> web.Response:
    svc = request.app[SERVICE]
    try:
        svc.metrics.refresh_scheduler(await svc.backend.scheduler_stats(), svc.tier_names)
    except RedisError:
        pass  # the request metrics are still worth a scrape
    return web.Response(body=svc.metrics.render(), content_type="text/plain",
                        headers={"X-Content-Type-Options": "nosniff"})


async def openapi_json(request: web.Request) -> web.Response:
    """This gateway's OpenAPI 3.1 description (its models, bounds and ``mfs`` defaults)."""
    return web.json_response(openapi.for_app(request.app))


# ---- completions ----------------------------------------------------------------------------
async def _serve(request: web.Request, req) -> web.StreamResponse:
    async with request.app[SERVICE].generation(request, req) as gen:
        if req.params.stream:
            return await _stream(request, gen)
        texts, lps, finish = [], [], None
        async for piece in gen.pieces():
            texts.append(piece.text)
            lps += piece.logprobs
            finish = piece.finish
        if gen.job.prompt_text is not None:  # echo
            texts.insert(0, gen.job.prompt_text)
            lps = gen.echo_infos() + lps
        return web.json_response(_final(gen, "".join(texts), finish, lps))


def _usage(gen: Generation) -> dict:
    return api.usage(gen.prompt_tokens, gen.completion_tokens, gen.cached_tokens, gen.draft)


def _logprobs(gen: Generation, items: list[api.TokenInfo], offset: int = 0) -> dict | None:
    """The choice's ``logprobs`` object (None when the request did not ask)."""
    if gen.job.params.logprobs is None:
        return None
    return api.chat_logprobs(items) if gen.job.kind == "chat" else api.completion_logprobs(items, offset)


def _final(gen: Generation, text: str, finish: str, lps: list[api.TokenInfo]) -> dict:
    j = gen.job
    build = api.chat_response if j.kind == "chat" else api.completion_response
    out = build(j.request_id, gen.model, j.created, text, finish, _usage(gen), _logprobs(gen, lps))
    out["mfs"] = api.served(gen.served_by)
    return out


def _chunk(gen: Generation, text: str | None, finish: str | None, role: bool = False,
           lps: list[api.TokenInfo] | None = None, offset: int = 0) -> dict:
    j, incl = gen.job, gen.job.params.include_usage
    lp = None if role else _logprobs(gen, lps or [], offset)
    if j.kind == "completion":
        c = api.completion_chunk(j.request_id, gen.model, j.created, text or "", finish, incl, lp)
    else:
        delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
        c = api.chat_chunk(j.request_id, gen.model, j.created, delta, finish, incl, lp)
    if finish:
        c["mfs"] = api.served(gen.served_by)
    return c


def _sse(obj) -> bytes:
    return b"data: " + (obj if isinstance(obj, bytes) else json.dumps(obj).encode()) + b"\n\n"


async def _stream(request: web.Request, gen: Generation) -> web.StreamResponse:
    pieces = gen.pieces()
    # Wait for the first piece before committing to 200: an immediate error keeps its real status.
    first = await anext(pieces)
    resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache",
                                       "X-Accel-Buffering": "no", "X-Request-Id": gen.job.request_id})
    await resp.prepare(request)
    try:
        if gen.job.kind == "chat":
            await resp.write(_sse(_chunk(gen, None, None, role=True)))
        piece, offset = first, 0  # offset: completions' text_offset, as the non-streamed answer counts it
        if gen.job.prompt_text is not None:  # echo: the prompt first (its logprobs came with the first token)
            echoed = gen.echo_infos()
            await resp.write(_sse(_chunk(gen, gen.job.prompt_text, None, lps=echoed)))
            offset = sum(len(t.text) for t in echoed)
        while True:
            if piece.text or piece.finish or piece.logprobs:
                await resp.write(_sse(_chunk(gen, piece.text, piece.finish, lps=piece.logprobs,
                                             offset=offset)))
                offset += sum(len(t.text) for t in piece.logprobs)
            if piece.finish:
                break
            piece = await anext(pieces)
        if gen.job.params.include_usage:
            obj = "chat.completion.chunk" if gen.job.kind == "chat" else "text_completion"
            chunk = api.usage_chunk(gen.job.request_id, gen.model, gen.job.created, obj, _usage(gen))
            chunk["mfs"] = api.served(gen.served_by)
            await resp.write(_sse(chunk))
        await resp.write(_sse(b"[DONE]"))
    except api.APIError as e:  # mid-stream: the status is sent already; say it in the stream
        request.app[SERVICE].metrics.errors.labels(str(e.status)).inc()
        await _write_quietly(resp, _sse(e.body()) + _sse(b"[DONE]"))
    except (ConnectionResetError, ClientGone):
        gen.cancel_reason = "disconnect"
    finally:
        await pieces.aclose()
    return resp


async def _write_quietly(resp: web.StreamResponse, data: bytes) -> None:
    try:
        await resp.write(data)
    except ConnectionResetError:
        pass
