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

Structured output is applied here too: a request with a grammar (``SamplingParams.grammar``) has a
matcher (worker/grammar.py) advanced with every token it commits; its sampled rows are masked to what
the matcher allows, after logit_bias and penalties, batched over the rows that have one. A re-planned
request rebuilds its matcher from the output tokens it had produced (the tail of ``prompt_ids``).
Speculation stays exact under a grammar: a draft row and each position of a verification row are
masked as plain decoding would mask them there (the matcher advanced through the round's earlier
drafts, then rolled back), so the drafts are checked against the mask.

Log-probabilities are taken here too, from the raw logits of the row that produced each token (plain
rows, and a verification row's positions: the target tier's), only for requests that ask; prompt
log-probabilities (``logits_all`` rows) are gathered per position and handed out with the request's
first token.
"""
from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from core.protocol import PlanRow, TokenLogprob
from kernels.cpu_argmax import argmax_rows
from worker.batch import build_step, order_rows
from worker.execution import EAGER, compiled_exits, decode_graphs, path_name
from worker.grammar import Grammars, mask_rows
from worker.kv_tensors import SegmentedKVCache
from worker.model import NestedModel
from worker.sampling import (SamplingParams, accept_greedy, accept_sampled, confidences, draw,
                             make_generator, probs_for, process_logits, sample, skip_draws, token_logprobs)


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
    # request -> one entry per token in `tokens` / `verified` (requests that asked for logprobs)
    logprobs: dict[str, list[TokenLogprob]] = field(default_factory=dict)
    # request -> its prompt tokens 1..P-1 scored, with its first output token (echo)
    prompt_logprobs: dict[str, list[TokenLogprob]] = field(default_factory=dict)
    path: str = EAGER  # the execution path the step ran (worker/execution.py): named in each token event


class ModelRunner:
    def __init__(self, model: NestedModel, num_blocks: list[int], block_size: int,
                 tier_map: dict[int, int] | None = None, keep_logits: bool = False, tokenizer=None,
                 load_tokenizer: Callable[[], object] | None = None):
        self.model = model
        # for grammars (structured output); None: a grammar request is refused. ``load_tokenizer``
        # instead: called with the first grammar request (a worker starts without reading it)
        self.tokenizer = tokenizer
        self._load_tokenizer = load_tokenizer
        self._grammars: Grammars | None = None  # built with the first grammar request
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
        self.prompts: dict[str, list[int]] = {}  # requests that need their prompt (params.needs_prompt)
        # request -> {prompt position: its token scored} until the first output token hands them out
        self.prompt_scores: dict[str, dict[int, TokenLogprob]] = {}
        # Requests with penalties: how often each token occurs in the output so far [V], and whether
        # it occurs in the prompt or the output [V] (kept in step with the committed tokens).
        self.counts: dict[str, torch.Tensor] = {}
        self.seen: dict[str, torch.Tensor] = {}
        self.matchers: dict[str, object] = {}  # requests with a grammar: their xgrammar matcher
        self._pending = None  # an execution path built in the background, applied before the next step
        self.step_lock = threading.Lock()  # held by each step: the background build's one pause of it
        self.record_graphs()

    def swap_in(self, path) -> None:
        """``path`` (worker/execution.py) serves from the next step on; safe from another thread: the step
        loop applies it between two steps (worker/execution_swap.py)."""
        self._pending = path

    def record_graphs(self) -> int:
        """With CUDA decode graphs on the model (``--compile`` on CUDA: worker/decode_graphs.py), records
        them over this runner's KV pools now, before any request waits; returns how many."""
        graphs = decode_graphs(self.model)
        return graphs.capture_all(self.kv) if graphs is not None else 0

    def add(self, request_id: str, params: SamplingParams, prompt_ids: list[int] | None = None,
            num_output: int = 0) -> None:
        """A new request; `prompt_ids` when its parameters need them, the last `num_output` of them
        being output tokens it produced before a re-plan."""
        gen = make_generator(params)
        skip_draws(gen, num_output if params.spec_draft_tier is None else 0, self.model.cfg.vocab_size)
        self.sampling[request_id] = (params, gen)
        if params.needs_prompt:
            if not prompt_ids:
                raise ValueError(f"request {request_id}: its parameters need the prompt's token ids")
            self.prompts[request_id] = list(prompt_ids)
        if params.penalized:
            v = self.model.cfg.vocab_size
            ids = torch.tensor(prompt_ids, dtype=torch.long, device=self.device)
            out = ids[len(ids) - num_output:] if num_output else ids[:0]
            self.counts[request_id] = torch.bincount(out, minlength=v).float()
            self.seen[request_id] = torch.bincount(ids, minlength=v) > 0
        if params.grammar is not None:
            m = self.grammars().matcher(params.grammar)
            for t in prompt_ids[len(prompt_ids) - num_output:] if num_output else []:
                if not m.accept_token(t):
                    raise ValueError(f"request {request_id}: its output so far does not follow its grammar")
            self.matchers[request_id] = m

    def warm_up(self, steps: int = 2, part: str = "all") -> float:
        """Runs throw-away requests so that compiled graphs (worker/execution.py) are built
        before any client waits: through the top tier, and through each lower tier whose exit block the
        graph serves (a block's own length is its own graph): one request decoding alone, then two
        together (the compiler specializes a batch of one), each over more than one KV block per
        segment, as real contexts are. Uses the first blocks of every pool; a real request never reads
        them before writing (each reads only positions its own rows wrote), and the warm-up requests are
        dropped after. ``part``: ``top`` only the top tier (the trunk's graphs), ``exits`` only the lower
        tiers (their exit blocks' graphs), ``all`` both. Returns the seconds it took."""
        import time  # noqa: PLC0415
        t0 = time.perf_counter()
        model = self.model
        top = model.num_segments - 1
        n = self.block_size + 2  # prompt tokens: two blocks
        need = -(-(n + steps) // self.block_size)
        if min(self.kv.num_blocks) < 2 * need:
            raise ValueError(f"warm_up needs {2 * need} KV blocks per segment; the pools have "
                             f"{min(self.kv.num_blocks)}")
        self.record_graphs()  # CUDA graphs: every bucket, largest first, before the steps below use any
        if part not in ("all", "top", "exits"):
            raise ValueError(f"warm_up part {part!r}: expected all, top or exits")
        local = ([top] if part != "exits" else []) + (
            [s for s in model.exit_block_segments if s in compiled_exits(model)] if part != "top" else [])
        prompt = [1 + k % 7 for k in range(n)]
        for t in local:
            if self.tier_map is None:
                tier = t
            else:  # the caller plans in global tiers; a lower tier no global one maps to is never served
                tier = next((g for g, lt in self.tier_map.items() if lt == t), None)
                if tier is None and t == top:
                    raise ValueError(f"warm_up: no global tier maps to this model's top tier {top} "
                                     f"(tier_map {self.tier_map})")
                if tier is None:
                    continue
            rids = [f"warm-up-{t}-0", f"warm-up-{t}-1"]
            tables = {rid: [list(range(k * need, (k + 1) * need))] * (t + 1) for k, rid in enumerate(rids)}
            for rid in rids:
                self.add(rid, SamplingParams(max_tokens=steps + 1, ignore_eos=True))
            last: dict[str, int] = {}
            for group in (rids[:1], rids):
                for rid in group:  # prefill (the second group rewrites the same positions)
                    last[rid] = self.execute([PlanRow(rid, tier, prompt, 0, tables[rid], True, 0)]).tokens[rid]
                for k in range(steps):
                    last.update(self.execute([PlanRow(rid, tier, [last[rid]], n + k, tables[rid], True, k + 1)
                                              for rid in group]).tokens)
            self.drop(rids)
        return time.perf_counter() - t0

    def grammars(self) -> Grammars:
        if self._grammars is None:
            if self.tokenizer is None and self._load_tokenizer is not None:
                self.tokenizer = self._load_tokenizer()
            if self.tokenizer is None:
                raise ValueError("this runner has no tokenizer: it cannot apply a grammar")
            cfg = self.model.cfg
            self._grammars = Grammars(self.tokenizer, cfg.vocab_size, list(cfg.eos_token_ids))
        return self._grammars

    def drop(self, request_ids) -> None:
        for rid in request_ids:
            self.sampling.pop(rid, None)
            self.draft_probs.pop(rid, None)
            self.windows.pop(rid, None)
            self.prompts.pop(rid, None)
            self.prompt_scores.pop(rid, None)
            self.counts.pop(rid, None)
            self.seen.pop(rid, None)
            self.matchers.pop(rid, None)

    def execute(self, rows: list[PlanRow]) -> StepOutput:
        with self.step_lock:
            return self._execute(rows)

    def _execute(self, rows: list[PlanRow]) -> StepOutput:
        if self._pending is not None:
            path, self._pending = self._pending, None
            path.apply(self.model)
            self.record_graphs()  # CUDA graphs over this runner's pools, before the step uses them
        if self.tier_map is not None:  # copies: the caller keeps the global tiers (it streams them)
            rows = [replace(r, tier=self.tier_map[r.tier]) for r in rows]
        rows = [rows[i] for i in order_rows(rows)]
        batch = build_step(rows, self.model.num_segments, self.block_size, self.device,
                           self.model.exit_block_segments)
        logits = self.model.forward_step(batch, self.kv)
        out = StepOutput({}, None, int(batch.input_ids.shape[0]), path=path_name(self.model))
        # The logits of each sampled row (several, in position order, for a verification row).
        per_row: dict[int, list[int]] = {}
        for k, i in enumerate(batch.sampled_rows):
            per_row.setdefault(i, []).append(k)
        plain: list[tuple[int, str]] = []    # (logits index, request) of rows sampling one token
        watched: list[tuple[int, str, PlanRow]] = []  # the cascade requests among them
        first: set[str] = set()              # requests sampling their first output token
        for i, ks in per_row.items():
            r = rows[i]
            rid = r.request_id
            params = self.sampling[rid][0]
            if r.sample_all:
                lg = logits[ks[0]:ks[-1] + 1]
                committed, k = self._verify(rid, r, lg)
                out.verified[rid], out.accepted[rid] = committed, k
                if params.logprobs is not None:
                    out.logprobs[rid] = token_logprobs(lg[:len(committed)], committed,
                                                       [params.logprobs] * len(committed))
                continue
            if r.logits_all:
                self._score_prompt(rid, r, logits[ks[0]:ks[-1] + 1])
                if not r.sample:
                    continue
                ks = ks[-1:]  # the last position samples
            if r.num_output == 0 and not r.draft:
                first.add(rid)
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
            ks = [k for k, _ in plain]
            if ks == list(range(ks[0], ks[0] + len(ks))):  # consecutive rows (every plain decode step): a view
                sub = logits[ks[0]:ks[0] + len(ks)]
            else:
                sub = logits.index_select(0, torch.tensor(ks, dtype=torch.long, device=logits.device))
            states = [self.sampling[rid] for _, rid in plain]
            ps = [st[0] for st in states]
            proc = process_logits(sub, ps, [self.counts.get(rid) for _, rid in plain],
                                  [self.seen.get(rid) for _, rid in plain])
            ruled = [j for j, (_, rid) in enumerate(plain) if rid in self.matchers]
            if ruled:  # structured output: what each grammar allows next (raw logits kept for logprobs)
                allowed = self.grammars().allowed([self.matchers[plain[j][1]] for j in ruled])
                proc = mask_rows(proc, ruled, allowed)
            toks = sample(proc, ps, [st[1] for st in states])
            for j in ruled:
                self._advance(plain[j][1], [toks[j]])
            out.tokens.update(zip((rid for _, rid in plain), toks))
            asked = [j for j, st in enumerate(states) if st[0].logprobs is not None]
            if asked:
                lps = token_logprobs(sub[asked], [toks[j] for j in asked], [states[j][0].logprobs for j in asked])
                out.logprobs.update((plain[j][1], [lp]) for j, lp in zip(asked, lps))
            for rid in first & self.prompt_scores.keys():
                if rid in out.tokens:
                    out.prompt_logprobs[rid] = self._prompt_logprobs(rid)
        for rid in self.matchers.keys() & out.verified.keys():
            self._advance(rid, out.verified[rid])
        for rid in self.counts.keys() & (out.tokens.keys() | out.verified.keys()):
            self._commit(rid, out.verified[rid] if rid in out.verified else [out.tokens[rid]])
        if self.keep_logits:
            out.logits = {rid: logits[ks[-1]].clone() for i, ks in per_row.items()
                          for rid in [rows[i].request_id] if rid in out.tokens}
        return out

    # ---- prompt log-probabilities ----------------------------------------------------------
    def _score_prompt(self, rid: str, r: PlanRow, lg: torch.Tensor) -> None:
        """lg [n, V]: logits at the row's positions; position p scores prompt token p + 1."""
        prompt, k = self.prompts[rid], self.sampling[rid][0].prompt_logprobs
        m = min(len(r.token_ids), len(prompt) - 1 - r.start_pos)  # positions with a prompt token after
        if m <= 0:
            return
        a = r.start_pos
        scored = token_logprobs(lg[:m], prompt[a + 1:a + 1 + m], [k] * m)
        self.prompt_scores.setdefault(rid, {}).update(zip(range(a + 1, a + 1 + m), scored))

    def _prompt_logprobs(self, rid: str) -> list[TokenLogprob]:
        scores, n = self.prompt_scores.pop(rid), len(self.prompts[rid])
        assert len(scores) == n - 1, f"request {rid}: {len(scores)} of {n - 1} prompt tokens scored"
        return [scores[p] for p in range(1, n)]

    # ---- penalties --------------------------------------------------------------------------
    def _commit(self, rid: str, toks: list[int]) -> None:
        t = torch.tensor(toks, dtype=torch.long, device=self.device)
        self.counts[rid].index_add_(0, t, torch.ones(len(toks), device=self.device))
        self.seen[rid][t] = True

    def _history(self, rid: str, extra: list[int]) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(counts, seen) of a request whose output so far is followed by `extra` (a round's drafts)."""
        c, sn = self.counts.get(rid), self.seen.get(rid)
        if c is None or not extra:
            return c, sn
        t = torch.tensor(extra, dtype=torch.long, device=self.device)
        c = c.index_add(0, t, torch.ones(len(extra), device=self.device))
        sn = sn.clone()
        sn[t] = True
        return c, sn

    def _processed(self, rid: str, lg: torch.Tensor, histories: list[list[int]]) -> torch.Tensor:
        """lg [n, V]: logit_bias and penalties at n positions of one request, position i's history being
        its output so far plus histories[i] (drafts): what plain decoding would apply there."""
        params = self.sampling[rid][0]
        if not params.processed:
            return lg
        hs = [self._history(rid, h) for h in histories]
        return process_logits(lg, [params] * len(hs), [h[0] for h in hs], [h[1] for h in hs])

    # ---- structured output ------------------------------------------------------------------
    def _advance(self, rid: str, toks: list[int]) -> None:
        """The request's matcher follows its committed tokens (none after the grammar's end: a round may
        commit past an eos, which ends the request there)."""
        m = self.matchers[rid]
        for t in toks:
            if m.is_terminated():
                return
            if not m.accept_token(t):
                # the EOS Grammars.allowed gives a row its grammar left with no token: it ends there
                assert t in self.grammars().stop_token_ids, f"request {rid}: token {t} outside its grammar"
                return

    def _masks_along(self, rid: str, path: list[int], n: int, last_only: bool = False) -> torch.Tensor | None:
        """[n, V] bool: what the request's grammar allows at n positions, position i following its output
        so far plus path[:i] (a round's drafts); None without a grammar (``last_only``: only position
        n - 1 is filled). The matcher is advanced through the path and rolled back. Positions past the
        grammar's end (an earlier draft was eos) or past a draft it refuses are left unconstrained: a
        round never commits a token there (the request ends at the eos; a refused draft is rejected)."""
        m = self.matchers.get(rid)
        if m is None:
            return None
        g = self.grammars()
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

    def _ruled(self, rid: str, lg: torch.Tensor, path: list[int], last_only: bool = False) -> torch.Tensor:
        """lg [n, V] masked by the request's grammar along path (the identity without one)."""
        mk = self._masks_along(rid, path, lg.shape[0], last_only)
        return lg if mk is None else lg.masked_fill(~mk.to(lg.device), float("-inf"))

    # ---- self-speculative decoding ----------------------------------------------------------
    def _draft(self, rid: str, r: PlanRow, row_logits: torch.Tensor) -> int:
        """A draft token: greedy, the draft tier's argmax; sampled, a draw from the draft tier's
        distribution q, which is kept (per input position) for the verification that follows. Its
        penalties count the round's earlier drafts (the row carries them)."""
        params, gen = self.sampling[rid]
        row_logits = self._processed(rid, row_logits[None], [r.drafts])
        if rid in self.matchers:  # the mask at this draft's position: after the round's earlier drafts
            row_logits = self._ruled(rid, row_logits.expand(len(r.drafts) + 1, -1), list(r.drafts), True)[-1:]
        row_logits = row_logits[0]
        if params.greedy:
            return int(argmax_rows(row_logits[None])[0])
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
        # position i follows the drafts before it: the same transforms plain decoding would apply there
        lg = self._processed(rid, lg, [drafts[:i] for i in range(len(drafts))])
        lg = self._ruled(rid, lg, drafts)  # and the grammar's mask there (the drafts are checked against it)
        if params.greedy:
            return accept_greedy(drafts, argmax_rows(lg).tolist())
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
