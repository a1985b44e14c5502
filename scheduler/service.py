"""The scheduler process: the one place that decides what runs.

It consumes ``mfs:req`` (submit / cancel) and ``mfs:done`` (step results) through its consumer group,
keeps one StepScheduler per live worker (queues, block accounting, prefix cache, tier-mix limits),
places each new request on a worker that serves its tier, and keeps every worker busy with exactly one
step plan in flight.

Several scheduler processes may run; one leads. Leadership is a lease in Redis (``mfs:scheduler:leader``,
renewed every half second) and each new leader takes the next epoch (``mfs:scheduler:epoch``), which its
plans carry: a worker forgets the requests of an older epoch and refuses its plans. A ``submit`` stays
pending in the consumer group until its request ends, and the leader appends every request's output
tokens to ``mfs:progress:{request}``; so a standby that takes over claims the pending submits
(``XAUTOCLAIM``) and resumes each request from its prompt plus the tokens already produced, its token
events continuing at the next sequence number (the gateway drops duplicates). Losing the connection to
Redis is handled the same way: the leader steps down and takes over again with a new epoch, since plans
and results may have been lost with the last second of Redis's writes.

Placement is cache-aware: the worker the KV block directory (kvstore/) lists with the longest reusable
prefix of the prompt (its blocks, or its session's chains) wins, unless its load exceeds the least
loaded worker's by both an absolute and a relative threshold; then the least loaded one. The directory
keeps learning either way (it is told what each worker caches and evicts), and is only a hint: the
chosen worker's own block pool decides what is reused.

Owners: this module is the main loop and the stream handlers; the lease and takeover claims are
scheduler/leadership.py, the workers and placement scheduler/registry.py, the published gauges
scheduler/stats.py, reaping and trimming scheduler/housekeeping.py."""
from __future__ import annotations

import argparse
import dataclasses
import os
import time
from collections.abc import Callable

import redis
import structlog

from core import protocol as P
from core.keyrecords import decode_progress, encode_progress, scheduler_consumer
from core.cli import add_args, from_args
from core.logs import configure, install_stop_signals
from core.redisconn import RedisTarget, add_redis_args, connect, target_from_args
from core.sampling import finish_reason
from scheduler.housekeeping import GatewayReaper, trim_streams
from scheduler.leadership import Lease, claim_requests, drop_idle_consumers
from scheduler.plan import build_plan
from scheduler.config import SchedulerProcessConfig
from scheduler.registry import WorkerRegistry
from scheduler.request import InvalidRequest
from scheduler.stats import snapshot

__all__ = ["SchedulerProcessConfig", "SchedulerService", "main"]

log = structlog.get_logger(__name__)


