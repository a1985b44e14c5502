"""The step scheduler of one worker: its requests, queues and KV block accounting.

``schedule()`` decides what the worker's next forward holds; ``update()`` takes the sampled tokens
back and decides who finished. The worker only executes plans (worker/runner.py), so the same class
serves the in-process engine and the scheduler process.

Decode rows (and partly prefilled prompts) are scheduled first so a long prompt never starves them;
waiting prompts are then admitted in chunks under the per-step token budget. When a segment's pool
runs out, the running request the policy names (scheduler/policy.py; FCFS: the latest arrival) is
preempted (blocks freed) and later recomputed from its prompt plus the tokens it already made.
Optional limits: how many tiers one step may mix, how often the tier mix may change (path-switch
budget, per second), and per-tier shares of the KV pool.

Prefix caching and lazy exits: scheduler/prefix_cache.py (:class:`PrefixCaching`, a base of the
scheduler). Where every layer attends within a window, a running request's blocks behind it go back to
the pools after each step (scheduler/window.py).

Self-speculative decoding (draft rows of a lower tier, then one verification row of the target tier)
and the confidence cascade (catch-up rows after an escalation) are scheduled here; their rules and
state live in scheduler/speculation.py. The runner accepts or rejects drafts and reports escalations;
:meth:`StepScheduler.update` commits what it hands back.
"""
from __future__ import annotations

import itertools
import time
from collections import deque

import structlog

from core.sampling import SamplingParams, finish_reason
from scheduler.blocks import BlockPool
from scheduler.policy import FCFS, SchedulingPolicy
from scheduler.prefix_cache import PrefixCaching
from scheduler.request import (InvalidRequest, Request, RequestOutput, ScheduledStep, SchedulerConfig,
                               SchedulerStats, Status)
from scheduler.speculation import Cascade, Speculation
from scheduler.tiermix import Clock, TierMix
from scheduler.window import blocks_held_at_most, held, release_outside_window

__all__ = ["InvalidRequest", "Request", "RequestOutput", "ScheduledStep", "SchedulerConfig", "SchedulerStats",
           "Status", "StepScheduler"]

log = structlog.get_logger(__name__)

