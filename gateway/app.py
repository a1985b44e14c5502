"""The gateway application: ``init_app(config)`` builds it, a cleanup context owns its Redis side.

The cleanup context opens the Redis client, starts the token-event reader and the heartbeat
(``SET mfs:gateway:{id}`` with a short TTL every second), and on shutdown stops both and closes the
client. Both ride over Redis outages with backoff (see ``gateway.backend``); a request arriving while
Redis is unreachable gets 503 ``backend_unavailable`` with ``Retry-After``, and ``/health`` answers 503
until Redis is back. One error middleware answers every failure in OpenAI's error JSON; inside it the
auth middleware (``gateway.auth``) checks API keys and rate limits on every route but ``/health``,
``/openapi.json`` (the API description, ``gateway.openapi``) and ``/`` (the status page's HTML; its
numbers, ``/status.json``, are guarded like ``/metrics``).
"""
from __future__ import annotations

import asyncio
import time

import structlog
from aiohttp import web
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialWithJitterBackoff
from redis.exceptions import RedisError

from core.protocol import gateway_key
from core.redisconn import RedisTarget, connect, connect_async
from gateway.apikeys import KeyStore
from gateway.auth import auth_middleware, on_prepare
from gateway.backend import Backend, stop_tasks
from gateway.config import GatewayConfig
from gateway.errors import APIError
from gateway.history import History
from gateway.keepalive import Keepalive
from gateway.keys import CONFIG, HISTORY, KEYS, SERVICE
from gateway.metrics import Metrics
from gateway.ratelimit import RateLimiter
from gateway.routes import setup_routes
from gateway.generation import ClientGone
from gateway.serving import Service

log = structlog.get_logger("gateway")


def _error_response(e: APIError) -> web.Response:
    return web.json_response(e.body(), status=e.status, headers=e.headers)


@web.middleware
async def error_middleware(request: web.Request, handler):
    try:
        return await handler(request)
    except APIError as e:
        err = e
    except web.HTTPException as e:
        if e.status < 400:
            raise
        msg = {404: f"Unknown path {request.path}", 405: f"Method {request.method} is not allowed here",
               413: f"The request body is too large (limit {request.app[CONFIG].max_body_bytes} bytes)"
               }.get(e.status, e.reason)
        code = {413: "request_too_large", 404: "not_found"}.get(e.status)
        err = APIError(e.status, msg, code=code, headers={k: v for k, v in e.headers.items()
                                                          if k.lower() in ("allow", "retry-after")})
    except ClientGone:
        return web.Response(status=499)  # nobody is listening
    except RedisError as e:
        log.error("redis.error", path=request.path, error=str(e))
        err = APIError(503, "The gateway cannot reach Redis; retry shortly.", code="backend_unavailable",
                       headers={"Retry-After": "2"})
    except asyncio.CancelledError:
        raise
    except Exception:  # noqa: BLE001 - a bug: log it, answer in the API's shape
        log.exception("unhandled", path=request.path)
        err = APIError(500, "Internal server error.", code="internal_error")
    if SERVICE in request.app:
        request.app[SERVICE].metrics.errors.labels(str(err.status)).inc()
    log.info("request.rejected", path=request.path, status=err.status, code=err.code, message=err.message)
    return _error_response(err)


