"""The gateway's OpenAPI 3.1 description, served at ``GET /openapi.json`` (no API key needed, like /health).

The document is built per gateway, from what it serves and how it is configured: model names are an
enum of the family's tier model ids (plus the family id and ``auto``), the bounds come from its
:class:`~gateway.openai_api.Limits`, its ``--max-prompt-tokens`` and its tokenizer's vocabulary, the
``mfs`` extension from its tiers and server defaults (``--spec-draft-tier``, ``--cascade-threshold``),
and security is a bearer token when API keys are configured.

Schemas are JSON Schema 2020-12 (``jsonSchemaDialect``) and describe exactly what the validator in
``gateway.openai_api`` and the modules beside it (and the tier checks in ``gateway.serving``) accept,
including the cross-field rules JSON Schema can express (the ``mfs`` rules that depend on ``model``).
What it cannot express, and what the gateway may therefore still answer with a 400 for a body valid by
this document:

* the context: prompt tokens + ``max_tokens`` over the smallest ``max_model_len`` of the live workers
  (``context_length_exceeded``), and the prompt's token count over ``--max-prompt-tokens`` after the
  chat template, or all message contents together over ``max_prompt_chars`` (``prompt_too_long``);
* ``mfs.speculative.draft`` on a family-id (or ``auto``) request: the draft must be below the tier the
  complexity scorer picks for the prompt.

Every field OpenAI defines is described: honoured, or (``gateway.refused.REFUSED``) accepted only with
the values that mean "off", anything else a 400 ``unsupported_parameter``; none is accepted and ignored.

Responses are described as exactly as the requests (``additionalProperties: false`` on the gateway's own
objects); a stream's ``data:`` events are described by the media type's ``x-event-data`` schema.
"""
from __future__ import annotations

from importlib import metadata

from core.sampling import SamplingParams
from core.sampling import MAX_GRAMMAR_CHARS, MAX_LOGIT_BIAS
from gateway.fields import INT32_MAX
from gateway.multilevel import MAX_CASCADE_WINDOW, MAX_SPEC_GAMMA
from gateway.openai_api import MAX_LOGPROBS, MAX_N, MAX_REPETITION, ROLES, Limits
from gateway.refused import REFUSED
from gateway.structured import MAX_CHOICES

PATH = "/openapi.json"
DIALECT = "https://json-schema.org/draft/2020-12/schema"
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
ERROR_TYPES = ["invalid_request_error", "authentication_error", "permission_error", "not_found_error",
               "timeout_error", "rate_limit_error", "service_unavailable", "server_error"]
FINISH_REASONS = ["stop", "length"]
FALSY = [None, False, 0, "", [], {}]  # what `body.get(x) or ...` reads as "not given"


def id_pattern(top: int) -> str:
    """A regex of the decimal strings 0..top, no leading zeros (logit_bias keys: the vocabulary's ids)."""
    d = str(top)
    alts = ["0"] + ([f"[1-9][0-9]{{0,{len(d) - 2}}}"] if len(d) > 1 else [])
    for i, c in enumerate(d):  # same length as top: equal up to i, smaller at i, anything after
        lo = 1 if i == 0 else 0
        if int(c) > lo:
            rest = f"[0-9]{{{len(d) - i - 1}}}" if i < len(d) - 1 else ""
            alts.append(f"{d[:i]}[{lo}-{int(c) - 1}]{rest}")
    alts.append(d)
    return "^(" + "|".join(alts) + ")$"


def _ref(name: str) -> dict:
    return {"$ref": f"#/components/schemas/{name}"}


def _nullable(schema: dict) -> dict:
    """``schema`` or JSON null (the validator reads a null field as "not given")."""
    return {"anyOf": [schema, {"type": "null"}]}


def _obj(props: dict, required: list[str] | tuple[str, ...] = (), closed: bool = True, **kw) -> dict:
    out = {"type": "object", "properties": props}
    if required:
        out["required"] = list(required)
    if closed:
        out["additionalProperties"] = False
    out.update(kw)
    return out


def _version() -> str:
    try:
        return metadata.version("mfs")
    except metadata.PackageNotFoundError:
        return "0.1.0"


