"""The gateway's OpenAPI 3.1 description, served at ``GET /openapi.json`` (no API key needed, like /health):
the document, its paths and operations. Its parts: ``requests`` (the request bodies), ``multilevel`` (the
``mfs`` extension), ``responses`` (what the gateway answers, and its headers), ``errors``, ``schema`` (JSON
Schema helpers, declared parameters as schemas) and ``facts`` (what the document is built from).

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

from gateway.openapi.errors import err_refs, error_responses, error_schemas
from gateway.openapi.facts import Facts
from gateway.openapi.requests import request_schemas
from gateway.openapi.responses import response_headers, response_schemas
from gateway.openapi.schema import ref

PATH = "/openapi.json"
DIALECT = "https://json-schema.org/draft/2020-12/schema"


def _version() -> str:
    try:
        return metadata.version("mfs")
    except metadata.PackageNotFoundError:
        return "0.1.0"


def _completion_op(op_id: str, summary: str, request: str, final: str, chunk: str) -> dict:
    ratelimit = {f"x-ratelimit-{w}-{u}": {"$ref": f"#/components/headers/x-ratelimit-{w}-{u}"}
                 for w in ("limit", "remaining", "reset") for u in ("requests", "tokens")}
    return {"post": {
        "operationId": op_id, "summary": summary, "tags": ["completions"],
        "requestBody": {"required": True, "content": {"application/json": {"schema": ref(request)}}},
        "responses": {
            "200": {"description": f"A {final} object, or with stream=true server-sent events: "
                                   "'data: <chunk JSON>' per event, an error object if the request fails "
                                   "mid-stream, and 'data: [DONE]' last.",
                    "headers": {**ratelimit, "X-Request-Id": {"$ref": "#/components/headers/X-Request-Id"}},
                    "content": {
                        "application/json": {"schema": ref(final)},
                        "text/event-stream": {
                            # OpenAPI 3.1 reads `schema` of an event stream as one event's (as 3.2's
                            # `itemSchema` says outright): its fields, not the stream's text
                            "schema": _SSE_EVENT,
                            # what each `data:` line but the last ('[DONE]') holds
                            "x-event-data": {"anyOf": [ref(chunk), ref("ErrorResponse")]}}}},
            **err_refs(400, 401, 404, 413, 429, 503, 504)}}}


# One Server-Sent Event as a client's parser yields it.
_SSE_EVENT = {
    "type": "object", "required": ["data"],
    "properties": {
        "data": {"type": "string", "description": "a JSON chunk (x-event-data), or [DONE] last"},
        "event": {"type": "string"}, "id": {"type": "string"}, "retry": {"type": "integer"}}}


def build(svc, cfg, *, auth: bool) -> dict:
    """The document for a gateway with Service ``svc`` and GatewayConfig ``cfg``; ``auth``: API keys
    are configured."""
    f = Facts(svc, cfg)
    open_ = {"security": []}
    guarded = err_refs(401, 429, 503)
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
                                      "content": {"application/json": {"schema": ref("ModelList")}}},
                              **guarded}}},
            "/v1/models/{model}": {"get": {
                "operationId": "retrieveModel", "summary": "One model.", "tags": ["models"],
                "parameters": [{"name": "model", "in": "path", "required": True,
                                "schema": {"type": "string"}}],
                "responses": {"200": {"description": "The model.",
                                      "content": {"application/json": {"schema": ref("Model")}}},
                              **err_refs(401, 404, 429, 503)}}},
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
                            "content": {"application/json": {"schema": ref("Health")}}},
                    "503": {"description": "No live worker, or Redis unreachable.",
                            "content": {"application/json": {"schema": ref("Health")}}}}}},
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
            "schemas": {**request_schemas(f), **response_schemas(f), **error_schemas()},
            "responses": error_responses(f),
            "headers": response_headers(),
            "securitySchemes": {"bearerAuth": {
                "type": "http", "scheme": "bearer",
                "description": "An API key ('Authorization: Bearer <key>'); needed only when the gateway "
                               "has keys (MFS_API_KEYS / --api-keys-file)."}},
        },
    }
