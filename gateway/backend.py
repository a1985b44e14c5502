"""The gateway's side of Redis: submit and cancel requests, route token events, watch workers.

One reader task XREADs the gateway's own stream ``mfs:out:{gateway}`` (BLOCK) and puts each
:class:`TokenEvent` on the queue of its request; events for requests this gateway no longer waits
for (finished, cancelled, or from before a restart) are dropped. Duplicates are the consumer's
business (``seq``), see ``gateway.serving``.
"""
from __future__ import annotations

import asyncio
import json
import os
import socket
import time
from dataclasses import dataclass

import msgpack
import redis.asyncio as aioredis
import structlog
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from core import protocol as P

log = structlog.get_logger("gateway.backend")

BACKOFF_MIN_S = 0.1
BACKOFF_MAX_S = 2.0
MAX_PENDING_CANCELS = 10_000  # kept while Redis is down; the oldest go first past this
# Errors that mean "Redis is unreachable" (BusyLoadingError, a restarted server loading its AOF, is a
# ConnectionError); any other RedisError is an answer from a live server.
UNREACHABLE = (RedisConnectionError, RedisTimeoutError, OSError)


@dataclass(slots=True)
class LiveWorker:
    """What the gateway reads of a registration (core.protocol.WorkerInfo): one HGET per worker."""
    worker_id: str
    max_model_len: int | None


class Backoff:
    """Exponential retry delays: ``BACKOFF_MIN_S`` doubling to ``BACKOFF_MAX_S``; ``reset()`` on success."""

    def __init__(self, lo: float = BACKOFF_MIN_S, hi: float = BACKOFF_MAX_S):
        self.lo, self.hi, self.delay = lo, hi, lo

    def next(self) -> float:
        d, self.delay = self.delay, min(self.hi, self.delay * 2)
        return d

    def reset(self) -> None:
        self.delay = self.lo


