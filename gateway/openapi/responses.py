"""What the gateway answers, in its OpenAPI document: completions and their stream chunks, usage, the
``mfs`` served-by record, log-probabilities, models and health, as the gateway writes them; and the
headers it sends."""
from __future__ import annotations

from core.protocol import EXECUTION_PATHS
from gateway.openai_api import MAX_LOGPROBS, MAX_N
from gateway.openapi.facts import Facts
from gateway.openapi.schema import nullable, obj, ref

FINISH_REASONS = ["stop", "length"]


def response_schemas(f: Facts) -> dict:
    """The components' schemas of what the gateway answers: completions, stream chunks, usage, models and
    health (errors: gateway/openapi/errors.py)."""
    count = {"type": "integer", "minimum": 0}
    tier = ref("TierModelId")
    usage = obj({
        "prompt_tokens": count, "completion_tokens": count, "total_tokens": count,
        "prompt_tokens_details": obj({"cached_tokens": {"type": "integer", "minimum": 1}}, ["cached_tokens"],
                                      description="Present when part of the prompt came from the KV cache."),
        "completion_tokens_details": obj({"accepted_prediction_tokens": count,
                                           "rejected_prediction_tokens": count},
                                          ["accepted_prediction_tokens", "rejected_prediction_tokens"],
                                          description="Present when the request speculated."),
        "mfs_draft": obj({"draft_model": nullable(tier), "proposed": {"type": "integer", "minimum": 1},
                           "accepted": count}, ["draft_model", "proposed", "accepted"],
                          description="Present when the request speculated."),
    }, ["prompt_tokens", "completion_tokens", "total_tokens"])
    served = obj({"tiers": {"type": "array", "minItems": 1, "items": tier},
                   "escalations": count,
                   "paths": {"type": "array", "items": {"enum": list(EXECUTION_PATHS)},
                             "description": "the workers' execution paths that computed the tokens, in order "
                                            "of first use (compiled graphs may round otherwise than eager)"}},
                  ["tiers", "escalations"],
                  description="MFS extension: the tiers that produced the tokens, in order.")
    finish = {"enum": FINISH_REASONS}
    number = {"type": "number"}
    byte_list = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 255}}
    top_entry = obj({"token": {"type": "string"}, "logprob": number, "bytes": byte_list},
                     ["token", "logprob", "bytes"])
    chat_lp = nullable(obj({
        "content": {"type": "array", "items": obj({
            "token": {"type": "string"}, "logprob": number, "bytes": byte_list,
            "top_logprobs": {"type": "array", "maxItems": MAX_LOGPROBS, "items": top_entry}},
            ["token", "logprob", "bytes", "top_logprobs"])},
        "refusal": {"type": "null"}}, ["content", "refusal"],
        description="Present (not null) when the request set logprobs: one entry per output token."))
    cmpl_lp = nullable(obj({
        "tokens": {"type": "array", "items": {"type": "string"}},
        "token_logprobs": {"type": "array", "items": nullable(number)},
        "top_logprobs": {"type": "array", "items": nullable({"type": "object", "additionalProperties": number,
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

    def chunk(kind: str, rid: dict, choice: dict) -> dict:
        return obj({"id": rid, "object": {"const": kind}, **base,
                     "choices": {"type": "array", "maxItems": 1, "items": choice},
                     "usage": nullable(ref("Usage")), "mfs": ref("Served")},
                    ["id", "object", "created", "model", "choices"],
                    anyOf=[{"properties": {"choices": {"minItems": 1}, "usage": {"type": "null"}}},
                           {"properties": {"choices": {"maxItems": 0}, "usage": ref("Usage")},
                            "required": ["usage"]}],
                    description="A token chunk (usage null when stream_options.include_usage), or the "
                                "final usage chunk (no choices). The chunk with finish_reason carries mfs.")

    models = obj({"id": {"enum": f.tier_ids + [f.family]}, "object": {"const": "model"},
                   "created": {"type": "integer"}, "owned_by": {"type": "string"}},
                  ["id", "object", "created", "owned_by"])
    return {
        "TierModelId": {"enum": list(f.tier_ids)},
        "Usage": usage,
        "Served": served,
        "ChatCompletion": obj({
            "id": chat_id, "object": {"const": "chat.completion"}, **base,
            "choices": {**one, "items": obj({
                "index": index,
                "message": obj({"role": {"const": "assistant"}, "content": {"type": "string"}},
                                ["role", "content"]),
                "logprobs": chat_lp, "finish_reason": finish},
                ["index", "message", "logprobs", "finish_reason"])},
            "usage": ref("Usage"), "mfs": ref("Served")},
            ["id", "object", "created", "model", "choices", "usage", "mfs"]),
        "TextCompletion": obj({
            "id": cmpl_id, "object": {"const": "text_completion"}, **base,
            "choices": {**one, "items": obj({
                "index": index, "text": {"type": "string"}, "logprobs": cmpl_lp,
                "finish_reason": finish}, ["index", "text", "logprobs", "finish_reason"])},
            "usage": ref("Usage"), "mfs": ref("Served")},
            ["id", "object", "created", "model", "choices", "usage", "mfs"]),
        "ChatCompletionChunk": chunk("chat.completion.chunk", chat_id, obj({
            "index": index,
            "delta": obj({"role": {"const": "assistant"}, "content": {"type": "string"}}),
            "logprobs": chat_lp, "finish_reason": nullable(finish)},
            ["index", "delta", "logprobs", "finish_reason"])),
        "TextCompletionChunk": chunk("text_completion", cmpl_id, obj({
            "index": index, "text": {"type": "string"}, "logprobs": cmpl_lp,
            "finish_reason": nullable(finish)}, ["index", "text", "logprobs", "finish_reason"])),
        "Model": models,
        "ModelList": obj({"object": {"const": "list"}, "data": {"type": "array", "items": ref("Model")}},
                          ["object", "data"]),
        "Health": {"anyOf": [
            obj({"status": {"const": "ok"}, "workers": {"type": "integer", "minimum": 1},
                  "gateway_id": {"type": "string"}}, ["status", "workers", "gateway_id"]),
            obj({"status": {"const": "no_workers"}, "workers": {"const": 0}, "gateway_id": {"type": "string"}},
                 ["status", "workers", "gateway_id"]),
            obj({"status": {"const": "error"}, "workers": {"const": 0}, "error": {"type": "string"}},
                 ["status", "workers", "error"])]},
    }


def response_headers() -> dict:
    """The components' headers: retry and auth hints, the request id and the rate limits."""
    def h(desc: str) -> dict:
        return {"description": desc, "schema": {"type": "string"}}
    return {
        "Retry-After": h("Seconds to wait before retrying."),
        "WWW-Authenticate": h("'Bearer'."),
        "X-Request-Id": h("The request id (also the response's 'id')."),
        **{f"x-ratelimit-{what}-{unit}": h(f"{what} of this key's {unit} per minute (with --rpm / --tpm).")
           for what in ("limit", "remaining", "reset") for unit in ("requests", "tokens")},
    }
