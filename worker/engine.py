"""The in-process engine: continuous batching of every tier of a nested model in one forward.

``step()`` = schedule -> run -> postprocess. Decode rows (and partly prefilled prompts) are scheduled
first so a long prompt never starves them; waiting prompts are then admitted in chunks under the
per-step token budget. When a segment's pool runs out, the latest-arrived running request is
preempted (its blocks freed) and later recomputed from its prompt plus the tokens it already made.
"""
from __future__ import annotations

import itertools
import time
from collections import deque
from dataclasses import dataclass, field
from enum import Enum

import structlog
import torch

from worker.batch import RowInput, build_step, order_rows
from worker.kv_cache import SegmentedKVCache
from worker.model import NestedModel
from worker.sampling import SamplingParams, make_generator, sample

log = structlog.get_logger(__name__)


class InvalidRequest(ValueError):
    """A request the engine refuses; the engine itself is unaffected."""


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True)
class Request:
    request_id: str
    prompt_ids: list[int]
    tier: int
    params: SamplingParams
    stop_ids: frozenset[int]
    arrival: int
    output_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_tables: list[list[int]] = field(default_factory=list)
    generator: torch.Generator | None = None
    status: Status = Status.WAITING
    finish_reason: str | None = None
    num_preemptions: int = 0
    first_token_time: float | None = None
    arrival_time: float = field(default_factory=time.perf_counter)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def token_slice(self, start: int, end: int) -> list[int]:
        p = len(self.prompt_ids)
        if end <= p:
            return self.prompt_ids[start:end]
        return (self.prompt_ids[start:] if start < p else []) + self.output_ids[max(0, start - p):end - p]


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    logits: torch.Tensor | None = None


@dataclass(slots=True)
class EngineStats:
    steps: int = 0
    forward_tokens: int = 0
    preemptions: int = 0
    peak_kv_blocks: list[int] = field(default_factory=list)