class _Facts:
    """What the document depends on, read from the gateway's Service and config."""

    def __init__(self, svc, cfg):
        self.tier_ids: list[str] = list(svc.tier_ids)
        self.tier_names: list[str] = list(svc.tier_names)
        self.family: str = svc.frontend.family_id
        self.vocab: int = int(svc.vocab_size)
        self.default_draft: int | None = svc.spec_draft_tier
        self.default_gamma: int = svc.spec_gamma
        self.default_threshold: float | None = svc.cascade_threshold
        self.default_window: int = svc.cascade_window
        self.max_prompt_tokens: int = svc.max_prompt_tokens
        self.default_max_tokens: int | None = svc.default_max_tokens
        self.limits: Limits = cfg.limits
        self.max_body_bytes: int = cfg.max_body_bytes
        self.request_timeout_s: float = cfg.request_timeout_s
        self.max_inflight: int = cfg.max_inflight


# ---- the mfs extension ------------------------------------------------------------------------
def _draft(f: _Facts, top: int) -> dict:
    """A reference to a tier with index 0..top: its name, its model id, its index, or the index as
    a string of at most 5 ASCII digits (how ``Service.resolve_tier`` reads it)."""
    refs = [f.tier_names[i] for i in range(top + 1)] + [f.tier_ids[i] for i in range(top + 1)]
    alts = [{"type": "string", "enum": list(dict.fromkeys(refs))},
            {"type": "integer", "minimum": 0, "maximum": top}]
    if top <= 9:
        alts.append({"type": "string", "pattern": f"^0{{0,4}}[0-{top}]$"})
    return {"anyOf": alts, "description": "A tier below the request's: its name ("
            + ", ".join(f.tier_names[:top + 1]) + "), model id or index."}


def _speculative(f: _Facts, top: int | None) -> dict:
    """``mfs.speculative`` for a request whose possible drafts are tiers 0..top (None: none)."""
    gamma = _nullable({"type": "integer", "minimum": 1, "maximum": MAX_SPEC_GAMMA,
                       "description": f"Draft tokens per verification round (server default "
                                      f"{f.default_gamma})."})
    has_default = f.default_draft is not None
    values: list = [None, False] + ([True] if has_default else [])
    alts: list[dict] = [{"enum": values}]
    if top is not None or has_default:
        if top is None:
            draft = {"type": "null"}
        else:
            draft = _nullable(_draft(f, top)) if has_default else _draft(f, top)
        stop = _nullable({"type": "number", "minimum": 0, "maximum": 1,
                          "description": "A round ends before 'gamma' drafts when the draft tier's top-token "
                                         "probability for its latest draft falls below this (0: always "
                                         f"'gamma'; default {SamplingParams().spec_stop_confidence})."})
        alts.append(_obj({"draft": draft, "gamma": gamma, "stop_confidence": stop},
                         [] if has_default else ["draft"]))
    default = (f"true: the server's defaults (draft tier '{f.tier_names[f.default_draft]}')" if has_default
               else "this server has no default draft tier: 'draft' is required")
    return {"anyOf": alts, "description": "Self-speculative decoding: a lower tier drafts, the request's tier "
            f"verifies. {default}; false: off."}


def _cascade(f: _Facts) -> dict:
    has_default = f.default_threshold is not None
    threshold = {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1,
                 "description": "Escalate one tier up when the mean top-token probability of the last "
                                "'window' tokens falls below it."}
    window = _nullable({"type": "integer", "minimum": 1, "maximum": MAX_CASCADE_WINDOW,
                        "description": f"Tokens the confidence is averaged over (server default "
                                       f"{f.default_window})."})
    obj = _obj({"threshold": _nullable(threshold) if has_default else threshold, "window": window},
               [] if has_default else ["threshold"])
    default = (f"true: the server's defaults (threshold {f.default_threshold:g})" if has_default
               else "this server has no default threshold: 'threshold' is required")
    return {"anyOf": [{"enum": [None, False] + ([True] if has_default else [])}, obj],
            "description": "Confidence cascade from the scored tier up; only for the family id or 'auto'. "
                           f"{default}; false: off."}


_ASKS = {"anyOf": [{"const": True}, {"type": "object"}]}


def _multilevel(spec: dict, cascade: dict) -> dict:
    return _nullable(_obj(
        {"speculative": spec, "cascade": cascade},
        # asking for both explicitly is a 400 ('mfs')
        **{"not": {"required": ["speculative", "cascade"],
                   "properties": {"speculative": _ASKS, "cascade": _ASKS}}},
        description="MFS multi-level sampling (see the gateway README): self-speculative decoding or a "
                    "confidence cascade, not both. null or a missing field: the server's default."))


