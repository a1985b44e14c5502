"""Prefix caching: every full computed block is registered in its segment's pool under a chained hash
(scheduler/blocks.py) and outlives its request (delayed reclamation). An admitted request starts from
the longest prefix of its tokens that is cached in *every* segment it uses (a position's KV must exist
in all of them before the forward may skip it), always leaving its last token to compute.

Lazy exits: a lower tier's exit block has KV layers in its boundary segment's pool, which a row of a
higher tier crossing that boundary would have to write too for its blocks to serve that tier later —
one layer or more of work per token that its own request never reads. Rows skip it (``PlanRow.exit_kv``
names the exits they do write: their draft tier's), their cached blocks are registered as *partial*
there, and a request that reads that exit and reuses them first fills the missing KV from the trunk
state stored at the boundary (an exit-only row over the cached positions, in its first step).

The methods here are a base class of :class:`scheduler.core.StepScheduler` and use its state: ``cfg``,
``pools``, ``stats``, ``cache_log`` and ``_segments``.
"""
from __future__ import annotations

from core.sampling import SamplingParams
from scheduler.blocks import block_hash
from scheduler.request import Request

# block-hash salts: nested segments are 0..n-1; a standalone copy of tier t salts with this + t
STANDALONE_KEY_BASE = 1000


class PrefixCaching:
    """Prefix caching and lazy exits of a step scheduler (see the module's docstring)."""

    # ---- lazy exits ---------------------------------------------------------------------------
    @property
    def lazy_exits(self) -> bool:
        cfg = self.cfg
        return cfg.lazy_exits and bool(cfg.exit_blocks) and cfg.served_tiers is None

    def _exits_read(self, req: Request) -> set[int]:
        """The exit blocks whose KV this request reads: its own tier's and its draft tier's."""
        return {req.tier, req.params.spec_draft_tier} & set(self.cfg.exit_blocks)

    def _plan_fills(self, req: Request, used: list[list[int]], budget: int, alone: bool) -> list[list[int]]:
        """Sets ``req.fills`` for the partial blocks among the cached ones it will start from, in the
        segments whose exit it reads: each from its first partial block to the end of the reuse (an
        exit block's upper layers depend on every earlier position). Fills that do not fit this step's
        budget (with any catch-up) are not planned: the request then recomputes from the first
        partial block instead, unless it runs `alone`."""
        req.fills = []
        if not self.lazy_exits:
            return used
        bs = self.cfg.block_size
        for s in sorted(self._exits_read(req)):
            i = self.pools[s].first_partial(used[s]) if s < len(used) else None
            if i is not None:
                req.fills.append((s, i * bs, len(used[s]) * bs))
        if not req.fills:
            return used
        extra = sum(b - a for _, a, b in req.fills) + (req.catchup[2] - req.catchup[1] if req.catchup else 0)
        if extra < budget or alone:
            return used
        k = min(min(a for _, a, _ in req.fills) // bs, min(len(u) for u in used))
        req.fills, req.catchup = [], None
        return [u[:k] for u in used]

    # ---- the prefix cache --------------------------------------------------------------------
    def _segment_key(self, req: Request, s: int) -> int:
        """What a block hash is salted with: nested segment ``s``, or, for a standalone copy, its tier
        (its one segment is the whole truncated model, whose KV no nested segment shares)."""
        return s if self.cfg.served_tiers is None else STANDALONE_KEY_BASE + req.tier

    def _hashes(self, req: Request, num_blocks: int) -> list[list[bytes]]:
        """Chained hashes of the request's first `num_blocks` full blocks, per segment (memoized:
        a request's tokens only ever grow)."""
        bs = self.cfg.block_size
        num_blocks = min(num_blocks, req.num_tokens // bs)  # never a block whose tokens are not all known
        while len(req.block_hashes) < self._segments(req):  # (a cascade adds segments)
            req.block_hashes.append([])
        for s, chain in enumerate(req.block_hashes):
            key = self._segment_key(req, s)
            while len(chain) < num_blocks:
                i = len(chain)
                tokens = req.token_slice(i * bs, (i + 1) * bs)
                chain.append(block_hash(chain[-1] if chain else None, key, tokens))
        return [chain[:num_blocks] for chain in req.block_hashes]

    def prefix_hashes(self, prompt_ids: list[int], tier: int) -> list[list[bytes]]:
        """What an admission of this prompt would look up, per segment (for placement)."""
        probe = Request("", list(prompt_ids), tier, SamplingParams(), frozenset(), -1)
        return self._hashes(probe, (len(prompt_ids) - 1) // self.cfg.block_size)

    def _cached_prefix(self, req: Request, budget: int, alone: bool = False) -> list[list[int]] | None:
        """The cached blocks a request can start from, per segment, short of its last token (whose
        logits it samples from). Positions cached in *every* segment it uses are reused outright.
        Cross-tier: when the lower segments 0..D hold a longer prefix (the session ran at a lower
        tier before), that longer prefix is reused there too and the segments above D are computed
        for the difference from the hidden state stored at exit D (``req.catchup``). A catch-up longer
        than the step's token budget is only planned in a step of its own (`alone`): it then runs
        with nothing else waiting on it."""
        req.catchup = None
        req.fills = []
        if not self.cfg.prefix_caching:
            return None
        if req.params.prompt_logprobs is not None and not req.output_ids:
            return None  # it scores every prompt position, so computes them all (its blocks are cached)
        chains = self._hashes(req, (req.num_tokens - 1) // self.cfg.block_size)
        hits = [self.pools[s].lookup(chain) for s, chain in enumerate(chains)]
        low = [min(len(h) for h in hits[:s + 1]) for s in range(len(hits))]  # cached in 0..s
        top = low[-1]
        d = max(s for s in range(len(low)) if low[s] == low[0])
        bs = self.cfg.block_size
        if (self.cfg.served_tiers is None and d < len(low) - 1 and low[0] > top
                and all(len(h) == top for h in hits[d + 1:])
                and ((low[0] - top) * bs < budget or alone)):
            req.catchup = (d + 1, top * bs, low[0] * bs)
            return self._plan_fills(req, [h[:low[0]] if s <= d else h[:top] for s, h in enumerate(hits)],
                                    budget, alone)
        return self._plan_fills(req, [h[:top] for h in hits], budget, alone)

    def _count_admission(self, req: Request, hit: list[list[int]] | None) -> None:
        full = (len(req.prompt_ids) - 1) // self.cfg.block_size
        for s in range(self._segments(req)):
            self.stats.cache_queries[s] += full
            self.stats.cache_hits[s] += len(hit[s]) if hit else 0
            reused = len(hit[s]) * self.cfg.block_size if hit else 0
            self.stats.prefill_reused[s] += min(reused, len(req.prompt_ids))
        if req.catchup is not None:  # the upper segments compute these cached positions now
            seg, a, b = req.catchup
            for s in range(seg, self._segments(req)):
                self.stats.prefill_computed[s] += b - a
        if req.num_preemptions == 0:
            req.num_cached_tokens = req.num_computed_tokens
        if hit and self.cache_log is not None:  # reuse refreshes the directory's entries
            for s, blocks in enumerate(hit):
                self.cache_log.extend((self.pools[s].hash_of[b], True) for b in blocks)

    def _register_full_blocks(self, req: Request) -> None:
        """After a step: the request's newly completed blocks become findable by hash. (A verification
        has computed positions whose tokens the request gets only when they are emitted: those blocks
        are registered at a later step, once their tokens are known.)"""
        full = min(req.num_computed_tokens, req.num_tokens) // self.cfg.block_size
        if not self.cfg.prefix_caching or full <= req.num_cached_blocks:
            return
        chains = self._hashes(req, full)
        reads = self._exits_read(req) if self.lazy_exits else None
        for s, table in enumerate(req.block_tables):
            complete = reads is None or s in reads or s not in self.cfg.exit_blocks  # its rows wrote that exit
            for i in range(req.num_cached_blocks, full):
                if self.pools[s].cache(table[i], chains[s][i], complete) and self.cache_log is not None:
                    self.cache_log.append((chains[s][i], True))
        req.num_cached_blocks = full

    def _evicted(self, s: int):
        def note(block: int, h: bytes) -> None:
            self.stats.evictions[s] += 1
            if self.cache_log is not None:
                self.cache_log.append((h, False))
        return note

    def drain_cache_log(self) -> list[tuple[bytes, bool]]:
        out, self.cache_log = self.cache_log or [], []
        return out
