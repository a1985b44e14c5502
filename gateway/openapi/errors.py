"""Errors in the gateway's OpenAPI document: OpenAI's error object, the error responses each status
stands for, and the references an operation lists."""
from __future__ import annotations

from gateway.openapi.facts import Facts
from gateway.openapi.schema import obj, ref

ERROR_TYPES = ["invalid_request_error", "authentication_error", "permission_error", "not_found_error",
               "timeout_error", "rate_limit_error", "service_unavailable", "server_error"]


def error_schemas() -> dict:
    """The components' schemas of an error, in OpenAI's shape."""
    return {
        "Error": obj({"message": {"type": "string", "minLength": 1},
                       "type": {"enum": ERROR_TYPES},
                       "param": {"type": ["string", "null"],
                                 "description": "The request field at fault, e.g. 'max_tokens', "
                                                "'messages[0].role', 'mfs.speculative.draft'."},
                       "code": {"type": ["string", "null"],
                                "description": "e.g. context_length_exceeded, unsupported_parameter, "
                                               "model_not_found, invalid_api_key, rate_limit_exceeded, "
                                               "backend_unavailable, timeout."}},
                      ["message", "type", "param", "code"]),
        "ErrorResponse": obj({"error": ref("Error")}, ["error"], description="OpenAI's error shape."),
    }


def _error(description: str, *headers: str) -> dict:
    out = {"description": description, "content": {"application/json": {"schema": ref("ErrorResponse")}}}
    if headers:
        out["headers"] = {h: {"$ref": f"#/components/headers/{h}"} for h in headers}
    return out


def error_responses(f: Facts) -> dict:
    """The components' responses: every error status the gateway answers, each an ErrorResponse."""
    return {
        "BadRequest": _error(
            "Malformed JSON or an invalid, unsupported or out-of-bounds parameter ('param' names it); also "
            "a prompt over the context (context_length_exceeded) or over the prompt bounds (prompt_too_long)."),
        "Unauthorized": _error("API keys are configured and the request has none or a wrong one "
                               "(invalid_api_key).", "WWW-Authenticate"),
        "NotFound": _error("Unknown model (model_not_found) or unknown path."),
        "PayloadTooLarge": _error(f"The body is over {f.max_body_bytes} bytes (request_too_large)."),
        "RateLimited": _error(f"Over this key's requests or tokens per minute (rate_limit_exceeded), the "
                              f"gateway's queue full: its --max-waiting / --max-waiting-per-tier bound or an "
                              f"expected wait past --max-queue-wait (queue_full), or {f.max_inflight} requests in "
                              f"flight on this gateway (too_many_requests). Retry-After says when to retry.",
                              "Retry-After"),
        "Unavailable": _error("No live worker (no_live_worker), Redis unreachable (backend_unavailable), the "
                              "token stream broke (stream_interrupted, redis_interrupted), the request's worker "
                              "was lost with no other to take it (worker_lost), or this gateway lost Redis "
                              "long enough for the scheduler to cancel its requests (gateway_lost): retry.",
                              "Retry-After"),
        "Timeout": _error(f"The request did not finish within {f.request_timeout_s:g} s (timeout)."),
        "ServerError": _error("Any other failure, in the same shape."),
    }


def err_refs(*statuses: int) -> dict:
    names = {400: "BadRequest", 401: "Unauthorized", 404: "NotFound", 413: "PayloadTooLarge",
             429: "RateLimited", 503: "Unavailable", 504: "Timeout"}
    out = {str(s): {"$ref": f"#/components/responses/{names[s]}"} for s in statuses}
    out["default"] = {"$ref": "#/components/responses/ServerError"}
    return out
