"""The in-process engine: a StepScheduler and a ModelRunner in one process.

``step()`` = schedule -> run -> update: one iteration of continuous batching with prefill chunks and
decode rows of every tier in one forward. The service splits the same two halves across the scheduler
and worker processes.
"""
from __future__ import annotations

import itertools
import time
from collections.abc import Callable

from core.sampling import SamplingParams
from scheduler.core import InvalidRequest, RequestOutput, SchedulerConfig, StepScheduler
from scheduler.plan import plan_rows
from worker.model import NestedModel
from worker.runner import ModelRunner

__all__ = ["Engine", "InvalidRequest", "RequestOutput"]


class Engine:
    def __init__(self, model: NestedModel, *, block_size: int = 16, num_blocks: int | list[int] = 256,
                 max_num_batched_tokens: int = 512, max_num_seqs: int = 64,
                 max_model_len: int | None = None, keep_logits: bool = False, tokenizer=None,
                 clock: Callable[[], float] = time.monotonic, release_outside_window: bool = True, **limits):
        """``tokenizer``: needed only by requests with a grammar (structured output); ``clock``: the
        scheduler's (path-switch budget, cached blocks' TTL); ``release_outside_window``: where every
        layer has an attention window, a request's blocks behind it go back to the pool as it runs
        (scheduler/window.py; False: held to its end)."""
        self.model = model
        nseg = model.num_segments
        blocks = num_blocks if isinstance(num_blocks, list) else [num_blocks] * nseg
        self.scheduler = StepScheduler(SchedulerConfig(
            num_tiers=nseg, num_blocks=blocks, block_size=block_size,
            max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
            max_model_len=min(max_model_len or model.max_positions, model.max_positions),
            eos_token_ids=model.cfg.eos_token_ids, vocab_size=model.cfg.vocab_size,
            exit_blocks=model.exit_block_segments, kv_window=model.kv_window if release_outside_window else 0,
            **limits), clock=clock)
        self.runner = ModelRunner(model, blocks, block_size, keep_logits=keep_logits, tokenizer=tokenizer)
        self._ids = itertools.count()

    # The scheduler's state, for tests and benchmarks.
    @property
    def stats(self):
        return self.scheduler.stats

    @property
    def pools(self):
        return self.scheduler.pools

    @property
    def running(self):
        return self.scheduler.running

    @property
    def kv(self):
        return self.runner.kv

    def tier_index(self, tier: int | str) -> int:
        for t in self.model.tiers:
            if tier == t.index or tier == t.name:
                return t.index
        raise InvalidRequest(f"unknown tier {tier!r}; this family has: "
                             + ", ".join(t.name for t in self.model.tiers), "model_not_found", 404)

    def add_request(self, request_id: str, prompt_ids: list[int], tier: int | str,
                    params: SamplingParams | None = None, follow: str | None = None) -> None:
        """``follow``: another request with the same prompt; this one is admitted once that one's
        prompt is computed, and starts from its cached blocks (the n > 1 choices of one request)."""
        params = params or SamplingParams()
        self.scheduler.add_request(request_id, prompt_ids, self.tier_index(tier), params, meta={"follow": follow})
        self.runner.add(request_id, params, prompt_ids)

    def abort_request(self, request_id: str) -> bool:
        self.runner.drop([request_id])
        return self.scheduler.abort_request(request_id)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[RequestOutput]:
        sched = self.scheduler.schedule()
        self.runner.drop(sched.drop)
        if not (sched.rows or sched.drafts or sched.verifies or sched.catchups):
            if self.scheduler.waiting and not self.scheduler.running:
                raise RuntimeError("engine stalled: a waiting request fits in no pool")
            return []
        rows = plan_rows(sched)
        out = self.runner.execute(rows)
        outs = self.scheduler.update(sched, out.tokens, out.verified, out.accepted, out.escalate,
                                     out.drafts, out.draft_conf)
        if out.logits is not None:
            for o in outs:
                o.logits = out.logits.get(o.request_id)
        for o in outs:
            o.logprobs = out.logprobs.get(o.request_id, [])[:len(o.new_token_ids)]
            o.prompt_logprobs = out.prompt_logprobs.get(o.request_id, [])
        for o in outs:
            if o.finished:
                self.runner.drop([o.request_id])
        return outs

    def generate(self, prompts: list[list[int]], tiers: list[int | str],
                 params: list[SamplingParams] | SamplingParams | None = None) -> list[list[int]]:
        """Runs the prompts to completion together; returns each one's generated token ids."""
        ps = params if isinstance(params, list) else [params or SamplingParams()] * len(prompts)
        ids = [f"gen-{next(self._ids)}-{i}" for i in range(len(prompts))]
        for rid, p, t, sp in zip(ids, prompts, tiers, ps):
            self.add_request(rid, p, t, sp)
        out: dict[str, list[int]] = {rid: [] for rid in ids}
        while self.has_unfinished():
            for o in self.step():
                out[o.request_id].extend(o.new_token_ids)
        return [out[rid] for rid in ids]