def _per_model(f: _Facts) -> list[dict]:
    """The ``mfs`` rules depend on ``model``: a tier model id takes no cascade and only drafts below it;
    the family id / ``auto`` takes either (its draft is checked against the scored tier later)."""
    no_cascade = {"enum": [None, False]}
    alts = [{"properties": {"model": {"enum": [f.family, "auto"]}, "mfs": _ref("MultiLevel")},
             "description": "The family id: the gateway picks the tier; either kind of 'mfs'."}]
    for k, tid in enumerate(f.tier_ids):
        below = f"drafts from {', '.join(f.tier_names[:k])}" if k else "no draft"
        alts.append({"properties": {"model": {"const": tid},
                                    "mfs": _multilevel(_speculative(f, k - 1 if k else None), no_cascade)},
                     "description": f"Tier '{f.tier_names[k]}': no cascade, {below}."})
    return alts


# ---- requests ---------------------------------------------------------------------------------
def _common_params(f: _Facts) -> dict:
    lim = f.limits
    cap = lim.max_tokens_cap or INT32_MAX
    max_tokens = _nullable({"type": "integer", "minimum": 1, "maximum": cap,
                            "description": "Tokens to generate at most; prompt + max_tokens must fit the "
                                           "context (else 400 context_length_exceeded)."})
    stop_string = {"type": "string", "minLength": 1, "maxLength": lim.max_stop_chars}
    session = _nullable({"type": "string", "maxLength": lim.max_session_chars,
                         "description": "KV-cache affinity key (valid Unicode; an empty string is none)."})
    return {
        "max_tokens": max_tokens,
        "max_completion_tokens": {**max_tokens, "description": "Like max_tokens, and wins over it."},
        "temperature": _nullable({"type": "number", "minimum": 0, "maximum": 2}),
        "top_p": _nullable({"type": "number", "minimum": 0, "maximum": 1}),
        "top_k": _nullable({"type": "integer", "minimum": -1, "maximum": INT32_MAX,
                            "description": "MFS extension: sample from the k most likely tokens (0 or -1: all)."}),
        "seed": _nullable({"type": "integer", "minimum": INT64_MIN, "maximum": INT64_MAX}),
        "stream": _nullable({"type": "boolean", "description": "Answer as server-sent events."}),
        "stream_options": _nullable(_obj({"include_usage": _nullable({"type": "boolean"})}, closed=False,
                                         description="Read only when streaming.")),
        "stop": _nullable({"anyOf": [stop_string, {"type": "array", "maxItems": lim.max_stop,
                                                   "items": stop_string}],
                           "description": "Stop strings, cut in the gateway."}),
        "stop_token_ids": _nullable({"type": "array", "maxItems": lim.max_stop_token_ids,
                                     "items": {"type": "integer", "minimum": 0, "maximum": INT32_MAX},
                                     "description": "MFS extension: token ids that end the generation."}),
        "ignore_eos": _nullable({"type": "boolean", "description": "MFS extension: keep going past eos."}),
        "session_id": {**session, "description": "MFS extension: KV-cache affinity key (wins over 'user')."},
        "user": session,
        "mfs": {"description": "MFS multi-level sampling; what it takes depends on 'model': see anyOf."},
        # not supported: only the values that mean "off" are accepted (others: 400 unsupported_parameter)
        "n": _nullable({"type": "integer", "minimum": 1, "maximum": MAX_N,
                        "description": f"Choices (at most {MAX_N}): each its own request sharing the prompt's KV "
                                       "through the prefix cache, choice i seeded with seed + i; usage counts the "
                                       "prompt once and every choice's tokens; streamed chunks carry each "
                                       "choice's index."}),
        "best_of": {"enum": [None, 1], "description": "Only 1."},
        "frequency_penalty": _nullable({"type": "number", "minimum": -2, "maximum": 2,
                                        "description": "Subtracted from a token's logit once per time it occurs "
                                                       "in the output so far."}),
        "presence_penalty": _nullable({"type": "number", "minimum": -2, "maximum": 2,
                                       "description": "Subtracted from the logit of every token in the output "
                                                      "so far."}),
        "repetition_penalty": _nullable({"type": "number", "exclusiveMinimum": 0, "maximum": MAX_REPETITION,
                                         "description": "MFS/vLLM extension (Hugging Face semantics): the logit of "
                                                        "a token in the prompt or the output is divided by it when "
                                                        "positive, multiplied when not (1: off)."}),
        "min_p": _nullable({"type": "number", "minimum": 0, "maximum": 1,
                            "description": "MFS/vLLM extension: sample only tokens whose probability is at least "
                                           "min_p times the most likely token's (after temperature)."}),
        "logit_bias": _nullable({"type": "object", "maxProperties": MAX_LOGIT_BIAS,
                                 "propertyNames": {"pattern": id_pattern(f.vocab - 1)},
                                 "additionalProperties": {"type": "number", "minimum": -100, "maximum": 100},
                                 "description": "Token id (a decimal string) -> a bias added to its logit before "
                                                "penalties and sampling."}),
        **_structured(),
        "tools": {"enum": FALSY, "description": "Not supported: only an empty value."},
        "functions": {"enum": FALSY, "description": "Not supported: only an empty value."},
        # refused unless "off" (gateway.refused.REFUSED): a 400 unsupported_parameter, never ignored
        **{name: {"enum": list(off), "description": f"Not supported ({why}): only the values meaning off."}
           for name, (off, why) in REFUSED.items()},
    }


