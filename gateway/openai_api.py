"""The OpenAI wire format of requests: bodies -> typed records (``ChatRequest``, ``CompletionRequest``,
``GenParams``) within a gateway's :class:`Limits`.

Everything that knows what an OpenAI request field is called lives here or beside it (``gateway.fields``
reads one field, ``gateway.refused`` refuses what is not implemented, ``gateway.multilevel`` and
``gateway.structured`` parse the ``mfs`` extension and structured output; answers are shaped by
``gateway.responses``); nothing here touches Redis or the tokenizer. Parsing raises
:class:`~gateway.errors.APIError` (status + OpenAI error JSON) for any bad input, so a client never sees a
500 for a malformed request.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from core.cli import opt
from core.params import PARAMS, Param, body_params
from core.sampling import MAX_BIAS, MAX_LOGIT_BIAS
from core.sampling import MAX_LOGPROBS as _MAX_LOGPROBS
from gateway.errors import invalid
from gateway.fields import INT32_MAX, bool_field, int_field, param_field, short
from gateway.multilevel import MultiLevel, parse_multilevel
from gateway.refused import check_refused
from gateway.structured import Grammar, parse_grammar

ROLES = ("system", "user", "assistant")
MAX_LOGPROBS = _MAX_LOGPROBS  # top_logprobs (chat) / logprobs (completions) at most
MAX_N = 16             # choices per request


@dataclass(slots=True, frozen=True)
class Limits:
    """Bounds on one request body; a request past one gets a 400 that names the parameter."""
    max_prompt_chars: int = opt(1 << 20, "characters in a prompt, or in all messages together", group="bounds")
    max_messages: int = opt(1024, group="bounds")
    max_stop: int = opt(16, "stop strings per request", group="bounds")
    max_stop_chars: int = opt(256, "characters per stop string", group="bounds")
    max_stop_token_ids: int = opt(256, cli=False)
    max_tokens_cap: int = opt(0, "largest max_tokens accepted, and the cap of a defaulted one (0: only the "
                                 "context)", group="bounds")
    max_session_chars: int = opt(256, cli=False)  # session_id / user: it names a Redis key


DEFAULT_LIMITS = Limits()


# ---- typed requests ---------------------------------------------------------------------------
@dataclass(slots=True)
class GenParams:
    max_tokens: int | None = None     # None: the rest of the context (chat) / 16 (completions)
    # Every declared body parameter (core/params.py) by name, as the body set it or its body default:
    # the Submit's SamplingParams takes them as they are (gateway.generation)
    sampling: dict[str, object] = field(default_factory=dict)
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    stream: bool = False
    include_usage: bool = False
    session_id: str | None = None
    multilevel: MultiLevel = field(default_factory=MultiLevel)
    logprobs: int | None = None       # alternatives per token (0: the chosen token's only); None: off
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> bias (ids checked later)
    echo: bool = False                # completions: the prompt first (with its logprobs when asked)
    n: int = 1                        # choices, each its own request (seed + i when seeded)
    grammar: Grammar | None = None    # structured output (response_format, guided_*)

    @property
    def seed(self) -> int | None:
        return self.sampling.get("seed")

    @property
    def ignore_eos(self) -> bool:
        return bool(self.sampling.get("ignore_eos", False))


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
    n = int_field(body, "n", lo=1)
    if n is not None and n > MAX_N:
        raise invalid(f"n={n} is more choices than this server gives one request (at most {MAX_N}).", "n",
                      code="unsupported_parameter")
    return n or 1


def _max_tokens(body: dict, lim: Limits, echo: bool = False) -> int | None:
    """``max_completion_tokens`` wins over ``max_tokens``; 0 only with completions' echo (the prompt
    scored, nothing generated)."""
    name = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    declared, raw = PARAMS["max_tokens"], body.get(name)
    if raw == 0 and not isinstance(raw, bool):  # below the declared bound: the prompt scored alone
        if not echo:
            raise invalid(f"'{name}' must be {declared.expects()}, got 0 (0 only with 'echo' on completions).",
                          name)
        return 0
    v = param_field(body, name, declared, name)
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
        return param_field(body, "logprobs", PARAMS["logprobs"], "logprobs")
    on = bool_field(body, "logprobs")
    top = param_field(body, "top_logprobs", PARAMS["logprobs"], "top_logprobs")
    if top is not None and not on:
        raise invalid("'top_logprobs' needs 'logprobs': true.", "top_logprobs")
    return (top or 0) if on else None


def read_param(body: dict, p: Param):
    """One declared parameter from a body: its value, or its body default when absent or null."""
    v = param_field(body, p.name, p, p.name)
    return p.wire_default if v is None else v


def sampling_fields(body: dict, endpoint: str) -> dict[str, object]:
    """Every parameter `endpoint`'s body carries as declared (core/params.py), by name."""
    return {p.name: read_param(body, p) for p in body_params(endpoint)}


