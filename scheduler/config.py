"""``SchedulerProcessConfig``: every knob of one scheduler process, said once; ``python -m scheduler``'s
flags are generated from its fields (core/cli.py) and the service gets it whole. The Redis connection
is apart (core/redisconn.py's flags give a RedisTarget). The knobs it passes to each worker's step
scheduler (``STEP_LIMITS``) are the fields it shares by name with ``SchedulerConfig``, whose defaults they
take."""
from __future__ import annotations

from dataclasses import MISSING, dataclass, fields

from core import protocol as P
from core.cli import opt
from scheduler.request import SchedulerConfig


def _step(name: str, help: str, **kw):  # noqa: A002
    """A knob of the step scheduler: SchedulerConfig's field ``name``, with its default."""
    f = SchedulerConfig.__dataclass_fields__[name]
    if f.default_factory is not MISSING:
        return opt(default_factory=f.default_factory, help=help, **kw)
    return opt(f.default, help, **kw)


def parse_quota(spec: str | None) -> dict[int, float]:
    """``0=0.6,1=0.3`` -> {0: 0.6, 1: 0.3}."""
    out = {}
    for part in (spec or "").split(","):
        if part.strip():
            k, _, v = part.partition("=")
            out[int(k)] = float(v)
    return out


def parse_steps(spec: str) -> int:
    n = int(spec)
    if n < 1:
        raise ValueError(f"{n} steps: a plan runs at least one")
    return n


@dataclass(slots=True)
class SchedulerProcessConfig:
    max_num_batched_tokens: int = _step("max_num_batched_tokens", "per-step token budget")
    max_num_seqs: int = _step("max_num_seqs", "requests in one step at most")
    max_tiers_per_step: int = _step("max_tiers_per_step", "0: a step may mix every tier")
    path_switches_per_s: float = _step("path_switches_per_s",
                                       "how often a worker's tier mix may change per second (0: unlimited)")
    kv_quota: dict[int, float] = _step("kv_quota", "tier=share of segment-0 blocks, e.g. 0=0.6,1=0.3",
                                       parse=parse_quota)
    prefix_caching: bool = _step("prefix_caching", "free a request's KV blocks when it ends (no reuse, no "
                                                   "cache-aware placement)")
    cache_ttl_s: float = _step("cache_ttl_s", "uncache KV blocks unused this long (0: only when a pool needs room)")
    lazy_exits: bool = _step("lazy_exits", "rows skip the exit-block KV of lower tiers their request never "
                                           "reads; a lower-tier request reusing such blocks fills it first "
                                           "(--no-lazy-exits: every row writes every exit it crosses)")
    decode_steps: int = opt(8, "multi-step decoding: while every running request of a worker is decoding "
                               "plainly and none waits, its plan runs this many steps (each row fed its own "
                               "token) before the scheduler plans again; a request arriving meanwhile waits "
                               "for them. 1: plan every step", parse=parse_steps)
    stream_interval: int = opt(4, "a multi-step plan sends its greedy tokens to their clients every this many "
                                  "of its steps (and at its end), a request's first and last tokens at once "
                                  "(vLLM's --stream-interval): fewer wake-ups of Redis, gateway and client a "
                                  "token, larger chunks of text. 1: every token", parse=parse_steps)
    directory_ttl_s: float = opt(600.0, "lifetime of KV directory entries")
    affinity_abs_threshold: int = opt(4, "cache affinity yields when the preferred worker has more than this "
                                         "many requests above the least loaded one...")
    affinity_rel_threshold: float = opt(1.5, "...and more than this times as many")
    spec_min_acceptance: float = _step("spec_min_acceptance", "self-speculation gate: while a draft>target tier "
                                                              "pair accepts less than this share of its drafts, "
                                                              "its requests start a round only every "
                                                              "--spec-probe-every chances")
    spec_probe_every: int = _step("spec_probe_every", "see --spec-min-acceptance")
    lease_s: float = opt(3.0, "leadership lease: a standby takes over this long after the leader stops "
                              "renewing")
    housekeeping_s: float = opt(2.0, "period of reaping gone gateways' requests and trimming streams")
    shard: str = opt(P.DEFAULT_SHARD, parse=P.Shard.check,
                     help="the control-plane shard this scheduler plans for (its workers join it with the "
                          "same --shard); one leader per shard, the others stand by")


# What a scheduler process sets in every worker's SchedulerConfig: the fields the two share by name.
STEP_LIMITS = tuple(f.name for f in fields(SchedulerConfig)
                    if f.name in {g.name for g in fields(SchedulerProcessConfig)})