STRUCTURED_NOTE = (" Structured output: every sampled token is masked to what the grammar allows next (xgrammar, in "
                   "the worker; after logit_bias and penalties, before temperature, top-k/p and min-p); eos only "
                   "where the grammar may end, and the output ends (finish_reason stop) once it is complete. "
                   "JSON is written compactly (no free whitespace). At most one of response_format (json_object "
                   "or json_schema), guided_json, guided_regex, guided_choice, and not with ignore_eos true (else 400 "
                   "conflicting_parameters); with "
                   "mfs.speculative the drafts are checked against the mask (exact). A schema, regex or choice "
                   "list that does not compile is a 400 naming the field (code invalid_grammar). "
                   "Log-probabilities stay the raw model's.")


def _structured() -> dict:
    schema = {"type": "object", "description": "A JSON schema (the draft 2020-12 subset xgrammar follows; one it "
                                               "cannot compile is a 400 invalid_grammar)."}
    json_schema = _obj({"name": {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"}, "schema": schema,
                        "strict": _nullable({"type": "boolean", "description": "Any value: the schema is always "
                                                                               "enforced."}),
                        "description": _nullable({"type": "string"})}, ["name", "schema"])
    return {
        "response_format": _nullable({"anyOf": [
            _obj({"type": {"const": "text"}}, ["type"], description="Plain text (the default)."),
            _obj({"type": {"const": "json_object"}}, ["type"], description="Any JSON object."),
            _obj({"type": {"const": "json_schema"}, "json_schema": json_schema}, ["type", "json_schema"],
                 description="JSON following json_schema.schema.")],
            "description": "The output's format." + STRUCTURED_NOTE}),
        "guided_json": _nullable({**schema, "description": "vLLM extension: JSON following this schema."
                                                           + STRUCTURED_NOTE}),
        "guided_regex": _nullable({"type": "string", "minLength": 1, "maxLength": MAX_GRAMMAR_CHARS,
                                   "description": "vLLM extension: the output matches this regular expression."
                                                  + STRUCTURED_NOTE}),
        "guided_choice": _nullable({"type": "array", "minItems": 1, "maxItems": MAX_CHOICES,
                                    "items": {"type": "string", "minLength": 1},
                                    "description": "vLLM extension: the output is exactly one of these strings."
                                                   + STRUCTURED_NOTE}),
    }


LOGPROBS_NOTE = ("Log-probabilities are the log-softmax of the raw logits of the tier that produced each "
                 "token (before temperature, penalties and logit_bias).")


def _chat_params() -> dict:
    return {
        "echo": {"enum": [None, False, 0], "description": "Not on chat (a completions parameter)."},
        "logprobs": _nullable({"type": "boolean", "description": "Return each output token's log-probability "
                                                                 "in choices[].logprobs.content. " + LOGPROBS_NOTE}),
        "top_logprobs": _nullable({"type": "integer", "minimum": 0, "maximum": MAX_LOGPROBS,
                                   "description": "Most likely tokens per position; needs logprobs true."}),
    }


# top_logprobs (not null) needs logprobs true
_TOP_NEEDS_LOGPROBS = {"if": {"properties": {"top_logprobs": {"type": "integer"}}, "required": ["top_logprobs"]},
                       "then": {"properties": {"logprobs": {"const": True}}, "required": ["logprobs"]}}


_ECHO = {"properties": {"echo": {"const": True}}, "required": ["echo"]}
# max_tokens 0 (the one read: max_completion_tokens wins) needs echo
_ZERO_NEEDS_ECHO = {"allOf": [
    {"if": {"properties": {"max_completion_tokens": {"const": 0}}, "required": ["max_completion_tokens"]},
     "then": _ECHO},
    {"if": {"properties": {"max_tokens": {"const": 0}, "max_completion_tokens": {"type": "null"}},
            "required": ["max_tokens"]},
     "then": _ECHO}]}


def _completion_params(f: _Facts) -> dict:
    common = _common_params(f)
    zero = "; 0 with echo: the prompt scored, nothing generated"
    return {
        "logprobs": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": MAX_LOGPROBS},
                               {"enum": [None, False]}],
                     "description": "Return each token's log-probability and this many most likely tokens per "
                                    "position (null or false: off). " + LOGPROBS_NOTE},
        "echo": _nullable({"type": "boolean", "description": "Return the prompt before the completion, with its "
                                                             "tokens' log-probabilities when logprobs is set (the "
                                                             "first token's is null)."}),
        "max_tokens": {"anyOf": [{**common["max_tokens"]["anyOf"][0], "minimum": 0}, {"type": "null"}],
                       "description": common["max_tokens"]["anyOf"][0]["description"] + zero + "."},
        "max_completion_tokens": {"anyOf": [{**common["max_tokens"]["anyOf"][0], "minimum": 0}, {"type": "null"}],
                                  "description": "Like max_tokens, and wins over it" + zero + "."},
    }


