"""What happens to one request between its parsed body and its generations.

:class:`Service` owns the gateway's serving state (frontend, backend, metrics, in-flight slots) and
turns a typed OpenAI request into a :class:`~gateway.generation.Job` (tier chosen, multi-level sampling
resolved, prompt tokenized, context checked) in one of its in-flight slots; the view charges
``Job.charged_tokens`` to the caller's token rate limit, then ``Service.generation`` submits the job's
choices as :class:`~gateway.generation.Generation`s. Nothing here reads an HTTP request: the caller
passes plain values (its session id, whether its client is still there).
"""
from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import structlog

from core import protocol as P
from core.params import PARAMS
from core.grammar import GrammarError, grammar_of
from gateway import complexity
from gateway.admission import Admission, default_max_waiting
from gateway.backend import Backend, max_context
from gateway.errors import APIError, context_overflow, invalid, model_not_found
from gateway.generation import DEFAULT_PARAMS, Generation, Job, never_gone
from gateway.metrics import Metrics
from gateway.multilevel import Cascade, MultiLevel, Speculative
from gateway.openai_api import ChatRequest, CompletionRequest
from gateway.ratelimit import RateLimiter
from gateway.responses import TokenInfo
from gateway.structured import Grammar

log = structlog.get_logger("gateway")
AUTO = "auto"
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


