"""The OpenAI wire format: request bodies -> typed records, typed results -> response JSON, errors.

Everything that knows what an OpenAI field is called lives here; nothing here touches Redis or the
tokenizer. Parsing raises :class:`APIError` (status + OpenAI error JSON) for any bad input, so a client
never sees a 500 for a malformed request.
"""
from __future__ import annotations

import json
import math
import re
import time
from dataclasses import dataclass, field

from core.sampling import MAX_GRAMMAR_CHARS, MAX_LOGIT_BIAS
from core.sampling import MAX_LOGPROBS as _MAX_LOGPROBS

ROLES = ("system", "user", "assistant")
INT32_MAX = (1 << 31) - 1
MAX_LOGPROBS = _MAX_LOGPROBS  # top_logprobs (chat) / logprobs (completions) at most
MAX_REPETITION = 10.0  # repetition_penalty at most (HF: > 0; 1 is off)
MAX_N = 16             # choices per request
LOGPROB_FLOOR = -9999.0  # what a -inf log-probability is reported as (JSON has no infinity)

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 408: "timeout_error", 413: "invalid_request_error",
          429: "rate_limit_error", 503: "service_unavailable", 504: "timeout_error"}


class APIError(Exception):
    """An error answered with ``status`` and ``{"error": {message, type, param, code}}``."""

    def __init__(self, status: int, message: str, *, type: str | None = None, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or _TYPES.get(status, "invalid_request_error" if status < 500 else "server_error")
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param,
                          "code": self.code}}


def invalid(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(400, message, param=param, code=code)


def model_not_found(model: str, available: list[str]) -> APIError:
    return APIError(404, f"The model '{model}' does not exist. Available models: {', '.join(available)}",
                    param="model", code="model_not_found")


def context_overflow(max_len: int, prompt_tokens: int, max_tokens: int | None) -> APIError:
    asks = f" and asks for {max_tokens} more" if max_tokens is not None else ""
    return APIError(400, f"This model's maximum context length is {max_len} tokens; the request has "
                         f"{prompt_tokens} prompt tokens{asks}. Shorten the prompt or lower max_tokens.",
                    param="messages", code="context_length_exceeded")


@dataclass(slots=True, frozen=True)
class Limits:
    """Bounds on one request body; a request past one gets a 400 that names the parameter."""
    max_prompt_chars: int = 1 << 20    # a completion prompt, or all message contents together
    max_messages: int = 1024
    max_stop: int = 16                 # stop strings
    max_stop_chars: int = 256          # characters in one stop string
    max_stop_token_ids: int = 256
    max_tokens_cap: int = 0            # max_tokens above it: 400 (0: only the context bounds it)
    max_session_chars: int = 256       # session_id / user: it names a Redis key


DEFAULT_LIMITS = Limits()


# ---- typed requests ---------------------------------------------------------------------------
MAX_SPEC_GAMMA = 16      # draft tokens per verification round
MAX_CASCADE_WINDOW = 64  # tokens the cascade's confidence is averaged over
MAX_CHOICES = 256        # guided_choice strings
# the structured-output fields: at most one per request
STRUCTURED = ("response_format", "guided_json", "guided_regex", "guided_choice")


@dataclass(slots=True, frozen=True)
class Grammar:
    """Structured output as the request asked it: core.sampling's (kind, text), and the field it came
    from (a 400 about it names that field)."""
    kind: str   # "json" (text: a JSON schema), "regex", "choice" (text: a JSON list of strings)
    text: str
    param: str


@dataclass(slots=True, frozen=True)
class Speculative:
    """``mfs.speculative`` as the request asked it (validated for type and range, not yet for tiers)."""
    draft: str | int | None = None   # tier name, model id or index; None: the server's --spec-draft-tier
    gamma: int | None = None         # None: the server's --spec-gamma
    stop_confidence: float | None = None  # None: SamplingParams' default


@dataclass(slots=True, frozen=True)
class Cascade:
    """``mfs.cascade`` as the request asked it."""
    threshold: float | None = None   # None: the server's --cascade-threshold
    window: int | None = None        # None: the server's --cascade-window


@dataclass(slots=True, frozen=True)
class MultiLevel:
    """The ``mfs`` body extension. Each field: None (the server default applies), False (off, whatever
    the server default), or what the request asked for."""
    speculative: Speculative | bool | None = None
    cascade: Cascade | bool | None = None


@dataclass(slots=True)
class GenParams:
    max_tokens: int | None = None     # None: the rest of the context (chat) / 16 (completions)
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    stream: bool = False
    include_usage: bool = False
    session_id: str | None = None
    multilevel: MultiLevel = field(default_factory=MultiLevel)
    logprobs: int | None = None       # alternatives per token (0: the chosen token's only); None: off
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> bias (ids checked later)
    echo: bool = False                # completions: the prompt first (with its logprobs when asked)
    n: int = 1                        # choices, each its own request (seed + i when seeded)
    grammar: Grammar | None = None    # structured output (response_format, guided_*)


@dataclass(slots=True)
class ChatRequest:
    model: str
    messages: list[dict]      # [{"role", "content": str}] with text parts already joined
    params: GenParams


@dataclass(slots=True)
class CompletionRequest:
    model: str
    prompt: str | list[int]   # text, or token ids
    params: GenParams


def _require_object(body) -> dict:
    if not isinstance(body, dict):
        raise invalid("The request body must be a JSON object.")
    return body


def _model(body: dict) -> str:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise invalid("'model' is required and must be a non-empty string.", "model")
    return model


def _int(body: dict, name: str, lo: int | None = None, hi: int | None = None,
         param: str | None = None) -> int | None:
    v = body.get(name)
    if v is None:
        return None
    param = param or name
    if isinstance(v, float) and v.is_integer():
        v = int(v)
    if isinstance(v, bool) or not isinstance(v, int):
        raise invalid(f"'{param}' must be an integer, got {_short(v)}.", param)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        bounds = f">= {lo}" if hi is None else f"between {lo} and {hi}"
        raise invalid(f"'{param}' must be {bounds}, got {v}.", param)
    return v


def _short(v, n: int = 80) -> str:
    r = repr(v)
    return r if len(r) <= n else r[:n] + "..."


def _float(body: dict, name: str, default: float, lo: float, hi: float) -> float:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise invalid(f"'{name}' must be a number, got {v!r}.", name)
    if not lo <= v <= hi:
        raise invalid(f"'{name}' must be between {lo} and {hi}, got {v}.", name)
    return float(v)


def _bool(body: dict, name: str, default: bool = False) -> bool:
    v = body.get(name, default)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise invalid(f"'{name}' must be a boolean, got {v!r}.", name)
    return v


def _stop(body: dict, lim: Limits) -> list[str]:
    v = body.get("stop")
    if v is None:
        return []
    stops = [v] if isinstance(v, str) else v
    if (not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops)
            or len(stops) > lim.max_stop):
        raise invalid(f"'stop' must be a non-empty string or a list of at most {lim.max_stop} "
                      "non-empty strings.", "stop")
    if any(len(s) > lim.max_stop_chars for s in stops):
        raise invalid(f"Each stop string may have at most {lim.max_stop_chars} characters.", "stop")
    return list(dict.fromkeys(stops))


