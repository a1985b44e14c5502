"""Records MFS keeps in Redis keys rather than streams (core.protocol names the keys): a request's
progress (``mfs:progress:{request}``), a worker's registration (``mfs:worker:{worker}``) and a shard
leader's stats snapshot (field of ``mfs:stats``)."""
from __future__ import annotations

import socket
import struct
from dataclasses import asdict, dataclass, field, fields

import msgpack

from core.protocol import DEFAULT_SHARD, Shard, from_wire, gateway_key, worker_key


def encode_progress(tokens: list[int]) -> bytes:
    """Output tokens as ``mfs:progress:{request}`` holds them: int32 little-endian, appended per step."""
    return struct.pack(f"<{len(tokens)}i", *tokens)


def decode_progress(raw: bytes | None) -> list[int]:
    """``mfs:progress:{request}`` -> its tokens (a torn trailing int, if any, is ignored)."""
    if not raw:
        return []
    return list(struct.unpack(f"<{len(raw) // 4}i", raw[:len(raw) // 4 * 4]))


_SCALARS = {"int": int, "float": float, "str": str}


@dataclass(slots=True)
class WorkerInfo:
    """A worker's registration, the hash ``mfs:worker:{worker}``, written whole with every heartbeat
    (so a Redis restart that lost it gets it back complete). Lists are msgpack in the hash; scalars stay
    plain so ``HGET`` reads one (the gateway reads ``max_model_len``, a new leader ``epoch``)."""
    LISTS = ("tiers", "num_blocks", "eos", "exit_blocks")
    tiers: list[int]        # tiers served (one, for a standalone copy)
    num_tiers: int          # tiers of the family
    num_blocks: list[int]   # KV blocks per segment pool
    block_size: int
    max_model_len: int
    vocab_size: int
    eos: list[int]
    started: str            # this life of the worker id: block tables of another life are stale
    device: str = ""
    kernels: str = ""
    weights: str = "fp32"   # the weight format it serves (--weights)
    choice: str = ""        # what it serves and why, as its start line says (the status page shows it)
    shard: str = DEFAULT_SHARD  # the control-plane shard it joined (its scheduler plans its steps)
    pid: int = 0
    epoch: int = 0          # the newest scheduler epoch it has seen in a plan
    heartbeat: float = 0.0
    exit_blocks: list[int] = field(default_factory=list)  # segments whose tier has an exit block
    kv_window: int = 0      # every layer's attention window when each has one (blocks behind it go back)

    def to_hash(self) -> dict[str, bytes | str | int | float]:
        d = asdict(self)
        for k in self.LISTS:
            d[k] = msgpack.packb(d[k])
        return d

    @classmethod
    def from_hash(cls, h: dict) -> WorkerInfo | None:
        """``HGETALL`` -> the registration; None when it is incomplete (only a heartbeat's fields
        reached a restarted Redis: the full hash follows)."""
        h = {(k.decode() if isinstance(k, bytes) else k): v for k, v in h.items()}
        if "started" not in h:
            return None
        kw = {}
        for f in fields(cls):
            if f.name not in h:
                continue
            v = h[f.name]
            if f.name in cls.LISTS:
                kw[f.name] = list(msgpack.unpackb(v))
            else:
                kw[f.name] = _SCALARS[f.type](v.decode() if isinstance(v, bytes) else v)
        return cls(**kw)


@dataclass(slots=True)
class StatsSnapshot:
    """A shard's leading scheduler's gauges and counters, field ``scheduler`` (``scheduler:{s}`` for
    shard ``s``) of the hash ``mfs:stats`` (msgpack), written every half second; ``/metrics``, the
    launcher and the benchmarks read it."""
    leader: str = ""                  # the leading scheduler's consumer name
    shard: str = DEFAULT_SHARD
    epoch: int = 0
    takeovers: int = 0
    updated: float = 0.0              # wall clock of the write
    workers: int = 0
    waiting: dict[int, int] = field(default_factory=dict)  # tier -> requests
    running: dict[int, int] = field(default_factory=dict)
    kv_blocks_used: dict[str, list[int]] = field(default_factory=dict)   # worker -> per segment
    kv_blocks_total: dict[str, list[int]] = field(default_factory=dict)
    path_switches: int = 0
    preemptions: int = 0
    replanned: int = 0                # requests moved off a lost worker
    gateway_cancels: int = 0          # requests cancelled because their gateway went away
    steps: int = 0                    # results handled; with the next two, the transport share
    step_roundtrip_s: float = 0.0     # plan sent -> result handled, summed
    step_forward_s: float = 0.0       # the workers' own step time, summed
    forward_steps: int = 0            # forward steps those results ran (more than `steps`: multi-step plans)
    # per segment, summed over workers
    prefill_computed: dict[int, int] = field(default_factory=dict)
    prefill_reused: dict[int, int] = field(default_factory=dict)
    cache_queries: dict[int, int] = field(default_factory=dict)
    cache_hits: dict[int, int] = field(default_factory=dict)
    evictions: dict[int, int] = field(default_factory=dict)
    exit_filled: dict[int, int] = field(default_factory=dict)  # cached positions whose exit-block KV was filled
    directory_blocks: dict[str, int] = field(default_factory=dict)  # worker -> blocks listed
    affinity_preferred: int = 0
    affinity_yielded: int = 0
    # "draft>target" -> {"rounds", "proposed", "accepted", "committed"}
    spec: dict[str, dict[str, int]] = field(default_factory=dict)
    spec_gated: int = 0
    escalations_by_pair: dict[str, int] = field(default_factory=dict)  # "from>to" -> count
    escalations: int = 0

    def encode(self) -> bytes:
        return msgpack.packb(asdict(self))

    @classmethod
    def decode(cls, raw: bytes | None) -> StatsSnapshot | None:
        return from_wire(cls, msgpack.unpackb(raw, raw=False, strict_map_key=False)) if raw else None


# What a dead process held, given back by whoever saw it exit (`mfs up`'s supervisor), only while it is
# still that process's: a restarted life, with its own pid, keeps its own.
# A worker's registration, while its pid is that process's:
_WITHDRAW = "if redis.call('HGET', KEYS[1], 'pid') == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0"
# A lease (the scheduler's leadership), while it names that holder; also how a leader hands it over itself:
RELEASE_IF_HELD = "if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end return 0"

# A gateway's heartbeat (JSON naming its host and pid), while it names that process:
_FORGET_GATEWAY = """
local ok, beat = pcall(cjson.decode, redis.call('GET', KEYS[1]) or 'null')
if ok and type(beat) == 'table' and beat['host'] == ARGV[1] and tonumber(beat['pid']) == tonumber(ARGV[2]) then
  return redis.call('DEL', KEYS[1])
end
return 0"""


def scheduler_consumer(pid: int) -> str:
    """The scheduler process ``pid`` of this host: its name in the ``scheduler`` group and on its lease
    (unless ``--consumer`` names it); unique across hosts, since two containers both run theirs as pid 1."""
    return f"sched-{socket.gethostname()}-{pid}"


def release_leadership(r, shard: str, pid: int) -> bool:
    """Deletes shard ``shard``'s lease if the scheduler process ``pid`` of this host holds it (it has
    exited): a standby takes over at its next poll (0.5 s) instead of when the lease expires (3 s)."""
    return bool(r.eval(RELEASE_IF_HELD, 1, Shard(shard).leader_key, scheduler_consumer(pid)))


def withdraw_registration(r, worker_id: str, pid: int) -> bool:
    """Removes the registration of the worker ``worker_id`` whose process ``pid`` has exited, so the
    scheduler's next refresh (every 0.5 s) moves its requests, instead of the 5 s of its heartbeat's TTL.
    True when it was that life's registration and is gone."""
    return bool(r.eval(_WITHDRAW, 1, worker_key(worker_id), str(pid)))


def forget_gateway(r, pid: int) -> bool:
    """Deletes the heartbeat of the gateway process ``pid`` of this host (it has exited; gateway ids are
    random per process, so the keys are scanned): the scheduler cancels its requests and frees their KV
    at its next housekeeping (2 s) instead of when the 5 s TTL ends."""
    host = socket.gethostname()
    keys = list(r.scan_iter(match=gateway_key("*"), count=100))
    return sum(r.eval(_FORGET_GATEWAY, 1, key, host, pid) for key in keys) > 0  # each key checked
