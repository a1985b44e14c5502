"""One request's state in the worker's runner (:class:`RequestState`), and the decisions taken on one
request's rows alone: penalty counts, its grammar's masks along a round's drafts, prompt
log-probabilities, the confidence cascade's window, and speculative drafting and verification.

A request's sampling parameters and seeded generator live here, so a request samples the same sequence
wherever it is batched. The batched work over many requests' rows (plain sampling, the grammar masks of
plain rows, the cascade's confidences) stays with the runner (worker/runner.py).

Speculation stays exact under penalties and a grammar: a draft row and each position of a verification
row are processed as plain decoding would process them there (the penalties counting the round's earlier
drafts; the matcher advanced through those drafts, then rolled back), so the drafts are checked against
what plain decoding would have allowed.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch

from core.protocol import PlanRow, TokenLogprob
from kernels.cpu_argmax import argmax_rows
from worker.grammar import Grammars
from worker.sampling import (SamplingParams, accept_greedy, accept_sampled, draw, probs_for, process_logits,
                             token_logprobs)


@dataclass(slots=True)
class RequestState:
    params: SamplingParams
    gen: torch.Generator | None
    prompt: list[int] | None = None  # its prompt's token ids, where its parameters need them (needs_prompt)
    # penalties: how often each token occurs in the output so far [V], and whether it occurs in the prompt or
    # the output [V] (kept in step with the committed tokens)
    counts: torch.Tensor | None = None
    seen: torch.Tensor | None = None
    matcher: object | None = None  # a grammar's xgrammar matcher, following the committed tokens
    grammars: Grammars | None = None  # the runner's grammars the matcher came from (masks, stop tokens)
    # input position of a draft row -> the distribution its draft was drawn from (sampled speculation)
    draft_probs: dict[int, torch.Tensor] = field(default_factory=dict)
    window: deque[float] | None = None  # cascade: the confidences of its latest sampled rows
    # prompt position -> its token scored, until the first output token hands them out
    prompt_scores: dict[int, TokenLogprob] | None = None

    # ---- penalties --------------------------------------------------------------------------
    def commit(self, toks: list[int]) -> None:
        """The committed tokens into the penalty counts."""
        t = torch.tensor(toks, dtype=torch.long, device=self.counts.device)
        self.counts.index_add_(0, t, torch.ones(len(toks), device=self.counts.device))
        self.seen[t] = True

    def history(self, extra: list[int]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(counts, seen) of its output so far followed by ``extra`` (a round's drafts)."""
        c, sn = self.counts, self.seen
        if c is None or not extra:
            return c, sn
        t = torch.tensor(extra, dtype=torch.long, device=c.device)
        c = c.index_add(0, t, torch.ones(len(extra), device=c.device))
        sn = sn.clone()
        sn[t] = True
        return c, sn

    def processed(self, lg: torch.Tensor, histories: list[list[int]]) -> torch.Tensor:
        """lg [n, V]: logit_bias and penalties at n positions, position i's history being its output so far
        plus histories[i] (drafts): what plain decoding would apply there."""
        if not self.params.processed:
            return lg
        hs = [self.history(h) for h in histories]
        return process_logits(lg, [self.params] * len(hs), [h[0] for h in hs], [h[1] for h in hs])

    # ---- structured output ------------------------------------------------------------------
    def advance(self, rid: str, toks: list[int]) -> None:
        """The matcher follows the committed tokens (none after the grammar's end: a round may commit past
        an eos, which ends the request there)."""
        m = self.matcher
        for t in toks:
            if m.is_terminated():
                return
            if not m.accept_token(t):
                # the EOS Grammars.allowed gives a row its grammar left with no token: it ends there
                assert t in self.grammars.stop_token_ids, f"request {rid}: token {t} outside its grammar"
                return

    def masks_along(self, path: list[int], n: int, last_only: bool = False) -> torch.Tensor | None:
        """[n, V] bool: what its grammar allows at n positions, position i following its output so far plus
        path[:i] (a round's drafts); None without a grammar (``last_only``: only position n - 1 is filled).
        The matcher is advanced through the path and rolled back. Positions past the grammar's end (an
        earlier draft was eos) or past a draft it refuses are left unconstrained: a round never commits a
        token there (the request ends at the eos; a refused draft is rejected)."""
        m = self.matcher
        if m is None:
            return None
        g = self.grammars
        masks = torch.ones(n, g.vocab_size, dtype=torch.bool)
        steps = 0
        for i in range(n):
            if i != steps or m.is_terminated():
                break
            if not last_only or i == n - 1:
                masks[i] = g.allowed([m])[0]
            if i < n - 1 and m.accept_token(path[i]):
                steps += 1
        if steps:
            m.rollback(steps)
        return masks

    def ruled(self, lg: torch.Tensor, path: list[int], last_only: bool = False) -> torch.Tensor:
        """lg [n, V] masked by its grammar along path (the identity without one)."""
        mk = self.masks_along(path, lg.shape[0], last_only)
        return lg if mk is None else lg.masked_fill(~mk.to(lg.device), float("-inf"))

    # ---- prompt log-probabilities ----------------------------------------------------------
    def score_prompt(self, r: PlanRow, lg: torch.Tensor) -> None:
        """lg [n, V]: logits at the row's positions; position p scores prompt token p + 1."""
        prompt, k = self.prompt, self.params.prompt_logprobs
        m = min(len(r.token_ids), len(prompt) - 1 - r.start_pos)  # positions with a prompt token after
        if m <= 0:
            return
        a = r.start_pos
        scored = token_logprobs(lg[:m], prompt[a + 1:a + 1 + m], [k] * m)
        if self.prompt_scores is None:
            self.prompt_scores = {}
        self.prompt_scores.update(zip(range(a + 1, a + 1 + m), scored))

    def take_prompt_logprobs(self, rid: str) -> list[TokenLogprob]:
        """Its prompt tokens 1..P-1 scored, handed out once (with its first output token)."""
        scores, n = self.prompt_scores, len(self.prompt)
        self.prompt_scores = None
        assert len(scores) == n - 1, f"request {rid}: {len(scores)} of {n - 1} prompt tokens scored"
        return [scores[p] for p in range(1, n)]

    # ---- the confidence cascade -------------------------------------------------------------
    def escalates(self, confidence: float, below_top: bool) -> bool:
        """Adds a sampled row's confidence to the window; True (window reset) when the full window averages
        below the threshold and a tier above the row's exists."""
        p = self.params
        win = self.window
        if win is None or win.maxlen != p.cascade_window:
            win = self.window = deque(maxlen=p.cascade_window)
        win.append(confidence)
        if len(win) == win.maxlen and sum(win) / len(win) < p.cascade_threshold and below_top:
            win.clear()
            return True
        return False

    # ---- self-speculative decoding ----------------------------------------------------------
    def draft(self, r: PlanRow, row_logits: torch.Tensor) -> int:
        """A draft token: greedy, the draft tier's argmax; sampled, a draw from the draft tier's
        distribution q, which is kept (per input position) for the verification that follows. Its
        penalties count the round's earlier drafts (the row carries them)."""
        params = self.params
        row_logits = self.processed(row_logits[None], [r.drafts])
        if self.matcher is not None:  # the mask at this draft's position: after the round's earlier drafts
            row_logits = self.ruled(row_logits.expand(len(r.drafts) + 1, -1), list(r.drafts), True)[-1:]
        row_logits = row_logits[0]
        if params.greedy:
            return int(argmax_rows(row_logits[None])[0])
        q = probs_for(row_logits.cpu(), params)
        self.draft_probs[r.start_pos + len(r.token_ids) - 1] = q.float()
        return draw(q, self.gen)

    def verify(self, rid: str, r: PlanRow, lg: torch.Tensor) -> tuple[list[int], int]:
        """lg [g, V]: the target's logits at the round's g positions; r.drafts the g drafts. Returns the
        tokens the round commits and how many drafts were accepted."""
        params = self.params
        kept, self.draft_probs = self.draft_probs, {}  # this round's, and any stale ones: all dropped now
        drafts = list(r.drafts)
        if len(drafts) != lg.shape[0]:
            raise ValueError(f"request {rid}: {len(drafts)} drafts for {lg.shape[0]} verified positions")
        # position i follows the drafts before it: the same transforms plain decoding would apply there
        lg = self.processed(lg, [drafts[:i] for i in range(len(drafts))])
        lg = self.ruled(lg, drafts)  # and the grammar's mask there (the drafts are checked against it)
        if params.greedy:
            return accept_greedy(drafts, argmax_rows(lg).tolist())
        p = torch.stack([probs_for(row, params) for row in lg.cpu()])
        q = [kept.get(r.start_pos + i) for i in range(len(drafts))]
        return accept_sampled(p, q, drafts, self.gen)