def _n(body: dict) -> int:
    n = _int(body, "n", lo=1)
    if n is not None and n > MAX_N:
        raise invalid(f"n={n} is more choices than this server gives one request (at most {MAX_N}).", "n",
                      code="unsupported_parameter")
    return n or 1


# OpenAI (and vLLM) request fields this server does not implement: only the values that mean "off"
# are accepted (compared type-strictly, as JSON Schema's enum does); anything else is a 400
# unsupported_parameter naming the field, never accepted and ignored. gateway/openapi.py describes
# each with exactly these values.
NO_TOOLS = "tools and function calling are not supported"
NO_STRUCTURED = ("only response_format, guided_json, guided_regex and guided_choice give structured output "
                 "here")
REFUSED: dict[str, tuple[tuple, str]] = {
    "suffix": ((None, ""), "insertion ('suffix') is not supported"),
    "guided_grammar": ((None,), NO_STRUCTURED),
    "structured_outputs": ((None,), NO_STRUCTURED),
    "tool_choice": ((None, "none", "auto"), NO_TOOLS),
    "function_call": ((None, "none", "auto"), NO_TOOLS),
    "parallel_tool_calls": ((None, True), NO_TOOLS),
    "modalities": ((None, ["text"]), "only text output is supported"),
    "audio": ((None,), "only text output is supported"),
    "prediction": ((None,), "predicted outputs are not supported"),
    "reasoning_effort": ((None,), "these models do not reason on a budget"),
    "web_search_options": ((None,), "web search is not supported"),
    "store": ((None, False), "completions are not stored"),
    "metadata": ((None, {}), "completions are not stored (metadata goes with 'store')"),
    "service_tier": ((None, "auto", "default"), "there is one service tier"),
}


