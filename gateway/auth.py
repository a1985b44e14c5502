"""Who may use the gateway and how much: the middleware that guards every route but ``/health``,
``/openapi.json`` and the status page's HTML (``/``) with the API keys (``gateway.apikeys``), and
admission against the per-key rate limits (``gateway.ratelimit``).

Every guarded request costs one request at the door; a completion also costs its prompt tokens plus
``max_tokens`` once the gateway has tokenized it (``admit``, called by the completion views). The last
admission's ``x-ratelimit-*`` headers go on whatever response the request gets (``on_prepare``).
"""
from __future__ import annotations

from aiohttp import web

from gateway.keys import ADMISSION, KEY_ID, KEYS, SERVICE
from gateway.errors import APIError

# Open: health, the API description, and the status page's HTML (it holds no numbers; its script sends
# the key the user types to /status.json, which is guarded like /metrics).
OPEN_PATHS = frozenset({"/health", "/openapi.json", "/"})
ANONYMOUS = "anonymous"  # the one client of a gateway without keys (its rate limits still apply)


def _bearer(request: web.Request) -> str | None:
    scheme, _, token = request.headers.get("Authorization", "").strip().partition(" ")
    token = token.strip()
    return token if scheme.lower() == "bearer" and token else None


def unauthorized(message: str) -> APIError:
    return APIError(401, message, code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"})


@web.middleware
async def auth_middleware(request: web.Request, handler):
    if request.path in OPEN_PATHS:
        return await handler(request)
    keys, key_id = request.app[KEYS], ANONYMOUS
    if keys.enabled:
        presented = _bearer(request)
        if presented is None:
            raise unauthorized("You didn't provide an API key. Send it as 'Authorization: Bearer <key>'.")
        key_id = keys.check(presented)
        if key_id is None:
            raise unauthorized("Incorrect API key provided.")
    request[KEY_ID] = key_id
    await admit(request, requests=1)
    return await handler(request)


async def admit(request: web.Request, requests: int = 0, tokens: int = 0) -> None:
    """Takes ``requests`` and ``tokens`` from the caller's buckets, or raises 429."""
    limiter = request.app[SERVICE].limiter
    if limiter is None or not limiter.enabled or (tokens and not limiter.tpm and not requests):
        return
    key_id = request.get(KEY_ID, ANONYMOUS)
    adm = await limiter.admit(key_id, requests, tokens)
    request[ADMISSION] = adm
    if adm.never_fits:
        raise APIError(429, f"Request too large for this key's limit of {limiter.tpm} tokens per minute: "
                            f"it asks for {tokens} (prompt + max_tokens). Lower max_tokens or shorten "
                            "the prompt.", code="rate_limit_exceeded")
    if not adm.allowed:
        what = "requests" if requests and adm.requests_left < requests else "tokens"
        raise APIError(429, f"Rate limit reached for {what} per minute on key {key_id}; retry in "
                            f"{adm.retry_after} s.", code="rate_limit_exceeded",
                       headers={"Retry-After": adm.retry_after})


async def on_prepare(request: web.Request, response: web.StreamResponse) -> None:
    """``on_response_prepare``: the last admission's ``x-ratelimit-*`` headers on any response."""
    adm = request.get(ADMISSION)
    if adm is not None:
        response.headers.update(adm.headers())
