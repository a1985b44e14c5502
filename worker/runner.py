"""The worker's side of a step: KV tensors, the group-batched forward, and sampling.

The runner holds no scheduling state. It is told which requests are new (their sampling parameters
and seeded generators live here, so a request samples the same sequence wherever it is batched),
which rows to compute, and which requests to forget.

Two decisions are made here because they need the logits and must precede any token reaching a client:
* speculative verification (``sample_all`` rows): the round's drafts are accepted or rejected against
  the target's distributions (greedy: argmax agreement; sampling: rejection sampling against the draft
  distributions kept from the draft rows), and the committed tokens come back in ``verified``;
* the confidence cascade: a cascade request's sampled row whose confidence window falls below its
  threshold returns no token; its id comes back in ``escalate`` instead.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field, replace

import torch

from core.protocol import PlanRow
from worker.batch import build_step, order_rows
from worker.kv_tensors import SegmentedKVCache
from worker.model import NestedModel
from worker.sampling import (SamplingParams, accept_greedy, accept_sampled, confidences, draw,
                             make_generator, probs_for, sample)


@dataclass(slots=True)
class StepOutput:
    tokens: dict[str, int]   # request -> the token its plain row sampled (a client may see it)
    logits: dict[str, torch.Tensor] | None
    num_tokens: int
    # request -> the token its draft row drew (speculation; never shown to a client), and the draft
    # tier's confidence in it (max softmax probability), for the round's early stop
    drafts: dict[str, int] = field(default_factory=dict)
    draft_conf: dict[str, float] = field(default_factory=dict)
    # Speculative verification, per verified request: the tokens the round commits (the accepted
    # drafts, then the replacement at the first rejection) and how many drafts were accepted.
    verified: dict[str, list[int]] = field(default_factory=dict)
    accepted: dict[str, int] = field(default_factory=dict)
    # Cascade requests whose row returned no token: the scheduler moves them up one tier.
    escalate: list[str] = field(default_factory=list)


class ModelRunner:
    def __init__(self, model: NestedModel, num_blocks: list[int], block_size: int,
                 tier_map: dict[int, int] | None = None, keep_logits: bool = False):
        self.model = model
        cfg = model.cfg
        p = next(model.parameters())
        self.device = p.device
        self.kv = SegmentedKVCache([model.segment_kv_layers(s) for s in range(model.num_segments)],
                                   num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim, p.dtype, p.device,
                                   hidden_size=cfg.hidden_size if model.num_segments > 1 else 0)
        self.block_size = block_size
        self.tier_map = tier_map  # global tier -> this model's tier (a standalone copy has one)
        self.keep_logits = keep_logits
        self.sampling: dict[str, tuple[SamplingParams, torch.Generator | None]] = {}
        # request -> {input position of a draft row: the distribution its draft was drawn from}
        self.draft_probs: dict[str, dict[int, torch.Tensor]] = {}
        # request -> the confidences of its latest sampled rows (cascade requests)
        self.windows: dict[str, deque[float]] = {}

    def add(self, request_id: str, params: SamplingParams) -> None:
        self.sampling[request_id] = (params, make_generator(params))

    def drop(self, request_ids) -> None:
        for rid in request_ids:
            self.sampling.pop(rid, None)
            self.draft_probs.pop(rid, None)
            self.windows.pop(rid, None)

    def execute(self, rows: list[PlanRow]) -> StepOutput:
        if self.tier_map is not None:  # copies: the caller keeps the global tiers (it streams them)
            rows = [replace(r, tier=self.tier_map[r.tier]) for r in rows]
        rows = [rows[i] for i in order_rows(rows)]
        batch = build_step(rows, self.model.num_segments, self.block_size, self.device)
        logits = self.model.forward_step(batch, self.kv)
        out = StepOutput({}, None, int(batch.input_ids.shape[0]))
        # The logits of each sampled row (several, in position order, for a verification row).
        per_row: dict[int, list[int]] = {}
        for k, i in enumerate(batch.sampled_rows):
            per_row.setdefault(i, []).append(k)
        plain: list[tuple[int, str]] = []    # (logits index, request) of rows sampling one token
        watched: list[tuple[int, str, PlanRow]] = []  # the cascade requests among them
        for i, ks in per_row.items():
            r = rows[i]
            rid = r.request_id
            if r.sample_all:
                committed, k = self._verify(rid, r, logits[ks[0]:ks[-1] + 1])
                out.verified[rid], out.accepted[rid] = committed, k
                continue
            params = self.sampling[rid][0]
            if r.draft:
                out.drafts[rid] = self._draft(rid, r, logits[ks[0]])
                if params.spec_stop_confidence > 0:
                    out.draft_conf[rid] = confidences(logits[ks[0]][None])[0]
                continue
            plain.append((ks[0], rid))
            if params.cascade_threshold is not None:
                watched.append((ks[0], rid, r))
        if watched:
            escalating = self._escalations(watched, logits)
            out.escalate = [rid for _, rid in plain if rid in escalating]
            plain = [(k, rid) for k, rid in plain if rid not in escalating]
        if plain:
            sub = logits.index_select(0, torch.tensor([k for k, _ in plain], dtype=torch.long,
                                                      device=logits.device))
            states = [self.sampling[rid] for _, rid in plain]
            toks = sample(sub, [st[0] for st in states], [st[1] for st in states])
            out.tokens.update(zip((rid for _, rid in plain), toks))
        if self.keep_logits:
            out.logits = {rid: logits[ks[0]].clone() for i, ks in per_row.items()
                          for rid in [rows[i].request_id] if rid in out.tokens}
        return out

    # ---- self-speculative decoding ----------------------------------------------------------
    def _draft(self, rid: str, r: PlanRow, row_logits: torch.Tensor) -> int:
        """A draft token: greedy, the draft tier's argmax; sampled, a draw from the draft tier's
        distribution q, which is kept (per input position) for the verification that follows."""
        params, gen = self.sampling[rid]
        if params.greedy:
            return int(torch.argmax(row_logits))
        q = probs_for(row_logits.cpu(), params)
        self.draft_probs.setdefault(rid, {})[r.start_pos + len(r.token_ids) - 1] = q.float()
        return draw(q, gen)

    def _verify(self, rid: str, r: PlanRow, lg: torch.Tensor) -> tuple[list[int], int]:
        """lg [g, V]: the target's logits at the round's g positions; r.drafts the g drafts."""
        params, gen = self.sampling[rid]
        kept = self.draft_probs.pop(rid, {})  # this round's, and any stale ones: all dropped now
        drafts = list(r.drafts)
        if len(drafts) != lg.shape[0]:
            raise ValueError(f"request {rid}: {len(drafts)} drafts for {lg.shape[0]} verified positions")
        if params.greedy:
            return accept_greedy(drafts, torch.argmax(lg, dim=-1).tolist())
        p = torch.stack([probs_for(row, params) for row in lg.cpu()])
        q = [kept.get(r.start_pos + i) for i in range(len(drafts))]
        return accept_sampled(p, q, drafts, gen)

    # ---- the confidence cascade -------------------------------------------------------------
    def _escalations(self, watched: list[tuple[int, str, PlanRow]], logits: torch.Tensor) -> set[str]:
        """Adds each watched row's confidence to its request's window; the requests whose full window
        averages below their threshold (and that have a tier above them) escalate, window reset."""
        idx = torch.tensor([k for k, _, _ in watched], dtype=torch.long, device=logits.device)
        confs = confidences(logits.index_select(0, idx))
        top = self.model.num_segments - 1
        out = set()
        for (_, rid, r), c in zip(watched, confs):
            params = self.sampling[rid][0]
            win = self.windows.get(rid)
            if win is None or win.maxlen != params.cascade_window:
                win = self.windows[rid] = deque(maxlen=params.cascade_window)
            win.append(c)
            if (len(win) == win.maxlen and sum(win) / len(win) < params.cascade_threshold
                    and r.tier < top):
                win.clear()
                out.add(rid)
        return out