def _same(a, b) -> bool:
    return type(a) is type(b) and a == b


def _unsupported(body: dict) -> None:
    best_of = _int(body, "best_of", lo=1)
    if best_of not in (None, 1):
        raise invalid("'best_of' > 1 is not supported.", "best_of", code="unsupported_parameter")
    for name in ("tools", "functions"):
        if body.get(name):
            raise invalid(f"'{name}': {NO_TOOLS}.", name, code="unsupported_parameter")
    for name, (off, why) in REFUSED.items():
        v = body.get(name)
        if not any(_same(v, o) for o in off):
            allowed = " or ".join(json.dumps(o) for o in off)
            shown = json.dumps(v, default=str)
            shown = shown if len(shown) <= 60 else shown[:60] + "..."
            raise invalid(f"'{name}': {shown} is not supported: {why}. Leave it out (or send {allowed}).",
                          name, code="unsupported_parameter")


def _max_tokens(body: dict, lim: Limits, echo: bool = False) -> int | None:
    """``max_completion_tokens`` wins over ``max_tokens``; 0 only with completions' echo (the prompt
    scored, nothing generated)."""
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    v = _int(body, name, lo=0, hi=INT32_MAX)
    if v == 0 and not echo:
        raise invalid(f"'{name}' must be between 1 and {INT32_MAX}, got 0 (0 only with 'echo' on completions).",
                      name)
    if v is not None and lim.max_tokens_cap and v > lim.max_tokens_cap:
        raise invalid(f"'{name}' may be at most {lim.max_tokens_cap} on this server, got {v}.", name)
    return v


def _session(body: dict, lim: Limits) -> str | None:
    name = "session_id" if body.get("session_id") is not None else "user"
    v = body.get(name)
    if not isinstance(v, str) or not v:
        return None
    if len(v) > lim.max_session_chars:
        raise invalid(f"'{name}' may have at most {lim.max_session_chars} characters.", name)
    try:
        v.encode("utf-8")  # it travels to Redis in msgpack: a lone surrogate (JSON "\ud800") cannot
    except UnicodeEncodeError:
        raise invalid(f"'{name}' is not valid Unicode text.", name) from None
    return v


def _only(obj: dict, allowed: tuple[str, ...], where: str) -> None:
    extra = sorted(k for k in obj if k not in allowed)
    if extra:
        raise invalid(f"'{where}' has an unknown field {_short(extra[0], 40)}; it takes "
                      f"{', '.join(allowed)}.", where)


def _speculative(v) -> Speculative | bool | None:
    name = "mfs.speculative"
    if v is None or v is False:
        return v
    if v is True:
        return Speculative()
    if not isinstance(v, dict):
        raise invalid(f"'{name}' must be an object {{\"draft\": <tier>, \"gamma\": <int>, "
                      f"\"stop_confidence\": <0..1>}} or false, got {_short(v)}.", name)
    _only(v, ("draft", "gamma", "stop_confidence"), name)
    draft = v.get("draft")
    if isinstance(draft, float) and draft.is_integer():
        draft = int(draft)
    if draft is not None and (isinstance(draft, bool) or not isinstance(draft, (str, int)) or draft == ""):
        raise invalid(f"'{name}.draft' must be a tier name, a model id or a tier index, got "
                      f"{_short(draft)}.", f"{name}.draft")
    gamma = _int(v, "gamma", lo=1, hi=MAX_SPEC_GAMMA, param=f"{name}.gamma")
    stop = v.get("stop_confidence")
    if stop is not None:
        if isinstance(stop, bool) or not isinstance(stop, (int, float)) or not math.isfinite(stop) \
                or not 0 <= stop <= 1:
            raise invalid(f"'{name}.stop_confidence' must be a number between 0 and 1, got {_short(stop)}.",
                          f"{name}.stop_confidence")
        stop = float(stop)
    return Speculative(draft, gamma, stop)


