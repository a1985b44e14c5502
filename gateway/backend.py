"""The gateway's side of Redis: submit and cancel requests, route token events, watch workers.

Shards (core.protocol "Shards"): each request goes to one shard's ``mfs:req``, chosen by
:func:`choose_shard` among the shards with a live worker serving its tier: the shard its session last
ran on (the KV directory's ``mfs:kv:session:{session}``, so the next turn finds its KV), else the least
loaded (the shards' published waiting + running requests, plus what this gateway sent since it last
read them). A second choice of the same request (``n`` > 1) follows the first; a Cancel goes to the
shard its submit went to. With one shard none of this costs a Redis command.

One reader task XREADs the gateway's own stream ``mfs:out:{gateway}`` (BLOCK) and puts each
:class:`TokenEvent` on the queue of its request; events for requests this gateway no longer waits
for (finished, cancelled, or from before a restart) are dropped. Duplicates are the consumer's
business (``seq``), see ``gateway.generation``.
"""
from __future__ import annotations

import asyncio
import json
import os
import socket
import time
from collections.abc import Callable

import msgpack
import redis.asyncio as aioredis
import structlog
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError
from redis.exceptions import TimeoutError as RedisTimeoutError

from core import protocol as P
from gateway.shards import LiveWorker, choose_shard, merge_stats  # noqa: F401 - re-exported

log = structlog.get_logger("gateway.backend")

