"""The worker's side of a step (:class:`ModelRunner`): the KV tensors, the requests it is told of (one
:class:`worker.request_state.RequestState` each), the group-batched forward, and what each row's logits
become.

The runner holds no scheduling state. It is told which requests are new (their sampling parameters and
seeded generators live in their records, so a request samples the same sequence wherever it is batched),
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

Log-probabilities are taken here too, from the raw logits of the row that produced each token (plain
rows, and a verification row's positions: the target tier's), only for requests that ask; prompt
log-probabilities (``logits_all`` rows) are gathered per position and handed out with the request's
first token.

The model's execution path (worker/execution.py) is the path's own business: the runner applies a path
swapped in from another thread between two steps, over its KV pools, and names the path of each step.
"""
from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from core.protocol import PlanRow, TokenLogprob
from worker.batch import build_step, order_rows
from worker.execution import EAGER, compiled_exits, path_name
from worker.grammar import Grammars, mask_rows
from worker.kv_tensors import SegmentedKVCache
from worker.memory import release_memory
from worker.model import NestedModel
from worker.request_state import RequestState
from worker.sampling import (SamplingParams, confidences, make_generator, process_logits, sample, skip_draws,
                             token_logprobs)


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


def kv_geometry(model: NestedModel) -> tuple[list[int], int, int, torch.dtype, int]:
    """The KV pools' shape for ``model``: KV layers per segment, KV heads, head dim, dtype (the
    activations': the embedding's, a quantized one's too) and the stored hidden size (0: one segment)."""
    cfg = model.cfg
    return ([model.segment_kv_layers(s) for s in range(model.num_segments)], cfg.num_kv_heads, cfg.head_dim,
            model.embed_tokens.weight.dtype, cfg.hidden_size if model.num_segments > 1 else 0)