class Engine:
    def __init__(self, model: NestedModel, *, block_size: int = 16, num_blocks: int | list[int] = 256,
                 max_num_batched_tokens: int = 512, max_num_seqs: int = 64,
                 max_model_len: int | None = None, keep_logits: bool = False):
        self.model = model
        cfg = model.cfg
        nseg = model.num_segments
        blocks = num_blocks if isinstance(num_blocks, list) else [num_blocks] * nseg
        if len(blocks) != nseg:
            raise ValueError(f"num_blocks has {len(blocks)} entries for {nseg} segments")
        self.device = next(model.parameters()).device
        dtype = next(model.parameters()).dtype
        self.kv = SegmentedKVCache([len(model.segment_layers(s)) for s in range(nseg)], blocks,
                                   block_size, cfg.num_kv_heads, cfg.head_dim, dtype, self.device)
        self.block_size = block_size
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.max_model_len = min(max_model_len or model.max_positions, model.max_positions)
        self.keep_logits = keep_logits
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self._arrivals = itertools.count()
        self.stats = EngineStats(peak_kv_blocks=[0] * nseg)

    # ---- requests ----------------------------------------------------------------------------
    def tier_index(self, tier: int | str) -> int:
        for t in self.model.tiers:
            if tier == t.index or tier == t.name:
                return t.index
        names = ", ".join(t.name for t in self.model.tiers)
        raise InvalidRequest(f"unknown tier {tier!r}; this family has: {names}")

    def add_request(self, request_id: str, prompt_ids: list[int], tier: int | str,
                    params: SamplingParams | None = None) -> None:
        params = params or SamplingParams()
        if request_id in self.requests:
            raise InvalidRequest(f"request id {request_id!r} is already in use")
        t = self.tier_index(tier)
        try:
            params.validate()
        except ValueError as e:
            raise InvalidRequest(str(e)) from None
        if not prompt_ids:
            raise InvalidRequest("the prompt is empty")
        if len(prompt_ids) >= self.max_model_len:
            raise InvalidRequest(f"the prompt has {len(prompt_ids)} tokens; this model's context "
                                 f"limit is {self.max_model_len} (prompt plus at least one new token)")
        V = self.model.cfg.vocab_size
        if min(prompt_ids) < 0 or max(prompt_ids) >= V:
            raise InvalidRequest(f"token ids must be in [0, {V})")
        need = self.kv.blocks_needed(min(len(prompt_ids) + params.max_tokens, self.max_model_len))
        small = min(self.kv.pools[s].num_blocks for s in range(t + 1))
        if need > small:
            raise InvalidRequest(f"the request needs {need} KV blocks but the pool holds {small}")
        stop = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop.update(self.model.cfg.eos_token_ids)
        req = Request(request_id, list(prompt_ids), t, params, frozenset(stop), next(self._arrivals),
                      generator=make_generator(params))
        self.requests[request_id] = req
        self.waiting.append(req)

    def abort_request(self, request_id: str) -> bool:
        req = self.requests.pop(request_id, None)
        if req is None:
            return False
        if req.status is Status.RUNNING:
            self.running.remove(req)
        elif req.status is Status.WAITING:
            self.waiting.remove(req)
        self._free(req)
        req.status, req.finish_reason = Status.FINISHED, "abort"
        return True

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- blocks ------------------------------------------------------------------------------
    def _free(self, req: Request) -> None:
        for s, table in enumerate(req.block_tables):
            self.kv.pools[s].release(table)
        req.block_tables = []

    def _allocate(self, req: Request, num_new: int) -> bool:
        """Make req's block tables cover num_computed + num_new tokens in segments 0..tier."""
        need = self.kv.blocks_needed(req.num_computed_tokens + num_new)
        if not req.block_tables:
            req.block_tables = [[] for _ in range(req.tier + 1)]
        grow = [need - len(t) for t in req.block_tables]
        if any(g > self.kv.pools[s].num_free for s, g in enumerate(grow) if g > 0):
            return False
        for s, g in enumerate(grow):
            if g > 0:
                req.block_tables[s].extend(self.kv.pools[s].allocate(g))
        return True

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self._free(req)
        req.num_computed_tokens = 0
        req.status = Status.WAITING
        req.num_preemptions += 1
        self.stats.preemptions += 1
        self.waiting.appendleft(req)
        log.debug("preempted", request_id=req.request_id, tier=req.tier, tokens=req.num_tokens)

    # ---- one iteration -----------------------------------------------------------------------
    def schedule(self) -> list[tuple[Request, int]]:
        budget = self.max_num_batched_tokens
        plan: list[tuple[Request, int]] = []
        preempted = False
        for req in sorted(self.running, key=lambda r: r.arrival):
            if budget == 0:
                break
            if req.status is not Status.RUNNING:
                continue  # preempted earlier in this loop
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            while not self._allocate(req, n):
                victim = max(self.running, key=lambda r: r.arrival)
                self._preempt(victim)
                preempted = True
                if victim is req:
                    break
            if req.status is Status.RUNNING:
                plan.append((req, n))
                budget -= n
        while self.waiting and budget > 0 and not preempted and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if not self._allocate(req, n):
                break
            self.waiting.popleft()
            req.status = Status.RUNNING
            self.running.append(req)
            plan.append((req, n))
            budget -= n
        return plan

    def step(self) -> list[RequestOutput]:
        plan = self.schedule()
        if not plan:
            if self.waiting and not self.running:
                raise RuntimeError("engine stalled: a waiting request fits in no pool")
            return []
        rows = [RowInput(r.tier, r.token_slice(r.num_computed_tokens, r.num_computed_tokens + n),
                         r.num_computed_tokens, r.block_tables, r.num_computed_tokens + n == r.num_tokens)
                for r, n in plan]
        order = order_rows(rows)
        rows = [rows[i] for i in order]
        plan = [plan[i] for i in order]
        batch = build_step(rows, self.model.num_segments, self.block_size, self.device)
        logits = self.model.forward_step(batch, self.kv)
        self.stats.steps += 1
        self.stats.forward_tokens += int(batch.input_ids.shape[0])
        for s, p in enumerate(self.kv.pools):
            self.stats.peak_kv_blocks[s] = max(self.stats.peak_kv_blocks[s], p.num_used)

        for req, n in plan:
            req.num_computed_tokens += n
        sampled = [plan[i][0] for i in batch.sampled_rows]
        tokens = sample(logits, [r.params for r in sampled], [r.generator for r in sampled])
        now = time.perf_counter()
        outs = []
        for k, (req, tok) in enumerate(zip(sampled, tokens)):
            req.output_ids.append(tok)
            if req.first_token_time is None:
                req.first_token_time = now
            reason = None
            if tok in req.stop_ids:
                reason = "stop"
            elif len(req.output_ids) >= req.params.max_tokens or req.num_tokens >= self.max_model_len:
                reason = "length"
            if reason:
                self._finish(req, reason)
            outs.append(RequestOutput(req.request_id, [tok], reason is not None, reason,
                                      len(req.prompt_ids), len(req.output_ids),
                                      logits[k].clone() if self.keep_logits else None))
        return outs

    def _finish(self, req: Request, reason: str) -> None:
        self.running.remove(req)
        self._free(req)
        req.status, req.finish_reason = Status.FINISHED, reason
        self.requests.pop(req.request_id, None)

    # ---- convenience -------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], tiers: list[int | str],
                 params: list[SamplingParams] | SamplingParams | None = None) -> list[list[int]]:
        """Runs the prompts to completion together; returns each one's generated token ids."""
        ps = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        ids = [f"gen-{next(self._arrivals)}-{i}" for i in range(len(prompts))]
        for rid, p, t, sp in zip(ids, prompts, tiers, ps):
            self.add_request(rid, p, t, sp)
        out: dict[str, list[int]] = {rid: [] for rid in ids}
        while self.has_unfinished():
            for o in self.step():
                out[o.request_id].extend(o.new_token_ids)
        return [out[rid] for rid in ids]
