"""One submitted request: :class:`Generation` submits a :class:`Job` (prepared by ``gateway.serving``)
and turns the token events that come back into text :class:`Piece`s: duplicate events dropped by
``seq``, incremental detokenization, stop strings cut in the text (the request is then cancelled), and a
Cancel sent whenever the gateway stops listening early (client gone, deadline, broken stream).

A broken token stream fails the request with a retryable 503 rather than text with a hole or a client
left hanging: a ``seq`` past the next expected one means tokens were lost (``stream_interrupted``), and
a request that lived through a Redis outage or restart with no event within ``--stall-timeout`` after
it (``Backend.stalled``) is given up (``redis_interrupted``).
"""
from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Protocol

import structlog
from redis.exceptions import RedisError

from core import protocol as P
from core.sampling import SamplingParams
from gateway.backend import Backend
from gateway.detok import IncrementalDetokenizer
from gateway.errors import APIError
from gateway.metrics import Metrics
from gateway.openai_api import GenParams
from gateway.responses import TokenInfo

log = structlog.get_logger("gateway")
DEFAULT_PARAMS = SamplingParams()


class Serving(Protocol):
    """What a Generation uses of the gateway's ``gateway.serving.Service`` (named here, so this module
    does not import the one that imports it)."""
    tok: object
    gateway_id: str
    backend: Backend
    metrics: Metrics
    tier_ids: list[str]
    tier_names: list[str]
    eos_ids: list[int]
    request_timeout_s: float
    poll_s: float

    def token_text(self, token: int) -> str: ...

    def token_info(self, lp: P.TokenLogprob, top: int) -> TokenInfo: ...


class ClientGone(Exception):
    """The client closed its connection; nobody reads the answer."""


def never_gone() -> bool:
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


class Generation:
    """One submitted request (one choice of the response): yields :class:`Piece`s, the finish reason
    on the last. Choice ``index`` > 0 of an n > 1 request is its own request (id ``<id>-<index>``, seed
    + index), placed with choice 0 and admitted once choice 0's prompt is computed (``Submit.follow``)."""

    def __init__(self, svc: Serving, job: Job, index: int = 0, *, session_id: str | None = None,
                 client_gone: Callable[[], bool] = never_gone):
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
        self.paths: list[str] = []        # execution paths of the steps that produced them (TokenEvent.path)
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
        # Every declared parameter the body carries (core/params.py) passes as it is; the rest come from
        # the job (limits, stop ids, tier-level defaults) or the choice (its seed).
        # logprobs is parsed per endpoint (chat's top_logprobs, completions' integer), not in p.sampling
        params = SamplingParams(**(p.sampling | {"seed": seed, "logprobs": p.logprobs}),
                                max_tokens=max(1, j.max_tokens), stop_token_ids=tuple(sorted(self.stop_ids)),
                                spec_draft_tier=j.spec_draft, spec_gamma=j.spec_gamma,
                                spec_stop_confidence=j.spec_stop_confidence,
                                cascade_threshold=j.cascade_threshold, cascade_window=j.cascade_window,
                                prompt_logprobs=p.logprobs if p.echo and first else None,
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
                raise APIError(status, ev.error or "The backend failed this request.", code=ev.error_code,
                               headers={"Retry-After": "1"} if status == 503 else None)  # worker_lost, gateway_lost
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
            if ids and ev.path and ev.path not in self.paths:
                self.paths.append(ev.path)
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
