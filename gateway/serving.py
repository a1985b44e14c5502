"""What happens to one request between its parsed body and its response.

:class:`Service` owns the gateway's serving state (frontend, backend, metrics, in-flight slots) and
turns a typed OpenAI request into a :class:`Job` (tier chosen, prompt tokenized, context checked) in
one of its in-flight slots; the view charges ``Job.charged_tokens`` to the caller's token rate limit.
Nothing here reads an HTTP request: the caller passes plain values (its session id, whether its client
is still there).
:class:`Generation` submits the job and turns the token events that come back into text pieces:
duplicate events dropped by ``seq``, incremental detokenization, stop strings cut in the text (the
request is then cancelled), and a Cancel sent whenever the gateway stops listening early (client gone,
deadline, broken stream).

A broken token stream fails the request with a retryable 503 rather than text with a hole or a client
left hanging: a ``seq`` past the next expected one means tokens were lost (``stream_interrupted``), and
a request that lived through a Redis outage or restart with no event within ``--stall-timeout`` after
it (``Backend.stalled``) is given up (``redis_interrupted``).
"""
from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

import structlog
from redis.exceptions import RedisError

from core import protocol as P
from core.grammar import GrammarError, grammar_of
from core.sampling import SamplingParams
from gateway import complexity
from gateway.backend import Backend, max_context
from gateway.detok import IncrementalDetokenizer
from gateway.metrics import Metrics
from gateway.errors import APIError, context_overflow, invalid, model_not_found
from gateway.multilevel import MAX_CASCADE_WINDOW, MAX_SPEC_GAMMA, Cascade, MultiLevel, Speculative
from gateway.openai_api import ChatRequest, CompletionRequest, GenParams
from gateway.ratelimit import RateLimiter
from gateway.responses import TokenInfo
from gateway.structured import Grammar

log = structlog.get_logger("gateway")
AUTO = "auto"
DEFAULT_PARAMS = SamplingParams()
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


class ClientGone(Exception):
    """The client closed its connection; nobody reads the answer."""


def _never() -> bool:
    return False


@dataclass(slots=True)
class Piece:
    """What one token event adds to a response: text safe to send, the finish reason on the last
    piece, and the log-probabilities of the piece's tokens (when the request asked)."""
    text: str
    finish: str | None = None
    logprobs: list[TokenInfo] = field(default_factory=list)


@dataclass(slots=True)
class Job:
    request_id: str
    kind: str                  # "chat" | "completion"
    tier: int
    prompt_ids: list[int]
    max_tokens: int
    params: GenParams
    routed: str                # "named" | "auto"
    score: float | None = None
    created: int = field(default_factory=lambda: int(time.time()))
    spec_draft: int | None = None          # self-speculation: the draft tier (below `tier`), or off
    spec_gamma: int = 4
    spec_stop_confidence: float = DEFAULT_PARAMS.spec_stop_confidence
    cascade_threshold: float | None = None  # confidence cascade from `tier` up, or off
    cascade_window: int = 4
    prompt_text: str | None = None         # echo: the prompt as the response repeats it

    @property
    def charged_tokens(self) -> int:
        """What the job costs the caller's token rate limit: the prompt, and max_tokens per choice."""
        return len(self.prompt_ids) + self.params.n * self.max_tokens

    @property
    def echo_only(self) -> bool:
        """Completions' echo with max_tokens 0: the prompt scored, nothing generated. The worker still
        samples one token with the prompt's last position (it costs no extra forward); it is dropped."""
        return self.max_tokens == 0


class StopMatcher:
    """Cuts generated text at the first stop string, holding back a tail that may start one."""

    def __init__(self, stops: list[str]):
        self.stops = stops
        self.hold = max((len(s) for s in stops), default=1) - 1
        self.text = ""
        self.sent = 0

    def feed(self, new: str, final: bool = False) -> tuple[str, bool]:
        """Returns (text safe to send now, whether a stop string matched)."""
        start = max(0, len(self.text) - self.hold)
        self.text += new
        hits = [i for s in self.stops if (i := self.text.find(s, start)) >= 0]
        if hits:
            cut = min(hits)
            out, self.text, self.sent = self.text[self.sent:cut], self.text[:cut], cut
            return out, True
        end = len(self.text) if final else max(self.sent, len(self.text) - self.hold)
        out, self.sent = self.text[self.sent:end], end
        return out, False


