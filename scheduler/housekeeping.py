"""Housekeeping of the leading scheduler (every 2 s): requests of a gateway that went away are
cancelled, each with an error event on its output stream, which then expires (``GONE_STREAM_TTL_S``);
``mfs:req`` and ``mfs:done`` are trimmed below what is still pending or unread."""
from __future__ import annotations

import time
from collections.abc import Callable

import redis
import structlog

from core import protocol as P
from scheduler.registry import WorkerRegistry, WorkerState

log = structlog.get_logger(__name__)

# A gone gateway's output stream expires this long after it was reaped. A gateway that was only cut off
# (its host partitioned, Redis out of its reach for longer than its heartbeat TTL) reads, once back,
# why each of its requests ended (``GATEWAY_LOST``) and fails them at once instead of waiting out its
# stall timeout; it PERSISTs its stream with every heartbeat. A gateway that is really gone leaves
# nothing behind.
GONE_STREAM_TTL_S = 300
GATEWAY_LOST = "gateway_lost"


class GatewayReaper:
    """Watches the heartbeats of the gateways whose requests are in flight."""

    def __init__(self, r: redis.Redis, clock: Callable[[], float] = time.monotonic):
        self.r = r
        self.clock = clock
        self.gateways_seen: set[str] = set()  # gateways whose heartbeat was seen (their loss cancels)
        self.gateways_gone: dict[str, float] = {}  # -> when: a step in flight may still write its stream
        self.gateway_cancels = 0

    def reap_gateways(self, registry: WorkerRegistry, end: Callable[[str, object], None]) -> None:
        """Requests of a gateway whose heartbeat stopped (it died, restarted under a new id, or its host
        was cut off) are cancelled: their KV is freed, their submits acknowledged (``end``) and an error
        event (503, ``GATEWAY_LOST``) written for each; its output stream then expires."""
        by_gw: dict[str, list[tuple[WorkerState, str]]] = {}
        for w in registry.workers.values():
            for rid, req in w.core.requests.items():
                gw = req.meta.get("gateway_id")
                if gw:
                    by_gw.setdefault(gw, []).append((w, rid))
        now = self.clock()
        for gw, t in list(self.gateways_gone.items()):
            # a step in flight may still write the stream, and an XADD after it expired makes a new one
            # without a TTL: set it again for a while
            self.r.expire(P.out_stream(gw), GONE_STREAM_TTL_S)
            if now - t > 30:
                del self.gateways_gone[gw]
        ids = sorted(set(by_gw) | self.gateways_seen)
        pipe = self.r.pipeline(transaction=False)
        for gw in ids:
            pipe.exists(P.gateway_key(gw))
        for gw, alive in zip(ids, pipe.execute() if ids else []):
            if alive:
                self.gateways_seen.add(gw)
                self.gateways_gone.pop(gw, None)  # back (it was cut off): its stream is its own again
                continue
            if gw not in self.gateways_seen:
                continue  # never seen alive: a client of the streams that keeps no heartbeat
            self.gateways_seen.discard(gw)
            gone = by_gw.get(gw, [])
            pipe = self.r.pipeline(transaction=False)
            for w, rid in gone:
                req = w.core.requests.get(rid)
                if req is not None and w.core.abort_request(rid):
                    registry.placement.pop(rid, None)
                    end(rid, req.meta.get("entry"))
                    pipe.xadd(P.out_stream(gw), P.TokenEvent(
                        rid, 0, [], True, "error", status=503, error_code=GATEWAY_LOST,
                        error="the gateway lost Redis for longer than its heartbeat TTL: the scheduler "
                              "cancelled this request and freed its KV; please retry").encode(),
                        maxlen=P.STREAM_MAXLEN, approximate=True)
            pipe.expire(P.out_stream(gw), GONE_STREAM_TTL_S)
            pipe.execute()
            self.gateway_cancels += len(gone)
            self.gateways_gone[gw] = now
            log.warning("gateway gone: its requests cancelled", gateway=gw, cancelled=len(gone))


def trim_streams(r: redis.Redis, shard: P.Shard = P.Shard()) -> None:
    """The shard's ``mfs:req`` keeps what is pending (requests in flight) or unread; its ``mfs:done``
    what is unread."""
    for stream in (shard.req_stream, shard.done_stream):
        try:
            groups = {g["name"].decode() if isinstance(g["name"], bytes) else g["name"]: g
                      for g in r.xinfo_groups(stream)}
        except redis.ResponseError:  # no such stream (yet): nothing to trim
            continue
        g = groups.get(P.SCHEDULER_GROUP)
        if g is None:
            continue
        minid = g["last-delivered-id"]
        pend = r.xpending(stream, P.SCHEDULER_GROUP)
        if pend["pending"]:
            minid = pend["min"]
        r.xtrim(stream, minid=minid, approximate=False)
