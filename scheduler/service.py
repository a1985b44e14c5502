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
chosen worker's own block pool decides what is reused."""
from __future__ import annotations

import argparse
import dataclasses
import os
import socket
import time
from dataclasses import dataclass, field

import redis
import structlog

from core import protocol as P
from core.sampling import finish_reason
from kvstore.directory import BlockDirectory, common_blocks
from scheduler.core import InvalidRequest, ScheduledStep, SchedulerConfig, StepScheduler
from scheduler.plan import build_plan

log = structlog.get_logger(__name__)


@dataclass(slots=True)
class WorkerState:
    worker_id: str
    started: str
    tiers: list[int]
    core: StepScheduler
    inflight: ScheduledStep | None = None
    step_id: int = 0
    sent_at: float = 0.0


@dataclass(slots=True)
class Limits:
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 64
    max_tiers_per_step: int = 0
    path_switches_per_s: float = 0.0
    kv_quota: dict[int, float] = field(default_factory=dict)
    prefix_caching: bool = True
    cache_ttl_s: float = 0.0          # uncache a worker's unused blocks after this long (0: never)
    directory_ttl_s: float = 600.0    # directory entries expire unless refreshed
    affinity_abs: int = 4             # affinity yields when the preferred worker has more than this many
    affinity_rel: float = 1.5         # ...requests above the least loaded AND more than this times as many
    spec_min_acceptance: float = 0.3  # speculation gate: a tier pair below this acceptance...
    spec_probe_every: int = 16        # ...starts a round only every this many chances


# Take the lease and the next epoch (above every epoch a worker has seen: Redis may have lost the counter).
_ACQUIRE = """
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  local e = redis.call('INCR', KEYS[2])
  local floor = tonumber(ARGV[3])
  if e <= floor then e = floor + 1; redis.call('SET', KEYS[2], e) end
  return e
end
return 0
"""
# Extend the lease; if it lapsed and nobody took over since (the epoch is still ours), take it back.
_RENEW = """
local v = redis.call('GET', KEYS[1])
if v == ARGV[1] then redis.call('PEXPIRE', KEYS[1], ARGV[2]); return 1 end
if (not v) and redis.call('GET', KEYS[2]) == ARGV[3] then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2]); return 1
end
return 0
"""
_RELEASE = "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0"