class Service:
    def __init__(self, frontend, metrics: Metrics, *, complexity_cfg: complexity.ComplexityConfig,
                 gateway_id: str, max_inflight: int = 256, request_timeout_s: float = 600.0,
                 default_max_tokens: int | None = None, max_prompt_tokens: int = 0,
                 max_tokens_cap: int = 0, poll_s: float = 0.25, spec_draft_tier: str | int | None = None,
                 spec_gamma: int = 4, cascade_threshold: float | None = None, cascade_window: int = 4):
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
        self._set_multilevel_defaults(spec_draft_tier, spec_gamma, cascade_threshold, cascade_window)

    def _set_multilevel_defaults(self, draft, gamma, threshold, window) -> None:
        """Server defaults (--spec-*, --cascade-*); a bad one stops the gateway at start-up."""
        self.spec_draft_tier = None
        if draft not in (None, ""):
            try:
                self.spec_draft_tier = self.resolve_tier(draft, "spec_draft_tier")
            except APIError as e:
                raise ValueError(f"--spec-draft-tier: {e.message}") from None
        if isinstance(gamma, bool) or not isinstance(gamma, int) or not 1 <= gamma <= MAX_SPEC_GAMMA:
            raise ValueError(f"--spec-gamma must be an integer between 1 and {MAX_SPEC_GAMMA}, got {gamma!r}")
        if threshold is not None and not (isinstance(threshold, (int, float)) and 0 < threshold < 1):
            raise ValueError(f"--cascade-threshold must be strictly between 0 and 1, got {threshold!r}")
        if isinstance(window, bool) or not isinstance(window, int) or not 1 <= window <= MAX_CASCADE_WINDOW:
            raise ValueError(f"--cascade-window must be an integer between 1 and {MAX_CASCADE_WINDOW}, "
                             f"got {window!r}")
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
        prepared in it (model resolved, prompt tokenized, context checked) as a :class:`Job`."""
        tier = self.resolve_model(req.model)
        if self.inflight >= self.max_inflight:
            raise APIError(429, f"This gateway is at its limit of {self.max_inflight} requests in "
                                "flight; retry shortly.", code="too_many_requests",
                           headers={"Retry-After": "1"})
        self.inflight += 1
        self.metrics.inflight.set(self.inflight)
        try:
            yield await self._prepare(req, tier)
        finally:
            self.inflight -= 1
            self.metrics.inflight.set(self.inflight)

    @asynccontextmanager
    async def generation(self, job: Job, *, session_id: str | None = None,
                         client_gone: Callable[[], bool] = _never) -> AsyncIterator[list["Generation"]]:
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


class Generation:
    """One submitted request (one choice of the response): yields :class:`Piece`s, the finish reason
    on the last. Choice ``index`` > 0 of an n > 1 request is its own request (id ``<id>-<index>``, seed
    + index), placed with choice 0 and admitted once choice 0's prompt is computed (``Submit.follow``)."""

    def __init__(self, svc: Service, job: Job, index: int = 0, *, session_id: str | None = None,
                 client_gone: Callable[[], bool] = _never):
        self.svc, self.job = svc, job
        self.index = index
        self.session_id = session_id or job.params.session_id
        self.client_gone = client_gone
        self.rid = job.request_id if index == 0 else f"{job.request_id}-{index}"
        self.detok = IncrementalDetokenizer(svc.tok)
        self.stopper = StopMatcher(job.params.stop)
        self.stop_ids = set(job.params.stop_token_ids) | (set() if job.params.ignore_eos else set(svc.eos_ids))
        self.tier = job.tier              # the tier of the last token: the response's `model`
        self.tiers: list[int] = []        # distinct tiers that produced tokens, in order of first appearance
        self.draft_proposed = 0           # self-speculation (cumulative, from the token events)
        self.draft_accepted = 0
        self.next_seq = 0
        self.completion_tokens = 0
        self.cached_tokens = 0
        self.finish_reason: str | None = None
        self.prompt_logprobs: list[P.TokenLogprob] | None = None  # echo with logprobs: from the first event
        self.done = False                 # the backend has finished (or been told to stop) the request
        self.submitted = False            # the Submit reached Redis (else there is nothing to cancel)
        self.cancel_reason = "abort"
        self.queue: asyncio.Queue[P.TokenEvent] | None = None
        self.t0 = time.perf_counter()
        self.t_first: float | None = None
        self.t_last: float | None = None
        self.deadline = self.t0 + svc.request_timeout_s
        self.log = log.bind(request_id=self.rid)

    @property
    def model(self) -> str:
        return self.svc.tier_ids[self.tier]

    @property
    def prompt_tokens(self) -> int:
        return len(self.job.prompt_ids)

    @property
    def served_by(self) -> list[str]:
        """Model ids of the tiers that served the request, in order (the requested one if no token)."""
        return [self.svc.tier_ids[t] for t in (self.tiers or [self.tier])]

    def echo_infos(self) -> list[TokenInfo]:
        """Echo with logprobs: the prompt's tokens, the first with no log-probability (nothing predicts
        it), the others as the request's tier scored them."""
        k, ids = self.job.params.logprobs, self.job.prompt_ids
        if k is None or not self.job.params.echo:
            return []
        scored = self.prompt_logprobs or []
        if len(scored) != len(ids) - 1:
            raise APIError(500, "The worker returned no log-probabilities for the prompt.", code="internal_error")
        return [TokenInfo(self.svc.token_text(ids[0]), None)] + [self.svc.token_info(lp, k) for lp in scored]

    async def start(self) -> None:
        j, p = self.job, self.job.params
        seed = p.seed
        if seed is not None and self.index:  # choice i: seed + i (within int64)
            seed = (seed + self.index + (1 << 63)) % (1 << 64) - (1 << 63)
        first = self.index == 0
        params = SamplingParams(max_tokens=max(1, j.max_tokens), temperature=p.temperature, top_k=p.top_k,
                                top_p=p.top_p,
                                seed=seed, stop_token_ids=tuple(sorted(self.stop_ids)), ignore_eos=p.ignore_eos,
                                spec_draft_tier=j.spec_draft, spec_gamma=j.spec_gamma,
                                spec_stop_confidence=j.spec_stop_confidence,
                                cascade_threshold=j.cascade_threshold, cascade_window=j.cascade_window,
                                logprobs=p.logprobs, prompt_logprobs=p.logprobs if p.echo and first else None,
                                min_p=p.min_p, presence_penalty=p.presence_penalty,
                                frequency_penalty=p.frequency_penalty, repetition_penalty=p.repetition_penalty,
                                logit_bias=dict(p.logit_bias),
                                grammar=(p.grammar.kind, p.grammar.text) if p.grammar is not None else None)
        sub = P.Submit(request_id=self.rid, gateway_id=self.svc.gateway_id, prompt_ids=j.prompt_ids,
                       tier=j.tier, params=params, model_id=self.model, arrival=time.time(),
                       session_id=self.session_id,
                       follow=None if first else j.request_id)
        try:
            self.queue = await self.svc.backend.submit(sub)  # registers nothing when it fails
        except (RedisError, OSError) as e:
            self.log.warning("submit.failed", error=str(e))
            raise APIError(503, "The gateway cannot reach its Redis right now; retry shortly.",
                           code="backend_unavailable", headers={"Retry-After": "2"}) from None
        self.submitted = True
        m, names = self.svc.metrics, self.svc.tier_names
        m.routing.labels(self.model, j.routed).inc()
        if j.spec_draft is not None:
            m.spec_requests.labels(names[j.spec_draft], names[j.tier]).inc()
        if j.cascade_threshold is not None:
            m.cascade_requests.labels(names[j.tier]).inc()

    async def _next_event(self) -> P.TokenEvent:
        while True:
            if self.client_gone():
                self.cancel_reason = "disconnect"
                raise ClientGone()
            left = self.deadline - time.perf_counter()
            if left <= 0:
                self.cancel_reason = "deadline"
                raise APIError(504, f"The request did not finish within {self.svc.request_timeout_s:g} s.",
                               code="timeout")
            if self.queue.empty() and self.svc.backend.stalled(self.rid):
                raise self._interrupted(
                    "redis", "redis_interrupted",
                    "The service lost its Redis (it restarted or was unreachable) and no more tokens "
                    f"came for this request within {self.svc.backend.stall_timeout_s:g} s; retry it.", "2")
            try:
                return await asyncio.wait_for(self.queue.get(), min(self.svc.poll_s, left))
            except TimeoutError:
                continue

    def _interrupted(self, reason: str, code: str, message: str, retry_after: str) -> APIError:
        """A broken token stream: counted, logged, and cancelled (``close`` sends the Cancel)."""
        self.cancel_reason = code
        self.svc.metrics.interrupted.labels(reason).inc()
        self.log.warning("request.interrupted", reason=reason, next_seq=self.next_seq)
        return APIError(503, message, code=code, headers={"Retry-After": retry_after})

    async def pieces(self) -> AsyncIterator[Piece]:
        while not self.done:
            ev = await self._next_event()
            if ev.finish_reason == "error":
                self.done, self.finish_reason = True, "error"
                status = ev.status or (400 if ev.error_code == "context_length_exceeded" else 500)
                raise APIError(status, ev.error or "The backend failed this request.", code=ev.error_code)
            if ev.seq > self.next_seq:  # tokens next_seq..seq-1 were lost: the text would have a hole
                self.log.warning("tokens.gap", expected=self.next_seq, got=ev.seq)
                raise self._interrupted("gap", "stream_interrupted",
                                        f"Tokens of this request were lost in transit (expected token "
                                        f"{self.next_seq}, got {ev.seq}); retry the request.", "1")
            skip = max(0, self.next_seq - ev.seq)
            ids = ev.token_ids[skip:]
            lps = ev.logprobs[skip:]
            if ev.seq == 0 and ev.prompt_logprobs and self.prompt_logprobs is None:
                self.prompt_logprobs = ev.prompt_logprobs
            if self.job.echo_only:  # the token that finished the prompt is not the client's
                ids, lps = [], []
            self.next_seq = max(self.next_seq, ev.seq + len(ev.token_ids))
            # The tier of new tokens only: a redelivered older event must not move `model` back.
            if 0 <= ev.tier < len(self.svc.tier_ids) and (ids or (ev.finished and not self.tiers)):
                self.tier = ev.tier
                if ev.tier not in self.tiers:
                    self.tiers.append(ev.tier)
            self.draft_proposed = max(self.draft_proposed, ev.draft_proposed or 0)
            self.draft_accepted = max(self.draft_accepted, ev.draft_accepted or 0)
            self.cached_tokens = max(self.cached_tokens, ev.cached_tokens)
            if ids:
                now = time.perf_counter()
                self.t_first = self.t_first or now
                self.t_last = now
                self.completion_tokens += len(ids)
            elif not ev.finished:
                continue  # a duplicate
            text_ids = ids[:-1] if ev.finish_reason == "stop" and ids and ids[-1] in self.stop_ids else ids
            k = self.job.params.logprobs
            infos = [] if k is None else [self.svc.token_info(lp, k) for lp in lps[:len(text_ids)]]
            text = self.detok.push(text_ids)
            if ev.finished:
                text += self.detok.flush()
            out, stopped = self.stopper.feed(text, final=ev.finished)
            if stopped and not ev.finished:
                await self.svc.backend.cancel(self.rid, "stop")
            if stopped or ev.finished:
                self.done = True
                self.finish_reason = ("stop" if stopped else "length" if self.job.echo_only
                                      else (ev.finish_reason or "stop"))
                yield Piece(out, self.finish_reason, infos)
                return
            if out or infos:
                yield Piece(out, None, infos)

    async def close(self) -> None:
        be = self.svc.backend
        if self.done or not self.submitted:
            be.release(self.rid)
        else:
            self.finish_reason = self.cancel_reason
            await be.cancel(self.rid, self.cancel_reason)
        e2e = time.perf_counter() - self.t0
        ttft = (self.t_first - self.t0) if self.t_first else None
        tpot = ((self.t_last - self.t_first) / (self.completion_tokens - 1)
                if self.t_first and self.completion_tokens > 1 else None)
        finish = self.finish_reason or "abort"
        self.svc.metrics.observe_request(self.model, finish, self.prompt_tokens, self.completion_tokens,
                                         ttft, tpot, e2e, cached_tokens=self.cached_tokens)
        self.log.info("request.done", kind=self.job.kind, tier=self.tier, model=self.model,
                      routed=self.job.routed, score=self.job.score, finish_reason=finish,
                      tiers=self.tiers, spec_draft=self.job.spec_draft, draft_proposed=self.draft_proposed,
                      draft_accepted=self.draft_accepted, cascade=self.job.cascade_threshold,
                      prompt_tokens=self.prompt_tokens, completion_tokens=self.completion_tokens,
                      cached_tokens=self.cached_tokens, ttft_s=_r(ttft), tpot_s=_r(tpot), e2e_s=_r(e2e))


def _r(x: float | None) -> float | None:
    return None if x is None else round(x, 4)
