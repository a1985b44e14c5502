"""The step scheduler's records: a request as counters (prefill and decode are derived), what one
step schedules and what it returns, the scheduler's configuration and counters."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum

from core.sampling import SamplingParams


class InvalidRequest(ValueError):
    """A request the engine refuses; everything else keeps running."""

    def __init__(self, message: str, code: str = "invalid_request", status: int = 400):
        super().__init__(message)
        self.code, self.status = code, status


class Status(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True)
class Request:
    request_id: str
    prompt_ids: list[int]
    tier: int
    params: SamplingParams
    stop_ids: frozenset[int]
    arrival: int
    meta: dict = field(default_factory=dict)
    output_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    block_tables: list[list[int]] = field(default_factory=list)
    status: Status = Status.WAITING
    finish_reason: str | None = None
    num_preemptions: int = 0
    announced: bool = False  # the worker has been told about this request
    num_cached_tokens: int = 0   # tokens reused from the prefix cache at its first admission
    num_cached_blocks: int = 0   # leading blocks of its tables registered in the prefix cache
    num_released_blocks: int = 0  # leading blocks of its tables given back, outside every layer's window
    block_hashes: list[list[bytes]] = field(default_factory=list)  # per segment, of its full blocks
    # Cross-tier reuse at admission: (first segment, start, end) of cached positions whose lower
    # segments' KV exists but whose upper segments must still be computed (from the stored hidden
    # state at that boundary). Scheduled once, in the request's first step.
    # A running request that escalated (cascade) holds its pending catch-up here too, scheduled in
    # chunks before its next row.
    catchup: tuple[int, int, int] | None = None
    # Exit fills at admission: (segment, start, end) of cached positions whose exit-block KV of that
    # segment this request reads but a higher tier skipped; computed from the stored trunk state.
    fills: list[tuple[int, int, int]] = field(default_factory=list)
    drafts: list[int] = field(default_factory=list)  # this speculation round's draft tokens
    spec_proposed: int = 0
    spec_accepted: int = 0
    spec_rate: float = 1.0   # running acceptance (EMA over rounds), optimistic at the start
    spec_pause: int = 0      # plain decode steps left before speculating again
    spec_backoff: int = 8    # the next pause after a poor round; doubles while drafts keep failing
    spec_stop: bool = False  # the drafter grew unsure: verify the drafts so far instead of drafting on
    tiers: list[int] = field(default_factory=list)         # tiers that served it, in order
    escalated_at: list[int] = field(default_factory=list)  # output index of each tier change
    arrival_time: float = field(default_factory=time.monotonic)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def token_slice(self, start: int, end: int) -> list[int]:
        p = len(self.prompt_ids)
        if end <= p:
            return self.prompt_ids[start:end]
        return (self.prompt_ids[start:] if start < p else []) + self.output_ids[max(0, start - p):end - p]


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    new_token_ids: list[int]
    finished: bool
    finish_reason: str | None
    num_prompt_tokens: int
    num_output_tokens: int
    tier: int = 0
    logits: object = None
    tiers: list[int] = field(default_factory=list)         # cascade: every tier that served it
    escalated_at: list[int] = field(default_factory=list)  # output index where each escalation happened
    logprobs: list = field(default_factory=list)         # per new token (core.protocol.TokenLogprob)
    prompt_logprobs: list = field(default_factory=list)  # prompt tokens 1.., with the first output


@dataclass(slots=True)
class SchedulerConfig:
    num_tiers: int
    num_blocks: list[int]
    block_size: int = 16
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 64
    max_model_len: int = 4096
    max_tiers_per_step: int = 0        # 0: any mix
    path_switches_per_s: float = 0.0   # 0: unlimited
    kv_quota: dict[int, float] = field(default_factory=dict)  # tier -> max share of segment-0 blocks
    served_tiers: tuple[int, ...] | None = None  # None: every tier (nested); else a standalone copy
    eos_token_ids: tuple[int, ...] = ()
    vocab_size: int = 0
    prefix_caching: bool = True
    cache_ttl_s: float = 0.0           # uncache blocks unused this long (0: only under pressure)
    # Speculation gate per draft>target tier pair: while the pair's running acceptance (over every
    # request's rounds) is below this, a round starts only every `spec_probe_every`-th chance; the
    # other steps decode plainly, so a poor drafter costs a few percent instead of its rounds.
    spec_min_acceptance: float = 0.3
    spec_probe_every: int = 16
    # Segments whose tier has an exit block (its KV layers sit in that segment's pool). With
    # lazy_exits a row crossing such a boundary skips the block's KV unless its request reads it
    # (its own tier, its draft tier); a cached block lacking it is filled when a reader reuses it.
    exit_blocks: tuple[int, ...] = ()
    lazy_exits: bool = True
    # Every layer's attention window (the widest) when each layer has one, else 0: a running request's
    # blocks wholly before its window go back to the pool (scheduler/window.py).
    kv_window: int = 0


@dataclass(slots=True)
class ScheduledStep:
    rows: list[tuple[Request, int]]
    new: list[Request]
    drop: list[str]
    catchups: list[tuple[Request, int, int, int]] = field(default_factory=list)  # req, segment, start, end
    drafts: list[tuple[Request, int, int]] = field(default_factory=list)   # req, token, position
    verifies: list[tuple[Request, list[int], int]] = field(default_factory=list)  # req, tokens, start
    fills: list[tuple[Request, int, int, int]] = field(default_factory=list)  # req, segment, start, end
    lazy_exits: bool = False  # rows write only the exit-block KV their request reads (PlanRow.exit_kv)


@dataclass(slots=True)
class SchedulerStats:
    steps: int = 0
    forward_tokens: int = 0
    preemptions: int = 0
    path_switches: int = 0
    peak_kv_blocks: list[int] = field(default_factory=list)
    # Per segment: prompt tokens whose KV was computed / taken from the cache, full prompt blocks
    # looked up / found at admission, cached blocks evicted (pressure or TTL).
    prefill_computed: list[int] = field(default_factory=list)
    prefill_reused: list[int] = field(default_factory=list)
    cache_queries: list[int] = field(default_factory=list)
    cache_hits: list[int] = field(default_factory=list)
    evictions: list[int] = field(default_factory=list)
    exit_filled: list[int] = field(default_factory=list)  # per segment: cached positions whose exit-block
    #                                                       KV was filled for a reader (lazy exits)
    spec_rounds: int = 0
    spec_proposed: int = 0
    spec_accepted: int = 0
    spec_gated: int = 0      # decode steps a speculating request ran plainly: its pair was below break-even
    escalations: dict[str, int] = field(default_factory=dict)  # "from>to" tier pair -> count
    # "draft>target" tier pair -> [rounds, drafts proposed, drafts accepted, tokens committed]
    spec_pairs: dict[str, list[int]] = field(default_factory=dict)