class Backend:
    def __init__(self, client: aioredis.Redis, gateway_id: str, block_ms: int = 1000,
                 heartbeat_s: float = P.HEARTBEAT_S, heartbeat_ttl_s: int = P.WORKER_TTL_S,
                 stall_timeout_s: float = 15.0, metrics=None):
        self.redis = client
        self.gateway_id = gateway_id
        self.stream = P.out_stream(gateway_id)
        self.block_ms = block_ms
        self.heartbeat_s = heartbeat_s
        self.heartbeat_ttl_s = heartbeat_ttl_s
        self.stall_timeout_s = stall_timeout_s
        self.metrics = metrics  # gateway.metrics.Metrics or None
        self._queues: dict[str, asyncio.Queue[P.TokenEvent]] = {}
        self._suspect: dict[str, float] = {}        # request_id -> monotonic deadline for its next event
        self._pending_cancels: dict[str, str] = {}  # request_id -> reason, not written yet (Redis down)
        self.events_routed = 0
        self.events_dropped = 0
        self.down_since: float | None = None        # monotonic start of the current outage
        self.outages = 0
        self.run_id: str | None = None              # the Redis server's run_id (changes on restart)
        self._outage_unchecked = False              # an outage counted since run_id was last compared
        if metrics is not None:
            metrics.redis_up.set(1)

    # ---- requests ------------------------------------------------------------------------------
    async def submit(self, sub: P.Submit) -> asyncio.Queue[P.TokenEvent]:
        """Registers the request's queue first (no event can beat it), then XADDs the Submit."""
        q: asyncio.Queue[P.TokenEvent] = asyncio.Queue()
        self._queues[sub.request_id] = q
        try:
            await self.redis.xadd(P.REQ_STREAM, sub.encode(), maxlen=P.STREAM_MAXLEN, approximate=True)
        except BaseException:
            self._queues.pop(sub.request_id, None)
            raise
        return q

    def release(self, request_id: str) -> None:
        self._queues.pop(request_id, None)
        self._suspect.pop(request_id, None)

    async def cancel(self, request_id: str, reason: str) -> None:
        self.release(request_id)
        try:
            await self.redis.xadd(P.REQ_STREAM, P.Cancel(request_id, reason).encode(),
                                  maxlen=P.STREAM_MAXLEN, approximate=True)
        except UNREACHABLE as e:  # written once Redis is back (the heartbeat does)
            self._redis_failed("cancel", e)
            self._pending_cancels[request_id] = reason
            while len(self._pending_cancels) > MAX_PENDING_CANCELS:
                self._pending_cancels.pop(next(iter(self._pending_cancels)))
            log.info("cancel.deferred", request_id=request_id, reason=reason, error=str(e))
        except RedisError as e:  # the scheduler will finish it at max_tokens anyway
            log.warning("cancel.failed", request_id=request_id, reason=reason, error=str(e))

    async def _flush_cancels(self) -> None:
        if not self._pending_cancels:
            return
        todo = list(self._pending_cancels.items())
        pipe = self.redis.pipeline(transaction=False)
        for rid, reason in todo:
            pipe.xadd(P.REQ_STREAM, P.Cancel(rid, reason).encode(), maxlen=P.STREAM_MAXLEN, approximate=True)
        try:
            await pipe.execute()
        except UNREACHABLE:
            raise  # kept for the next beat
        except RedisError as e:  # a live server refused: retrying would not help
            log.warning("cancel.failed", count=len(todo), error=str(e))
        for rid, _ in todo:
            self._pending_cancels.pop(rid, None)
        log.info("cancel.flushed", count=len(todo))

    def stalled(self, request_id: str) -> bool:
        """True when the request lived through a Redis outage or restart and no event has come for it
        within ``stall_timeout_s`` (counted from when Redis was back, or from the outage's start while
        it lasts): its tokens were likely lost, and waiting longer would only hang its client."""
        d = self._suspect.get(request_id)
        return d is not None and time.monotonic() > d

    @property
    def redis_down(self) -> bool:
        return self.down_since is not None

    # ---- outages -------------------------------------------------------------------------------
    def _mark_suspect(self, deadline: float, reset: bool = False) -> None:
        for rid in self._queues:
            if reset:
                self._suspect[rid] = deadline
            else:
                self._suspect.setdefault(rid, deadline)

    def _redis_failed(self, where: str, err: BaseException) -> None:
        now = time.monotonic()
        if self.down_since is None:
            self.down_since = now
            self.outages += 1
            self._outage_unchecked = True
            if self.metrics is not None:
                self.metrics.redis_up.set(0)
                self.metrics.redis_outages.inc()
            log.warning("redis.down", seen_by=where, error=str(err), in_flight=len(self._queues))
        else:
            log.debug("redis.retry", seen_by=where, error=str(err))
        self._mark_suspect(now + self.stall_timeout_s)

    def _redis_ok(self, where: str) -> None:
        if self.down_since is None:
            return
        now = time.monotonic()
        down_s, self.down_since = now - self.down_since, None
        if self.metrics is not None:
            self.metrics.redis_up.set(1)
        # a fresh grace period for every request that lived through it
        self._mark_suspect(now + self.stall_timeout_s, reset=True)
        log.warning("redis.up", seen_by=where, down_s=round(down_s, 3), suspect=len(self._suspect),
                    stall_timeout_s=self.stall_timeout_s)

    def _check_run_id(self, run_id: str | None) -> None:
        if run_id and self.run_id and run_id != self.run_id:
            log.warning("redis.restarted", old_run_id=self.run_id, run_id=run_id, in_flight=len(self._queues))
            if not self._outage_unchecked:  # a restart no command failed on: counted here
                self.outages += 1
                if self.metrics is not None:
                    self.metrics.redis_outages.inc()
            self._mark_suspect(time.monotonic() + self.stall_timeout_s, reset=True)
        if run_id:
            self.run_id, self._outage_unchecked = run_id, False

    # ---- the reader task -----------------------------------------------------------------------
    async def _tail_id(self) -> str:
        last = await self.redis.xrevrange(self.stream, count=1)
        return last[0][0].decode() if last else "0-0"

    async def run_reader(self, trim_every_s: float = 5.0) -> None:
        last_id, trimmed_at = None, time.monotonic()
        backoff = Backoff()
        while True:
            try:
                if last_id is None:
                    last_id = await self._tail_id()  # skip what a previous life of this id left
                if time.monotonic() - trimmed_at > trim_every_s and last_id != "0-0":
                    # only this gateway reads its stream: what it has read can go
                    await self.redis.xtrim(self.stream, minid=last_id, approximate=True)
                    trimmed_at = time.monotonic()
                # After a restart the stream may have lost its last second, but new entries get ids
                # past last_id (they are time-based), so reading on from last_id misses nothing new.
                resp = await self.redis.xread({self.stream: last_id}, count=512, block=self.block_ms)
            except asyncio.CancelledError:
                raise
            except UNREACHABLE as e:
                self._redis_failed("reader", e)
                await asyncio.sleep(backoff.next())
                continue
            except RedisError as e:  # a live server said no: not an outage, but do not spin on it
                log.warning("reader.redis_error", error=str(e))
                await asyncio.sleep(backoff.next())
                continue
            backoff.reset()
            self._redis_ok("reader")
            for _stream, entries in resp or ():
                for entry_id, fields in entries:
                    last_id = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
                    self._route(fields)

    def _route(self, fields: dict) -> None:
        try:
            ev = P.decode(fields)
        except Exception as e:  # noqa: BLE001 - a bad entry must not kill the reader
            log.warning("reader.bad_entry", error=str(e))
            return
        if not isinstance(ev, P.TokenEvent):
            log.warning("reader.unexpected_record", type=type(ev).__name__)
            return
        q = self._queues.get(ev.request_id)
        if q is None:
            self.events_dropped += 1
            return
        self.events_routed += 1
        self._suspect.pop(ev.request_id, None)  # its stream is alive again
        q.put_nowait(ev)

    # ---- heartbeat, workers, stats -------------------------------------------------------------
    async def run_heartbeat(self, info: dict | None = None) -> None:
        """Beats every ``heartbeat_s``; also watches the server's run_id and writes deferred Cancels.
        On errors it retries with backoff (at most ``heartbeat_s`` apart)."""
        base = {"host": socket.gethostname(), "pid": os.getpid(), **(info or {})}
        backoff = Backoff(hi=max(BACKOFF_MIN_S, min(BACKOFF_MAX_S, self.heartbeat_s)))
        while True:
            body = json.dumps({**base, "t": round(time.time(), 3), "waiting": len(self._queues)})
            try:
                await self.redis.set(P.gateway_key(self.gateway_id), body, ex=self.heartbeat_ttl_s)
                server = await self.redis.info("server")
                self._redis_ok("heartbeat")
                self._check_run_id(server.get("run_id") if isinstance(server, dict) else None)
                await self._flush_cancels()
            except asyncio.CancelledError:
                raise
            except UNREACHABLE as e:
                self._redis_failed("heartbeat", e)
                await asyncio.sleep(backoff.next())
                continue
            except RedisError as e:
                log.warning("heartbeat.failed", error=str(e))
                await asyncio.sleep(backoff.next())
                continue
            backoff.reset()
            await asyncio.sleep(self.heartbeat_s)

    async def live_workers(self) -> list[LiveWorker]:
        """Registered workers whose key still exists (it expires without their heartbeat)."""
        ids = sorted(w.decode() if isinstance(w, bytes) else w
                     for w in await self.redis.smembers(P.WORKERS_SET))
        if not ids:
            return []
        pipe = self.redis.pipeline(transaction=False)
        for w in ids:
            pipe.exists(P.worker_key(w))
            pipe.hget(P.worker_key(w), "max_model_len")
        res = await pipe.execute()
        out = []
        for i, w in enumerate(ids):
            if res[2 * i]:
                out.append(LiveWorker(w, _as_int(res[2 * i + 1])))
        return out

    async def scheduler_stats(self) -> dict:
        raw = await self.redis.hget(P.STATS_KEY, "scheduler")
        if not raw:
            return {}
        try:
            stats = msgpack.unpackb(raw, raw=False, strict_map_key=False)
        except Exception:  # noqa: BLE001
            return {}
        return stats if isinstance(stats, dict) else {}


def _as_int(v) -> int | None:
    try:
        return int(v) if v is not None else None
    except (TypeError, ValueError):
        return None


def max_context(workers: list[LiveWorker]) -> int | None:
    """The smallest ``max_model_len`` among live workers: a request must fit wherever it lands."""
    lens = [w.max_model_len for w in workers if w.max_model_len]
    return min(lens) if lens else None