def _cascade(v) -> Cascade | bool | None:
    name = "mfs.cascade"
    if v is None or v is False:
        return v
    if v is True:
        return Cascade()
    if not isinstance(v, dict):
        raise invalid(f"'{name}' must be an object {{\"threshold\": <0..1>, \"window\": <int>}} or false, "
                      f"got {_short(v)}.", name)
    _only(v, ("threshold", "window"), name)
    t = v.get("threshold")
    if t is not None:
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or not 0 < t < 1:
            raise invalid(f"'{name}.threshold' must be a number strictly between 0 and 1, got {_short(t)}.",
                          f"{name}.threshold")
        t = float(t)
    window = _int(v, "window", lo=1, hi=MAX_CASCADE_WINDOW, param=f"{name}.window")
    return Cascade(t, window)


def parse_multilevel(body: dict) -> MultiLevel:
    """The ``mfs`` extension field: ``{"speculative": {...} | false, "cascade": {...} | false}``."""
    v = body.get("mfs")
    if v is None:
        return MultiLevel()
    if not isinstance(v, dict):
        raise invalid(f"'mfs' must be an object, got {_short(v)}.", "mfs")
    _only(v, ("speculative", "cascade"), "mfs")
    ml = MultiLevel(_speculative(v.get("speculative")), _cascade(v.get("cascade")))
    if isinstance(ml.speculative, Speculative) and isinstance(ml.cascade, Cascade):
        raise invalid("A request may ask for self-speculative decoding or for a confidence cascade, not both "
                      "('mfs.speculative' and 'mfs.cascade').", "mfs")
    return ml


def _logprobs(body: dict, chat: bool) -> int | None:
    """Chat: ``logprobs`` (boolean) and ``top_logprobs`` (0..20, only with logprobs true); completions:
    ``logprobs`` (0..20). Returns the number of alternatives per token, or None (off)."""
    if not chat:
        v = body.get("logprobs")
        if v is False:
            return None
        if v is True:
            raise invalid(f"'logprobs' on completions is the number of most likely tokens to return (0 to "
                          f"{MAX_LOGPROBS}), not a boolean.", "logprobs")
        return _int(body, "logprobs", lo=0, hi=MAX_LOGPROBS)
    on = _bool(body, "logprobs")
    top = _int(body, "top_logprobs", lo=0, hi=MAX_LOGPROBS)
    if top is not None and not on:
        raise invalid("'top_logprobs' needs 'logprobs': true.", "top_logprobs")
    return (top or 0) if on else None


def _repetition_penalty(body: dict) -> float:
    v = body.get("repetition_penalty")
    if v is None:
        return 1.0
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not 0 < v <= MAX_REPETITION:
        raise invalid(f"'repetition_penalty' must be a number > 0 and at most {MAX_REPETITION:g} (1: off), "
                      f"got {_short(v)}.", "repetition_penalty")
    return float(v)


def _logit_bias(body: dict) -> dict[int, float]:
    """``{"<token id>": bias}``, bias in [-100, 100] (ids against the vocabulary: gateway.serving)."""
    v = body.get("logit_bias")
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise invalid(f"'logit_bias' must be an object mapping token ids to numbers, got {_short(v)}.", "logit_bias")
    if len(v) > MAX_LOGIT_BIAS:
        raise invalid(f"'logit_bias' may name at most {MAX_LOGIT_BIAS} tokens, got {len(v)}.", "logit_bias")
    out = {}
    for k, b in v.items():
        if not (k.isascii() and k.isdigit() and len(k) <= 10 and k == str(int(k)) and int(k) <= INT32_MAX):
            raise invalid(f"'logit_bias' keys must be token ids (decimal strings, no leading zeros), got "
                          f"{_short(k, 40)}.", "logit_bias")
        if isinstance(b, bool) or not isinstance(b, (int, float)) or not math.isfinite(b) or not -100 <= b <= 100:
            raise invalid(f"'logit_bias' values must be numbers between -100 and 100, got {_short(b, 40)} for "
                          f"token {k}.", "logit_bias")
        out[int(k)] = float(b)
    return out


def _echo(body: dict, chat: bool) -> bool:
    if chat:
        if body.get("echo") not in (None, False):
            raise invalid("'echo' is a completions parameter; chat completions do not take it.", "echo",
                          code="unsupported_parameter")
        return False
    return _bool(body, "echo")


def _text(v, param: str) -> str:
    if len(v) > MAX_GRAMMAR_CHARS:
        raise invalid(f"'{param}' may have at most {MAX_GRAMMAR_CHARS} characters, got {len(v)}.", param)
    try:
        v.encode("utf-8")
    except UnicodeEncodeError:
        raise invalid(f"'{param}' is not valid Unicode text.", param) from None
    return v