BACKOFF_MIN_S = 0.1
BACKOFF_MAX_S = 2.0
MAX_PENDING_CANCELS = 10_000  # kept while Redis is down; the oldest go first past this
# Errors that mean "Redis is unreachable" (BusyLoadingError, a restarted server loading its AOF, is a
# ConnectionError); any other RedisError is an answer from a live server.
UNREACHABLE = (RedisConnectionError, RedisTimeoutError, OSError)


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
                 stall_timeout_s: float = 15.0, metrics=None, reader_client: aioredis.Redis | None = None):
        self.redis = client
        # the reader's XREAD BLOCK holds its connection for up to block_ms: a client of its own, so it
        # neither waits behind a burst's commands nor takes one of their connections
        self.reader_redis = reader_client or client
        self.gateway_id = gateway_id
        self.stream = P.out_stream(gateway_id)
        self.block_ms = block_ms
        self.heartbeat_s = heartbeat_s
        self.heartbeat_ttl_s = heartbeat_ttl_s
        self.stall_timeout_s = stall_timeout_s
        self.metrics = metrics  # gateway.metrics.Metrics or None
        self._queues: dict[str, asyncio.Queue[P.TokenEvent]] = {}
        self._suspect: dict[str, float] = {}        # request_id -> monotonic deadline for its next event
        self._pending_cancels: dict[str, tuple[str, str]] = {}  # request_id -> (reason, shard), not written yet
        self.shards: list[str] = [P.DEFAULT_SHARD]  # shards whose scheduler has started (mfs:shards)
        self._shard_of: dict[str, str] = {}          # request_id -> the shard its submit went to
        self._workers: list[LiveWorker] = []         # the last live_workers() answer
        self._shard_load: dict[str, float] = {}      # published waiting + running, + sent since
        self._on_first: dict[str, Callable[[], None]] = {}  # request_id -> called on its first event
        self._workers_query: asyncio.Future | None = None   # the live_workers() query in flight
        self.last_beat: float | None = None                  # monotonic time of the last heartbeat written
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
            shard = await self.shard_for(sub)
            self._shard_of[sub.request_id] = shard
            await self.redis.xadd(P.Shard(shard).req_stream, sub.encode(), maxlen=P.STREAM_MAXLEN,
                                  approximate=True)
        except BaseException:
            self._queues.pop(sub.request_id, None)
            self._shard_of.pop(sub.request_id, None)
            raise
        self._shard_load[shard] = self._shard_load.get(shard, 0.0) + 1
        return q

    async def shard_for(self, sub: P.Submit) -> str:
        """See the module docstring; one HGET when several shards could take a request of a session."""
        if sub.follow and sub.follow in self._shard_of:
            return self._shard_of[sub.follow]
        if len(self.shards) <= 1 and all(w.shard == P.DEFAULT_SHARD for w in self._workers):
            return self.shards[0] if self.shards else P.DEFAULT_SHARD
        session_shard = None
        if sub.session_id:
            raw = await self.redis.hget(P.kv_session_key(sub.session_id), "shard")
            session_shard = raw.decode() if isinstance(raw, bytes) else raw
        return choose_shard(sub.tier, self._workers, self._shard_load, self.shards, session_shard)

    def on_first_event(self, request_id: str, fn: Callable[[], None]) -> None:
        """Calls ``fn`` when the first token event of ``request_id`` arrives (it has left the
        scheduler's queue); forgotten on ``release``."""
        self._on_first[request_id] = fn

    def release(self, request_id: str) -> None:
        self._queues.pop(request_id, None)
        self._on_first.pop(request_id, None)
        self._suspect.pop(request_id, None)
        self._shard_of.pop(request_id, None)

    async def cancel(self, request_id: str, reason: str) -> None:
        shard = self._shard_of.get(request_id, P.DEFAULT_SHARD)
        self.release(request_id)
        try:
            await self.redis.xadd(P.Shard(shard).req_stream, P.Cancel(request_id, reason).encode(),
                                  maxlen=P.STREAM_MAXLEN, approximate=True)
        except UNREACHABLE as e:  # written once Redis is back (the heartbeat does)
            self._redis_failed("cancel", e)
            self._pending_cancels[request_id] = (reason, shard)
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
        for rid, (reason, shard) in todo:
            pipe.xadd(P.Shard(shard).req_stream, P.Cancel(rid, reason).encode(), maxlen=P.STREAM_MAXLEN,
                      approximate=True)
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
        last = await self.reader_redis.xrevrange(self.stream, count=1)
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
                    await self.reader_redis.xtrim(self.stream, minid=last_id, approximate=True)
                    trimmed_at = time.monotonic()
                # After a restart the stream may have lost its last second, but new entries get ids
                # past last_id (they are time-based), so reading on from last_id misses nothing new.
                resp = await self.reader_redis.xread({self.stream: last_id}, count=512, block=self.block_ms)
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
            events = P.token_events(fields)
        except Exception as e:  # noqa: BLE001 - a bad entry must not kill the reader
            log.warning("reader.bad_entry", error=str(e))
            return
        for ev in events:
            q = self._queues.get(ev.request_id)
            if q is None:
                self.events_dropped += 1
                continue
            self.events_routed += 1
            self._suspect.pop(ev.request_id, None)  # its stream is alive again
            started = self._on_first.pop(ev.request_id, None)
            if started is not None:
                try:
                    started()
                except Exception:  # noqa: BLE001 - a bookkeeping bug must never stop the routing of tokens
                    log.exception("reader.on_first_event_failed", request_id=ev.request_id)
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
                pipe = self.redis.pipeline(transaction=False)
                pipe.set(P.gateway_key(self.gateway_id), body, ex=self.heartbeat_ttl_s)
                # a scheduler that took this gateway for gone (its link was cut for longer than the TTL)
                # gave its stream a TTL (scheduler/housekeeping.py): it is this gateway's again
                pipe.persist(self.stream)
                await pipe.execute()
                self.last_beat = time.monotonic()  # gateway.keepalive renews the key while this is recent
                server = await self.redis.info("server")
                self._redis_ok("heartbeat")
                self._check_run_id(server.get("run_id") if isinstance(server, dict) else None)
                await self._flush_cancels()
                await self._refresh_shards()
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

    async def _refresh_shards(self) -> None:
        """The shard list, and (with several shards) their published load: once per heartbeat."""
        names = sorted(_text(s) for s in await self.redis.smembers(P.SHARDS_SET))
        self.shards = names or [P.DEFAULT_SHARD]
        if len(self.shards) > 1:
            self._shard_load = {
                s: float(sum((st.get("waiting") or {}).values()) + sum((st.get("running") or {}).values()))
                for s, st in (await self.shard_stats()).items()}

    async def live_workers(self) -> list[LiveWorker]:
        """Registered workers (of every known shard) whose key still exists (it expires without their
        heartbeat). Callers that ask while a query is in flight share its answer: a burst of a thousand
        requests costs a few rounds of commands, not a thousand."""
        task = self._workers_query
        if task is None or task.done():
            task = self._workers_query = asyncio.ensure_future(self._query_workers())
        return await asyncio.shield(task)  # one caller cancelled does not cancel the others' query

    async def _query_workers(self) -> list[LiveWorker]:
        pipe = self.redis.pipeline(transaction=False)
        for s in self.shards:
            pipe.smembers(P.Shard(s).workers_set)
        ids = sorted({_text(w) for members in await pipe.execute() for w in members})
        if not ids:
            self._workers = []
            return []
        pipe = self.redis.pipeline(transaction=False)
        for w in ids:
            pipe.hmget(P.worker_key(w), "max_model_len", "shard", "tiers", "started", "weights", "choice")
        out = []
        for w, (mml, shard, tiers, started, weights, choice) in zip(ids, await pipe.execute()):
            if mml is None and started is None:
                continue  # expired
            out.append(LiveWorker(w, _as_int(mml), _text(shard) if shard else P.DEFAULT_SHARD,
                                  _tiers(tiers), _text(weights) if weights else "", _text(choice) if choice else ""))
        self._workers = out
        return out

    async def worker_heartbeats(self, worker_ids: list[str]) -> dict[str, float]:
        """Each worker's last heartbeat (wall clock, its registration's ``heartbeat`` field); a worker
        without one is left out. For the status page (``gateway.status``)."""
        pipe = self.redis.pipeline(transaction=False)
        for w in worker_ids:
            pipe.hget(P.worker_key(w), "heartbeat")
        out = {}
        for w, raw in zip(worker_ids, await pipe.execute()):
            try:
                out[w] = float(_text(raw))
            except (TypeError, ValueError):
                continue
        return out

    async def shard_stats(self) -> dict[str, dict]:
        """Each shard's leader's published snapshot (msgpack dicts), by shard name."""
        out = {}
        for name, raw in (await self.redis.hgetall(P.STATS_KEY)).items():
            shard = P.shard_of_stats_field(_text(name))
            if shard is None:
                continue
            try:
                stats = msgpack.unpackb(raw, raw=False, strict_map_key=False)
            except Exception:  # noqa: BLE001
                continue
            if isinstance(stats, dict):
                out[shard] = stats
        return out

    async def scheduler_stats(self) -> dict:
        """The shards' snapshots merged (one shard: its own)."""
        per = await self.shard_stats()
        return merge_stats([per[s] for s in sorted(per)])