def blocks_within(model: NestedModel, block_size: int, budget_bytes: int, least_tokens: int,
                  most: int) -> int:
    """KV blocks per segment pool that ``budget_bytes`` holds for ``model`` (every pool together), raised to
    hold ``least_tokens`` (one request of the longest context served) and capped at ``most``."""
    layers, heads, dim, dtype, hidden = kv_geometry(model)
    per_block = SegmentedKVCache.block_bytes(layers, block_size, heads, dim, dtype, hidden)
    return max(-(-least_tokens // block_size), min(most, budget_bytes // per_block))


class ModelRunner:
    def __init__(self, model: NestedModel, num_blocks: list[int], block_size: int,
                 tier_map: dict[int, int] | None = None, keep_logits: bool = False, tokenizer=None,
                 load_tokenizer: Callable[[], object] | None = None, release_after_tokens: int = 256):
        """``release_after_tokens``: a step computing at least this many tokens gives the heap its
        transients used back to the system (:func:`worker.memory.release_memory`; 0: never); on CPU."""
        self.model = model
        # for grammars (structured output); None: a grammar request is refused. ``load_tokenizer``
        # instead: called with the first grammar request (a worker starts without reading it)
        self.tokenizer = tokenizer
        self._load_tokenizer = load_tokenizer
        self._grammars: Grammars | None = None  # built with the first grammar request
        layers, heads, dim, dtype, hidden = kv_geometry(model)
        self.device = model.embed_tokens.weight.device
        self.kv = SegmentedKVCache(layers, num_blocks, block_size, heads, dim, dtype, self.device, hidden_size=hidden)
        self.release_after_tokens = release_after_tokens if self.device.type == "cpu" else 0
        self.block_size = block_size
        self.tier_map = tier_map  # global tier -> this model's tier (a standalone copy has one)
        self.keep_logits = keep_logits
        self.requests: dict[str, RequestState] = {}
        self._pending = None  # an execution path built in the background, applied before the next step
        self.step_lock = threading.Lock()  # held by each step: the background build's one pause of it
        self._bind_path()

    def swap_in(self, path) -> None:
        """``path`` (worker/execution.py) serves from the next step on; safe from another thread: the step
        loop applies it between two steps (worker/background_compile.py)."""
        self._pending = path

    def _bind_path(self) -> None:
        """The model's execution path, applied before this runner's pools existed, applied again over them
        (CUDA graphs: recorded now, before any request waits)."""
        if self.model.execution is not None:
            self.model.execution.apply(self.model, self.kv)

    def add(self, request_id: str, params: SamplingParams, prompt_ids: list[int] | None = None,
            num_output: int = 0) -> None:
        """A new request; `prompt_ids` when its parameters need them, the last `num_output` of them
        being output tokens it produced before a re-plan."""
        gen = make_generator(params)
        skip_draws(gen, num_output if params.spec_draft_tier is None else 0, self.model.cfg.vocab_size)
        st = RequestState(params, gen)
        if params.needs_prompt:
            if not prompt_ids:
                raise ValueError(f"request {request_id}: its parameters need the prompt's token ids")
            st.prompt = list(prompt_ids)
        if params.penalized:
            v = self.model.cfg.vocab_size
            ids = torch.tensor(prompt_ids, dtype=torch.long, device=self.device)
            out = ids[len(ids) - num_output:] if num_output else ids[:0]
            st.counts = torch.bincount(out, minlength=v).float()
            st.seen = torch.bincount(ids, minlength=v) > 0
        if params.grammar is not None:
            st.grammars = self.grammars()
            m = st.grammars.matcher(params.grammar)
            for t in prompt_ids[len(prompt_ids) - num_output:] if num_output else []:
                if not m.accept_token(t):
                    raise ValueError(f"request {request_id}: its output so far does not follow its grammar")
            st.matcher = m
        self.requests[request_id] = st

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
        self._bind_path()  # CUDA graphs: every bucket, largest first, before the steps below use any
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
            self.requests.pop(rid, None)

    def execute(self, rows: list[PlanRow]) -> StepOutput:
        with self.step_lock:
            out = self._execute(rows)
        if self.release_after_tokens and out.num_tokens >= self.release_after_tokens:
            release_memory(collect=False)  # a long step's activations: freed, their heap pages given back
        return out

    def _execute(self, rows: list[PlanRow]) -> StepOutput:
        if self._pending is not None:  # a path built in the background: over this runner's pools from now on
            path, self._pending = self._pending, None
            path.apply(self.model, self.kv)
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
        plain, watched, first = self._route(rows, per_row, logits, out)
        if watched:
            escalating = self._escalations(watched, logits)
            out.escalate = [rid for _, rid in plain if rid in escalating]
            plain = [(k, rid) for k, rid in plain if rid not in escalating]
        if plain:
            self._sample(plain, logits, out)
        for rid in first:
            st = self.requests[rid]
            if st.prompt_scores is not None and rid in out.tokens:
                out.prompt_logprobs[rid] = st.take_prompt_logprobs(rid)
        self._commit(out)
        if self.keep_logits:
            out.logits = {rid: logits[ks[-1]].clone() for i, ks in per_row.items()
                          for rid in [rows[i].request_id] if rid in out.tokens}
        return out

    def _route(self, rows: list[PlanRow], per_row: dict[int, list[int]], logits: torch.Tensor,
               out: StepOutput) -> tuple[list[tuple[int, str]], list[tuple[int, str, PlanRow]], set[str]]:
        """Each sampled row's logits to what they are for: a verification row's round verified, a prompt's
        positions scored, a draft row's draft drawn (all into ``out``); the rows sampling one token
        returned as (plain rows: (logits index, request); the cascade requests among them, with their
        row; the requests sampling their first output token)."""
        plain: list[tuple[int, str]] = []
        watched: list[tuple[int, str, PlanRow]] = []
        first: set[str] = set()
        for i, ks in per_row.items():
            r = rows[i]
            rid = r.request_id
            st = self.requests[rid]
            if r.sample_all:
                lg = logits[ks[0]:ks[-1] + 1]
                committed, k = st.verify(rid, r, lg)
                out.verified[rid], out.accepted[rid] = committed, k
                if st.params.logprobs is not None:
                    out.logprobs[rid] = token_logprobs(lg[:len(committed)], committed,
                                                       [st.params.logprobs] * len(committed))
                continue
            if r.logits_all:
                st.score_prompt(r, logits[ks[0]:ks[-1] + 1])
                if not r.sample:
                    continue
                ks = ks[-1:]  # the last position samples
            if r.num_output == 0 and not r.draft:
                first.add(rid)
            if r.draft:
                out.drafts[rid] = st.draft(r, logits[ks[0]])
                if st.params.spec_stop_confidence > 0:
                    out.draft_conf[rid] = confidences(logits[ks[0]][None])[0]
                continue
            plain.append((ks[0], rid))
            if st.params.cascade_threshold is not None:
                watched.append((ks[0], rid, r))
        return plain, watched, first

    def _sample(self, plain: list[tuple[int, str]], logits: torch.Tensor, out: StepOutput) -> None:
        """One token for each plain row (logits index, request), batched: logit_bias and penalties, the
        grammars' masks, sampling; their log-probabilities where asked (from the raw logits)."""
        ks = [k for k, _ in plain]
        if ks == list(range(ks[0], ks[0] + len(ks))):  # consecutive rows (every plain decode step): a view
            sub = logits[ks[0]:ks[0] + len(ks)]
        else:
            sub = logits.index_select(0, torch.tensor(ks, dtype=torch.long, device=logits.device))
        states = [self.requests[rid] for _, rid in plain]
        ps = [st.params for st in states]
        proc = process_logits(sub, ps, [st.counts for st in states], [st.seen for st in states])
        ruled = [j for j, st in enumerate(states) if st.matcher is not None]
        if ruled:  # structured output: what each grammar allows next (raw logits kept for logprobs)
            allowed = self.grammars().allowed([states[j].matcher for j in ruled])
            proc = mask_rows(proc, ruled, allowed)
        toks = sample(proc, ps, [st.gen for st in states])
        for j in ruled:
            states[j].advance(plain[j][1], [toks[j]])
        out.tokens.update(zip((rid for _, rid in plain), toks))
        asked = [j for j, st in enumerate(states) if st.params.logprobs is not None]
        if asked:
            lps = token_logprobs(sub[asked], [toks[j] for j in asked], [ps[j].logprobs for j in asked])
            out.logprobs.update((plain[j][1], [lp]) for j, lp in zip(asked, lps))

    def _commit(self, out: StepOutput) -> None:
        """The round's verified tokens into their grammars' matchers, and every committed token into its
        request's penalty counts."""
        for rid, toks in out.verified.items():
            st = self.requests[rid]
            if st.matcher is not None:
                st.advance(rid, toks)
        for rid in out.tokens.keys() | out.verified.keys():
            st = self.requests[rid]
            if st.counts is not None:
                st.commit(out.verified[rid] if rid in out.verified else [out.tokens[rid]])

    def _escalations(self, watched: list[tuple[int, str, PlanRow]], logits: torch.Tensor) -> set[str]:
        """Each watched row's confidence into its request's window; the requests whose full window averages
        below their threshold (and that have a tier above them) escalate, window reset."""
        idx = torch.tensor([k for k, _, _ in watched], dtype=torch.long, device=logits.device)
        confs = confidences(logits.index_select(0, idx))
        top = self.model.num_segments - 1
        return {rid for (_, rid, r), c in zip(watched, confs) if self.requests[rid].escalates(c, r.tier < top)}
