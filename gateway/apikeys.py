"""API keys: who may use the gateway (``gateway.auth`` checks them on every guarded request).

Keys come from ``MFS_API_KEYS`` (comma-separated) and/or a file (one key per line, ``#`` comments).
The file is stat'ed on each guarded request and re-read when it changed, so a revoked key stops
working without a restart; a file that disappears lets nobody in (never "no keys, so open").
Keys are held only as SHA-256 digests, and a presented key is compared with every one of them by
``hmac.compare_digest`` (equal lengths, no early exit). A key's id, a prefix of its digest, names its
rate-limit bucket and is what logs show.
"""
from __future__ import annotations

import hashlib
import hmac
import os
from pathlib import Path

import structlog

log = structlog.get_logger("gateway.auth")


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
