"""Who may use the gateway and how much: API keys, the middleware that guards every route but
``/health`` and ``/openapi.json``, and admission against the per-key rate limits (``gateway.ratelimit``).

Keys come from ``MFS_API_KEYS`` (comma-separated) and/or a file (one key per line, ``#`` comments).
The file is stat'ed on each guarded request and re-read when it changed, so a revoked key stops
working without a restart; a file that disappears lets nobody in (never "no keys, so open").
Keys are held only as SHA-256 digests, and a presented key is compared with every one of them by
``hmac.compare_digest`` (equal lengths, no early exit). A key's id, a prefix of its digest, names its
rate-limit bucket and is what logs show.

Every guarded request costs one request at the door; a completion also costs its prompt tokens plus
``max_tokens`` once the gateway has tokenized it (``admit`` from ``gateway.serving``). The last
admission's ``x-ratelimit-*`` headers go on whatever response the request gets (``on_prepare``).
"""
from __future__ import annotations

import hashlib
import hmac
import os
from pathlib import Path

import structlog
from aiohttp import web

from gateway.keys import ADMISSION, KEY_ID, KEYS, SERVICE
from gateway.openai_api import APIError

log = structlog.get_logger("gateway.auth")
OPEN_PATHS = frozenset({"/health", "/openapi.json"})  # the API description: readable before a key
ANONYMOUS = "anonymous"  # the one client of a gateway without keys (its rate limits still apply)


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8", "surrogatepass")).digest()


def parse_keys(text: str) -> list[str]:
    """One key per line; blank lines and ``#`` comments (whole line or trailing) are ignored."""
    return [k for line in text.splitlines() if (k := line.split("#", 1)[0].strip())]


class KeyStore:
    def __init__(self, keys: list[str] | tuple[str, ...] = (), path: str | None = None):
        self.path = path
        self._static = [_digest(k) for k in keys if k.strip()]
        self._file: list[bytes] = []
        self._sig: tuple | None = None
        if path is not None:
            self._reload(initial=True)

    @property
    def enabled(self) -> bool:
        return bool(self._static) or self.path is not None

    def __len__(self) -> int:
        return len(self._static) + len(self._file)

    def _reload(self, initial: bool = False) -> None:
        try:
            st = os.stat(self.path)
            sig = (st.st_mtime_ns, st.st_size, st.st_ino)
            if sig == self._sig:
                return
            keys = parse_keys(Path(self.path).read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError) as e:
            if initial:
                raise ValueError(f"cannot read --api-keys-file {self.path}: {e}") from None
            if self._sig is not None:
                log.error("api_keys.unreadable", path=self.path, error=str(e), effect="no key is valid")
            self._file, self._sig = [], None
            return
        self._file, self._sig = [_digest(k) for k in keys], sig
        log.info("api_keys.loaded", path=self.path, keys=len(self._file))

    def check(self, presented: str) -> str | None:
        """The key's id when ``presented`` is a valid key, else None."""
        if self.path is not None:
            self._reload()
        d, found = _digest(presented), None
        for k in (*self._static, *self._file):
            if hmac.compare_digest(d, k):
                found = k
        return found.hex()[:16] if found is not None else None


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