def _request(f: _Facts, required: str, first: dict, description: str, extra: dict, **rules) -> dict:
    props = {"model": _ref("ModelId"), required: first, **_common_params(f), **extra}
    # Every OpenAI field is described (honoured, or refused unless off); a field the description does not
    # name is not read (the object stays open, as before: clients and SDKs add their own)
    return _obj(props, ["model", required], closed=False, anyOf=_per_model(f), description=description,
                **rules)


def _chat_request(f: _Facts) -> dict:
    lim = f.limits
    text = {"type": "string", "maxLength": lim.max_prompt_chars}
    part = _obj({"type": {"const": "text"}, "text": text}, ["type", "text"], closed=False)
    content = {"anyOf": [text, {"type": "array", "items": part}]}
    message = {"anyOf": [
        _obj({"role": {"enum": [r for r in ROLES if r != "assistant"]}, "content": content},
             ["role", "content"], closed=False),
        _obj({"role": {"const": "assistant"}, "content": _nullable(content)}, ["role"], closed=False),
    ], "description": "Text only: a string or text parts (joined with newlines). Other fields are ignored."}
    messages = {"type": "array", "minItems": 1, "maxItems": lim.max_messages, "items": message,
                "description": f"All contents together at most {lim.max_prompt_chars} characters."}
    return _request(f, "messages", messages, "OpenAI's chat completion request, text only.",
                    _chat_params(), **_TOP_NEEDS_LOGPROBS)


def _completion_request(f: _Facts) -> dict:
    lim = f.limits
    text = {"type": "string", "minLength": 1, "maxLength": lim.max_prompt_chars}
    ids = {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0, "maximum": f.vocab - 1}}
    if f.max_prompt_tokens:
        ids["maxItems"] = f.max_prompt_tokens
    prompt = {"anyOf": [text, ids, {"type": "array", "minItems": 1, "maxItems": 1,
                                    "items": {"anyOf": [text, ids]}}],
              "description": "Text or token ids; a batch of one is accepted, larger batches are not."}
    return _request(f, "prompt", prompt, "OpenAI's (legacy) completion request, one prompt.",
                    _completion_params(f), **_ZERO_NEEDS_ECHO)


