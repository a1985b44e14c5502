"""``SchedulerProcessConfig``: every knob of one scheduler process, said once; ``python -m scheduler``'s
flags are generated from its fields (core/cli.py) and the service gets it whole. The Redis connection
is apart (core/redisconn.py's flags give a RedisTarget)."""
from __future__ import annotations

from dataclasses import dataclass

from core import protocol as P
from core.cli import opt


def parse_quota(spec: str | None) -> dict[int, float]:
    """``0=0.6,1=0.3`` -> {0: 0.6, 1: 0.3}."""
    out = {}
    for part in (spec or "").split(","):
        if part.strip():
            k, _, v = part.partition("=")
            out[int(k)] = float(v)
    return out


@dataclass(slots=True)
class SchedulerProcessConfig:
    max_num_batched_tokens: int = opt(512, "per-step token budget")
    max_num_seqs: int = opt(64, "requests in one step at most")
    max_tiers_per_step: int = opt(0, "0: a step may mix every tier")
    path_switches_per_s: float = opt(0.0, "how often a worker's tier mix may change per second (0: unlimited)")
    kv_quota: dict[int, float] = opt(default_factory=dict, parse=parse_quota,
                                     help="tier=share of segment-0 blocks, e.g. 0=0.6,1=0.3")
    prefix_caching: bool = opt(True, "free a request's KV blocks when it ends (no reuse, no cache-aware "
                                     "placement)")
    cache_ttl_s: float = opt(0.0, "uncache KV blocks unused this long (0: only when a pool needs room)")
    directory_ttl_s: float = opt(600.0, "lifetime of KV directory entries")
    affinity_abs_threshold: int = opt(4, "cache affinity yields when the preferred worker has more than this "
                                         "many requests above the least loaded one...")
    affinity_rel_threshold: float = opt(1.5, "...and more than this times as many")
    spec_min_acceptance: float = opt(0.3, "self-speculation gate: while a draft>target tier pair accepts less "
                                          "than this share of its drafts, its requests start a round only "
                                          "every --spec-probe-every chances")
    spec_probe_every: int = opt(16, "see --spec-min-acceptance")
    lease_s: float = opt(3.0, "leadership lease: a standby takes over this long after the leader stops "
                              "renewing")
    housekeeping_s: float = opt(2.0, "period of reaping gone gateways' requests and trimming streams")
    shard: str = opt(P.DEFAULT_SHARD, parse=P.Shard.check,
                     help="the control-plane shard this scheduler plans for (its workers join it with the "
                          "same --shard); one leader per shard, the others stand by")