class SchedulerService:
    def __init__(self, redis_url: str, limits: Limits, consumer: str | None = None, lease_s: float = 3.0):
        self.r = redis.Redis.from_url(redis_url)
        self.limits = limits
        # unique per process across hosts: two containers both run their scheduler as pid 1
        self.consumer = consumer or f"sched-{socket.gethostname()}-{os.getpid()}"
        self.lease_ms = int(lease_s * 1000)
        self.leader = False
        self.epoch = 0
        self.takeovers = 0
        self._last_renew = 0.0
        self._last_gc = 0.0
        self._acquire = self.r.register_script(_ACQUIRE)
        self._renew = self.r.register_script(_RENEW)
        self._release_lease = self.r.register_script(_RELEASE)
        self.gateways_seen: set[str] = set()  # gateways whose heartbeat was seen (their loss cancels)
        self.gateways_gone: dict[str, float] = {}  # -> when: a step in flight may still write its stream
        self.gateway_cancels = 0
        self.workers: dict[str, WorkerState] = {}
        self.placement: dict[str, str] = {}  # request id -> worker id
        self._last_refresh = 0.0
        self._last_stats = 0.0
        self.replanned = 0
        self.directory = BlockDirectory(self.r, limits.directory_ttl_s)
        self.affinity_preferred = 0   # requests with a worker listed as holding their prefix
        self.affinity_yielded = 0     # ...that went to a less loaded worker instead
        # Transport share of a step: plan sent -> result handled, against the worker's own step time.
        self.step_count = 0
        self.step_roundtrip_s = 0.0
        self.step_forward_s = 0.0
        self.running = True

    def setup(self) -> None:
        for stream in (P.REQ_STREAM, P.DONE_STREAM):
            try:
                # from the start: submits that arrived before any scheduler did are served too
                self.r.xgroup_create(stream, P.SCHEDULER_GROUP, id="0", mkstream=True)
            except redis.ResponseError as e:
                if "BUSYGROUP" not in str(e):
                    raise

    # ---- workers -----------------------------------------------------------------------------
    def refresh_workers(self) -> None:
        ids = {m.decode() for m in self.r.smembers(P.WORKERS_SET)}
        for wid in ids:
            raw = self.r.hgetall(P.worker_key(wid))
            if not raw:
                self.r.srem(P.WORKERS_SET, wid)
                continue
            info = P.WorkerInfo.from_hash(raw)
            if info is None:  # a heartbeat after a Redis restart; the full hash follows
                continue
            w = self.workers.get(wid)
            if w is not None and w.started == info.started:
                continue
            if w is not None:
                self.lose_worker(wid, "the worker restarted")
            self.workers[wid] = self._new_worker(wid, info)
        for wid in list(self.workers):
            if wid not in ids or not self.r.exists(P.worker_key(wid)):
                self.lose_worker(wid, "the worker stopped answering")

    def _new_worker(self, wid: str, info: P.WorkerInfo) -> WorkerState:
        tiers = info.tiers
        standalone = len(tiers) == 1 and info.num_tiers > 1
        lim = self.limits
        cfg = SchedulerConfig(
            num_tiers=info.num_tiers if not standalone else 1,
            num_blocks=list(info.num_blocks), block_size=info.block_size,
            max_num_batched_tokens=lim.max_num_batched_tokens, max_num_seqs=lim.max_num_seqs,
            max_model_len=info.max_model_len, max_tiers_per_step=lim.max_tiers_per_step,
            path_switches_per_s=lim.path_switches_per_s, kv_quota=dict(lim.kv_quota),
            served_tiers=tuple(tiers) if standalone else None,
            eos_token_ids=tuple(info.eos), vocab_size=info.vocab_size,
            enable_prefix_caching=lim.prefix_caching, cache_ttl_s=lim.cache_ttl_s,
            spec_min_acceptance=lim.spec_min_acceptance, spec_probe_every=lim.spec_probe_every)
        if standalone:  # a standalone copy keeps global tier numbers for validation, one segment
            cfg.num_tiers = max(tiers) + 1
            cfg.num_blocks = cfg.num_blocks * cfg.num_tiers
        log.info("worker joined", worker=wid, tiers=tiers, blocks=cfg.num_blocks[:1])
        core = StepScheduler(cfg)
        core.cache_log = []
        self.directory.drop_worker(wid)  # whatever a previous life of this id (or scheduler) listed
        return WorkerState(wid, info.started, tiers, core)

    def lose_worker(self, wid: str, why: str) -> None:
        w = self.workers.pop(wid, None)
        if w is None:
            return
        log.warning("worker lost", worker=wid, reason=why, requests=len(w.core.requests))
        self.directory.drop_worker(wid)
        for rid, req in list(w.core.requests.items()):
            self.placement.pop(rid, None)
            if not self.replan(req):
                self.fail(rid, req.meta.get("gateway_id", ""), f"{why}; please retry", "worker_lost", 503,
                          req.meta.get("entry"))

    def replan(self, req) -> bool:
        """Moves a lost worker's request to a live one: it is prefilled again from its prompt plus the
        tokens already streamed, and its token events continue at the next sequence number."""
        cands = [w for w in self.workers.values() if req.tier in w.tiers]
        remaining = req.params.max_tokens - len(req.output_ids)
        if not cands or remaining <= 0:
            return False
        w = min(cands, key=lambda w: w.core.num_unfinished())
        meta = dict(req.meta, seq_offset=req.meta.get("seq_offset", 0) + len(req.output_ids))
        params = dataclasses.replace(req.params, max_tokens=remaining)
        try:
            w.core.add_request(req.request_id, req.prompt_ids + req.output_ids, req.tier, params, meta=meta)
        except InvalidRequest as e:
            log.warning("re-plan refused", request_id=req.request_id, error=str(e))
            return False
        self.placement[req.request_id] = w.worker_id
        self.replanned += 1
        log.info("request re-planned", request_id=req.request_id, worker=w.worker_id,
                 streamed=len(req.output_ids))
        return True

    # ---- messages ----------------------------------------------------------------------------
    def end(self, rid: str, entry: str | bytes | None, pipe=None) -> None:
        """A request is over (finished, failed, cancelled): its submit is acknowledged, its progress goes."""
        p = pipe if pipe is not None else self.r.pipeline(transaction=False)
        if entry is not None:
            p.xack(P.REQ_STREAM, P.SCHEDULER_GROUP, entry)
        p.delete(P.progress_key(rid))
        if pipe is None:
            p.execute()

    def end_entry(self, entry) -> None:
        if entry is not None:
            self.r.xack(P.REQ_STREAM, P.SCHEDULER_GROUP, entry)

    def fail(self, rid: str, gateway: str, message: str, code: str, status: int, entry=None) -> None:
        self.end(rid, entry)
        if not gateway:
            return
        ev = P.TokenEvent(rid, 0, [], True, "error", error=message, error_code=code, status=status)
        self.r.xadd(P.out_stream(gateway), ev.encode(), maxlen=P.STREAM_MAXLEN, approximate=True)

    def on_submit(self, s: P.Submit, entry: str | bytes | None = None, done: list[int] | None = None) -> None:
        """Places a new request; or, with ``done`` (tokens it already produced under a former leader),
        resumes it from its prompt plus those tokens."""
        if s.request_id in self.placement:  # the same submit twice (a client retried an XADD that landed)
            log.warning("duplicate submit ignored", request_id=s.request_id)
            self.end_entry(entry)
            return
        cands = [w for w in self.workers.values() if s.tier in w.tiers]
        if not cands:  # a worker may have registered since the last refresh
            self.refresh_workers()
            cands = [w for w in self.workers.values() if s.tier in w.tiers]
        if not cands:
            known = {t for w in self.workers.values() for t in range(w.core.cfg.num_tiers)}
            if self.workers and s.tier not in known:
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
                                    params=dataclasses.replace(s.params, max_tokens=max_tokens - len(done)))
            seq_offset = len(done)
        w = self.place(s, cands)
        try:
            w.core.add_request(s.request_id, s.prompt_ids, s.tier, s.params,
                               meta={"gateway_id": s.gateway_id, "arrival": s.arrival,
                                     "session_id": s.session_id, "entry": entry, "seq_offset": seq_offset})
        except InvalidRequest as e:
            self.fail(s.request_id, s.gateway_id, str(e), e.code, e.status, entry)
            return
        self.placement[s.request_id] = w.worker_id

    def place(self, s: P.Submit, cands: list[WorkerState]) -> WorkerState:
        """The worker with the longest reusable prefix of the prompt, unless it is overloaded;
        otherwise the least loaded one."""
        def load(w: WorkerState) -> tuple[int, int]:
            return w.core.num_unfinished(), sum(p.num_used for p in w.core.pools)
        least = min(cands, key=load)
        if not self.limits.prefix_caching:
            return least
        try:
            cached = self.cached_blocks(s, cands)
        except (redis.RedisError, OverflowError) as e:  # a hint only: place by load without it
            log.warning("no cache-aware placement", request_id=s.request_id, error=str(e))
            return least
        best = max(cands, key=lambda w: (cached[w.worker_id], -load(w)[0]))
        if cached[best.worker_id] == 0:
            return least
        self.affinity_preferred += 1
        lb, ll = load(best)[0], load(least)[0]
        if lb - ll > self.limits.affinity_abs and lb > self.limits.affinity_rel * ll:
            self.affinity_yielded += 1
            log.info("affinity yields to load", request_id=s.request_id, preferred=best.worker_id,
                     load=lb, chosen=least.worker_id, least_load=ll)
            return least
        return best

    def cached_blocks(self, s: P.Submit, cands: list[WorkerState]) -> dict[str, int]:
        """Per candidate: leading prompt blocks the directory lists it as holding (its blocks, or the
        chains of the request's session if the session last ran there)."""
        entry = self.directory.session(s.session_id) if s.session_id else None
        groups: dict[tuple, list[WorkerState]] = {}
        for w in cands:  # workers with the same block size and layout hash a prompt alike
            groups.setdefault((w.core.cfg.block_size, w.core.cfg.served_tiers), []).append(w)
        out: dict[str, int] = {}
        for ws in groups.values():
            chains = ws[0].core.prefix_hashes(s.prompt_ids, s.tier)
            out.update(self.directory.held_blocks(chains, [w.worker_id for w in ws]))
            for w in ws:
                if entry is not None and entry.worker == w.worker_id and entry.started == w.started:
                    out[w.worker_id] = max(out[w.worker_id], common_blocks(chains, entry.chains))
        return out

    def on_cancel(self, c: P.Cancel) -> None:
        wid = self.placement.pop(c.request_id, None)
        w = self.workers.get(wid)
        req = w.core.requests.get(c.request_id) if w is not None else None
        if req is not None and w.core.abort_request(c.request_id):
            self.end(c.request_id, req.meta.get("entry"))
            log.info("request cancelled", request_id=c.request_id, reason=c.reason, worker=wid)

    def on_result(self, res: P.StepResult) -> None:
        w = self.workers.get(res.worker)
        if w is None or w.inflight is None or res.step_id != w.step_id or res.epoch != self.epoch:
            return  # a result for a plan from before a restart, or from a former leader's plan
        self.step_count += 1
        self.step_roundtrip_s += time.monotonic() - w.sent_at
        self.step_forward_s += res.forward_s
        reqs = {r.request_id: r for r, _ in w.inflight.rows}
        reqs.update((r.request_id, r) for r, _, _ in w.inflight.verifies)
        pipe = self.r.pipeline(transaction=False)
        for o in w.core.update(w.inflight, res.tokens, res.verified, res.accepted, res.escalate, res.drafts,
                               res.draft_conf):
            req = reqs[o.request_id]
            if o.finished:
                self.placement.pop(o.request_id, None)
                self.end(o.request_id, req.meta.get("entry"), pipe)
                if req.meta.get("session_id") and w.core.cfg.enable_prefix_caching:
                    full = req.num_computed_tokens // w.core.cfg.block_size
                    self.directory.touch_session(req.meta["session_id"], w.worker_id, w.started, req.tier,
                                                 [c[:full] for c in req.block_hashes])
            elif o.new_token_ids:  # what a new leader would resume it from
                key = P.progress_key(o.request_id)
                pipe.append(key, P.encode_progress(o.new_token_ids))
                pipe.expire(key, P.PROGRESS_TTL_S)
        pipe.execute()
        w.inflight = None

    def dispatch(self) -> None:
        for w in self.workers.values():
            if w.inflight is not None or not w.core.has_unfinished():
                continue
            sched = w.core.schedule()
            if not (sched.rows or sched.drafts or sched.verifies or sched.catchups):
                continue
            w.step_id += 1
            plan = build_plan(sched, w.step_id, w.started, self.epoch)
            self.r.xadd(P.plan_stream(w.worker_id), plan.encode(), maxlen=P.STREAM_MAXLEN, approximate=True)
            w.inflight, w.sent_at = sched, time.monotonic()

    def flush_directory(self) -> None:
        """Tells the directory what each worker's pools cached and evicted since the last flush."""
        for w in self.workers.values():
            changes = w.core.drain_cache_log()
            if changes:
                self.directory.record(w.worker_id, changes)

    def write_stats(self) -> None:
        waiting: dict[int, int] = {}
        running: dict[int, int] = {}
        used, total = {}, {}
        sw = pre = gated = 0
        cache = {k: {} for k in ("prefill_computed", "prefill_reused", "cache_queries", "cache_hits",
                                 "evictions")}
        held = {}
        spec: dict[str, dict[str, int]] = {}
        escal: dict[str, int] = {}
        for w in self.workers.values():
            for pair, (rounds, proposed, accepted, committed) in w.core.stats.spec_pairs.items():
                d = spec.setdefault(pair, {"rounds": 0, "proposed": 0, "accepted": 0, "committed": 0})
                d["rounds"] += rounds
                d["proposed"] += proposed
                d["accepted"] += accepted
                d["committed"] += committed
            for pair, n in w.core.stats.escalations.items():
                escal[pair] = escal.get(pair, 0) + n
            for r in w.core.waiting:
                waiting[r.tier] = waiting.get(r.tier, 0) + 1
            for r in w.core.running:
                running[r.tier] = running.get(r.tier, 0) + 1
            used[w.worker_id], total[w.worker_id] = w.core.kv_usage()
            sw += w.core.stats.path_switches
            pre += w.core.stats.preemptions
            gated += w.core.stats.spec_gated
            for k, per_seg in cache.items():
                for seg, v in enumerate(getattr(w.core.stats, k)):
                    per_seg[seg] = per_seg.get(seg, 0) + v
            held[w.worker_id] = self.directory.num_held(w.worker_id)
        snap = P.StatsSnapshot(
            leader=self.consumer, epoch=self.epoch, takeovers=self.takeovers, updated=time.time(),
            workers=len(self.workers), waiting=waiting, running=running, kv_blocks_used=used,
            kv_blocks_total=total, path_switches=sw, preemptions=pre, replanned=self.replanned,
            gateway_cancels=self.gateway_cancels, steps=self.step_count, step_roundtrip_s=self.step_roundtrip_s,
            step_forward_s=self.step_forward_s, **cache, directory_blocks=held,
            affinity_preferred=self.affinity_preferred, affinity_yielded=self.affinity_yielded, spec=spec,
            spec_gated=gated, escalations_by_pair=escal, escalations=sum(escal.values()))
        self.r.hset(P.STATS_KEY, "scheduler", snap.encode())

    # ---- leadership ----------------------------------------------------------------------------
    def try_lead(self) -> bool:
        floor = 0
        for wid in self.r.smembers(P.WORKERS_SET):
            e = self.r.hget(P.worker_key(wid.decode()), "epoch")
            floor = max(floor, int(e or 0))
        epoch = int(self._acquire(keys=[P.LEADER_KEY, P.EPOCH_KEY], args=[self.consumer, self.lease_ms, floor]))
        if not epoch:
            return False
        self.leader, self.epoch = True, epoch
        self._last_renew = time.monotonic()
        self.takeover()
        return True

    def renew(self) -> bool:
        """Keeps the lease; False (and the state dropped) when another scheduler has taken over."""
        if time.monotonic() - self._last_renew < 0.5:
            return True
        if self._renew(keys=[P.LEADER_KEY, P.EPOCH_KEY], args=[self.consumer, self.lease_ms, self.epoch]):
            self._last_renew = time.monotonic()
            return True
        self.step_down("another scheduler took over")
        return False

    def step_down(self, why: str) -> None:
        log.warning("no longer leading", consumer=self.consumer, epoch=self.epoch, reason=why,
                    requests=len(self.placement))
        try:
            self._release_lease(keys=[P.LEADER_KEY], args=[self.consumer])
        except redis.RedisError:
            pass
        self.leader = False
        self.workers.clear()
        self.placement.clear()

    def _claim(self, stream: str):
        """Every entry pending in the group (whoever read it), now this consumer's."""
        start = "0-0"
        while True:
            res = self.r.xautoclaim(stream, P.SCHEDULER_GROUP, self.consumer, 0, start_id=start, count=500)
            start, entries = res[0], res[1]
            yield from entries
            if start in (b"0-0", "0-0"):
                return

    def takeover(self) -> None:
        """Rebuilds the state from Redis: the live workers, and every request whose submit is pending."""
        self.setup()
        self.workers.clear()
        self.placement.clear()
        self.refresh_workers()
        self._last_refresh = time.monotonic()
        stale = 0
        for entry_id, _ in self._claim(P.DONE_STREAM):  # results of a former leader's plans
            self.r.xack(P.DONE_STREAM, P.SCHEDULER_GROUP, entry_id)
            stale += 1
        subs, cancels = [], []
        for entry_id, fields in self._claim(P.REQ_STREAM):
            try:
                rec = P.decode(fields) if fields else None
            except (ValueError, TypeError, KeyError):
                rec = None
            if isinstance(rec, P.Submit):
                subs.append((entry_id, rec))
            elif isinstance(rec, P.Cancel):
                cancels.append((entry_id, rec))
            else:  # trimmed away or unreadable
                self.r.xack(P.REQ_STREAM, P.SCHEDULER_GROUP, entry_id)
        # Workers re-register within a heartbeat after Redis comes back: wait for them (up to their
        # TTL) rather than failing the requests in flight for want of a worker.
        deadline = time.monotonic() + P.WORKER_TTL_S + 1
        while subs and not self.workers and time.monotonic() < deadline:
            time.sleep(0.25)
            self._renew(keys=[P.LEADER_KEY, P.EPOCH_KEY], args=[self.consumer, self.lease_ms, self.epoch])
            self.refresh_workers()
        pipe = self.r.pipeline(transaction=False)
        for _, sub in subs:
            pipe.get(P.progress_key(sub.request_id))
        progress = pipe.execute() if subs else []
        for (entry_id, sub), raw in zip(subs, progress):
            self.on_submit(sub, entry_id, P.decode_progress(raw))
        for entry_id, c in cancels:
            self.on_cancel(c)
            self.r.xack(P.REQ_STREAM, P.SCHEDULER_GROUP, entry_id)
        for stream in (P.REQ_STREAM, P.DONE_STREAM):  # former leaders' consumers hold nothing now
            for c in self.r.xinfo_consumers(stream, P.SCHEDULER_GROUP):
                name = c["name"].decode() if isinstance(c["name"], bytes) else c["name"]
                if name != self.consumer and not c["pending"]:
                    self.r.xgroup_delconsumer(stream, P.SCHEDULER_GROUP, name)
        self.takeovers += 1
        log.info("leading", consumer=self.consumer, epoch=self.epoch, workers=sorted(self.workers),
                 resumed=len(self.placement), submits_pending=len(subs), stale_results=stale)

    # ---- housekeeping --------------------------------------------------------------------------
    def reap_gateways(self) -> None:
        """Requests of a gateway whose heartbeat stopped (it died or restarted under a new id) are
        cancelled: their KV is freed and their submits acknowledged; its output stream is deleted."""
        by_gw: dict[str, list[tuple[WorkerState, str]]] = {}
        for w in self.workers.values():
            for rid, req in w.core.requests.items():
                gw = req.meta.get("gateway_id")
                if gw:
                    by_gw.setdefault(gw, []).append((w, rid))
        now = time.monotonic()
        for gw, t in list(self.gateways_gone.items()):
            self.r.delete(P.out_stream(gw))
            if now - t > 30:
                del self.gateways_gone[gw]
        ids = sorted(set(by_gw) | self.gateways_seen)
        pipe = self.r.pipeline(transaction=False)
        for gw in ids:
            pipe.exists(P.gateway_key(gw))
        for gw, alive in zip(ids, pipe.execute() if ids else []):
            if alive:
                self.gateways_seen.add(gw)
                continue
            if gw not in self.gateways_seen:
                continue  # never seen alive: a client of the streams that keeps no heartbeat
            self.gateways_seen.discard(gw)
            gone = by_gw.get(gw, [])
            for w, rid in gone:
                req = w.core.requests.get(rid)
                if req is not None and w.core.abort_request(rid):
                    self.placement.pop(rid, None)
                    self.end(rid, req.meta.get("entry"))
            self.gateway_cancels += len(gone)
            self.r.delete(P.out_stream(gw))
            self.gateways_gone[gw] = now
            log.warning("gateway gone: its requests cancelled", gateway=gw, cancelled=len(gone))

    def trim_streams(self) -> None:
        """``mfs:req`` keeps what is pending (requests in flight) or unread; ``mfs:done`` what is unread."""
        for stream in (P.REQ_STREAM, P.DONE_STREAM):
            try:
                groups = {g["name"].decode() if isinstance(g["name"], bytes) else g["name"]: g
                          for g in self.r.xinfo_groups(stream)}
            except redis.ResponseError:  # no such stream (yet): nothing to trim
                continue
            g = groups.get(P.SCHEDULER_GROUP)
            if g is None:
                continue
            minid = g["last-delivered-id"]
            pend = self.r.xpending(stream, P.SCHEDULER_GROUP)
            if pend["pending"]:
                minid = pend["min"]
            self.r.xtrim(stream, minid=minid, approximate=False)

    # ---- the loop ----------------------------------------------------------------------------
    def run_once(self) -> None:
        now = time.monotonic()
        if now - self._last_refresh > 0.5:
            self.refresh_workers()
            self._last_refresh = now
        busy = any(w.inflight is not None for w in self.workers.values())
        # Results first: placement then sees the load and cache they leave behind.
        resp = self.r.xreadgroup(P.SCHEDULER_GROUP, self.consumer, {P.DONE_STREAM: ">", P.REQ_STREAM: ">"},
                                 count=256, block=100 if busy else 250)
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
                        self.on_result(rec)
                except (ValueError, TypeError, KeyError) as e:
                    log.error("bad stream entry dropped", stream=stream, entry=entry_id, error=str(e))
                if not pending:
                    self.r.xack(stream, P.SCHEDULER_GROUP, entry_id)
        self.dispatch()
        self.flush_directory()
        if now - self._last_stats > 0.5:
            self.write_stats()
            self._last_stats = now
        if now - self._last_gc > 2.0:
            self.reap_gateways()
            self.trim_streams()
            self._last_gc = now

    def run(self, standby_poll_s: float = 0.5) -> None:
        backoff, down_since = 0.1, None
        log.info("scheduler started", consumer=self.consumer, limits=str(self.limits))
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