async def stop_tasks(tasks: list[asyncio.Task], timeout_s: float = 5.0) -> list[asyncio.Task]:
    """Cancels the tasks and waits for them, cancelling again every half second: a cancel that lands
    inside a blocking redis-py read can be swallowed (redis/redis-py#2028), and a task that kept
    running would hang the shutdown. Returns the tasks still running after ``timeout_s`` (logged)."""
    deadline = time.monotonic() + timeout_s
    pending = [t for t in tasks if not t.done()]
    while pending and time.monotonic() < deadline:
        for t in pending:
            t.cancel()
        _, still = await asyncio.wait(pending, timeout=0.5)
        pending = list(still)
    if pending:
        log.warning("tasks.not_stopped", tasks=[t.get_name() for t in pending], timeout_s=timeout_s)
    return pending


def _tiers(raw) -> tuple[int, ...]:
    """A registration's msgpack ``tiers``; () when absent or unreadable (the worker's tiers unknown)."""
    try:
        v = msgpack.unpackb(raw) if raw else ()
    except Exception:  # noqa: BLE001 - a bad registration must not fail the request
        return ()
    return tuple(int(t) for t in v if isinstance(t, int)) if isinstance(v, (list, tuple)) else ()


def _text(v) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


def _as_int(v) -> int | None:
    try:
        return int(v) if v is not None else None
    except (TypeError, ValueError):
        return None


def max_context(workers: list[LiveWorker]) -> int | None:
    """The smallest ``max_model_len`` among live workers: a request must fit wherever it lands."""
    lens = [w.max_model_len for w in workers if w.max_model_len]
    return min(lens) if lens else None

