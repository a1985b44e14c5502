"""Per-key rate limits (requests and tokens per minute), shared by every gateway through Redis.

Each key has two token buckets in one hash ``mfs:ratelimit:{key-id}`` (fields ``r``, ``t``, ``ts``):
capacity = the per-minute limit, refilled continuously at limit/60 per second. One Lua script reads,
refills, checks both buckets, takes the cost only when both allow it, and sets a TTL (a minute and a
bit: an idle key's hash expires full). The clock is Redis's ``TIME``, so gateways on different hosts
agree. A limit of 0 means unlimited (that bucket is not kept and gets no headers).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import redis.asyncio as aioredis

from core.protocol import ratelimit_key

# KEYS[1]: the bucket hash. ARGV: rpm, tpm, request cost, token cost.
# Returns {allowed (1/0/-1: never fits), requests left, tokens left, wait ms} (floats as strings).
_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local lim = {tonumber(ARGV[1]), tonumber(ARGV[2])}
local cost = {tonumber(ARGV[3]), tonumber(ARGV[4])}
local st = redis.call('HMGET', KEYS[1], 'r', 't', 'ts')
local dt = math.max(0, now - (tonumber(st[3]) or now))
local lvl = {0, 0}
local wait, allowed = 0, 1
for i = 1, 2 do
  if lim[i] > 0 then
    local v = tonumber(st[i]) or lim[i]
    lvl[i] = math.min(lim[i], v + dt * lim[i] / 60000)
    if cost[i] > lim[i] then
      allowed = -1
    elseif cost[i] > lvl[i] then
      wait = math.max(wait, (cost[i] - lvl[i]) * 60000 / lim[i])
      if allowed == 1 then allowed = 0 end
    end
  end
end
if allowed == 1 then
  lvl[1] = lvl[1] - cost[1]
  lvl[2] = lvl[2] - cost[2]
end
redis.call('HSET', KEYS[1], 'r', tostring(lvl[1]), 't', tostring(lvl[2]), 'ts', now)
redis.call('PEXPIRE', KEYS[1], 61000)
return {allowed, tostring(lvl[1]), tostring(lvl[2]), tostring(math.ceil(wait))}
"""


@dataclass(slots=True)
class Admission:
    """The result of one :meth:`RateLimiter.admit`: what to answer and which headers to send."""
    allowed: bool
    never_fits: bool          # the cost alone is over a limit: no wait helps
    rpm: int
    tpm: int
    requests_left: float
    tokens_left: float
    wait_s: float             # until the cost would fit (0 when allowed)

    def headers(self) -> dict[str, str]:
        """OpenAI's ``x-ratelimit-*`` headers; ``reset`` is the time until the bucket is full again."""
        h = {}
        for name, lim, left in (("requests", self.rpm, self.requests_left),
                                ("tokens", self.tpm, self.tokens_left)):
            if lim > 0:
                h[f"x-ratelimit-limit-{name}"] = str(lim)
                h[f"x-ratelimit-remaining-{name}"] = str(max(0, math.floor(left)))
                h[f"x-ratelimit-reset-{name}"] = duration((lim - max(0.0, left)) * 60.0 / lim)
        return h

    @property
    def retry_after(self) -> str:
        return str(max(1, math.ceil(self.wait_s)))


def duration(s: float) -> str:
    """Seconds in OpenAI's style: ``20ms``, ``1.5s``, ``6m0s``."""
    if s <= 0:
        return "0s"
    if s < 1:
        return f"{max(1, round(s * 1000))}ms"
    if s < 60:
        return f"{round(s, 3):g}s"
    m, rest = divmod(s, 60)
    return f"{int(m)}m{round(rest):d}s"


class RateLimiter:
    def __init__(self, client: aioredis.Redis, rpm: int = 0, tpm: int = 0):
        self.rpm, self.tpm = rpm, tpm
        self._script = client.register_script(_LUA)

    @property
    def enabled(self) -> bool:
        return self.rpm > 0 or self.tpm > 0

    async def admit(self, key_id: str, requests: int = 0, tokens: int = 0) -> Admission:
        ok, r, t, wait_ms = await self._script(keys=[ratelimit_key(key_id)],
                                               args=[self.rpm, self.tpm, requests, tokens])
        return Admission(int(ok) == 1, int(ok) == -1, self.rpm, self.tpm, float(r), float(t),
                         float(wait_ms) / 1000.0)