# ---- responses --------------------------------------------------------------------------------
def _schemas(f: _Facts) -> dict:
    count = {"type": "integer", "minimum": 0}
    tier = _ref("TierModelId")
    usage = _obj({
        "prompt_tokens": count, "completion_tokens": count, "total_tokens": count,
        "prompt_tokens_details": _obj({"cached_tokens": {"type": "integer", "minimum": 1}}, ["cached_tokens"],
                                      description="Present when part of the prompt came from the KV cache."),
        "completion_tokens_details": _obj({"accepted_prediction_tokens": count,
                                           "rejected_prediction_tokens": count},
                                          ["accepted_prediction_tokens", "rejected_prediction_tokens"],
                                          description="Present when the request speculated."),
        "mfs_draft": _obj({"draft_model": _nullable(tier), "proposed": {"type": "integer", "minimum": 1},
                           "accepted": count}, ["draft_model", "proposed", "accepted"],
                          description="Present when the request speculated."),
    }, ["prompt_tokens", "completion_tokens", "total_tokens"])
    served = _obj({"tiers": {"type": "array", "minItems": 1, "items": tier},
                   "escalations": count}, ["tiers", "escalations"],
                  description="MFS extension: the tiers that produced the tokens, in order.")
    finish = {"enum": FINISH_REASONS}
    number = {"type": "number"}
    byte_list = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 255}}
    top_entry = _obj({"token": {"type": "string"}, "logprob": number, "bytes": byte_list},
                     ["token", "logprob", "bytes"])
    chat_lp = _nullable(_obj({
        "content": {"type": "array", "items": _obj({
            "token": {"type": "string"}, "logprob": number, "bytes": byte_list,
            "top_logprobs": {"type": "array", "maxItems": MAX_LOGPROBS, "items": top_entry}},
            ["token", "logprob", "bytes", "top_logprobs"])},
        "refusal": {"type": "null"}}, ["content", "refusal"],
        description="Present (not null) when the request set logprobs: one entry per output token."))
    cmpl_lp = _nullable(_obj({
        "tokens": {"type": "array", "items": {"type": "string"}},
        "token_logprobs": {"type": "array", "items": _nullable(number)},
        "top_logprobs": {"type": "array", "items": _nullable({"type": "object", "additionalProperties": number,
                                                              "maxProperties": MAX_LOGPROBS})},
        "text_offset": {"type": "array", "items": {"type": "integer", "minimum": 0}}},
        ["tokens", "token_logprobs", "top_logprobs", "text_offset"],
        description="Present (not null) when the request set logprobs: one entry per token (null for the "
                    "first prompt token of an echo)."))
    base = {"created": {"type": "integer"}, "model": tier}
    chat_id = {"type": "string", "pattern": "^chatcmpl-[0-9a-f]{32}$"}
    cmpl_id = {"type": "string", "pattern": "^cmpl-[0-9a-f]{32}$"}
    one = {"type": "array", "minItems": 1, "maxItems": MAX_N}  # n choices
    index = {"type": "integer", "minimum": 0, "maximum": MAX_N - 1}

    def chunk(obj: str, rid: dict, choice: dict) -> dict:
        return _obj({"id": rid, "object": {"const": obj}, **base,
                     "choices": {"type": "array", "maxItems": 1, "items": choice},
                     "usage": _nullable(_ref("Usage")), "mfs": _ref("Served")},
                    ["id", "object", "created", "model", "choices"],
                    anyOf=[{"properties": {"choices": {"minItems": 1}, "usage": {"type": "null"}}},
                           {"properties": {"choices": {"maxItems": 0}, "usage": _ref("Usage")},
                            "required": ["usage"]}],
                    description="A token chunk (usage null when stream_options.include_usage), or the "
                                "final usage chunk (no choices). The chunk with finish_reason carries mfs.")

    models = _obj({"id": {"enum": f.tier_ids + [f.family]}, "object": {"const": "model"},
                   "created": {"type": "integer"}, "owned_by": {"type": "string"}},
                  ["id", "object", "created", "owned_by"])
    return {
        "ModelId": {"enum": f.tier_ids + [f.family, "auto"],
                    "description": f"A tier of the {f.family} family, or '{f.family}' / 'auto': the gateway "
                                   "picks the tier from the prompt."},
        "TierModelId": {"enum": list(f.tier_ids)},
        "MultiLevel": _multilevel(_speculative(f, len(f.tier_ids) - 2 if len(f.tier_ids) > 1 else None),
                                  _cascade(f)),
        "ChatCompletionRequest": _chat_request(f),
        "CompletionRequest": _completion_request(f),
        "Usage": usage,
        "Served": served,
        "ChatCompletion": _obj({
            "id": chat_id, "object": {"const": "chat.completion"}, **base,
            "choices": {**one, "items": _obj({
                "index": index,
                "message": _obj({"role": {"const": "assistant"}, "content": {"type": "string"}},
                                ["role", "content"]),
                "logprobs": chat_lp, "finish_reason": finish},
                ["index", "message", "logprobs", "finish_reason"])},
            "usage": _ref("Usage"), "mfs": _ref("Served")},
            ["id", "object", "created", "model", "choices", "usage", "mfs"]),
        "TextCompletion": _obj({
            "id": cmpl_id, "object": {"const": "text_completion"}, **base,
            "choices": {**one, "items": _obj({
                "index": index, "text": {"type": "string"}, "logprobs": cmpl_lp,
                "finish_reason": finish}, ["index", "text", "logprobs", "finish_reason"])},
            "usage": _ref("Usage"), "mfs": _ref("Served")},
            ["id", "object", "created", "model", "choices", "usage", "mfs"]),
        "ChatCompletionChunk": chunk("chat.completion.chunk", chat_id, _obj({
            "index": index,
            "delta": _obj({"role": {"const": "assistant"}, "content": {"type": "string"}}),
            "logprobs": chat_lp, "finish_reason": _nullable(finish)},
            ["index", "delta", "logprobs", "finish_reason"])),
        "TextCompletionChunk": chunk("text_completion", cmpl_id, _obj({
            "index": index, "text": {"type": "string"}, "logprobs": cmpl_lp,
            "finish_reason": _nullable(finish)}, ["index", "text", "logprobs", "finish_reason"])),
        "Model": models,
        "ModelList": _obj({"object": {"const": "list"}, "data": {"type": "array", "items": _ref("Model")}},
                          ["object", "data"]),
        "Health": {"anyOf": [
            _obj({"status": {"const": "ok"}, "workers": {"type": "integer", "minimum": 1},
                  "gateway_id": {"type": "string"}}, ["status", "workers", "gateway_id"]),
            _obj({"status": {"const": "no_workers"}, "workers": {"const": 0}, "gateway_id": {"type": "string"}},
                 ["status", "workers", "gateway_id"]),
            _obj({"status": {"const": "error"}, "workers": {"const": 0}, "error": {"type": "string"}},
                 ["status", "workers", "error"])]},
        "Error": _obj({"message": {"type": "string", "minLength": 1},
                       "type": {"enum": ERROR_TYPES},
                       "param": {"type": ["string", "null"],
                                 "description": "The request field at fault, e.g. 'max_tokens', "
                                                "'messages[0].role', 'mfs.speculative.draft'."},
                       "code": {"type": ["string", "null"],
                                "description": "e.g. context_length_exceeded, unsupported_parameter, "
                                               "model_not_found, invalid_api_key, rate_limit_exceeded, "
                                               "backend_unavailable, timeout."}},
                      ["message", "type", "param", "code"]),
        "ErrorResponse": _obj({"error": _ref("Error")}, ["error"], description="OpenAI's error shape."),
    }


