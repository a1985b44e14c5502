"""Leadership: one scheduler leads, the others stand by. The lease ``mfs:scheduler:leader`` (renewed
every half second) says who; taking it increments the epoch ``mfs:scheduler:epoch``, which the
leader's plans carry (a worker refuses an older one). A new leader claims what its predecessor left
pending in the ``scheduler`` group: stale results (acknowledged) and the submits of requests in flight
(resumed by the service, scheduler/service.py, from ``mfs:progress:{request}``). A leader's round of
writes (plans, progress, acknowledgements, token events) reaches Redis as one script that applies it only
while the epoch is still the leader's (:meth:`Lease.write`)."""
from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import redis

from core import protocol as P
from core.keyrecords import RELEASE_IF_HELD

# Take the lease and the next epoch (above every epoch a worker has seen: Redis may have lost the counter).
_ACQUIRE = """
if redis.call('SET', KEYS[1], ARGV[1], 'NX', 'PX', ARGV[2]) then
  local e = redis.call('INCR', KEYS[2])
  local floor = tonumber(ARGV[3])
  if e <= floor then e = floor + 1; redis.call('SET', KEYS[2], e) end
  return e
end
return 0
"""
# Extend the lease; if it lapsed and nobody took over since (the epoch is still ours), take it back.
_RENEW = """
local v = redis.call('GET', KEYS[1])
if v == ARGV[1] then redis.call('PEXPIRE', KEYS[1], ARGV[2]); return 1 end
if (not v) and redis.call('GET', KEYS[2]) == ARGV[3] then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2]); return 1
end
return 0
"""
# A leader's round of writes, applied only while the shard's epoch is still the leader's: Redis itself
# fences a round that was delayed in flight (a partition, TCP retransmitting it after the link is back)
# past a takeover. ARGV: the epoch, then per command its argument count and its arguments. Each command
# runs as in a pipeline: an error answers that command and the rest still run.
_FENCED = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return -1 end
local i, n = 2, 0
while i <= #ARGV do
  local argc = tonumber(ARGV[i])
  redis.pcall(unpack(ARGV, i + 1, i + argc))
  i = i + 1 + argc
  n = n + 1
end
return n
"""




class Lease:
    """The leadership lease of one scheduler process, and the epoch it took with it."""

    def __init__(self, r: redis.Redis, consumer: str, lease_s: float, renew_every_s: float = 0.5,
                 shard: P.Shard = P.Shard(), clock: Callable[[], float] = time.monotonic):
        self.r = r
        self.clock = clock  # this process's own: what Lease.held measures the lease with
        self.shard = shard
        self.consumer = consumer
        self.lease_ms = int(lease_s * 1000)
        self.renew_every_s = renew_every_s
        self.epoch = 0
        self._last_renew = 0.0
        self._acquire = r.register_script(_ACQUIRE)
        self._renew = r.register_script(_RENEW)
        self._release = r.register_script(RELEASE_IF_HELD)
        self._fenced = r.register_script(_FENCED)

    def acquire(self) -> bool:
        """Takes the lease if nobody holds it, with an epoch above every one a worker has seen."""
        epoch = int(self._acquire(keys=[self.shard.leader_key, self.shard.epoch_key],
                                  args=[self.consumer, self.lease_ms, epoch_floor(self.r, self.shard)]))
        if not epoch:
            return False
        self.epoch = epoch
        self._last_renew = self.clock()
        return True

    def renew(self) -> bool:
        """Extends the lease when due; False once another scheduler has taken it."""
        if self.clock() - self._last_renew < self.renew_every_s:
            return True
        return self.renew_now()

    def held(self) -> bool:
        """Whether the lease is certainly still ours by this process's own clock: renewed less than a
        lease ago. A leader cut off from Redis may come back with results it read before the cut; it
        must not write what it planned from them (plans, progress) unless renewing succeeds first,
        since a standby may have led, and written, meanwhile."""
        return self.clock() - self._last_renew < self.lease_ms / 1000

    def renew_now(self) -> bool:
        if self._renew(keys=[self.shard.leader_key, self.shard.epoch_key], args=[self.consumer, self.lease_ms, self.epoch]):
            self._last_renew = self.clock()
            return True
        return False

    def write(self, pipe: redis.client.Pipeline) -> bool:
        """Sends the commands queued on ``pipe`` (not executed) as one fenced script; False, and nothing
        written, when the epoch has moved on (another scheduler leads)."""
        argv: list = [self.epoch]
        for args, _options in pipe.command_stack:
            argv += [len(args), *args]
        pipe.reset()
        return len(argv) == 1 or int(self._fenced(keys=[self.shard.epoch_key], args=argv)) >= 0

    def release(self) -> None:
        """Hands the lease over now rather than when it expires (only if it is still ours)."""
        try:
            self._release(keys=[self.shard.leader_key], args=[self.consumer])
        except redis.RedisError:
            pass


def epoch_floor(r: redis.Redis, shard: P.Shard = P.Shard()) -> int:
    """The newest epoch any worker of the shard has seen (Redis may have lost the counter)."""
    floor = 0
    for wid in r.smembers(shard.workers_set):
        e = r.hget(P.worker_key(wid.decode()), "epoch")
        floor = max(floor, int(e or 0))
    return floor


def claim_pending(r: redis.Redis, stream: str, consumer: str) -> Iterator[tuple]:
    """Every entry pending in the group (whoever read it), now this consumer's."""
    start = "0-0"
    while True:
        res = r.xautoclaim(stream, P.SCHEDULER_GROUP, consumer, 0, start_id=start, count=500)
        start, entries = res[0], res[1]
        yield from entries
        if start in (b"0-0", "0-0"):
            return


def claim_requests(r: redis.Redis, consumer: str, shard: P.Shard = P.Shard()) -> tuple[list[tuple], list[tuple], int]:
    """What a former leader left pending: its stale results are acknowledged (counted), its submits and
    cancels come back as (entry id, record) for the new leader to handle; unreadable entries are
    acknowledged."""
    stale = 0
    for entry_id, _ in claim_pending(r, shard.done_stream, consumer):  # results of a former leader's plans
        r.xack(shard.done_stream, P.SCHEDULER_GROUP, entry_id)
        stale += 1
    subs, cancels = [], []
    for entry_id, fields in claim_pending(r, shard.req_stream, consumer):
        try:
            rec = P.decode(fields) if fields else None
        except (ValueError, TypeError, KeyError):
            rec = None
        if isinstance(rec, P.Submit):
            subs.append((entry_id, rec))
        elif isinstance(rec, P.Cancel):
            cancels.append((entry_id, rec))
        else:  # trimmed away or unreadable
            r.xack(shard.req_stream, P.SCHEDULER_GROUP, entry_id)
    return subs, cancels, stale


def drop_idle_consumers(r: redis.Redis, consumer: str, shard: P.Shard = P.Shard()) -> None:
    """Former leaders' consumers hold nothing once their entries are claimed: delete them."""
    for stream in (shard.req_stream, shard.done_stream):
        for c in r.xinfo_consumers(stream, P.SCHEDULER_GROUP):
            name = c["name"].decode() if isinstance(c["name"], bytes) else c["name"]
            if name != consumer and not c["pending"]:
                r.xgroup_delconsumer(stream, P.SCHEDULER_GROUP, name)