def _logit_bias(body: dict) -> dict[int, float]:
    """``{"<token id>": bias}``, bias in [-100, 100] (ids against the vocabulary: gateway.serving)."""
    v = body.get("logit_bias")
    if v is None:
        return {}
    if not isinstance(v, dict):
        raise invalid(f"'logit_bias' must be an object mapping token ids to numbers, got {short(v)}.", "logit_bias")
    if len(v) > MAX_LOGIT_BIAS:
        raise invalid(f"'logit_bias' may name at most {MAX_LOGIT_BIAS} tokens, got {len(v)}.", "logit_bias")
    out = {}
    for k, b in v.items():
        if not (k.isascii() and k.isdigit() and len(k) <= 10 and k == str(int(k)) and int(k) <= INT32_MAX):
            raise invalid(f"'logit_bias' keys must be token ids (decimal strings, no leading zeros), got "
                          f"{short(k, 40)}.", "logit_bias")
        if isinstance(b, bool) or not isinstance(b, (int, float)) or not math.isfinite(b) \
                or not -MAX_BIAS <= b <= MAX_BIAS:
            raise invalid(f"'logit_bias' values must be numbers between -{MAX_BIAS:g} and {MAX_BIAS:g}, got "
                          f"{short(b, 40)} for token {k}.", "logit_bias")
        out[int(k)] = float(b)
    return out


def _echo(body: dict, chat: bool) -> bool:
    if chat:
        if body.get("echo") not in (None, False):
            raise invalid("'echo' is a completions parameter; chat completions do not take it.", "echo",
                          code="unsupported_parameter")
        return False
    return bool_field(body, "echo")


def parse_params(body: dict, lim: Limits = DEFAULT_LIMITS, chat: bool = True) -> GenParams:
    check_refused(body)
    echo = _echo(body, chat)
    max_tokens = _max_tokens(body, lim, echo)
    stream = bool_field(body, "stream")
    opts = body.get("stream_options")
    if opts is not None and not isinstance(opts, dict):
        raise invalid("'stream_options' must be an object.", "stream_options")
    include_usage = bool_field(opts or {}, "include_usage") if stream else False
    stop_ids = body.get("stop_token_ids") or []
    if not isinstance(stop_ids, list) or not all(isinstance(t, int) and not isinstance(t, bool)
                                                 and 0 <= t <= INT32_MAX for t in stop_ids):
        raise invalid("'stop_token_ids' must be a list of token ids.", "stop_token_ids")
    if len(stop_ids) > lim.max_stop_token_ids:
        raise invalid(f"'stop_token_ids' may list at most {lim.max_stop_token_ids} ids.", "stop_token_ids")
    return GenParams(max_tokens=max_tokens, sampling=sampling_fields(body, "chat" if chat else "completions"),
                     stop=_stop(body, lim), stop_token_ids=stop_ids, stream=stream, include_usage=include_usage,
                     session_id=_session(body, lim), multilevel=parse_multilevel(body),
                     logprobs=_logprobs(body, chat), echo=echo, n=_n(body), logit_bias=_logit_bias(body),
                     grammar=parse_grammar(body))


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
