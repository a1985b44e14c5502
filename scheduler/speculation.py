"""The scheduler's side of the two multi-level modes, their state and rules in one place.

Self-speculative decoding (:class:`Speculation`): when a request drafts, how many drafts a round gets
(adaptive gamma, early stop on an unsure drafter, a pause after poor rounds), the per tier-pair gate
that keeps a poor drafter from costing more than it saves, and taking a verification's outcome back.
The runner (worker/runner.py) holds the distributions and decides acceptance.

Confidence cascade (:class:`Cascade`): a request the runner reports as escalated moves one tier up;
the new segment's KV for its history is computed from the hidden state stored at the old exit, in
budget-sized catch-up chunks, before it decodes on."""
from __future__ import annotations

from collections.abc import Callable

import structlog

from scheduler.request import Request, SchedulerConfig, SchedulerStats

log = structlog.get_logger(__name__)


class Speculation:
    def __init__(self, cfg: SchedulerConfig, stats: SchedulerStats):
        self.cfg = cfg
        self.stats = stats
        self._pair_rate: dict[str, float] = {}   # "draft>target" -> acceptance EMA over all rounds
        self._pair_chances: dict[str, int] = {}  # rounds a gated pair could have started

    def gamma(self, req: Request) -> int:
        """Drafts per round: the request's gamma while drafts are mostly accepted, fewer otherwise."""
        if req.spec_stop and req.drafts:
            return len(req.drafts)
        left = min(req.params.max_tokens - len(req.output_ids), self.cfg.max_model_len - req.num_tokens)
        g = req.params.spec_gamma if req.spec_rate >= 0.6 else max(2, req.params.spec_gamma // 2)
        return min(g, left)

    def next_row(self, req: Request, budget: int, allocate: Callable[[Request, int], bool]) -> tuple[str, int] | None:
        """("draft" | "verify", gamma) when a decoding request speculates this step; None for a
        plain row (prefill, no speculation, too few tokens left, or no blocks for the round: a new
        round first reserves its positions in every segment through ``allocate``)."""
        if req.params.spec_draft_tier is None or req.num_computed_tokens != req.num_tokens - 1:
            return None
        if req.spec_pause > 0 and not req.drafts:
            req.spec_pause -= 1  # this step decodes plainly
            return None
        g = self.gamma(req)
        if g < 2 and not req.drafts:
            return None
        if not req.drafts:
            pair = f"{req.params.spec_draft_tier}>{req.tier}"
            rate = self._pair_rate.get(pair)
            if rate is not None and rate < self.cfg.spec_min_acceptance:
                n = self._pair_chances[pair] = self._pair_chances.get(pair, 0) + 1
                if n % self.cfg.spec_probe_every:
                    self.stats.spec_gated += 1
                    return None  # the pair is below break-even: decode plainly, probe now and then
        if not req.drafts and not allocate(req, g):  # the round's positions, every segment
            return None
        if len(req.drafts) < g:
            return ("draft", g) if budget >= 1 else None
        # A verification that does not fit the budget verifies the drafts that do (never a plain row:
        # the round's drafts would go stale, and their stored hidden states with them).
        return ("verify", min(g, budget)) if budget >= 1 else None

    def accept(self, req: Request, committed: list[int], g: int, k: int | None = None) -> list[int]:
        """Takes a verification's outcome from the runner: `committed` (the accepted drafts, then the
        target's replacement at the first rejection; as many tokens as positions now valid) of a
        round of `g` drafts, `k` of them accepted (derived from the drafts when not given)."""
        committed = list(committed)[:g]
        if k is None:
            k = 0
            while k < len(committed) and k < len(req.drafts) and committed[k] == req.drafts[k]:
                k += 1
        req.spec_proposed += g
        req.spec_accepted += k
        self.stats.spec_proposed += g
        self.stats.spec_accepted += k
        self.stats.spec_rounds += 1
        key = f"{req.params.spec_draft_tier}>{req.tier}"
        rate = self._pair_rate.get(key)
        self._pair_rate[key] = k / g if rate is None else 0.8 * rate + 0.2 * k / g
        pair = self.stats.spec_pairs.setdefault(key, [0, 0, 0, 0])
        pair[0] += 1
        pair[1] += g
        pair[2] += k
        pair[3] += len(committed)
        req.drafts = []
        req.spec_stop = False
        # Adaptive drafting: when the drafter keeps missing, decode plainly for a while (longer each
        # time), so a poor drafter costs a bounded share of the steps instead of slowing every token.
        req.spec_rate = 0.5 * req.spec_rate + 0.5 * k / g
        if req.spec_rate < 0.3:
            req.spec_pause, req.spec_backoff = req.spec_backoff, min(req.spec_backoff * 2, 512)
        else:
            req.spec_backoff = 8
        return committed

    def add_draft(self, req: Request, token: int, confidence: float | None) -> None:
        """A draft row's token joins its round; a drafter unsure of it (below the request's
        ``spec_stop_confidence``) ends the round early: the drafts so far are verified next."""
        req.drafts.append(token)
        if confidence is not None and confidence < req.params.spec_stop_confidence:
            req.spec_stop = True


class Cascade:
    def __init__(self, cfg: SchedulerConfig, stats: SchedulerStats):
        self.cfg = cfg
        self.stats = stats

    def escalate(self, req: Request) -> None:
        """Moves a running request one tier up. Its computed positions get the new segment's KV from
        a catch-up (planned by :meth:`schedule`, which also allocates the new segment's blocks)."""
        old = req.tier
        if self.cfg.served_tiers is not None or old + 1 >= self.cfg.num_tiers:
            return
        req.tier = old + 1
        req.block_tables.append([])
        req.num_cached_blocks = 0  # re-registers every segment's full blocks once the catch-up ran
        n = req.num_computed_tokens
        req.catchup = (req.tier, 0, n) if n else None
        req.tiers.append(req.tier)
        req.escalated_at.append(len(req.output_ids))
        key = f"{old}>{req.tier}"
        self.stats.escalations[key] = self.stats.escalations.get(key, 0) + 1
        log.debug("escalated", request_id=req.request_id, tier=req.tier, at=len(req.output_ids))

    def plan_catchup(self, req: Request, budget: int, catchups: list, num_segments: int) -> int:
        """Plans (a chunk of) a running request's pending catch-up under the budget; returns the
        tokens it takes. Chunks run in order, each attending to the ones before it."""
        seg, a, b = req.catchup
        c = min(b - a, budget)
        catchups.append((req, seg, a, a + c))
        p = len(req.prompt_ids)
        for s in range(seg, num_segments):
            self.stats.prefill_computed[s] += max(0, min(a + c, p) - min(a, p))
        req.catchup = (seg, a + c, b) if a + c < b else None
        return c