class StepScheduler(PrefixCaching):
    def __init__(self, cfg: SchedulerConfig, policy: SchedulingPolicy | None = None, clock: Clock = time.monotonic):
        """``clock``: what the path-switch budget and the cached blocks' TTL read (tests step one)."""
        if len(cfg.num_blocks) != cfg.num_tiers:
            raise ValueError(f"num_blocks has {len(cfg.num_blocks)} entries for {cfg.num_tiers} segments")
        self.cfg = cfg
        self.pools = [BlockPool(n, self._evicted(s), clock) for s, n in enumerate(cfg.num_blocks)]
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._arrivals = itertools.count()
        self._drop: list[str] = []
        self.mix = TierMix(cfg.max_tiers_per_step, cfg.path_switches_per_s, clock)
        n = cfg.num_tiers
        self.stats = SchedulerStats(peak_kv_blocks=[0] * n, prefill_computed=[0] * n,
                                    prefill_reused=[0] * n, cache_queries=[0] * n, cache_hits=[0] * n,
                                    evictions=[0] * n, exit_filled=[0] * n)
        self.policy = policy or FCFS()
        self.spec = Speculation(cfg, self.stats)
        self.cascade = Cascade(cfg, self.stats)
        # (hash, cached?) changes for the block directory; None until an owner drains it.
        self.cache_log: list[tuple[bytes, bool]] | None = None

    # ---- requests ----------------------------------------------------------------------------
    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.cfg.block_size)

    def validate(self, prompt_ids: list[int], tier: int, params: SamplingParams) -> None:
        cfg = self.cfg
        if not 0 <= tier < cfg.num_tiers:
            raise InvalidRequest(f"unknown tier {tier!r}", "model_not_found", 404)
        if cfg.served_tiers is not None and tier not in cfg.served_tiers:
            raise InvalidRequest(f"tier {tier} is not served here", "model_not_found", 404)
        try:
            params.validate()
        except ValueError as e:
            raise InvalidRequest(str(e)) from None
        d = params.spec_draft_tier
        if d is not None and (cfg.served_tiers is not None or not 0 <= d < tier):
            raise InvalidRequest(f"draft tier {d} must be a lower tier of the same nested model than {tier}")
        cascade = params.cascade_threshold is not None
        if cascade and cfg.served_tiers is not None:
            raise InvalidRequest("a cascade needs the nested model (this worker serves standalone tiers)")
        if not prompt_ids:
            raise InvalidRequest("the prompt is empty")
        if len(prompt_ids) >= cfg.max_model_len:
            raise InvalidRequest(f"the prompt has {len(prompt_ids)} tokens; this model's context limit "
                                 f"is {cfg.max_model_len} (prompt plus at least one new token)",
                                 "context_length_exceeded")
        if cfg.vocab_size and (min(prompt_ids) < 0 or max(prompt_ids) >= cfg.vocab_size):
            raise InvalidRequest(f"token ids must be in [0, {cfg.vocab_size})")
        if cfg.vocab_size and params.logit_bias and max(params.logit_bias) >= cfg.vocab_size:
            raise InvalidRequest(f"logit_bias token ids must be in [0, {cfg.vocab_size})")
        need = self.blocks_needed(min(len(prompt_ids) + params.max_tokens, cfg.max_model_len))
        if cfg.kv_window and params.cascade_threshold is None:  # its blocks behind the window go back
            need = min(need, blocks_held_at_most(cfg, max(cfg.max_num_batched_tokens, params.spec_gamma)))
        segs = range(cfg.num_tiers if cascade else tier + 1) if cfg.served_tiers is None else range(1)
        small = min(self.pools[s].num_blocks for s in segs)
        if need > small:
            raise InvalidRequest(f"the request needs {need} KV blocks but the pool holds {small}",
                                 "context_length_exceeded")

    def add_request(self, request_id: str, prompt_ids: list[int], tier: int,
                    params: SamplingParams, meta: dict | None = None) -> Request:
        if request_id in self.requests:
            raise InvalidRequest(f"request id {request_id!r} is already in use")
        self.validate(prompt_ids, tier, params)
        req = Request(request_id, list(prompt_ids), tier, params, params.stop_ids(self.cfg.eos_token_ids),
                      next(self._arrivals), meta or {}, tiers=[tier])
        self.requests[request_id] = req
        self.waiting.append(req)
        return req

    def abort_request(self, request_id: str) -> bool:
        req = self.requests.pop(request_id, None)
        if req is None:
            return False
        if req.status is Status.RUNNING:
            self.running.remove(req)
        elif req.status is Status.WAITING:
            self.waiting.remove(req)
        self._release(req)
        req.status, req.finish_reason = Status.FINISHED, "abort"
        if req.announced:
            self._drop.append(request_id)
        return True

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    # ---- blocks ------------------------------------------------------------------------------
    def _segments(self, req: Request) -> int:
        """How many segment pools a request holds blocks in (a standalone copy has one)."""
        return req.tier + 1 if self.cfg.served_tiers is None else 1

    def _release(self, req: Request) -> None:
        for s in range(len(req.block_tables)):
            self.pools[s].release(reversed(held(req, s)))  # tail first: the shared head is evicted last
        req.block_tables = []
        req.num_cached_blocks = req.num_released_blocks = 0

    def _allocate(self, req: Request, num_new: int, hit: list[list[int]] | None = None) -> bool:
        """Grows the request's tables to hold `num_new` more tokens. A request without tables starts
        from `hit`, its cached prefix blocks per segment (see :meth:`_cached_prefix`)."""
        fresh = not req.block_tables
        tables = (hit or [[] for _ in range(self._segments(req))]) if fresh else req.block_tables
        start = len(tables[0]) * self.cfg.block_size if fresh else req.num_computed_tokens
        need = self.blocks_needed(start + num_new)
        grow = [need - len(t) for t in tables]
        for s, g in enumerate(grow):
            pool = self.pools[s]
            taken = pool.num_evictable_among(tables[s]) if fresh else 0  # reused blocks stop being free
            if g > 0 and g > pool.num_free - taken:
                return False
        if fresh:
            for s, t in enumerate(tables):
                self.pools[s].touch(t)
            req.block_tables = [list(t) for t in tables]
            req.num_computed_tokens = start
            req.num_cached_blocks = min(len(t) for t in tables)
        for s, g in enumerate(grow):
            if g > 0:
                req.block_tables[s].extend(self.pools[s].allocate(g))
        return True

    def _follows_a_prefill(self, req: Request) -> bool:
        """A choice of an n > 1 request (``meta["follow"]``: its first choice) waits while the first
        choice's prompt is being computed here, then starts from its cached blocks."""
        lead = self.requests.get(req.meta.get("follow") or "")
        return (lead is not None and lead is not req and lead.status is not Status.FINISHED
                and lead.num_computed_tokens < len(lead.prompt_ids) and self.cfg.prefix_caching)

    def _within_quota(self, req: Request, num_new: int) -> bool:
        share = self.cfg.kv_quota.get(req.tier)
        if share is None:
            return True
        n = sum(len(held(r, 0)) for r in self.running if r.tier == req.tier and r.block_tables)
        return n + self.blocks_needed(num_new) <= share * self.pools[0].num_blocks

    def _grow_or_preempt(self, req: Request, num_new: int) -> bool:
        """Grows a running request's tables by `num_new` tokens, preempting the policy's victim (the
        request itself, possibly) until they fit. Returns whether anything was preempted."""
        preempted = False
        while not self._allocate(req, num_new):
            victim = self.policy.victim(self.running)
            self._preempt(victim)
            preempted = True
            if victim is req:
                break
        return preempted

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self._release(req)
        req.num_computed_tokens = 0
        req.drafts = []
        req.spec_stop = False
        req.catchup = None
        req.status = Status.WAITING
        req.num_preemptions += 1
        self.stats.preemptions += 1
        self.waiting.appendleft(req)
        log.debug("preempted", request_id=req.request_id, tier=req.tier, tokens=req.num_tokens)

    # ---- one iteration -----------------------------------------------------------------------
    def schedule(self) -> ScheduledStep:
        budget = self.cfg.max_num_batched_tokens
        if self.cfg.cache_ttl_s > 0:
            for p in self.pools:
                p.reclaim_expired(self.cfg.cache_ttl_s)
        allowed = self.mix.allowed(r.tier for r in self.policy.order(self.running) + list(self.waiting)) \
            if self.mix.limited else None
        rows: list[tuple[Request, int]] = []
        draft_rows: list[tuple[Request, int, int]] = []
        verify_rows: list[tuple[Request, list[int], int]] = []
        catchups: list[tuple[Request, int, int, int]] = []
        fills: list[tuple[Request, int, int, int]] = []
        budget, preempted = self._step_running(budget, allowed, rows, draft_rows, verify_rows, catchups)
        if not preempted:
            self._admit_waiting(budget, allowed, rows, catchups, fills, bool(draft_rows or verify_rows))
        return self._close_step(rows, draft_rows, verify_rows, catchups, fills)

    def _step_running(self, budget: int, allowed, rows: list, draft_rows: list, verify_rows: list,
                      catchups: list) -> tuple[int, bool]:
        """The running requests' rows, in the policy's order, within the token budget: a catch-up, a
        draft or verify row, or the next tokens. Returns the budget left and whether one was preempted."""
        preempted = False
        for req in self.policy.order(self.running):
            if budget == 0:
                break
            if req.status is not Status.RUNNING or (allowed is not None and req.tier not in allowed):
                continue
            if req.catchup is not None:  # escalated (cascade): the new segment's history first
                preempted |= self._grow_or_preempt(req, 1)
                if req.status is not Status.RUNNING:
                    continue
                budget -= self.cascade.plan_catchup(req, budget, catchups, self._segments(req))
                if req.catchup is not None or budget == 0:
                    continue  # its next row waits for the rest of the catch-up
            spec = self.spec.next_row(req, budget, self._allocate)
            if spec is not None:
                kind, g = spec
                if kind == "draft":
                    pos = req.num_computed_tokens + len(req.drafts)
                    x = req.drafts[-1] if req.drafts else req.token_slice(pos, pos + 1)[0]
                    draft_rows.append((req, x, pos))
                    budget -= 1
                else:
                    a = req.num_computed_tokens
                    verify_rows.append((req, req.token_slice(a, a + 1) + req.drafts[:g - 1], a))
                    budget -= g
                continue
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            preempted |= self._grow_or_preempt(req, n)
            if req.status is Status.RUNNING:
                rows.append((req, n))
                budget -= n
        return budget, preempted

    def _admit_waiting(self, budget: int, allowed, rows: list, catchups: list, fills: list,
                       spec_rows: bool) -> None:
        """Waiting requests admitted into what is left of the budget, their cached prefix found first;
        one the policy, the tier mix or its quota holds back keeps its place in the queue."""
        skipped: list[Request] = []
        while self.waiting and budget > 0 and len(self.running) < self.cfg.max_num_seqs:
            req = self.waiting.popleft()
            if self._follows_a_prefill(req):
                skipped.append(req)
                continue
            alone = not rows and not spec_rows and not catchups and not fills
            hit = self._cached_prefix(req, budget, alone)
            extra = (req.catchup[2] - req.catchup[1] if req.catchup else 0) + sum(b - a for _, a, b in req.fills)
            n = min(req.num_tokens - (len(hit[0]) * self.cfg.block_size if hit else 0),
                    max(1, budget - extra))
            if (allowed is not None and req.tier not in allowed) or not self._within_quota(req, n):
                skipped.append(req)
                continue
            if not self._allocate(req, n, hit):
                self.waiting.appendleft(req)
                break
            self._count_admission(req, hit)
            req.status = Status.RUNNING
            self.running.append(req)
            rows.append((req, n))
            budget -= n + extra
            if req.catchup is not None:
                catchups.append((req, *req.catchup))
                req.catchup = None
            fills.extend((req, *f) for f in req.fills)
            req.fills = []
        self.waiting.extendleft(reversed(skipped))

    def _close_step(self, rows: list, draft_rows: list, verify_rows: list, catchups: list,
                    fills: list) -> ScheduledStep:
        """The step as the worker runs it, and the statistics it moves."""
        new = [r for r, _ in rows if not r.announced]
        for r in new:
            r.announced = True
        drop, self._drop = self._drop, []
        if self.mix.ran(frozenset(r.tier for r, _ in rows) | {r.tier for r, _, _ in verify_rows}
                        | {r.params.spec_draft_tier for r, _, _ in draft_rows} | {r.tier for r, *_ in catchups}):
            self.stats.path_switches += 1
        for s, p in enumerate(self.pools):
            self.stats.peak_kv_blocks[s] = max(self.stats.peak_kv_blocks[s], p.num_used)
        if rows:
            self.stats.steps += 1
            self.stats.forward_tokens += sum(n for _, n in rows)
        return ScheduledStep(rows, new, drop, catchups, draft_rows, verify_rows, fills, self.lazy_exits)

    def extend_decode(self, step: ScheduledStep, k: int) -> int:
        """Multi-step decoding: how many decode steps the worker may run ``step`` for without the
        scheduler in between (it feeds each row's sampled token back and stops a row at its end), 1 when
        the step is not plain decoding of every running request. The rows' tables grow to hold their
        next k tokens (never more than a row can still make); a row that cannot grow without a
        preemption keeps the step at 1 (the blocks already grown serve its next steps anyway)."""
        if (k <= 1 or self.waiting or step.new or step.drafts or step.verifies or step.catchups or step.fills
                or not step.rows):
            return 1
        for req, n in step.rows:
            p = req.params
            if (n != 1 or req.num_computed_tokens + 1 != req.num_tokens or p.cascade_threshold is not None
                    or p.spec_draft_tier is not None or p.prompt_logprobs is not None and not req.output_ids):
                return 1
        for req, _ in step.rows:
            left = min(req.params.max_tokens - len(req.output_ids), self.cfg.max_model_len - req.num_tokens)
            if left > 1 and not self._allocate(req, min(k, left)):
                return 1
        return k

    def update(self, step: ScheduledStep, tokens: dict[str, int],
               verified: dict[str, list[int]] | None = None, accepted: dict[str, int] | None = None,
               escalate: list[str] | None = None, drafts: dict[str, int] | None = None,
               draft_conf: dict[str, float] | None = None,
               decoded: dict[str, list[int]] | None = None) -> list[RequestOutput]:
        """Advance the step's rows and append each sampled token; finished requests free blocks.
        Draft rows add their token (`drafts`; read from `tokens` when not given) to their request's
        round; verification rows commit the tokens the runner committed (`verified`, with `accepted`
        drafts among them). An escalated request (`escalate`) got no token: its last position is
        recomputed at the next tier up after its catch-up. ``decoded``: a multi-step plan's rows (see
        :meth:`extend_decode`), every token each made, one position computed per token."""
        drafted = tokens if drafts is None else drafts
        esc = set(escalate or ())
        bs = self.cfg.block_size
        for req, s, a, b in step.fills:  # their exit-block KV is there now
            if req.block_tables:
                self.pools[s].mark_complete(req.block_tables[s][a // bs:b // bs])
            self.stats.exit_filled[s] += b - a
        for req, n in step.rows:
            if req.status is Status.RUNNING:
                start, p = req.num_computed_tokens, len(req.prompt_ids)
                for s in range(self._segments(req)):
                    self.stats.prefill_computed[s] += max(0, min(start + n, p) - start)
                if decoded and req.request_id in decoded:  # registered below, once its tokens are in
                    req.num_computed_tokens += len(decoded[req.request_id])
                    continue
                req.num_computed_tokens += n - (req.request_id in esc)
                self._register_full_blocks(req)
        for req, _, _ in step.drafts:
            if req.status is Status.RUNNING and req.request_id in drafted:
                self.spec.add_draft(req, drafted[req.request_id], (draft_conf or {}).get(req.request_id))
        new: dict[str, list[int]] = {req.request_id: [tokens[req.request_id]] for req, _ in step.rows
                                     if req.request_id in tokens}
        for req, toks, _ in step.verifies:
            if req.status is Status.RUNNING and verified and req.request_id in verified:
                committed = self.spec.accept(req, verified[req.request_id], len(toks),
                                             (accepted or {}).get(req.request_id))
                req.num_computed_tokens += len(committed)
                self._register_full_blocks(req)
                new[req.request_id] = committed
        new.update(decoded or {})
        outs = []
        for req in [r for r, _ in step.rows] + [r for r, _, _ in step.verifies]:
            toks = new.get(req.request_id)
            if not toks or req.status is not Status.RUNNING:
                continue
            emitted, reason = [], None
            for tok in toks:
                req.output_ids.append(tok)
                emitted.append(tok)
                reason = finish_reason(tok, len(req.output_ids), req.num_tokens, req.params.max_tokens,
                                       req.stop_ids, self.cfg.max_model_len)
                if reason:
                    break
            if decoded and req.request_id in decoded:
                self._register_full_blocks(req)
            if reason:
                self.running.remove(req)
                self._release(req)
                req.status, req.finish_reason = Status.FINISHED, reason
                self.requests.pop(req.request_id, None)
                self._drop.append(req.request_id)
            outs.append(RequestOutput(req.request_id, emitted, reason is not None, reason,
                                      len(req.prompt_ids), len(req.output_ids), req.tier,
                                      tiers=list(req.tiers), escalated_at=list(req.escalated_at)))
        for req, _ in step.rows:
            if req.request_id in esc and req.status is Status.RUNNING:
                self.cascade.escalate(req)
        for req in [r for r, _ in step.rows] + [r for r, _, _ in step.verifies]:
            if req.status is Status.RUNNING:
                release_outside_window(self.cfg, self.pools, req)
        return outs

    def kv_usage(self) -> tuple[list[int], list[int]]:
        return [p.num_used for p in self.pools], [p.num_blocks for p in self.pools]