def parse_quota(spec: str | None) -> dict[int, float]:
    out = {}
    for part in (spec or "").split(","):
        if part.strip():
            k, _, v = part.partition("=")
            out[int(k)] = float(v)
    return out


def main(argv: list[str] | None = None) -> int:
    from mfs.launch import install_stop_signals  # noqa: PLC0415
    from mfs.logs import configure  # noqa: PLC0415
    p = argparse.ArgumentParser(prog="python -m scheduler", description="MFS scheduler process")
    p.add_argument("--redis-url", default=os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0"))
    p.add_argument("--max-num-batched-tokens", type=int, default=512, help="per-step token budget")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-tiers-per-step", type=int, default=0, help="0: a step may mix every tier")
    p.add_argument("--path-switches-per-s", type=float, default=0.0,
                   help="how often a worker's tier mix may change per second (0: unlimited)")
    p.add_argument("--kv-quota", default=None, help="tier=share of segment-0 blocks, e.g. 0=0.6,1=0.3")
    p.add_argument("--no-prefix-caching", action="store_true",
                   help="free a request's KV blocks when it ends (no reuse, no cache-aware placement)")
    p.add_argument("--cache-ttl-s", type=float, default=0.0,
                   help="uncache KV blocks unused this long (0: only when a pool needs room)")
    p.add_argument("--directory-ttl-s", type=float, default=600.0, help="lifetime of KV directory entries")
    p.add_argument("--affinity-abs-threshold", type=int, default=4,
                   help="cache affinity yields when the preferred worker has more than this many requests "
                        "above the least loaded one...")
    p.add_argument("--affinity-rel-threshold", type=float, default=1.5,
                   help="...and more than this times as many")
    p.add_argument("--spec-min-acceptance", type=float, default=0.3,
                   help="self-speculation gate: while a draft>target tier pair accepts less than this share "
                        "of its drafts, its requests start a round only every --spec-probe-every chances")
    p.add_argument("--spec-probe-every", type=int, default=16)
    p.add_argument("--lease-s", type=float, default=3.0,
                   help="leadership lease: a standby takes over this long after the leader stops renewing")
    args = p.parse_args(argv)
    configure(json_lines=True)
    install_stop_signals()
    svc = SchedulerService(args.redis_url, Limits(
        args.max_num_batched_tokens, args.max_num_seqs, args.max_tiers_per_step, args.path_switches_per_s,
        parse_quota(args.kv_quota), prefix_caching=not args.no_prefix_caching, cache_ttl_s=args.cache_ttl_s,
        directory_ttl_s=args.directory_ttl_s, affinity_abs=args.affinity_abs_threshold,
        affinity_rel=args.affinity_rel_threshold, spec_min_acceptance=args.spec_min_acceptance,
        spec_probe_every=args.spec_probe_every), lease_s=args.lease_s)
    try:
        svc.run()
    except KeyboardInterrupt:
        pass
    finally:
        if svc.leader:  # hand the lease over now rather than when it expires
            svc.step_down("stopping")
    return 0
