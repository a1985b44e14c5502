"""The KV block directory in Redis: which worker holds which prefix blocks and sessions.

It is a *hint* for placement, never the truth: the scheduler's own block pools decide what a request
reuses, so a stale entry (an evicted block, a dead or restarted worker) costs a cache miss, not a
wrong answer. The scheduler writes it: blocks cached and evicted per worker (MULTI per batch), a session's worker,
tier and block-hash chains when one of its turns finishes (MULTI), and drops a worker's entries when the
worker (re)joins or leaves. A worker's blocks are one set of raw 16-byte hashes (``mfs:kv:held:{worker}``,
~60 bytes a block in Redis; a key per block cost ~5x that); a placement asks each candidate worker's set
with one SMISMEMBER. Every entry expires ``ttl_s`` after its last write: a worker's set while it caches
or evicts anything. Key names live in core/protocol.py.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import msgpack
import redis

from core import protocol as P

# KEYS: the worker's held set, its sessions set; ARGV: worker, session key prefix.
_DROP = """
local held = redis.call('SCARD', KEYS[1])
for _, s in ipairs(redis.call('SMEMBERS', KEYS[2])) do
  if redis.call('HGET', ARGV[2] .. s, 'worker') == ARGV[1] then redis.call('DEL', ARGV[2] .. s) end
end
redis.call('DEL', KEYS[1], KEYS[2])
return held
"""


@dataclass(slots=True)
class SessionEntry:
    worker: str
    started: str                 # the worker's incarnation when the entry was written
    tier: int
    chains: list[list[bytes]]    # block hashes per segment, from segment 0
    last_use: float


def common_blocks(chains: list[list[bytes]], known: list[list[bytes]]) -> int:
    """Leading blocks of `chains` found in `known` in every segment of `chains`."""
    if len(known) < len(chains):
        return 0
    best = None
    for want, have in zip(chains, known):
        n = 0
        while n < min(len(want), len(have)) and want[n] == have[n]:
            n += 1
        best = n if best is None else min(best, n)
    return best or 0


class BlockDirectory:
    def __init__(self, r: redis.Redis, ttl_s: float = 600.0):
        self.r = r
        self.ttl_s = max(1, int(ttl_s))
        self._drop = r.register_script(_DROP)

    # ---- writes -------------------------------------------------------------------------------
    def record(self, worker: str, changes: list[tuple[bytes, bool]]) -> int:
        """Applies (hash, held?) changes of one worker in order: the last word on a hash wins."""
        last: dict[bytes, bool] = {}
        for h, held in changes:
            last[h] = held
        if not last:
            return 0
        key = P.kv_held_key(worker)
        added = [h for h, v in last.items() if v]
        gone = [h for h, v in last.items() if not v]
        p = self.r.pipeline(transaction=True)
        if added:
            p.sadd(key, *added)
        if gone:
            p.srem(key, *gone)
        p.expire(key, self.ttl_s)
        p.execute()
        return len(last)

    def touch_session(self, session: str, worker: str, started: str, tier: int,
                      chains: list[list[bytes]], shard: str = P.DEFAULT_SHARD) -> None:
        """``shard``: the worker's control-plane shard (a gateway routes the session's next turn there)."""
        key, owned = P.kv_session_key(session), P.kv_sessions_key(worker)
        p = self.r.pipeline(transaction=True)
        p.hset(key, mapping={"worker": worker, "started": started, "tier": tier, "shard": shard,
                             "chains": msgpack.packb(chains, use_bin_type=True), "last_use": time.time()})
        p.expire(key, self.ttl_s)
        p.sadd(owned, session)
        p.expire(owned, self.ttl_s)
        p.execute()

    def drop_worker(self, worker: str) -> int:
        """Forgets everything listed for a worker (it restarted or left); returns the blocks dropped."""
        return self._drop(keys=[P.kv_held_key(worker), P.kv_sessions_key(worker)],
                          args=[worker, P.kv_session_key("")])

    # ---- reads --------------------------------------------------------------------------------
    def session(self, session: str) -> SessionEntry | None:
        raw = self.r.hgetall(P.kv_session_key(session))
        if not raw:
            return None
        return SessionEntry(raw[b"worker"].decode(), raw[b"started"].decode(), int(raw[b"tier"]),
                            msgpack.unpackb(raw[b"chains"], raw=False), float(raw[b"last_use"]))

    def held_blocks(self, chains: list[list[bytes]], workers: list[str]) -> dict[str, int]:
        """Per worker: how many leading blocks of `chains` (one chain per segment) it is listed as
        holding in every segment."""
        uniq = list(dict.fromkeys(h for chain in chains for h in chain))
        if not uniq or not workers:
            return {w: 0 for w in workers}
        p = self.r.pipeline(transaction=False)
        for w in workers:
            p.smismember(P.kv_held_key(w), uniq)
        out = {}
        for w, flags in zip(workers, p.execute()):
            has = {h for h, f in zip(uniq, flags) if f}
            n = None
            for chain in chains:
                k = 0
                while k < len(chain) and chain[k] in has:
                    k += 1
                n = k if n is None else min(n, k)
            out[w] = n or 0
        return out

    def num_held(self, worker: str) -> int:
        return int(self.r.scard(P.kv_held_key(worker)))