async def redis_ctx(app: web.Application):
    cfg, svc = app[CONFIG], app[SERVICE]
    # A client from a URL retries nothing by default: after a Redis restart every pooled connection is
    # dead, and each would fail one command (a user's request among them). Two quick retries on a
    # connection error reconnect instead; while Redis is down they fail within a few hundredths of a s.
    target = RedisTarget.parse(cfg.redis_url, timeout_s=cfg.redis_timeout_s)
    # A blocking pool: a burst waits for a connection instead of failing with "Too many
    # connections"; the token-event reader has a connection of its own.
    retry = Retry(ExponentialWithJitterBackoff(base=0.01, cap=0.1), 2)
    # (a wait for a free connection is no sign of an unreachable Redis, but of a busy loop: it may last
    # longer than the command timeout)
    client = connect_async(target, max_connections=cfg.redis_pool, pool_timeout_s=max(30.0, target.timeout_s),
                           health_check_interval=30, retry=retry)
    reader = connect_async(target, max_connections=1, health_check_interval=30, retry=retry)
    backend = Backend(client, cfg.gateway_id, block_ms=cfg.reader_block_ms,
                      stall_timeout_s=cfg.stall_timeout_s, metrics=svc.metrics, reader_client=reader)
    svc.backend = backend
    svc.limiter = RateLimiter(client, rpm=cfg.rpm, tpm=cfg.tpm)
    tasks = [asyncio.create_task(backend.run_reader(), name="mfs-gateway-reader"),
             asyncio.create_task(backend.run_heartbeat({"port": cfg.port}), name="mfs-gateway-heartbeat")]
    # the heartbeat key renewed from a thread while a burst holds the loop (gateway.keepalive)
    sync = connect(target)
    keepalive = Keepalive(sync, gateway_key(cfg.gateway_id), backend.heartbeat_ttl_s, backend.heartbeat_s,
                          lambda: backend.last_beat)
    keepalive.start()
    log.info("gateway.start", gateway_id=cfg.gateway_id, redis=target.describe(), models=svc.model_ids)
    yield
    await asyncio.to_thread(keepalive.stop)
    sync.close()
    await stop_tasks(tasks)
    try:
        await client.delete(gateway_key(cfg.gateway_id))
    except RedisError:
        pass
    await client.aclose()
    await reader.aclose()


async def history_ctx(app: web.Application):
    """Samples the metrics every ``history_period_s`` for the status page's charts (gateway.history),
    the scheduler's gauges refreshed first, as ``/metrics`` does."""
    svc, hist = app[SERVICE], app[HISTORY]

    async def loop():
        while True:
            try:
                svc.metrics.refresh_scheduler(await svc.backend.scheduler_stats(), svc.tier_names)
            except RedisError:
                pass  # this gateway's own numbers are still worth a point
            hist.record(svc.metrics.registry, time.time())
            await asyncio.sleep(hist.period_s)

    task = asyncio.create_task(loop(), name="mfs-gateway-history")
    yield
    await stop_tasks([task])


def init_app(config: GatewayConfig | None = None) -> web.Application:
    cfg = config or GatewayConfig()
    frontend = cfg.frontend
    if frontend is None:
        from family.manifest import load_frontend  # noqa: PLC0415 - heavy (transformers)
        frontend = load_frontend(cfg.model, cfg.tiers)
    if frontend.tokenizer is None:
        raise ValueError(f"--model {cfg.model!r} has no tokenizer; the gateway needs one to tokenize prompts")
    keys = KeyStore(cfg.api_keys, cfg.api_keys_file)
    if not keys.enabled:
        log.warning("gateway.open", host=cfg.host,
                    message="no API keys (MFS_API_KEYS or --api-keys-file): anyone who can reach this "
                            "gateway may use it")
    app = web.Application(middlewares=[error_middleware, auth_middleware],
                          client_max_size=cfg.max_body_bytes)
    app[CONFIG] = cfg
    app[KEYS] = keys
    app[SERVICE] = Service(frontend, Metrics(), complexity_cfg=cfg.complexity, gateway_id=cfg.gateway_id,
                           max_inflight=cfg.max_inflight, request_timeout_s=cfg.request_timeout_s,
                           default_max_tokens=cfg.default_max_tokens, max_prompt_tokens=cfg.max_prompt_tokens,
                           max_tokens_cap=cfg.limits.max_tokens_cap, spec_draft_tier=cfg.spec_draft_tier,
                           spec_gamma=cfg.spec_gamma, cascade_threshold=cfg.cascade_threshold,
                           cascade_window=cfg.cascade_window, max_waiting=cfg.max_waiting,
                           max_waiting_per_tier=cfg.max_waiting_per_tier, max_queue_wait_s=cfg.max_queue_wait_s)
    app[HISTORY] = History(app[SERVICE].tier_names, app[SERVICE].tier_ids, period_s=cfg.history_period_s,
                           span_s=cfg.history_span_s)
    app.cleanup_ctx.append(redis_ctx)
    app.cleanup_ctx.append(history_ctx)  # after redis_ctx: it reads the scheduler's stats through the backend
    app.on_response_prepare.append(on_prepare)
    setup_routes(app)
    return app