def _error(description: str, *headers: str) -> dict:
    out = {"description": description, "content": {"application/json": {"schema": _ref("ErrorResponse")}}}
    if headers:
        out["headers"] = {h: {"$ref": f"#/components/headers/{h}"} for h in headers}
    return out


def _responses(f: _Facts) -> dict:
    return {
        "BadRequest": _error(
            "Malformed JSON or an invalid, unsupported or out-of-bounds parameter ('param' names it); also "
            "a prompt over the context (context_length_exceeded) or over the prompt bounds (prompt_too_long)."),
        "Unauthorized": _error("API keys are configured and the request has none or a wrong one "
                               "(invalid_api_key).", "WWW-Authenticate"),
        "NotFound": _error("Unknown model (model_not_found) or unknown path."),
        "PayloadTooLarge": _error(f"The body is over {f.max_body_bytes} bytes (request_too_large)."),
        "RateLimited": _error(f"Over this key's requests or tokens per minute (rate_limit_exceeded), or "
                              f"{f.max_inflight} requests in flight on this gateway (too_many_requests).",
                              "Retry-After"),
        "Unavailable": _error("No live worker (no_live_worker), Redis unreachable (backend_unavailable), or "
                              "the token stream broke (stream_interrupted, redis_interrupted): retry.",
                              "Retry-After"),
        "Timeout": _error(f"The request did not finish within {f.request_timeout_s:g} s (timeout)."),
        "ServerError": _error("Any other failure, in the same shape."),
    }


def _headers() -> dict:
    def h(desc: str) -> dict:
        return {"description": desc, "schema": {"type": "string"}}
    return {
        "Retry-After": h("Seconds to wait before retrying."),
        "WWW-Authenticate": h("'Bearer'."),
        "X-Request-Id": h("The request id (also the response's 'id')."),
        **{f"x-ratelimit-{what}-{unit}": h(f"{what} of this key's {unit} per minute (with --rpm / --tpm).")
           for what in ("limit", "remaining", "reset") for unit in ("requests", "tokens")},
    }


def _err_refs(*statuses: int) -> dict:
    names = {400: "BadRequest", 401: "Unauthorized", 404: "NotFound", 413: "PayloadTooLarge",
             429: "RateLimited", 503: "Unavailable", 504: "Timeout"}
    out = {str(s): {"$ref": f"#/components/responses/{names[s]}"} for s in statuses}
    out["default"] = {"$ref": "#/components/responses/ServerError"}
    return out


