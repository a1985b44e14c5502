"""Every scalar request parameter that reaches sampling, declared once: its name, type, default, bounds,
doc, the endpoints whose bodies carry it under its name, or the body path that carries it otherwise (the
``mfs`` extension's fields). Derived from :data:`PARAMS` and nothing else: ``SamplingParams``' defaults
and ``validate`` (core/sampling.py), the gateway's parsers of OpenAI bodies and of the ``mfs`` extension
(``gateway.openai_api``, ``gateway.multilevel``), the gateway's checks and help of its server defaults
(``gateway.serving``, ``gateway.config``) and the request schemas of its OpenAPI document
(``gateway.openapi.requests``). A new parameter is one :class:`Param` here, its ``SamplingParams`` field
and its math in worker/sampling.py; tests/test_params.py checks that they agree on every bound, and
tests/test_params_api.py does it through the HTTP API.

Not here, because their values are not scalars: ``stop_token_ids``, ``logit_bias`` and ``grammar`` keep
their own checks (their bounds are the constants in core/sampling.py, shared the same way)."""
from __future__ import annotations

import math
from dataclasses import dataclass

INT32_MAX = (1 << 31) - 1
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
ENDPOINTS = ("chat", "completions")
_SAME = "same as default"  # Param.body_default: an absent body field means SamplingParams' default
_KINDS = {bool: ("a boolean", "boolean"), int: ("an integer", "integer"), float: ("a number", "number")}


@dataclass(slots=True, frozen=True)
class Param:
    name: str                 # the SamplingParams field, and the body field of `endpoints`
    kind: type                # bool, int or float (a float parameter takes any finite JSON number)
    default: object           # SamplingParams' default
    doc: str                  # the OpenAPI description
    lo: float | None = None   # None: unbounded
    hi: float | None = None
    lo_open: bool = False     # lo itself is refused (exclusiveMinimum)
    hi_open: bool = False
    nullable: bool = False    # None is a value of the SamplingParams field (off, unseeded)
    # The endpoints whose body carries it under `name`, read as is; (): the gateway sets it another way
    # (max_tokens, logprobs: spelled differently per endpoint; spec_*, cascade_*: the `mfs` extension)
    endpoints: tuple[str, ...] = ENDPOINTS
    body_default: object = _SAME  # what an absent body field means, where OpenAI's default differs
    # Where both endpoints' bodies carry it when not under `name` at the top: a dotted path into the
    # body (``mfs.cascade.threshold``), read against these bounds; absent, the server's default applies
    path: str | None = None

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise TypeError(f"parameter {self.name}: kind must be bool, int or float, got {self.kind!r}")
        if self.problem(self.default) is not None or self.problem(self.wire_default) is not None:
            raise ValueError(f"parameter {self.name}: its default is out of its own bounds")

    @property
    def wire_default(self) -> object:
        return self.default if self.body_default == _SAME else self.body_default

    @property
    def json_type(self) -> str:
        return _KINDS[self.kind][1]

    def expects(self) -> str:
        """What a value must be: 'a number between 0 and 1', 'an integer >= 1', 'a boolean'."""
        return _KINDS[self.kind][0] + self.bounds() + (" or null" if self.nullable else "")

    def bounds(self) -> str:
        """Its range in words, with a leading space: ' between 0 and 1', ' >= 1' ('' when unbounded)."""
        lo, hi = self.lo, self.hi
        above = f"{'>' if self.lo_open else '>='} {_num(lo)}"
        if lo is not None and hi is not None:
            closed = not (self.lo_open or self.hi_open)
            bounds = (f" between {_num(lo)} and {_num(hi)}" if closed
                      else f" {above} and {'<' if self.hi_open else 'at most'} {_num(hi)}")
        elif lo is not None:
            bounds = " " + above
        elif hi is not None:
            bounds = f" {'<' if self.hi_open else '<='} {_num(hi)}"
        else:
            bounds = ""
        return bounds

    def problem(self, v) -> str | None:
        """None when `v` is a value of this parameter, else what it must be ("must be ...")."""
        if v is None and self.nullable:
            return None
        if not self._typed(v) or not self._within(v):
            return "must be " + self.expects()
        return None

    def _typed(self, v) -> bool:
        if isinstance(v, bool) or self.kind is bool:
            return isinstance(v, bool) and self.kind is bool
        if self.kind is int:
            return isinstance(v, int)
        # an int is finite (math.isfinite would overflow on a huge one); a float must be checked
        return isinstance(v, int) or (isinstance(v, float) and math.isfinite(v))

    def _within(self, v) -> bool:
        if self.kind is bool:
            return True
        if self.lo is not None and (v <= self.lo if self.lo_open else v < self.lo):
            return False
        return self.hi is None or not (v >= self.hi if self.hi_open else v > self.hi)


