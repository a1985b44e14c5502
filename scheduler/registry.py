"""The live workers and where requests go. One StepScheduler per worker, discovered from its
registration (``mfs:workers`` + ``mfs:worker:{id}`` with a TTL); placement of a new request on a worker
that serves its tier (cache affinity from the KV block directory, yielding to load); and re-planning a
lost worker's requests on a live one. The service (scheduler/service.py) reads and writes the streams;
this module owns the maps they change."""
from __future__ import annotations

import copy
import time
from collections.abc import Callable
from dataclasses import dataclass

import redis
import structlog

from core import protocol as P
from core.keyrecords import WorkerInfo
from kvstore.directory import BlockDirectory, common_blocks
from scheduler.config import STEP_LIMITS, SchedulerProcessConfig
from scheduler.core import StepScheduler
from scheduler.request import InvalidRequest, Request, ScheduledStep, SchedulerConfig

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


class WorkerRegistry:
    def __init__(self, r: redis.Redis, cfg: SchedulerProcessConfig, shard: P.Shard = P.Shard(),
                 clock: Callable[[], float] = time.monotonic):
        self.r = r
        self.clock = clock  # each worker's step scheduler's (its path-switch budget, cached blocks' TTL)
        self.cfg = cfg
        self.shard = shard  # only the workers that joined this shard
        self.workers: dict[str, WorkerState] = {}
        self.placement: dict[str, str] = {}  # request id -> worker id
        self.directory = BlockDirectory(r, cfg.directory_ttl_s)
        self.replanned = 0
        self.affinity_preferred = 0   # requests with a worker listed as holding their prefix
        self.affinity_yielded = 0     # ...that went to a less loaded worker instead

    def clear(self) -> None:
        self.workers.clear()
        self.placement.clear()

    def serving(self, tier: int) -> list[WorkerState]:
        return [w for w in self.workers.values() if tier in w.tiers]

    def known_tiers(self) -> set[int]:
        return {t for w in self.workers.values() for t in range(w.core.cfg.num_tiers)}

    def refresh(self) -> list[tuple[Request, str]]:
        """Joins the workers that registered, drops those whose registration expired or that restarted.
        Returns the dropped workers' requests no live worker could take, with why (the caller fails them)."""
        orphans: list[tuple[Request, str]] = []
        ids = {m.decode() for m in self.r.smembers(self.shard.workers_set)}
        for wid in ids:
            raw = self.r.hgetall(P.worker_key(wid))
            if not raw:
                self.r.srem(self.shard.workers_set, wid)
                continue
            info = WorkerInfo.from_hash(raw)
            if info is None:  # a heartbeat after a Redis restart; the full hash follows
                continue
            w = self.workers.get(wid)
            if w is not None and w.started == info.started:
                continue
            if w is not None:
                orphans += self.lose(wid, "the worker restarted")
            self.workers[wid] = self._new_worker(wid, info)
        for wid in list(self.workers):
            if wid not in ids or not self.r.exists(P.worker_key(wid)):
                orphans += self.lose(wid, "the worker stopped answering")
        return orphans

    def _new_worker(self, wid: str, info: WorkerInfo) -> WorkerState:
        tiers = info.tiers
        standalone = len(tiers) == 1 and info.num_tiers > 1
        cfg = SchedulerConfig(
            num_tiers=info.num_tiers if not standalone else 1,
            num_blocks=list(info.num_blocks), block_size=info.block_size, max_model_len=info.max_model_len,
            served_tiers=tuple(tiers) if standalone else None,
            eos_token_ids=tuple(info.eos), vocab_size=info.vocab_size,
            exit_blocks=() if standalone else tuple(info.exit_blocks), kv_window=info.kv_window,
            **{name: copy.copy(getattr(self.cfg, name)) for name in STEP_LIMITS})
        if standalone:  # a standalone copy keeps global tier numbers for validation, one segment
            cfg.num_tiers = max(tiers) + 1
            cfg.num_blocks = cfg.num_blocks * cfg.num_tiers
        log.info("worker joined", worker=wid, tiers=tiers, blocks=cfg.num_blocks[:1])
        core = StepScheduler(cfg, clock=self.clock)
        core.cache_log = []
        self.directory.drop_worker(wid)  # whatever a previous life of this id (or scheduler) listed
        return WorkerState(wid, info.started, tiers, core)

    def lose(self, wid: str, why: str) -> list[tuple[Request, str]]:
        """Drops a worker; each of its requests is re-planned on a live one, or returned with why."""
        w = self.workers.pop(wid, None)
        if w is None:
            return []
        log.warning("worker lost", worker=wid, reason=why, requests=len(w.core.requests))
        self.directory.drop_worker(wid)
        orphans = []
        for rid, req in list(w.core.requests.items()):
            self.placement.pop(rid, None)
            if not self.replan(req):
                orphans.append((req, why))
        return orphans

    def replan(self, req) -> bool:
        """Moves a lost worker's request to a live one: it is prefilled again from its prompt plus the
        tokens already streamed, and its token events continue at the next sequence number."""
        cands = [w for w in self.workers.values() if req.tier in w.tiers]
        remaining = req.params.max_tokens - len(req.output_ids)
        if not cands or remaining <= 0:
            return False
        w = min(cands, key=lambda w: w.core.num_unfinished())
        meta = dict(req.meta, seq_offset=req.meta.get("seq_offset", 0) + len(req.output_ids))
        params = req.params.resumed(len(req.output_ids))
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

    # ---- placement ---------------------------------------------------------------------------
    def place(self, s: P.Submit, cands: list[WorkerState]) -> WorkerState:
        """Another choice of an n > 1 request goes where its first choice is (they share its prompt's
        KV). Otherwise the worker with the longest reusable prefix of the prompt, unless it is
        overloaded; otherwise the least loaded one."""
        if s.follow:
            lead = self.workers.get(self.placement.get(s.follow, ""))
            if lead is not None and lead in cands:
                return lead
        def load(w: WorkerState) -> tuple[int, int]:
            return w.core.num_unfinished(), sum(p.num_used for p in w.core.pools)
        least = min(cands, key=load)
        if not self.cfg.prefix_caching:
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
        if lb - ll > self.cfg.affinity_abs_threshold and lb > self.cfg.affinity_rel_threshold * ll:
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

    def flush_directory(self) -> None:
        """Tells the directory what each worker's pools cached and evicted since the last flush."""
        for w in self.workers.values():
            changes = w.core.drain_cache_log()
            if changes:
                self.directory.record(w.worker_id, changes)