def _schema(v, param: str) -> str:
    """A JSON schema (an object) -> its text."""
    if not isinstance(v, dict):
        raise invalid(f"'{param}' must be a JSON schema (an object), got {_short(v)}.", param)
    return _text(json.dumps(v, ensure_ascii=False), param)  # key order kept: it is the output's


def _response_format(v) -> Grammar | None:
    name = "response_format"
    if not isinstance(v, dict) or v.get("type") not in ("text", "json_object", "json_schema"):
        raise invalid(f"'{name}' must be {{\"type\": \"text\"}}, {{\"type\": \"json_object\"}} or "
                      f"{{\"type\": \"json_schema\", \"json_schema\": {{\"name\": ..., \"schema\": {{...}}}}}}, "
                      f"got {_short(v)}.", name)
    if v["type"] != "json_schema":
        _only(v, ("type",), name)
        return None if v["type"] == "text" else Grammar("json", '{"type": "object"}', name)
    _only(v, ("type", "json_schema"), name)
    js = v.get("json_schema")
    where = f"{name}.json_schema"
    if not isinstance(js, dict):
        raise invalid(f"'{where}' must be an object {{\"name\", \"schema\", \"strict\", \"description\"}}.", where)
    _only(js, ("name", "schema", "strict", "description"), where)
    n = js.get("name")
    if not isinstance(n, str) or not re.fullmatch(r"[A-Za-z0-9_-]{1,64}", n):
        raise invalid(f"'{where}.name' is required: 1 to 64 letters, digits, '_' or '-', got {_short(n)}.",
                      f"{where}.name")
    if js.get("strict") is not None and not isinstance(js["strict"], bool):
        raise invalid(f"'{where}.strict' must be a boolean.", f"{where}.strict")
    if js.get("description") is not None and not isinstance(js["description"], str):
        raise invalid(f"'{where}.description' must be a string.", f"{where}.description")
    if js.get("schema") is None:
        raise invalid(f"'{where}.schema' is required: the JSON schema the output follows.", f"{where}.schema")
    return Grammar("json", _schema(js["schema"], f"{where}.schema"), f"{where}.schema")


def _grammar(body: dict) -> Grammar | None:
    """response_format (json_object, json_schema) or one of vLLM's guided_json / guided_regex /
    guided_choice: at most one. Checked here for shape; whether it compiles, by the gateway
    (gateway.serving, with the worker's grammar engine)."""
    found: list[Grammar] = []
    if body.get("response_format") is not None:
        g = _response_format(body["response_format"])
        if g is not None:
            found.append(g)
    if body.get("guided_json") is not None:
        found.append(Grammar("json", _schema(body["guided_json"], "guided_json"), "guided_json"))
    v = body.get("guided_regex")
    if v is not None:
        if not isinstance(v, str) or not v:
            raise invalid(f"'guided_regex' must be a non-empty regular expression, got {_short(v)}.", "guided_regex")
        found.append(Grammar("regex", _text(v, "guided_regex"), "guided_regex"))
    v = body.get("guided_choice")
    if v is not None:
        if (not isinstance(v, list) or not v or len(v) > MAX_CHOICES
                or not all(isinstance(c, str) and c for c in v)):
            raise invalid(f"'guided_choice' must be a list of 1 to {MAX_CHOICES} non-empty strings, got "
                          f"{_short(v)}.", "guided_choice")
        found.append(Grammar("choice", _text(json.dumps(v, ensure_ascii=False), "guided_choice"), "guided_choice"))
    if len(found) > 1:
        raise invalid("A request may constrain its output one way: " + ", ".join(STRUCTURED)
                      + f" (it has {found[0].param.split('.')[0]} and {found[1].param.split('.')[0]}).",
                      found[1].param.split(".")[0], code="conflicting_parameters")
    g = found[0] if found else None
    if g is not None and body.get("ignore_eos") is True:
        raise invalid(f"'ignore_eos' cannot go with structured output ('{g.param.split('.')[0]}'): the output "
                      "ends where its grammar does, with eos.", "ignore_eos", code="conflicting_parameters")
    return g