def _completion_op(op_id: str, summary: str, request: str, final: str, chunk: str) -> dict:
    ratelimit = {f"x-ratelimit-{w}-{u}": {"$ref": f"#/components/headers/x-ratelimit-{w}-{u}"}
                 for w in ("limit", "remaining", "reset") for u in ("requests", "tokens")}
    return {"post": {
        "operationId": op_id, "summary": summary, "tags": ["completions"],
        "requestBody": {"required": True, "content": {"application/json": {"schema": _ref(request)}}},
        "responses": {
            "200": {"description": f"A {final} object, or with stream=true server-sent events: "
                                   "'data: <chunk JSON>' per event, an error object if the request fails "
                                   "mid-stream, and 'data: [DONE]' last.",
                    "headers": {**ratelimit, "X-Request-Id": {"$ref": "#/components/headers/X-Request-Id"}},
                    "content": {
                        "application/json": {"schema": _ref(final)},
                        "text/event-stream": {
                            # OpenAPI 3.1 reads `schema` of an event stream as one event's (as 3.2's
                            # `itemSchema` says outright): its fields, not the stream's text
                            "schema": _SSE_EVENT,
                            # what each `data:` line but the last ('[DONE]') holds
                            "x-event-data": {"anyOf": [_ref(chunk), _ref("ErrorResponse")]}}}},
            **_err_refs(400, 401, 404, 413, 429, 503, 504)}}}


# One Server-Sent Event as a client's parser yields it.
_SSE_EVENT = {
    "type": "object", "required": ["data"],
    "properties": {
        "data": {"type": "string", "description": "a JSON chunk (x-event-data), or [DONE] last"},
        "event": {"type": "string"}, "id": {"type": "string"}, "retry": {"type": "integer"}}}


def build(svc, cfg, *, auth: bool) -> dict:
    """The document for a gateway with Service ``svc`` and GatewayConfig ``cfg``; ``auth``: API keys
    are configured."""
    f = _Facts(svc, cfg)
    open_ = {"security": []}
    guarded = _err_refs(401, 429, 503)
    return {
        "openapi": "3.1.0",
        "jsonSchemaDialect": DIALECT,
        "info": {
            "title": "MFS gateway",
            "version": _version(),
            "description": f"OpenAI-compatible API of an MFS gateway serving the {f.family} family "
                           f"(tiers: {', '.join(f.tier_ids)}). Errors are always OpenAI's "
                           "{\"error\": {message, type, param, code}}. With API keys configured every "
                           "path but /health and /openapi.json needs 'Authorization: Bearer <key>'.",
        },
        "security": [{"bearerAuth": []}] if auth else [{}],
        "paths": {
            "/v1/models": {"get": {
                "operationId": "listModels", "summary": "The tier model ids and the family id.",
                "tags": ["models"],
                "responses": {"200": {"description": "The models.",
                                      "content": {"application/json": {"schema": _ref("ModelList")}}},
                              **guarded}}},
            "/v1/models/{model}": {"get": {
                "operationId": "retrieveModel", "summary": "One model.", "tags": ["models"],
                "parameters": [{"name": "model", "in": "path", "required": True,
                                "schema": {"type": "string"}}],
                "responses": {"200": {"description": "The model.",
                                      "content": {"application/json": {"schema": _ref("Model")}}},
                              **_err_refs(401, 404, 429, 503)}}},
            "/v1/chat/completions": _completion_op(
                "createChatCompletion", "Chat completion (text only).", "ChatCompletionRequest",
                "ChatCompletion", "ChatCompletionChunk"),
            "/v1/completions": _completion_op(
                "createCompletion", "Completion of a text or token-id prompt.",
                "CompletionRequest", "TextCompletion", "TextCompletionChunk"),
            "/health": {"get": {
                "operationId": "health", "summary": "Liveness: 200 with a live worker, else 503.",
                "tags": ["operations"], **open_,
                "responses": {
                    "200": {"description": "At least one live worker.",
                            "content": {"application/json": {"schema": _ref("Health")}}},
                    "503": {"description": "No live worker, or Redis unreachable.",
                            "content": {"application/json": {"schema": _ref("Health")}}}}}},
            "/metrics": {"get": {
                "operationId": "metrics", "summary": "Prometheus metrics (text exposition format).",
                "tags": ["operations"],
                "responses": {"200": {"description": "The metrics.",
                                      "content": {"text/plain": {"schema": {"type": "string"}}}},
                              **guarded}}},
            PATH: {"get": {
                "operationId": "openapi", "summary": "This document.", "tags": ["operations"], **open_,
                "responses": {"200": {"description": "The OpenAPI 3.1 description of this gateway.",
                                      "content": {"application/json": {"schema": {"type": "object"}}}}}}},
        },
        "components": {
            "schemas": _schemas(f),
            "responses": _responses(f),
            "headers": _headers(),
            "securitySchemes": {"bearerAuth": {
                "type": "http", "scheme": "bearer",
                "description": "An API key ('Authorization: Bearer <key>'); needed only when the gateway "
                               "has keys (MFS_API_KEYS / --api-keys-file)."}},
        },
    }

