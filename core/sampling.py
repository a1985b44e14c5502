"""What a request asks of sampling, and when it ends: shared by the gateway, the scheduler and the
worker, so it imports nothing heavy (the sampling math itself is worker/sampling.py)."""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field, replace

from core.params import PARAMS, default

MAX_LOGPROBS = int(PARAMS["logprobs"].hi)  # most likely alternatives per token (OpenAI's bound)
MAX_LOGIT_BIAS = 1024  # token ids a request may bias
MAX_BIAS = 100.0  # a logit_bias value is in [-MAX_BIAS, MAX_BIAS] (OpenAI's bound)
# Structured output: a grammar the worker masks every sampled row with (worker/grammar.py, xgrammar).
# The spec travels as (kind, text), never compiled: "json" (text: a JSON schema), "regex" (text: a
# regular expression), "choice" (text: a JSON list of the strings allowed).
GRAMMAR_KINDS = ("json", "regex", "choice")
MAX_GRAMMAR_CHARS = 1 << 16


@dataclass(slots=True)
class SamplingParams:
    """A request's sampling. The defaults, bounds, types and docs of its scalar fields are declared once,
    in core/params.py; each field here reads its default from there."""
    max_tokens: int = default("max_tokens")
    temperature: float = default("temperature")  # 0 = greedy
    top_k: int = default("top_k")  # 0 or -1 = off
    top_p: float = default("top_p")
    seed: int | None = default("seed")
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = default("ignore_eos")
    # Self-speculative decoding: draft with this lower tier, verify `spec_gamma` tokens at a time.
    spec_draft_tier: int | None = default("spec_draft_tier")
    spec_gamma: int = default("spec_gamma")
    # Early stop (Kangaroo/EESD style): a round ends before gamma drafts when the draft tier's max
    # softmax probability for its latest draft falls below this (0: always draft gamma). 0.5 measured
    # best of {0, 0.5} on the default family (docs/BENCHMARKS.md).
    spec_stop_confidence: float = default("spec_stop_confidence")
    # Confidence cascade: start at the request's tier and move up one tier whenever the mean max
    # softmax probability of the last `cascade_window` sampled tokens falls below the threshold.
    cascade_threshold: float | None = default("cascade_threshold")
    cascade_window: int = default("cascade_window")
    # Log-probabilities, computed in the worker from the raw logits of the tier that produced each
    # token (before logit_bias, penalties, temperature, top-k/p, min-p): None is off; k >= 0 returns
    # the chosen token's log-probability and the k most likely tokens'. `prompt_logprobs` does the
    # same for every prompt token but the first (echo); such a request reads nothing from the prefix
    # cache, so that every prompt position is computed (the blocks it writes are cached as usual).
    logprobs: int | None = default("logprobs")
    prompt_logprobs: int | None = default("prompt_logprobs")
    # Logit transforms, applied per row in the worker in vLLM's order: logit_bias (token id -> added to
    # its logit), then the penalties: repetition (HF: a logit of a token seen in the prompt or the
    # output is divided by it when positive, multiplied when not), frequency (minus penalty x count in
    # the output) and presence (minus penalty if in the output at all). Greedy takes the argmax of the
    # result; sampling then applies temperature, min_p (drop tokens below min_p x the top probability),
    # typical_p (locally typical sampling, Meister et al. 2022: keep the tokens whose surprisal is closest
    # to the distribution's entropy until their mass reaches typical_p; 1 = off), top_k and top_p.
    min_p: float = default("min_p")
    typical_p: float = default("typical_p")
    presence_penalty: float = default("presence_penalty")
    frequency_penalty: float = default("frequency_penalty")
    repetition_penalty: float = default("repetition_penalty")
    logit_bias: dict[int, float] = field(default_factory=dict)
    # Structured output: (kind, text), GRAMMAR_KINDS. Every sampled token is masked to what the grammar
    # allows next (after logit_bias and penalties, before temperature and the rest); the model's EOS is
    # allowed only where the grammar may end, and is all it allows once the grammar is complete, so the
    # request ends there with "stop".
    grammar: tuple[str, str] | None = None

    def __post_init__(self) -> None:
        self.stop_token_ids = tuple(self.stop_token_ids)  # a list off the wire: keep it hashable
        if self.grammar is not None:
            self.grammar = tuple(self.grammar)
        self.logit_bias = {int(k): float(v) for k, v in (self.logit_bias or {}).items()}

    def validate(self) -> None:
        """Every declared parameter within its declaration (core/params.py: the gateway's parser and
        schema read the same), then what no single declaration says."""
        for p in PARAMS.values():
            v = getattr(self, p.name)
            if (why := p.problem(v)) is not None:
                raise ValueError(f"{p.name} {why}, got {v!r}")
        if self.cascade_threshold is not None and self.spec_draft_tier is not None:
            raise ValueError("a request either cascades or speculates, not both")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise ValueError(f"logit_bias may name at most {MAX_LOGIT_BIAS} tokens, got {len(self.logit_bias)}")
        for t, b in self.logit_bias.items():
            if t < 0 or not -MAX_BIAS <= b <= MAX_BIAS:
                raise ValueError(f"logit_bias maps token ids >= 0 to values in [-{MAX_BIAS:g}, {MAX_BIAS:g}], "
                                 f"got {t}: {b}")
        if self.grammar is not None:
            kind, text = self.grammar if len(self.grammar) == 2 else (None, None)
            if kind not in GRAMMAR_KINDS or not isinstance(text, str) or not text:
                raise ValueError(f"grammar must be (kind, text) with kind in {GRAMMAR_KINDS}, got {self.grammar!r}")
            if len(text) > MAX_GRAMMAR_CHARS:
                raise ValueError(f"a grammar may have at most {MAX_GRAMMAR_CHARS} characters, got {len(text)}")
            if self.ignore_eos:
                raise ValueError("a grammar ends the output with EOS: it cannot be combined with ignore_eos")

    def resumed(self, done: int) -> SamplingParams:
        """The parameters of this request resumed elsewhere after `done` output tokens were streamed
        (a lost worker, a new scheduler leader): what is left of max_tokens, and no prompt
        log-probabilities once the client has them (they came with the first token)."""
        return replace(self, max_tokens=self.max_tokens - done,
                       prompt_logprobs=self.prompt_logprobs if done == 0 else None)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        """Some penalty depends on the tokens so far (the worker keeps their counts)."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def processed(self) -> bool:
        """The logits go through logit_bias or a penalty before sampling."""
        return self.penalized or bool(self.logit_bias)

    @property
    def needs_prompt(self) -> bool:
        """The worker needs the prompt's token ids (to score them, to count them for penalties, or, for a
        grammar, the output tokens a re-planned request already produced: the prompt's tail)."""
        return self.prompt_logprobs is not None or self.penalized or self.grammar is not None

    def stop_ids(self, eos_token_ids: Iterable[int]) -> frozenset[int]:
        """The tokens that end this request: its own stop ids, and the model's EOS unless ignored."""
        stop = set(self.stop_token_ids)
        if not self.ignore_eos:
            stop.update(eos_token_ids)
        return frozenset(stop)


def finish_reason(token: int, num_output: int, num_tokens: int, max_tokens: int,
                  stop_ids, max_model_len: int) -> str | None:
    """Why a request ends after sampling `token` as its `num_output`-th output (None: it goes on).
    Shared by the scheduler and the worker so both agree without a round trip."""
    if token in stop_ids:
        return "stop"
    if num_output >= max_tokens or num_tokens >= max_model_len:
        return "length"
    return None
