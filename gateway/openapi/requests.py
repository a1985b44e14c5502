"""The request bodies in the gateway's OpenAPI document: chat and completion requests, every field
OpenAI defines (honoured, or refused unless off), exactly as ``gateway.openai_api`` and the modules beside
it validate them; the ``mfs`` field's schema is gateway/openapi/multilevel.py's."""
from __future__ import annotations

from core.params import INT32_MAX, PARAMS, body_params
from core.sampling import MAX_BIAS, MAX_GRAMMAR_CHARS, MAX_LOGIT_BIAS
from gateway.openai_api import MAX_N, ROLES
from gateway.openapi.facts import Facts
from gateway.openapi.multilevel import multilevel_schema, per_model
from gateway.openapi.schema import bounds_schema, nullable, num, obj, param_schema, ref
from gateway.refused import REFUSED
from gateway.structured import MAX_CHOICES

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


def _declared(endpoint: str) -> dict:
    return {p.name: param_schema(p) for p in body_params(endpoint)}


def _common_params(f: Facts) -> dict:
    lim = f.limits
    declared = bounds_schema(PARAMS["max_tokens"])
    max_tokens = nullable({**declared, "maximum": lim.max_tokens_cap or declared["maximum"],
                            "description": "Tokens to generate at most; prompt + max_tokens must fit the "
                                           "context (else 400 context_length_exceeded)."})
    stop_string = {"type": "string", "minLength": 1, "maxLength": lim.max_stop_chars}
    session = nullable({"type": "string", "maxLength": lim.max_session_chars,
                         "description": "KV-cache affinity key (valid Unicode; an empty string is none)."})
    return {
        "max_tokens": max_tokens,
        "max_completion_tokens": {**max_tokens, "description": "Like max_tokens, and wins over it."},
        "stream": nullable({"type": "boolean", "description": "Answer as server-sent events."}),
        "stream_options": nullable(obj({"include_usage": nullable({"type": "boolean"})}, closed=False,
                                         description="Read only when streaming.")),
        "stop": nullable({"anyOf": [stop_string, {"type": "array", "maxItems": lim.max_stop,
                                                   "items": stop_string}],
                           "description": "Stop strings, cut in the gateway."}),
        "stop_token_ids": nullable({"type": "array", "maxItems": lim.max_stop_token_ids,
                                     "items": {"type": "integer", "minimum": 0, "maximum": INT32_MAX},
                                     "description": "MFS extension: token ids that end the generation."}),
        "session_id": {**session, "description": "MFS extension: KV-cache affinity key (wins over 'user')."},
        "user": session,
        "mfs": {"description": "MFS multi-level sampling; what it takes depends on 'model': see anyOf."},
        # not supported: only the values that mean "off" are accepted (others: 400 unsupported_parameter)
        "n": nullable({"type": "integer", "minimum": 1, "maximum": MAX_N,
                        "description": f"Choices (at most {MAX_N}): each its own request sharing the prompt's KV "
                                       "through the prefix cache, choice i seeded with seed + i; usage counts the "
                                       "prompt once and every choice's tokens; streamed chunks carry each "
                                       "choice's index."}),
        "best_of": {"enum": [None, 1], "description": "Only 1."},
        "logit_bias": nullable({"type": "object", "maxProperties": MAX_LOGIT_BIAS,
                                 "propertyNames": {"pattern": id_pattern(f.vocab - 1)},
                                 "additionalProperties": {"type": "number", "minimum": num(-MAX_BIAS),
                                                           "maximum": num(MAX_BIAS)},
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
    json_schema = obj({"name": {"type": "string", "pattern": "^[A-Za-z0-9_-]{1,64}$"}, "schema": schema,
                        "strict": nullable({"type": "boolean", "description": "Any value: the schema is always "
                                                                               "enforced."}),
                        "description": nullable({"type": "string"})}, ["name", "schema"])
    return {
        "response_format": nullable({"anyOf": [
            obj({"type": {"const": "text"}}, ["type"], description="Plain text (the default)."),
            obj({"type": {"const": "json_object"}}, ["type"], description="Any JSON object."),
            obj({"type": {"const": "json_schema"}, "json_schema": json_schema}, ["type", "json_schema"],
                 description="JSON following json_schema.schema.")],
            "description": "The output's format." + STRUCTURED_NOTE}),
        "guided_json": nullable({**schema, "description": "vLLM extension: JSON following this schema."
                                                           + STRUCTURED_NOTE}),
        "guided_regex": nullable({"type": "string", "minLength": 1, "maxLength": MAX_GRAMMAR_CHARS,
                                   "description": "vLLM extension: the output matches this regular expression."
                                                  + STRUCTURED_NOTE}),
        "guided_choice": nullable({"type": "array", "minItems": 1, "maxItems": MAX_CHOICES,
                                    "items": {"type": "string", "minLength": 1},
                                    "description": "vLLM extension: the output is exactly one of these strings."
                                                   + STRUCTURED_NOTE}),
    }


LOGPROBS_NOTE = ("Log-probabilities are the log-softmax of the raw logits of the tier that produced each "
                 "token (before temperature, penalties and logit_bias).")


def _chat_params() -> dict:
    return {
        "echo": {"enum": [None, False, 0], "description": "Not on chat (a completions parameter)."},
        "logprobs": nullable({"type": "boolean", "description": "Return each output token's log-probability "
                                                                 "in choices[].logprobs.content. " + LOGPROBS_NOTE}),
        "top_logprobs": nullable({**bounds_schema(PARAMS["logprobs"]),
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


def _completion_params(f: Facts) -> dict:
    common = _common_params(f)
    zero = "; 0 with echo: the prompt scored, nothing generated"
    return {
        "logprobs": {"anyOf": [bounds_schema(PARAMS["logprobs"]),
                               {"enum": [None, False]}],
                     "description": "Return each token's log-probability and this many most likely tokens per "
                                    "position (null or false: off). " + LOGPROBS_NOTE},
        "echo": nullable({"type": "boolean", "description": "Return the prompt before the completion, with its "
                                                             "tokens' log-probabilities when logprobs is set (the "
                                                             "first token's is null)."}),
        "max_tokens": {"anyOf": [{**common["max_tokens"]["anyOf"][0], "minimum": 0}, {"type": "null"}],
                       "description": common["max_tokens"]["anyOf"][0]["description"] + zero + "."},
        "max_completion_tokens": {"anyOf": [{**common["max_tokens"]["anyOf"][0], "minimum": 0}, {"type": "null"}],
                                  "description": "Like max_tokens, and wins over it" + zero + "."},
    }


def _request(f: Facts, endpoint: str, required: str, first: dict, description: str, extra: dict,
             **rules) -> dict:
    props = {"model": ref("ModelId"), required: first, **_common_params(f), **_declared(endpoint), **extra}
    # Every OpenAI field is described (honoured, or refused unless off); a field the description does not
    # name is not read (the object stays open, as before: clients and SDKs add their own)
    return obj(props, ["model", required], closed=False, anyOf=per_model(f), description=description,
                **rules)


def _chat_request(f: Facts) -> dict:
    lim = f.limits
    text = {"type": "string", "maxLength": lim.max_prompt_chars}
    part = obj({"type": {"const": "text"}, "text": text}, ["type", "text"], closed=False)
    content = {"anyOf": [text, {"type": "array", "items": part}]}
    message = {"anyOf": [
        obj({"role": {"enum": [r for r in ROLES if r != "assistant"]}, "content": content},
             ["role", "content"], closed=False),
        obj({"role": {"const": "assistant"}, "content": nullable(content)}, ["role"], closed=False),
    ], "description": "Text only: a string or text parts (joined with newlines). Other fields are ignored."}
    messages = {"type": "array", "minItems": 1, "maxItems": lim.max_messages, "items": message,
                "description": f"All contents together at most {lim.max_prompt_chars} characters."}
    return _request(f, "chat", "messages", messages, "OpenAI's chat completion request, text only.",
                    _chat_params(), **_TOP_NEEDS_LOGPROBS)


def _completion_request(f: Facts) -> dict:
    lim = f.limits
    text = {"type": "string", "minLength": 1, "maxLength": lim.max_prompt_chars}
    ids = {"type": "array", "minItems": 1, "items": {"type": "integer", "minimum": 0, "maximum": f.vocab - 1}}
    if f.max_prompt_tokens:
        ids["maxItems"] = f.max_prompt_tokens
    prompt = {"anyOf": [text, ids, {"type": "array", "minItems": 1, "maxItems": 1,
                                    "items": {"anyOf": [text, ids]}}],
              "description": "Text or token ids; a batch of one is accepted, larger batches are not."}
    return _request(f, "completions", "prompt", prompt, "OpenAI's (legacy) completion request, one prompt.",
                    _completion_params(f), **_ZERO_NEEDS_ECHO)


def request_schemas(f: Facts) -> dict:
    """The components' schemas of the requests: the model id they name, the ``mfs`` extension and the two
    bodies."""
    return {
        "ModelId": {"enum": f.tier_ids + [f.family, "auto"],
                    "description": f"A tier of the {f.family} family, or '{f.family}' / 'auto': the gateway "
                                   "picks the tier from the prompt."},
        "MultiLevel": multilevel_schema(f),
        "ChatCompletionRequest": _chat_request(f),
        "CompletionRequest": _completion_request(f),
    }