class SchedulerService:
    def __init__(self, redis_target: RedisTarget | str, cfg: SchedulerProcessConfig | None = None,
                 consumer: str | None = None, clock: Callable[[], float] = time.monotonic):
        """``clock``: what the lease, the loop's periods (worker refresh, stats, housekeeping) and the step
        schedulers read; tests step one instead of sleeping."""
        self.clock = clock
        self.target = redis_target if isinstance(redis_target, RedisTarget) else RedisTarget.parse(redis_target)
        self.r = connect(self.target)
        self.cfg = cfg = cfg or SchedulerProcessConfig()
        self.consumer = consumer or scheduler_consumer(os.getpid())
        self.shard = P.Shard(cfg.shard)  # the shard it plans for: its streams, workers set, lease, epoch
        self.lease = Lease(self.r, self.consumer, cfg.lease_s, shard=self.shard, clock=clock)
        self.leader = False
        self.takeovers = 0
        self.registry = WorkerRegistry(self.r, cfg, shard=self.shard, clock=clock)
        self.reaper = GatewayReaper(self.r, clock)
        self._last_refresh = 0.0
        self._last_stats = 0.0
        self._last_gc = 0.0
        # Transport share of a step: plan sent -> result handled, against the worker's own step time.
        self.step_count = 0
        self.step_roundtrip_s = 0.0
        self.step_forward_s = 0.0
        self.forward_steps = 0  # forward steps run by those plans (multi-step plans run several)
        self.running = True
        # While a loop round runs, its one pipeline: every write of the round goes through it, in order
        # (a cancel's progress delete must follow the progress append of the step before it).
        self.round = None

    def setup(self) -> None:
        self.r.sadd(P.SHARDS_SET, self.shard.name)  # gateways route to the shards listed here
        for stream in (self.shard.req_stream, self.shard.done_stream):
            try:
                # from the start: submits that arrived before any scheduler did are served too
                self.r.xgroup_create(stream, P.SCHEDULER_GROUP, id="0", mkstream=True)
            except redis.ResponseError as e:
                if "BUSYGROUP" not in str(e):
                    raise

    def refresh_workers(self) -> None:
        """Follows the registrations; a lost worker's requests that no live worker can take fail."""
        for req, why in self.registry.refresh():
            self.fail(req.request_id, req.meta.get("gateway_id", ""), f"{why}; please retry", "worker_lost",
                      503, req.meta.get("entry"))

    # ---- messages ----------------------------------------------------------------------------
    def end(self, rid: str, entry: str | bytes | None, pipe=None) -> None:
        """A request is over (finished, failed, cancelled): its submit is acknowledged, its progress goes."""
        p = pipe if pipe is not None else self.round
        now = p is None
        if now:
            p = self.r.pipeline(transaction=False)
        if entry is not None:
            p.xack(self.shard.req_stream, P.SCHEDULER_GROUP, entry)
        p.delete(P.progress_key(rid))
        if now:
            p.execute()

    def end_entry(self, entry) -> None:
        if entry is not None:
            self.r.xack(self.shard.req_stream, P.SCHEDULER_GROUP, entry)

    def fail(self, rid: str, gateway: str, message: str, code: str, status: int, entry=None) -> None:
        self.end(rid, entry)
        if not gateway:
            return
        ev = P.TokenEvent(rid, 0, [], True, "error", error=message, error_code=code, status=status)
        (self.round or self.r).xadd(P.out_stream(gateway), ev.encode(), maxlen=P.STREAM_MAXLEN, approximate=True)

    def on_submit(self, s: P.Submit, entry: str | bytes | None = None, done: list[int] | None = None) -> None:
        """Places a new request; or, with ``done`` (tokens it already produced under a former leader),
        resumes it from its prompt plus those tokens."""
        reg = self.registry
        if s.request_id in reg.placement:  # the same submit twice (a client retried an XADD that landed)
            log.warning("duplicate submit ignored", request_id=s.request_id)
            self.end_entry(entry)
            return
        cands = reg.serving(s.tier)
        if not cands:  # a worker may have registered since the last refresh
            self.refresh_workers()
            cands = reg.serving(s.tier)
        if not cands:
            if reg.workers and s.tier not in reg.known_tiers():
                self.fail(s.request_id, s.gateway_id, f"unknown tier {s.tier}", "model_not_found", 404, entry)
            else:
                self.fail(s.request_id, s.gateway_id, "no live worker serves this tier yet; retry shortly",
                          "no_worker", 503, entry)
            return
        seq_offset = 0
        if done:
            cfg, max_tokens = cands[0].core.cfg, s.params.max_tokens
            if finish_reason(done[-1], len(done), len(s.prompt_ids) + len(done), max_tokens,
                             s.params.stop_ids(cfg.eos_token_ids), cfg.max_model_len):
                self.end(s.request_id, entry)  # it ended; only the acknowledgement was missing
                return
            s = dataclasses.replace(s, prompt_ids=s.prompt_ids + done,
                                    params=s.params.resumed(len(done)))
            seq_offset = len(done)
        w = reg.place(s, cands)
        try:
            w.core.add_request(s.request_id, s.prompt_ids, s.tier, s.params,
                               meta={"gateway_id": s.gateway_id, "arrival": s.arrival,
                                     "session_id": s.session_id, "entry": entry, "seq_offset": seq_offset,
                                     "follow": s.follow})
        except InvalidRequest as e:
            self.fail(s.request_id, s.gateway_id, str(e), e.code, e.status, entry)
            return
        reg.placement[s.request_id] = w.worker_id

    def on_cancel(self, c: P.Cancel) -> None:
        wid = self.registry.placement.pop(c.request_id, None)
        w = self.registry.workers.get(wid)
        req = w.core.requests.get(c.request_id) if w is not None else None
        if req is not None and w.core.abort_request(c.request_id):
            self.end(c.request_id, req.meta.get("entry"))
            log.info("request cancelled", request_id=c.request_id, reason=c.reason, worker=wid)

    def on_result(self, res: P.StepResult, pipe) -> None:
        """Folds a step's result into its worker's state; the Redis writes (submits acknowledged,
        progress appended) go into `pipe`, which the loop sends once per round."""
        w = self.registry.workers.get(res.worker)
        if w is None or w.inflight is None or res.step_id != w.step_id or res.epoch != self.lease.epoch:
            return  # a result for a plan from before a restart, or from a former leader's plan
        self.step_count += 1
        self.step_roundtrip_s += time.monotonic() - w.sent_at
        self.step_forward_s += res.forward_s
        self.forward_steps += max(map(len, res.decoded.values()), default=1)
        reqs = {r.request_id: r for r, _ in w.inflight.rows}
        reqs.update((r.request_id, r) for r, _, _ in w.inflight.verifies)
        for o in w.core.update(w.inflight, res.tokens, res.verified, res.accepted, res.escalate, res.drafts,
                               res.draft_conf, res.decoded):
            req = reqs[o.request_id]
            if o.finished:
                self.registry.placement.pop(o.request_id, None)
                self.end(o.request_id, req.meta.get("entry"), pipe)
                if req.meta.get("session_id") and w.core.cfg.prefix_caching:
                    full = req.num_computed_tokens // w.core.cfg.block_size
                    self.registry.directory.touch_session(req.meta["session_id"], w.worker_id, w.started, req.tier,
                                                          [c[:full] for c in req.block_hashes],
                                                          shard=self.shard.name)
            elif o.new_token_ids:  # what a new leader would resume it from
                key = P.progress_key(o.request_id)
                pipe.append(key, encode_progress(o.new_token_ids))
                if not req.meta.get("progress_ttl"):  # APPEND keeps a key's TTL: set it once
                    pipe.expire(key, P.PROGRESS_TTL_S)
                    req.meta["progress_ttl"] = True
        w.inflight = None

    def dispatch(self, pipe) -> None:
        """A step plan for every idle worker with work, into `pipe`."""
        for w in self.registry.workers.values():
            if w.inflight is not None or not w.core.has_unfinished():
                continue
            sched = w.core.schedule()
            if not (sched.rows or sched.drafts or sched.verifies or sched.catchups):
                continue
            w.step_id += 1
            steps = w.core.extend_decode(sched, self.cfg.decode_steps)
            plan = build_plan(sched, w.step_id, w.started, self.lease.epoch, steps, self.cfg.stream_interval)
            pipe.xadd(P.plan_stream(w.worker_id), plan.encode(), maxlen=P.STREAM_MAXLEN, approximate=True)
            w.inflight, w.sent_at = sched, time.monotonic()

    def write_stats(self) -> None:
        snap = snapshot(self.registry, leader=self.consumer, shard=self.shard.name, epoch=self.lease.epoch,
                        takeovers=self.takeovers,
                        gateway_cancels=self.reaper.gateway_cancels, steps=self.step_count,
                        step_roundtrip_s=self.step_roundtrip_s, step_forward_s=self.step_forward_s,
                        forward_steps=self.forward_steps)
        self.r.hset(P.STATS_KEY, self.shard.stats_field, snap.encode())

    # ---- leadership ----------------------------------------------------------------------------
    def try_lead(self) -> bool:
        if not self.lease.acquire():
            return False
        self.leader = True
        self.takeover()
        return True

    def renew(self) -> bool:
        """Keeps the lease; False (and the state dropped) when another scheduler has taken over."""
        if self.lease.renew():
            return True
        self.step_down("another scheduler took over")
        return False

    def renew_now(self) -> bool:
        """Renews at once (the lease lapsed locally); False, and stepped down, if it is no longer ours."""
        if self.lease.renew_now():
            return True
        self.step_down("the lease lapsed and another scheduler took over")
        return False

    def step_down(self, why: str) -> None:
        log.warning("no longer leading", consumer=self.consumer, epoch=self.lease.epoch, reason=why,
                    requests=len(self.registry.placement))
        self.lease.release()
        self.leader = False
        self.registry.clear()

    def takeover(self) -> None:
        """Rebuilds the state from Redis: the live workers, and every request whose submit is pending."""
        self.setup()
        self.registry.clear()
        self.refresh_workers()
        self._last_refresh = self.clock()
        subs, cancels, stale = claim_requests(self.r, self.consumer, self.shard)
        # Workers re-register within a heartbeat after Redis comes back: wait for them (up to their
        # TTL) rather than failing the requests in flight for want of a worker.
        deadline = time.monotonic() + P.WORKER_TTL_S + 1
        while subs and not self.registry.workers and time.monotonic() < deadline:
            time.sleep(0.25)
            self.lease.renew_now()
            self.refresh_workers()
        pipe = self.r.pipeline(transaction=False)
        for _, sub in subs:
            pipe.get(P.progress_key(sub.request_id))
        progress = pipe.execute() if subs else []
        for (entry_id, sub), raw in zip(subs, progress):
            self.on_submit(sub, entry_id, decode_progress(raw))
        for entry_id, c in cancels:
            self.on_cancel(c)
            self.r.xack(self.shard.req_stream, P.SCHEDULER_GROUP, entry_id)
        drop_idle_consumers(self.r, self.consumer, self.shard)
        self.takeovers += 1
        log.info("leading", consumer=self.consumer, shard=self.shard.name, epoch=self.lease.epoch, workers=sorted(self.registry.workers),
                 resumed=len(self.registry.placement), submits_pending=len(subs), stale_results=stale)

    # ---- the loop ----------------------------------------------------------------------------
    def _handle(self, resp, pipe) -> None:
        """The round's stream entries: submits, cancels, step results."""
        for stream, entries in resp or []:
            stream = stream.decode() if isinstance(stream, bytes) else stream
            for entry_id, fields in entries:
                pending = False  # a placed submit stays pending until its request ends
                try:
                    rec = P.decode(fields)
                    if isinstance(rec, P.Submit):
                        self.on_submit(rec, entry_id)
                        pending = True
                    elif isinstance(rec, P.Cancel):
                        self.on_cancel(rec)
                    elif isinstance(rec, P.StepResult):
                        self.on_result(rec, pipe)
                except (ValueError, TypeError, KeyError) as e:
                    log.error("bad stream entry dropped", stream=stream, entry=entry_id, error=str(e))
                if not pending:
                    pipe.xack(stream, P.SCHEDULER_GROUP, entry_id)

    def run_once(self) -> None:
        now = self.clock()
        if now - self._last_refresh > 0.5:
            self.refresh_workers()
            self._last_refresh = now
        busy = any(w.inflight is not None for w in self.registry.workers.values())
        # Results first: placement then sees the load and cache they leave behind.
        resp = self.r.xreadgroup(P.SCHEDULER_GROUP, self.consumer, {self.shard.done_stream: ">", self.shard.req_stream: ">"},
                                 count=256, block=100 if busy else 250)
        # One round trip for the round's writes: acks, progress, plans (they were one each).
        pipe = self.round = self.r.pipeline(transaction=False)
        try:
            self._handle(resp, pipe)
            self.dispatch(pipe)
            if not self.lease.held() and not self.renew_now():
                return  # fenced: a round prepared under a lapsed lease is not written (see Lease.held)
            if not self.lease.write(pipe):  # and fenced by Redis: the epoch moved while it was in flight
                self.step_down("another scheduler took over: Redis refused this leader's round (epoch moved)")
                return
        finally:
            self.round = None
        self.registry.flush_directory()
        if now - self._last_stats > 0.5:
            self.write_stats()
            self._last_stats = now
        if now - self._last_gc > self.cfg.housekeeping_s:  # reaping gone gateways, trimming streams
            self.reaper.reap_gateways(self.registry, self.end)
            trim_streams(self.r, self.shard)
            self._last_gc = now

    def run(self, standby_poll_s: float = 0.5) -> None:
        backoff, down_since = 0.1, None
        log.info("scheduler started", consumer=self.consumer, shard=self.shard.name, redis=self.target.describe(), config=str(self.cfg))
        while self.running:
            try:
                if down_since is not None:
                    self.r.ping()
                    log.info("redis reachable again", down_s=round(time.monotonic() - down_since, 1))
                    down_since = None
                    if self.leader:  # plans and results may be lost with Redis's last writes: start over
                        self.step_down("the connection to Redis was lost")
                if not self.leader:
                    self.setup()
                    if not self.try_lead():
                        time.sleep(standby_poll_s)
                        continue
                if self.renew():
                    self.run_once()
                backoff = 0.1
            except redis.ResponseError as e:
                if "NOGROUP" not in str(e):
                    raise
                log.warning("consumer group lost (Redis restarted without it); starting over")
                if self.leader:
                    self.step_down("the consumer group was lost")
            except (redis.ConnectionError, redis.TimeoutError) as e:
                if down_since is None:
                    down_since = time.monotonic()
                    log.warning("redis unavailable; retrying with backoff", error=str(e))
                time.sleep(backoff)
                backoff = min(2.0, backoff * 2)
        if self.leader:
            self.step_down("stopping")



def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m scheduler", description="MFS scheduler process")
    add_redis_args(p)
    add_args(p, SchedulerProcessConfig)
    args = p.parse_args(argv)
    configure(json_lines=True)
    install_stop_signals()
    svc = SchedulerService(target_from_args(args), from_args(SchedulerProcessConfig, args))
    try:
        svc.run()
    except KeyboardInterrupt:
        pass
    finally:
        if svc.leader:  # hand the lease over now rather than when it expires
            svc.step_down("stopping")
    return 0
