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
from redis.exceptions import RedisError

from mfs import protocol as P

log = structlog.get_logger("gateway.backend")


@dataclass(slots=True)
class WorkerInfo:
    worker_id: str
    max_model_len: int | None


class Backend:
    def __init__(self, client: aioredis.Redis, gateway_id: str, block_ms: int = 1000,
                 heartbeat_s: float = P.HEARTBEAT_S, heartbeat_ttl_s: int = P.WORKER_TTL_S):
        self.redis = client
        self.gateway_id = gateway_id
        self.stream = P.out_stream(gateway_id)
        self.block_ms = block_ms
        self.heartbeat_s = heartbeat_s
        self.heartbeat_ttl_s = heartbeat_ttl_s
        self._queues: dict[str, asyncio.Queue[P.TokenEvent]] = {}
        self.events_routed = 0
        self.events_dropped = 0

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

    async def cancel(self, request_id: str, reason: str) -> None:
        self.release(request_id)
        try:
            await self.redis.xadd(P.REQ_STREAM, P.Cancel(request_id, reason).encode(),
                                  maxlen=P.STREAM_MAXLEN, approximate=True)
        except RedisError as e:  # the scheduler will finish it at max_tokens anyway
            log.warning("cancel.failed", request_id=request_id, reason=reason, error=str(e))

    @property
    def num_waiting(self) -> int:
        return len(self._queues)

    # ---- the reader task -----------------------------------------------------------------------
    async def _tail_id(self) -> str:
        last = await self.redis.xrevrange(self.stream, count=1)
        return last[0][0].decode() if last else "0-0"

    async def run_reader(self, trim_every_s: float = 5.0) -> None:
        last_id, trimmed_at = None, time.monotonic()
        while True:
            try:
                if last_id is None:
                    last_id = await self._tail_id()  # skip what a previous life of this id left
                if time.monotonic() - trimmed_at > trim_every_s and last_id != "0-0":
                    # only this gateway reads its stream: what it has read can go
                    await self.redis.xtrim(self.stream, minid=last_id, approximate=True)
                    trimmed_at = time.monotonic()
                resp = await self.redis.xread({self.stream: last_id}, count=512, block=self.block_ms)
            except asyncio.CancelledError:
                raise
            except (RedisError, OSError) as e:
                log.warning("reader.redis_error", error=str(e))
                await asyncio.sleep(0.5)
                continue
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
        q.put_nowait(ev)

    # ---- heartbeat, workers, stats -------------------------------------------------------------
    async def run_heartbeat(self, info: dict | None = None) -> None:
        base = {"host": socket.gethostname(), "pid": os.getpid(), **(info or {})}
        while True:
            body = json.dumps({**base, "t": round(time.time(), 3), "waiting": len(self._queues)})
            try:
                await self.redis.set(P.gateway_key(self.gateway_id), body, ex=self.heartbeat_ttl_s)
            except (RedisError, OSError) as e:
                log.warning("heartbeat.failed", error=str(e))
            await asyncio.sleep(self.heartbeat_s)

    async def live_workers(self) -> list[WorkerInfo]:
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
                out.append(WorkerInfo(w, _as_int(res[2 * i + 1])))
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


def max_context(workers: list[WorkerInfo]) -> int | None:
    """The smallest ``max_model_len`` among live workers: a request must fit wherever it lands."""
    lens = [w.max_model_len for w in workers if w.max_model_len]
    return min(lens) if lens else None

