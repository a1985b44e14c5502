"""The KV block directory in Redis: which worker holds which prefix blocks and sessions.

It is a *hint* for placement, never the truth: the scheduler's own block pools decide what a request
reuses, so a stale entry (an evicted block, a dead or restarted worker) costs a cache miss, not a
wrong answer. The scheduler writes it: blocks cached and evicted per worker (one Lua script per batch,
atomic), a session's worker, tier and block-hash chains when one of its turns finishes (MULTI), and
drops a worker's entries when the worker (re)joins or leaves. Every entry expires after ``ttl_s``.
Key names live in core/protocol.py.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import msgpack
import redis

from core import protocol as P

# KEYS: the worker's held set, then one block key per hash; ARGV: worker, ttl, number of additions,
# then the hashes (hex) in KEYS order: the first `n` are now held, the rest were evicted.
_RECORD = """
local worker, ttl, nadd = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3])
for i = 2, #KEYS do
  local h = ARGV[i + 2]
  if i - 1 <= nadd then
    redis.call('SADD', KEYS[i], worker)
    redis.call('EXPIRE', KEYS[i], ttl)
    redis.call('SADD', KEYS[1], h)
  else
    redis.call('SREM', KEYS[i], worker)
    redis.call('SREM', KEYS[1], h)
  end
end
redis.call('EXPIRE', KEYS[1], ttl)
return #KEYS - 1
"""

# KEYS: the worker's held set, its sessions set; ARGV: worker, block key prefix, session key prefix.
_DROP = """
local held = redis.call('SMEMBERS', KEYS[1])
for _, h in ipairs(held) do redis.call('SREM', ARGV[2] .. h, ARGV[1]) end
for _, s in ipairs(redis.call('SMEMBERS', KEYS[2])) do
  if redis.call('HGET', ARGV[3] .. s, 'worker') == ARGV[1] then redis.call('DEL', ARGV[3] .. s) end
end
redis.call('DEL', KEYS[1], KEYS[2])
return #held
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
        self._record = r.register_script(_RECORD)
        self._drop = r.register_script(_DROP)

    # ---- writes -------------------------------------------------------------------------------
    def record(self, worker: str, changes: list[tuple[bytes, bool]]) -> int:
        """Applies (hash, held?) changes of one worker in order: the last word on a hash wins."""
        last: dict[bytes, bool] = {}
        for h, held in changes:
            last[h] = held
        if not last:
            return 0
        order = [h for h, v in last.items() if v] + [h for h, v in last.items() if not v]
        hexes = [h.hex() for h in order]
        keys = [P.kv_held_key(worker)] + [P.kv_block_key(x) for x in hexes]
        return self._record(keys=keys, args=[worker, self.ttl_s, sum(last.values())] + hexes)

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
                          args=[worker, P.kv_block_key(""), P.kv_session_key("")])

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
        for h in uniq:
            p.smembers(P.kv_block_key(h.hex()))
        holders = {h: {m.decode() for m in ms} for h, ms in zip(uniq, p.execute())}
        out = {}
        for w in workers:
            n = None
            for chain in chains:
                k = 0
                while k < len(chain) and w in holders[chain[k]]:
                    k += 1
                n = k if n is None else min(n, k)
            out[w] = n or 0
        return out

    def num_held(self, worker: str) -> int:
        return int(self.r.scard(P.kv_held_key(worker)))