def _num(x: float) -> str:
    return f"{x:g}" if isinstance(x, float) else str(x)


_PROB = dict(lo=0.0, hi=1.0)
_MFS = ()  # set through the `mfs` body extension (gateway.multilevel), with the server's defaults

PARAMS: dict[str, Param] = {}


def register(p: Param) -> Param:
    """Declare a parameter (a second one of the same name is a mistake, not an override)."""
    if p.name in PARAMS:
        raise ValueError(f"request parameter {p.name!r} is declared twice")
    PARAMS[p.name] = p
    return p


def default(name: str) -> object:
    """A declared parameter's default: what SamplingParams' field starts at."""
    return PARAMS[name].default


def path_params() -> list[Param]:
    """The parameters a body carries at a path of their own (the ``mfs`` extension's fields)."""
    return [p for p in PARAMS.values() if p.path is not None]


def body_params(endpoint: str) -> list[Param]:
    """The parameters `endpoint`'s body carries under their own name, read and described as declared."""
    if endpoint not in ENDPOINTS:
        raise ValueError(f"unknown endpoint {endpoint!r}; one of {ENDPOINTS}")
    return [p for p in PARAMS.values() if endpoint in p.endpoints]


for _p in (
    Param("max_tokens", int, 16, "Tokens to generate at most.", lo=1, hi=INT32_MAX, endpoints=()),
    Param("temperature", float, 0.0, "Divides the logits before sampling (0: greedy, the most likely token).",
          lo=0.0, hi=2.0, body_default=1.0),
    Param("top_p", float, 1.0, "Sample from the most likely tokens whose probabilities add up to top_p "
          "(0: only the most likely token; 1: off).", **_PROB),
    Param("top_k", int, 0, "MFS extension: sample from the k most likely tokens (0 or -1: all).",
          lo=-1, hi=INT32_MAX),
    Param("seed", int, None, "Seeds the request's sampling: the same seed and body give the same output.",
          lo=INT64_MIN, hi=INT64_MAX, nullable=True),
    Param("ignore_eos", bool, False, "MFS extension: keep going past eos."),
    Param("min_p", float, 0.0, "MFS/vLLM extension: sample only tokens whose probability is at least min_p "
          "times the most likely token's (after temperature).", **_PROB),
    Param("typical_p", float, 1.0, "MFS/Hugging Face extension (locally typical sampling): sample only the "
          "tokens whose surprisal is closest to the distribution's entropy, as many as reach this "
          "probability mass (1: off).", **_PROB),
    Param("presence_penalty", float, 0.0, "Subtracted from the logit of every token in the output so far.",
          lo=-2.0, hi=2.0),
    Param("frequency_penalty", float, 0.0, "Subtracted from a token's logit once per time it occurs in the "
          "output so far.", lo=-2.0, hi=2.0),
    Param("repetition_penalty", float, 1.0, "MFS/vLLM extension (Hugging Face semantics): the logit of a "
          "token in the prompt or the output is divided by it when positive, multiplied when not (1: off).",
          lo=0.0, hi=10.0, lo_open=True),
    Param("logprobs", int, None, "Most likely alternatives returned per output token (0: the chosen "
          "token's log-probability only).", lo=0, hi=20, nullable=True, endpoints=()),
    Param("prompt_logprobs", int, None, "The same for every prompt token but the first (completions' echo).",
          lo=0, hi=20, nullable=True, endpoints=()),
    # the body names the draft tier by name, model id or index (mfs.speculative.draft, gateway.serving)
    Param("spec_draft_tier", int, None, "Self-speculative decoding: the tier that drafts.", lo=0,
          nullable=True, endpoints=_MFS),
    Param("spec_gamma", int, 4, "Draft tokens per verification round.", lo=1, hi=16, endpoints=_MFS,
          path="mfs.speculative.gamma"),
    Param("spec_stop_confidence", float, 0.5, "A round ends early when the draft's top-token probability "
          "falls below this (0: always gamma drafts).", endpoints=_MFS, path="mfs.speculative.stop_confidence",
          **_PROB),
    # 1: escalate at the end of every window; 0: never (the engine's tests use both ends)
    Param("cascade_threshold", float, None, "Confidence cascade: move a tier up when the mean top-token "
          "probability of the last window tokens falls below it.", nullable=True, endpoints=_MFS,
          path="mfs.cascade.threshold", **_PROB),
    Param("cascade_window", int, 4, "Tokens the cascade's confidence is averaged over.", lo=1, hi=64,
          endpoints=_MFS, path="mfs.cascade.window"),
):
    register(_p)