class Service:
    def __init__(self, frontend, metrics: Metrics, *, complexity_cfg: complexity.ComplexityConfig,
                 gateway_id: str, max_inflight: int = 256, request_timeout_s: float = 600.0,
                 default_max_tokens: int | None = None, max_prompt_tokens: int = 0,
                 max_tokens_cap: int = 0, poll_s: float = 0.25, spec_draft_tier: str | int | None = None,
                 spec_gamma: int = 4, cascade_threshold: float | None = None, cascade_window: int = 4,
                 max_waiting: int | None = None, max_waiting_per_tier: int = 0, max_queue_wait_s: float = 0.0):
        self.frontend = frontend
        self.tok = frontend.tokenizer
        self.metrics = metrics
        self.complexity = complexity_cfg
        self.gateway_id = gateway_id
        self.max_inflight = max_inflight
        self.request_timeout_s = request_timeout_s
        self.default_max_tokens = default_max_tokens
        self.max_prompt_tokens = max_prompt_tokens
        self.max_tokens_cap = max_tokens_cap
        self.poll_s = poll_s
        self.backend: Backend | None = None  # set by the app's cleanup context
        self.limiter: RateLimiter | None = None  # likewise
        self.inflight = 0
        n = len(frontend.tiers)
        self.tier_ids = [frontend.model_id(i) for i in range(n)]
        self.usable = frontend.usable_tiers()  # tiers the family id may route to (quality floor)
        self.tier_names = [t.name for t in frontend.tiers]
        self.eos_ids = _eos_ids(self.tok)
        self.vocab_size = len(self.tok)
        self._token_texts: dict[int, str] = {}
        self.admission = Admission(default_max_waiting() if max_waiting is None else max_waiting,
                                   max_waiting_per_tier, self.tier_names, metrics, max_queue_wait_s)
        self._set_multilevel_defaults(spec_draft_tier, spec_gamma, cascade_threshold, cascade_window)

    def _set_multilevel_defaults(self, draft, gamma, threshold, window) -> None:
        """Server defaults (--spec-*, --cascade-*); a bad one stops the gateway at start-up."""
        self.spec_draft_tier = None
        if draft not in (None, ""):
            try:
                self.spec_draft_tier = self.resolve_tier(draft, "spec_draft_tier")
            except APIError as e:
                raise ValueError(f"--spec-draft-tier: {e.message}") from None
        for name, v in (("spec_gamma", gamma), ("cascade_threshold", threshold), ("cascade_window", window)):
            if (why := PARAMS[name].problem(v)) is not None:  # the request's own bounds (core/params.py)
                raise ValueError(f"--{name.replace('_', '-')} {why}, got {v!r}")
        self.spec_gamma = gamma
        self.cascade_threshold = None if threshold is None else float(threshold)
        self.cascade_window = window

    @property
    def model_ids(self) -> list[str]:
        return self.tier_ids + [self.frontend.family_id]

    def resolve_model(self, model: str) -> int | None:
        """Tier index, or None for "choose for me" (the family id or "auto")."""
        if model in (self.frontend.family_id, AUTO):
            return None
        if model in self.tier_ids:
            return self.tier_ids.index(model)
        raise model_not_found(model, self.model_ids + [AUTO])

    def resolve_tier(self, ref: str | int, param: str) -> int:
        """A tier named by its name (``small``), its model id or its index (int or digits)."""
        n = len(self.tier_ids)
        if isinstance(ref, str):
            if ref in self.tier_names:
                return self.tier_names.index(ref)
            if ref in self.tier_ids:
                return self.tier_ids.index(ref)
            if ref.isascii() and ref.isdigit() and len(ref) < 6:
                ref = int(ref)
        if isinstance(ref, int) and not isinstance(ref, bool) and 0 <= ref < n:
            return ref
        shown = repr(ref) if len(repr(ref)) <= 80 else repr(ref)[:80] + "..."
        raise invalid(f"{shown} names no tier of this family: use a tier name ({', '.join(self.tier_names)}), "
                      f"a model id ({', '.join(self.tier_ids)}) or an index (0..{n - 1}).", param)

    def multilevel(self, ml: MultiLevel, tier: int, family: bool) -> dict:
        """Resolves the ``mfs`` extension against the server defaults and the request's final tier.

        * A cascade applies only to family-id requests (it starts at the scored tier); asked for on a
          tier model id it is a 400. Routed to the top tier it has nowhere to go and is dropped.
        * Speculation applies only with a draft tier strictly below the request's tier: a default draft
          that is not is dropped silently, a draft the request named is a 400.
        * Both at once: asking for both is a 400 (parsing); otherwise an explicit choice beats a server
          default, and between two defaults the cascade wins (family requests).
        """
        spec, casc = ml.speculative, ml.cascade
        top = len(self.tier_ids) - 1
        threshold, window = None, self.cascade_window
        if isinstance(casc, Cascade):
            if not family:
                raise invalid("A confidence cascade applies only to the family model id "
                              f"('{self.frontend.family_id}' or '{AUTO}'), where the server picks the starting "
                              f"tier; this request names the tier model '{self.tier_ids[tier]}'.", "mfs.cascade")
            threshold = casc.threshold if casc.threshold is not None else self.cascade_threshold
            if threshold is None:
                raise invalid("'mfs.cascade.threshold' is required: this server has no default "
                              "(--cascade-threshold).", "mfs.cascade.threshold")
            window = casc.window or self.cascade_window
        elif casc is None and family and not isinstance(spec, Speculative):
            threshold = self.cascade_threshold
        if tier >= top:
            threshold = None  # nothing above it to escalate to
        draft, gamma, stop = None, self.spec_gamma, DEFAULT_PARAMS.spec_stop_confidence
        if threshold is None and spec is not False:
            if isinstance(spec, Speculative):
                gamma = spec.gamma or self.spec_gamma
                if spec.stop_confidence is not None:
                    stop = spec.stop_confidence
                if spec.draft is not None:
                    draft = self.resolve_tier(spec.draft, "mfs.speculative.draft")
                    if draft >= tier:
                        raise invalid(f"The draft tier '{self.tier_names[draft]}' is not below this request's "
                                      f"tier '{self.tier_names[tier]}': speculation drafts with a smaller tier "
                                      "and verifies with the request's.", "mfs.speculative.draft")
                elif self.spec_draft_tier is None:
                    raise invalid("'mfs.speculative.draft' is required: this server has no default draft "
                                  "tier (--spec-draft-tier).", "mfs.speculative.draft")
                else:
                    draft = self.spec_draft_tier
            else:
                draft = self.spec_draft_tier
            if draft is not None and draft >= tier:
                draft = None  # the server default is not below this request's tier: no speculation
        return {"spec_draft": draft, "spec_gamma": gamma, "spec_stop_confidence": stop,
                "cascade_threshold": threshold, "cascade_window": window}

    # ---- preparing --------------------------------------------------------------------------
    @asynccontextmanager
    async def job(self, req: ChatRequest | CompletionRequest) -> AsyncIterator[Job]:
        """One of this gateway's in-flight slots, held until the caller is done, and the request
        prepared in it (model resolved, prompt tokenized, context checked) as a :class:`Job`; it counts
        as waiting (``gateway.admission``) until its first token event, and is shed (429) past a bound."""
        tier = self.resolve_model(req.model)
        if self.inflight >= self.max_inflight:
            raise APIError(429, f"This gateway is at its limit of {self.max_inflight} requests in "
                                "flight; retry shortly.", code="too_many_requests",
                           headers={"Retry-After": "1"})
        ticket = self.admission.enter()
        self.inflight += 1
        self.metrics.inflight.set(self.inflight)
        rid = None
        try:
            job = await self._prepare(req, tier)
            self.admission.place(ticket, job.tier)
            rid = job.request_id
            self.backend.on_first_event(rid, lambda: self.admission.started(ticket))
            yield job
        finally:
            self.admission.leave(ticket)
            if rid is not None:
                self.backend.release(rid)  # (again: a no-op after the generation's own release)
            self.inflight -= 1
            self.metrics.inflight.set(self.inflight)

    @asynccontextmanager
    async def generation(self, job: Job, *, session_id: str | None = None,
                         client_gone: Callable[[], bool] = never_gone) -> AsyncIterator[list[Generation]]:
        """The job's choices (``n`` of them), submitted; each is closed (cancelled if unfinished) when
        the caller is done. ``session_id``: the caller's session header (the body's ``session_id``
        otherwise); ``client_gone``: whether nobody is listening any more."""
        gens: list[Generation] = []
        try:
            for i in range(job.params.n):  # choice 0 first: the others follow it (placement, prefix)
                gens.append(Generation(self, job, i, session_id=session_id, client_gone=client_gone))
                await gens[-1].start()
            yield gens
        except asyncio.CancelledError:  # aiohttp cancels the handler when the client goes away
            for gen in gens:
                gen.cancel_reason = "disconnect"
            raise
        finally:
            for gen in gens:
                await gen.close()

    async def _prepare(self, req: ChatRequest | CompletionRequest, tier: int | None) -> Job:
        workers = await self.backend.live_workers()
        self.metrics.live_workers.set(len(workers))
        if not workers:
            raise APIError(503, "No worker is serving right now; retry shortly.", code="no_live_worker",
                           headers={"Retry-After": "2"})
        if isinstance(req, ChatRequest):
            kind, ids = "chat", self._chat_ids(req.messages)
            text, turns = complexity.chat_text(req.messages)
        else:
            kind, ids = "completion", self._prompt_ids(req.prompt)
            text, turns = (req.prompt if isinstance(req.prompt, str) else self.tok.decode(req.prompt)), 1
        routed, score = "named", None
        if tier is None:
            s = complexity.score_prompt(text, len(ids), turns, len(self.tier_ids), self.complexity)
            # never a tier the family's own evaluation marks unusable: the next usable one up
            tier = min(t for t in self.usable if t >= s.tier)
            routed, score = "auto", s.score
        if self.max_prompt_tokens and len(ids) > self.max_prompt_tokens:
            param = "messages" if kind == "chat" else "prompt"
            raise invalid(f"The prompt has {len(ids)} tokens; this server takes at most "
                          f"{self.max_prompt_tokens}.", param, code="prompt_too_long")
        p = req.params
        bad = sorted(t for t in p.logit_bias if t >= self.vocab_size)
        if bad:
            raise invalid(f"'logit_bias' names token {bad[0]}, out of range (vocabulary size {self.vocab_size}).",
                          "logit_bias")
        if p.grammar is not None:  # compiles? (xgrammar, as the worker will; off the event loop)
            await asyncio.to_thread(_check_grammar, p.grammar)
        ml = self.multilevel(p.multilevel, tier, routed == "auto")
        max_len = max_context(workers)
        asked = p.max_tokens
        if max_len is not None and (len(ids) >= max_len or len(ids) + (asked or 0) > max_len):
            raise context_overflow(max_len, len(ids), asked)
        if asked is None:
            default = COMPLETIONS_DEFAULT_MAX_TOKENS if kind == "completion" else self.default_max_tokens
            room = (max_len - len(ids)) if max_len is not None else None
            asked = min(x for x in (default, room, self.max_tokens_cap or None, 1 << 20) if x is not None)
        prefix = "chatcmpl" if kind == "chat" else "cmpl"
        echo = None
        if p.echo:
            echo = req.prompt if isinstance(req.prompt, str) else self.tok.decode(req.prompt)
        return Job(f"{prefix}-{uuid.uuid4().hex}", kind, tier, ids, asked, p, routed, score, **ml,
                   prompt_text=echo)

    def token_text(self, token: int) -> str:
        """A token decoded alone (what log-probabilities name it by), memoized per id."""
        t = self._token_texts.get(token)
        if t is None:
            t = self._token_texts[token] = self.tok.decode([token])
        return t

    def token_info(self, lp: P.TokenLogprob, top: int) -> TokenInfo:
        return TokenInfo(self.token_text(lp.token), lp.logprob,
                         [(self.token_text(t), v) for t, v in zip(lp.top_ids[:top], lp.top_logprobs[:top])])

    def _chat_ids(self, messages: list[dict]) -> list[int]:
        try:
            out = self.tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        except Exception as e:  # noqa: BLE001 - a template that rejects the conversation is bad input
            raise invalid(f"The chat template rejected these messages: {e}", "messages") from None
        if hasattr(out, "keys") and "input_ids" in out:  # transformers 5: a BatchEncoding
            out = out["input_ids"]
        ids = list(out)
        if ids and isinstance(ids[0], list):
            ids = ids[0]
        return [int(t) for t in ids]

    def _prompt_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, list):
            bad = [t for t in prompt if t >= self.vocab_size]
            if bad:
                raise invalid(f"Token id {bad[0]} is out of range (vocabulary size {self.vocab_size}).",
                              "prompt")
            return list(prompt)
        try:
            return list(self.tok(prompt)["input_ids"])
        except Exception as e:  # noqa: BLE001 - text the tokenizer cannot take is bad input
            raise invalid(f"The prompt cannot be tokenized: {e}", "prompt") from None


def _check_grammar(g: Grammar) -> None:
    try:
        grammar_of((g.kind, g.text))
    except GrammarError as e:
        what = {"json": "JSON schema", "regex": "regular expression", "choice": "choice list"}[g.kind]
        raise invalid(f"'{g.param}' is not a {what} this server can follow: {e}", g.param,
                      code="invalid_grammar") from None


def _eos_ids(tok) -> list[int]:
    eos = getattr(tok, "eos_token_id", None)
    return [eos] if isinstance(eos, int) else list(eos or [])
