"""The scheduler process: the one place that decides what runs.

It consumes ``mfs:req`` (submit / cancel) and ``mfs:done`` (step results) through its consumer group,
keeps one StepScheduler per live worker (queues, block accounting, prefix cache, tier-mix limits),
places each new request on a worker that serves its tier, and keeps every worker busy with exactly one
step plan in flight. Entries are acknowledged after they are handled.

Placement is cache-aware: the worker the KV block directory (kvstore/) lists with the longest reusable
prefix of the prompt (its blocks, or its session's chains) wins, unless its load exceeds the least
loaded worker's by both an absolute and a relative threshold; then the least loaded one. The directory
keeps learning either way (it is told what each worker caches and evicts), and is only a hint: the
chosen worker's own block pool decides what is reused."""
from __future__ import annotations

import argparse
import dataclasses
import os
import time
from dataclasses import dataclass, field

import msgpack
import redis
import structlog

from kvstore.directory import BlockDirectory, common_blocks
from mfs import protocol as P
from scheduler.core import InvalidRequest, ScheduledStep, SchedulerConfig, StepScheduler
from worker.sampling import SamplingParams

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


class SchedulerService:
    def __init__(self, redis_url: str, limits: Limits, consumer: str | None = None):
        self.r = redis.Redis.from_url(redis_url)
        self.limits = limits
        self.consumer = consumer or f"sched-{os.getpid()}"
        self.workers: dict[str, WorkerState] = {}
        self.placement: dict[str, str] = {}  # request id -> worker id
        self._last_refresh = 0.0
        self._last_stats = 0.0
        self.escalations = 0
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
                self.r.xgroup_create(stream, P.SCHEDULER_GROUP, id="$", mkstream=True)
            except redis.ResponseError as e:
                if "BUSYGROUP" not in str(e):
                    raise

    # ---- workers -----------------------------------------------------------------------------
    def refresh_workers(self) -> None:
        ids = {m.decode() for m in self.r.smembers(P.WORKERS_SET)}
        for wid in ids:
            info = self.r.hgetall(P.worker_key(wid))
            if not info:
                self.r.srem(P.WORKERS_SET, wid)
                continue
            started = info[b"started"].decode()
            w = self.workers.get(wid)
            if w is not None and w.started == started:
                continue
            if w is not None:
                self.lose_worker(wid, "the worker restarted")
            self.workers[wid] = self._new_worker(wid, info)
        for wid in list(self.workers):
            if wid not in ids or not self.r.exists(P.worker_key(wid)):
                self.lose_worker(wid, "the worker stopped answering")

    def _new_worker(self, wid: str, info: dict) -> WorkerState:
        tiers = msgpack.unpackb(info[b"tiers"])
        num_tiers = int(info[b"num_tiers"])
        standalone = len(tiers) == 1 and num_tiers > 1
        lim = self.limits
        cfg = SchedulerConfig(
            num_tiers=num_tiers if not standalone else 1,
            num_blocks=msgpack.unpackb(info[b"num_blocks"]), block_size=int(info[b"block_size"]),
            max_num_batched_tokens=lim.max_num_batched_tokens, max_num_seqs=lim.max_num_seqs,
            max_model_len=int(info[b"max_model_len"]), max_tiers_per_step=lim.max_tiers_per_step,
            path_switches_per_s=lim.path_switches_per_s, kv_quota=dict(lim.kv_quota),
            served_tiers=tuple(tiers) if standalone else None,
            eos_token_ids=tuple(msgpack.unpackb(info[b"eos"])), vocab_size=int(info[b"vocab_size"]),
            enable_prefix_caching=lim.prefix_caching, cache_ttl_s=lim.cache_ttl_s)
        if standalone:  # a standalone copy keeps global tier numbers for validation, one segment
            cfg.num_tiers = max(tiers) + 1
            cfg.num_blocks = cfg.num_blocks * cfg.num_tiers
        log.info("worker joined", worker=wid, tiers=tiers, blocks=cfg.num_blocks[:1])
        core = StepScheduler(cfg)
        core.cache_log = []
        self.directory.drop_worker(wid)  # whatever a previous life of this id (or scheduler) listed
        return WorkerState(wid, info[b"started"].decode(), tiers, core)

    def lose_worker(self, wid: str, why: str) -> None:
        w = self.workers.pop(wid, None)
        if w is None:
            return
        log.warning("worker lost", worker=wid, reason=why, requests=len(w.core.requests))
        self.directory.drop_worker(wid)
        for rid, req in list(w.core.requests.items()):
            self.placement.pop(rid, None)
            if not self.replan(req):
                self.fail(rid, req.meta.get("gateway_id", ""), f"{why}; please retry", "worker_lost", 503)

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
    def fail(self, rid: str, gateway: str, message: str, code: str, status: int) -> None:
        if not gateway:
            return
        ev = P.TokenEvent(rid, 0, [], True, "error", error=message, error_code=code, status=status)
        self.r.xadd(P.out_stream(gateway), ev.encode(), maxlen=P.STREAM_MAXLEN, approximate=True)

    def on_submit(self, s: P.Submit) -> None:
        cands = [w for w in self.workers.values() if s.tier in w.tiers]
        if not cands:  # a worker may have registered since the last refresh
            self.refresh_workers()
            cands = [w for w in self.workers.values() if s.tier in w.tiers]
        if not cands:
            known = {t for w in self.workers.values() for t in range(w.core.cfg.num_tiers)}
            if self.workers and s.tier not in known:
                self.fail(s.request_id, s.gateway_id, f"unknown tier {s.tier}", "model_not_found", 404)
            else:
                self.fail(s.request_id, s.gateway_id, "no live worker serves this tier yet; retry shortly",
                          "no_worker", 503)
            return
        w = self.place(s, cands)
        params = SamplingParams(max_tokens=s.max_tokens, temperature=s.temperature, top_p=s.top_p,
                                top_k=s.top_k, seed=s.seed, stop_token_ids=tuple(s.stop_token_ids),
                                ignore_eos=s.ignore_eos)
        try:
            w.core.add_request(s.request_id, s.prompt_ids, s.tier, params,
                               meta={"gateway_id": s.gateway_id, "arrival": s.arrival,
                                     "session_id": s.session_id})
        except InvalidRequest as e:
            self.fail(s.request_id, s.gateway_id, str(e), e.code, e.status)
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
        if wid in self.workers and self.workers[wid].core.abort_request(c.request_id):
            log.info("request cancelled", request_id=c.request_id, reason=c.reason, worker=wid)

    def on_result(self, res: P.StepResult) -> None:
        w = self.workers.get(res.worker)
        if w is None or w.inflight is None or res.step_id != w.step_id:
            return  # a result for a plan from before a restart
        self.step_count += 1
        self.step_roundtrip_s += time.monotonic() - w.sent_at
        self.step_forward_s += res.forward_s
        reqs = {r.request_id: r for r, _ in w.inflight.rows}
        for o in w.core.update(w.inflight, res.tokens):
            if o.finished:
                self.placement.pop(o.request_id, None)
                req = reqs[o.request_id]
                if req.meta.get("session_id") and w.core.cfg.enable_prefix_caching:
                    full = req.num_computed_tokens // w.core.cfg.block_size
                    self.directory.touch_session(req.meta["session_id"], w.worker_id, w.started, req.tier,
                                                 [c[:full] for c in req.block_hashes])
        w.inflight = None

    def dispatch(self) -> None:
        for w in self.workers.values():
            if w.inflight is not None or not w.core.has_unfinished():
                continue
            sched = w.core.schedule()
            if not sched.rows:
                continue
            w.step_id += 1
            plan = P.StepPlan(
                w.step_id,
                new=[{"request_id": r.request_id, "gateway_id": r.meta.get("gateway_id", ""),
                      "tier": r.tier, "prompt_len": len(r.prompt_ids), "max_tokens": r.params.max_tokens,
                      "stop_ids": sorted(r.stop_ids), "temperature": r.params.temperature,
                      "top_p": r.params.top_p, "top_k": r.params.top_k, "seed": r.params.seed,
                      "cached_tokens": r.num_cached_tokens, "seq_offset": r.meta.get("seq_offset", 0)}
                     for r in sched.new],
                rows=[{"request_id": r.request_id, "tier": r.tier,
                       "token_ids": r.token_slice(r.num_computed_tokens, r.num_computed_tokens + n),
                       "start_pos": r.num_computed_tokens, "block_tables": r.block_tables,
                       "sample": r.num_computed_tokens + n == r.num_tokens,
                       "num_output": len(r.output_ids)} for r, n in sched.rows]
                + [{"request_id": r.request_id, "tier": r.tier, "token_ids": r.token_slice(a, b),
                    "start_pos": a, "block_tables": r.block_tables, "sample": False,
                    "num_output": len(r.output_ids), "enter": seg} for r, seg, a, b in sched.catchups],
                drop=sched.drop, worker_started=w.started)
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
        sw = pre = 0
        cache = {k: {} for k in ("prefill_computed", "prefill_reused", "cache_queries", "cache_hits",
                                 "evictions")}
        held = {}
        for w in self.workers.values():
            for r in w.core.waiting:
                waiting[r.tier] = waiting.get(r.tier, 0) + 1
            for r in w.core.running:
                running[r.tier] = running.get(r.tier, 0) + 1
            used[w.worker_id], total[w.worker_id] = w.core.kv_usage()
            sw += w.core.stats.path_switches
            pre += w.core.stats.preemptions
            for k, per_seg in cache.items():
                for seg, v in enumerate(getattr(w.core.stats, k)):
                    per_seg[seg] = per_seg.get(seg, 0) + v
            held[w.worker_id] = self.directory.num_held(w.worker_id)
        stats = {"waiting": waiting, "running": running, "kv_blocks_used": used, "kv_blocks_total": total,
                 "path_switches": sw, "escalations": self.escalations, "replanned": self.replanned, "preemptions": pre,
                 "workers": len(self.workers), "updated": time.time(), "steps": self.step_count,
                 "step_roundtrip_s": self.step_roundtrip_s, "step_forward_s": self.step_forward_s,
                 **cache, "directory_blocks": held, "affinity_preferred": self.affinity_preferred,
                 "affinity_yielded": self.affinity_yielded}
        self.r.hset(P.STATS_KEY, "scheduler", msgpack.packb(stats))

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
                try:
                    rec = P.decode(fields)
                    if isinstance(rec, P.Submit):
                        self.on_submit(rec)
                    elif isinstance(rec, P.Cancel):
                        self.on_cancel(rec)
                    elif isinstance(rec, P.StepResult):
                        self.on_result(rec)
                except (ValueError, TypeError, KeyError) as e:
                    log.error("bad stream entry dropped", stream=stream, entry=entry_id, error=str(e))
                self.r.xack(stream, P.SCHEDULER_GROUP, entry_id)
        self.dispatch()
        self.flush_directory()
        if now - self._last_stats > 0.5:
            self.write_stats()
            self._last_stats = now

    def run(self) -> None:
        self.setup()
        log.info("scheduler started", consumer=self.consumer, limits=str(self.limits))
        while self.running:
            try:
                self.run_once()
            except redis.ConnectionError as e:
                log.warning("redis unavailable; retrying", error=str(e))
                time.sleep(0.5)


def parse_quota(spec: str | None) -> dict[int, float]:
    out = {}
    for part in (spec or "").split(","):
        if part.strip():
            k, _, v = part.partition("=")
            out[int(k)] = float(v)
    return out


def main(argv: list[str] | None = None) -> int:
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
    args = p.parse_args(argv)
    configure(json_lines=True)
    svc = SchedulerService(args.redis_url, Limits(
        args.max_num_batched_tokens, args.max_num_seqs, args.max_tiers_per_step, args.path_switches_per_s,
        parse_quota(args.kv_quota), prefix_caching=not args.no_prefix_caching, cache_ttl_s=args.cache_ttl_s,
        directory_ttl_s=args.directory_ttl_s, affinity_abs=args.affinity_abs_threshold,
        affinity_rel=args.affinity_rel_threshold))
    try:
        svc.run()
    except KeyboardInterrupt:
        pass
    return 0