def parse_params(body: dict, lim: Limits = DEFAULT_LIMITS, chat: bool = True) -> GenParams:
    _unsupported(body)
    echo = _echo(body, chat)
    max_tokens = _max_tokens(body, lim, echo)
    top_k = _int(body, "top_k", lo=-1, hi=INT32_MAX)
    stream = _bool(body, "stream")
    opts = body.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise invalid("'stream_options' must be an object.", "stream_options")
    include_usage = _bool(opts or {}, "include_usage") if stream else False
    seed = _int(body, "seed", lo=-(1 << 63), hi=(1 << 63) - 1)
    stop_ids = body.get("stop_token_ids") or []
    if not isinstance(stop_ids, list) or not all(isinstance(t, int) and not isinstance(t, bool)
                                                 and 0 <= t <= INT32_MAX for t in stop_ids):
        raise invalid("'stop_token_ids' must be a list of token ids.", "stop_token_ids")
    if len(stop_ids) > lim.max_stop_token_ids:
        raise invalid(f"'stop_token_ids' may list at most {lim.max_stop_token_ids} ids.", "stop_token_ids")
    return GenParams(max_tokens=max_tokens,
                     temperature=_float(body, "temperature", 1.0, 0.0, 2.0),
                     top_p=_float(body, "top_p", 1.0, 0.0, 1.0),
                     top_k=max(0, top_k or 0), seed=seed, stop=_stop(body, lim), stop_token_ids=stop_ids,
                     ignore_eos=_bool(body, "ignore_eos"), stream=stream, include_usage=include_usage,
                     session_id=_session(body, lim), multilevel=parse_multilevel(body),
                     logprobs=_logprobs(body, chat), echo=echo, n=_n(body),
                     min_p=_float(body, "min_p", 0.0, 0.0, 1.0),
                     presence_penalty=_float(body, "presence_penalty", 0.0, -2.0, 2.0),
                     frequency_penalty=_float(body, "frequency_penalty", 0.0, -2.0, 2.0),
                     repetition_penalty=_repetition_penalty(body), logit_bias=_logit_bias(body),
                     grammar=_grammar(body))


def _content(msg: dict, i: int) -> str:
    c = msg.get("content")
    if isinstance(c, str):
        return c
    if c is None and msg["role"] == "assistant":
        return ""
    if isinstance(c, list):
        parts = []
        for p in c:
            if not isinstance(p, dict) or p.get("type") != "text" or not isinstance(p.get("text"), str):
                raise invalid(f"messages[{i}].content: only text parts ({{\"type\": \"text\", "
                              "\"text\": ...}) are supported.", f"messages[{i}].content")
            parts.append(p["text"])
        return "\n".join(parts)
    raise invalid(f"messages[{i}].content must be a string or a list of text parts.",
                  f"messages[{i}].content")


def parse_chat(body, lim: Limits = DEFAULT_LIMITS) -> ChatRequest:
    body = _require_object(body)
    model = _model(body)
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise invalid("'messages' must be a non-empty list.", "messages")
    if len(msgs) > lim.max_messages:
        raise invalid(f"'messages' may hold at most {lim.max_messages} messages, got {len(msgs)}.",
                      "messages")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict):
            raise invalid(f"messages[{i}] must be an object.", f"messages[{i}]")
        if m.get("role") not in ROLES:
            raise invalid(f"messages[{i}].role must be one of {', '.join(ROLES)}, got {m.get('role')!r}.",
                          f"messages[{i}].role")
        out.append({"role": m["role"], "content": _content(m, i)})
    if sum(len(m["content"]) for m in out) > lim.max_prompt_chars:
        raise invalid(f"The messages may have at most {lim.max_prompt_chars} characters together.",
                      "messages", code="prompt_too_long")
    return ChatRequest(model, out, parse_params(body, lim, chat=True))


def parse_completion(body, lim: Limits = DEFAULT_LIMITS) -> CompletionRequest:
    body = _require_object(body)
    model = _model(body)
    p = body.get("prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]  # one prompt in a batch of one
    if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
        if any(t < 0 or t > INT32_MAX for t in p):
            raise invalid("'prompt' token ids must be non-negative.", "prompt")
        prompt: str | list[int] = p
    elif isinstance(p, str) and p:
        if len(p) > lim.max_prompt_chars:
            raise invalid(f"'prompt' may have at most {lim.max_prompt_chars} characters, got {len(p)}.",
                          "prompt", code="prompt_too_long")
        prompt = p
    elif isinstance(p, list) and len(p) > 1:
        raise invalid("Batched prompts are not supported: send one prompt per request.", "prompt",
                      code="unsupported_parameter")
    else:
        raise invalid("'prompt' must be a non-empty string or a list of token ids.", "prompt")
    return CompletionRequest(model, prompt, parse_params(body, lim, chat=False))


# ---- responses --------------------------------------------------------------------------------
def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0,
          draft: tuple[str | None, int, int] | None = None) -> dict:
    """``draft``: (draft model id, proposed, accepted) of a speculated request; with proposed > 0 it
    adds OpenAI's predicted-output fields (``completion_tokens_details.accepted_prediction_tokens`` /
    ``rejected_prediction_tokens``) and ``mfs_draft``."""
    u = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
         "total_tokens": prompt_tokens + completion_tokens}
    if cached_tokens:
        u["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    if draft is not None and draft[1] > 0:
        model, proposed, accepted = draft
        accepted = max(0, min(accepted, proposed))
        u["completion_tokens_details"] = {"accepted_prediction_tokens": accepted,
                                          "rejected_prediction_tokens": proposed - accepted}
        u["mfs_draft"] = {"draft_model": model, "proposed": proposed, "accepted": accepted}
    return u


def served(tier_ids: list[str]) -> dict:
    """The ``mfs`` response extension: the tiers that produced the tokens, in order."""
    return {"tiers": list(tier_ids), "escalations": max(0, len(tier_ids) - 1)}


@dataclass(slots=True)
class TokenInfo:
    """One token as a response shows its log-probability: its text (the token decoded alone), its
    log-probability (None: the first prompt token, which nothing predicts) and the most likely tokens
    at its position, most likely first."""
    text: str
    logprob: float | None
    top: list[tuple[str, float]] = field(default_factory=list)


def _lp(v: float) -> float:
    return v if v > LOGPROB_FLOOR else LOGPROB_FLOOR


def _bytes(text: str) -> list[int]:
    return list(text.encode("utf-8", errors="surrogatepass"))


def chat_logprobs(items: list[TokenInfo]) -> dict:
    """OpenAI's ``choices[i].logprobs`` of a chat completion (or chunk)."""
    return {"content": [{"token": t.text, "logprob": _lp(t.logprob), "bytes": _bytes(t.text),
                         "top_logprobs": [{"token": s, "logprob": _lp(v), "bytes": _bytes(s)} for s, v in t.top]}
                        for t in items],
            "refusal": None}


def completion_logprobs(items: list[TokenInfo], offset: int = 0) -> dict:
    """OpenAI's legacy ``choices[i].logprobs``; ``offset``: characters of the choice's text before the
    first item (text_offset counts from there, each token adding its own text's length)."""
    offsets = []
    for t in items:
        offsets.append(offset)
        offset += len(t.text)
    return {"tokens": [t.text for t in items],
            "token_logprobs": [None if t.logprob is None else _lp(t.logprob) for t in items],
            "top_logprobs": [None if t.logprob is None else {s: _lp(v) for s, v in t.top} for t in items],
            "text_offset": offsets}


@dataclass(slots=True)
class Choice:
    """One choice of a finished response."""
    index: int
    text: str
    finish: str
    logprobs: dict | None = None


def chat_response(rid: str, model: str, created: int, choices: list[Choice], use: dict) -> dict:
    return {"id": rid, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                         "logprobs": c.logprobs, "finish_reason": c.finish} for c in choices],
            "usage": use}


def completion_response(rid: str, model: str, created: int, choices: list[Choice], use: dict) -> dict:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": c.index, "text": c.text, "logprobs": c.logprobs, "finish_reason": c.finish}
                        for c in choices],
            "usage": use}


def chat_chunk(rid: str, model: str, created: int, delta: dict, finish: str | None,
               with_usage: bool, logprobs: dict | None = None, index: int = 0) -> dict:
    c = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
         "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]}
    if with_usage:
        c["usage"] = None
    return c


def completion_chunk(rid: str, model: str, created: int, text: str, finish: str | None,
                     with_usage: bool, logprobs: dict | None = None, index: int = 0) -> dict:
    c = {"id": rid, "object": "text_completion", "created": created, "model": model,
         "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}]}
    if with_usage:
        c["usage"] = None
    return c


def usage_chunk(rid: str, model: str, created: int, obj: str, use: dict) -> dict:
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [], "usage": use}


def models_list(ids: list[str], created: int | None = None, owner: str = "mfs") -> dict:
    created = created or int(time.time())
    return {"object": "list", "data": [{"id": i, "object": "model", "created": created,
                                        "owned_by": owner} for i in ids]}
