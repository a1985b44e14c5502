"""Every Redis stream and key MFS uses, and the msgpack records that travel on them.

One module owns the names so an operator can find them (README "Watching it with redis-cli"):

================================  ==========  =========================================================
name                              type        what
================================  ==========  =========================================================
``mfs:req``                       stream      gateway -> scheduler: ``submit`` / ``cancel`` (group ``scheduler``)
``mfs:done``                      stream      worker -> scheduler: step results (group ``scheduler``)
``mfs:shards``                    set         shard names whose scheduler has started (see "Shards")
``mfs:plan:{worker}``             stream      scheduler -> worker: step plans (group ``worker``)
``mfs:out:{gateway}``             stream      worker/scheduler -> gateway: tokens, finishes, errors (one
                                              ``tokens`` entry, or a worker step's ``tokens*`` batch)
``mfs:workers``                   set         worker ids that have registered
``mfs:worker:{worker}``           hash + TTL  a live worker's registration (expires without heartbeat)
``mfs:gateway:{gateway}``         string+TTL  a live gateway's heartbeat
``mfs:stats``                     hash        scheduler gauges/counters for ``/metrics`` (msgpack)
``mfs:kv:session:{session}``      hash + TTL  KV directory: a session's worker (+ its ``started``), tier,
                                              block-hash chains per segment (msgpack), last use
``mfs:kv:held:{worker}``          set + TTL   KV directory: the prefix block hashes a worker holds (raw
                                              16 bytes each; ``SMISMEMBER`` asks for several)
``mfs:kv:sessions:{worker}``      set + TTL   KV directory: sessions last placed on a worker
``mfs:ratelimit:{key-id}``        hash + TTL  a gateway API key's rate-limit buckets (``r``, ``t``, ``ts``);
                                              ``key-id`` is a hash prefix, never the key
``mfs:scheduler:leader``          string+TTL  the leading scheduler's consumer name (a lease, renewed)
``mfs:scheduler:epoch``           counter     leadership generation; plans carry it, workers refuse older
``mfs:progress:{request}``        string+TTL  output tokens of an in-flight request (int32 LE), for a
                                              new leader to resume it; deleted when it ends
================================  ==========  =========================================================

Shards: the control plane may be split into shards, each a scheduler leader (with its standbys) and
the workers that joined it. The default shard ``0`` uses the names above; a shard ``s`` suffixes its own:
``mfs:req:{s}``, ``mfs:done:{s}``, ``mfs:workers:{s}``, ``mfs:scheduler:leader:{s}``,
``mfs:scheduler:epoch:{s}`` and the field ``scheduler:{s}`` of ``mfs:stats`` (:class:`Shard`). Everything
else (plans, outputs, registrations, the KV directory, progress) is keyed by worker, gateway, session or
request and shared. A gateway picks the shard of each request (``gateway.backend.choose_shard``).

Every stream entry has two fields: ``t`` (the record type) and ``d`` (the msgpack body). The records kept
in keys (progress, a worker's registration, the stats snapshot) are in ``core.keyrecords``.

Delivery: a ``submit`` entry stays pending in the ``scheduler`` group until its request ends (finished,
failed, cancelled, or its gateway gone), so a scheduler that takes over claims (``XAUTOCLAIM``) exactly the
requests in flight and resumes each from ``mfs:progress:{request}``. Streams are bounded: the leader
trims ``mfs:req`` and ``mfs:done`` below what is still pending or unread (``XTRIM MINID``), a worker its
plan stream below what it has executed, a gateway its own output stream below what it has read, and every
XADD carries ``MAXLEN ~`` as a backstop.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field, fields
from functools import cache

import msgpack

from core.sampling import SamplingParams

REQ_STREAM = "mfs:req"
DONE_STREAM = "mfs:done"
SCHEDULER_GROUP = "scheduler"
WORKER_GROUP = "worker"
WORKERS_SET = "mfs:workers"
STATS_KEY = "mfs:stats"
STREAM_MAXLEN = 100_000  # approximate trim (MAXLEN ~) on every XADD: a backstop, see "Delivery"
HEARTBEAT_S = 1.0
WORKER_TTL_S = 5
LEADER_KEY = "mfs:scheduler:leader"
EPOCH_KEY = "mfs:scheduler:epoch"
PROGRESS_TTL_S = 24 * 3600
SHARDS_SET = "mfs:shards"
DEFAULT_SHARD = "0"
_SHARD_NAME = re.compile(r"^[A-Za-z0-9_-]{1,32}$")


@dataclass(frozen=True, slots=True)
class Shard:
    """The keys of one shard of the control plane (see "Shards" above); the default shard keeps the
    unsuffixed names, so one shard behaves (and reads in redis-cli) as before shards existed."""
    name: str = DEFAULT_SHARD

    def __post_init__(self):
        if not _SHARD_NAME.match(self.name):
            raise ValueError(f"shard name {self.name!r}: 1-32 characters of A-Z a-z 0-9 _ -")

    @classmethod
    def check(cls, name: str) -> str:
        """``name`` if it can name a shard, else ValueError (a ``--shard`` flag's parse)."""
        return cls(name).name

    def _key(self, base: str) -> str:
        return base if self.name == DEFAULT_SHARD else f"{base}:{self.name}"

    @property
    def req_stream(self) -> str:
        return self._key(REQ_STREAM)

    @property
    def done_stream(self) -> str:
        return self._key(DONE_STREAM)

    @property
    def workers_set(self) -> str:
        return self._key(WORKERS_SET)

    @property
    def leader_key(self) -> str:
        return self._key(LEADER_KEY)

    @property
    def epoch_key(self) -> str:
        return self._key(EPOCH_KEY)

    @property
    def stats_field(self) -> str:
        """The field of ``mfs:stats`` its leader writes."""
        return self._key("scheduler")


def shard_of_stats_field(name: str) -> str | None:
    """``scheduler`` -> the default shard, ``scheduler:{s}`` -> ``s``; None for other fields."""
    if name == "scheduler":
        return DEFAULT_SHARD
    return name.split(":", 1)[1] if name.startswith("scheduler:") else None


def plan_stream(worker: str) -> str:
    return f"mfs:plan:{worker}"


def out_stream(gateway: str) -> str:
    return f"mfs:out:{gateway}"


def worker_key(worker: str) -> str:
    return f"mfs:worker:{worker}"


def gateway_key(gateway: str) -> str:
    return f"mfs:gateway:{gateway}"


def kv_session_key(session: str) -> str:
    return f"mfs:kv:session:{session}"


def kv_held_key(worker: str) -> str:
    return f"mfs:kv:held:{worker}"


def kv_sessions_key(worker: str) -> str:
    return f"mfs:kv:sessions:{worker}"


def ratelimit_key(key_id: str) -> str:
    return f"mfs:ratelimit:{key_id}"


def progress_key(request_id: str) -> str:
    return f"mfs:progress:{request_id}"


@cache
def _field_names(cls) -> tuple[str, ...]:
    return tuple(f.name for f in fields(cls))


def to_wire(record) -> dict:
    """A record (its ``NESTED`` records included) as the plain dict msgpack packs. Shallow: lists and
    dicts are packed as they are, not copied (``dataclasses.asdict`` deep-copied every block table of
    every plan row, a third of the leader's CPU in `mfs bench control-plane`, docs/SCALING.md)."""
    cls = type(record)
    out = {name: getattr(record, name) for name in _field_names(cls)}
    for name, sub in getattr(cls, "NESTED", {}).items():
        v = out[name]
        if v is not None:
            out[name] = [to_wire(x) for x in v] if isinstance(sub, list) else to_wire(v)
    return out


def from_wire(cls, raw: dict):
    """The plain dict off the wire -> ``cls``, its nested records (``cls.NESTED``: field -> record
    type, or ``[record type]`` for a list of them) rebuilt too; unknown keys are ignored, so a newer
    sender's extra fields do not break an older reader."""
    names = {f.name for f in fields(cls)}
    kw = {k: v for k, v in raw.items() if k in names}
    for name, sub in getattr(cls, "NESTED", {}).items():
        v = kw.get(name)
        if v is None:
            continue
        kw[name] = [from_wire(sub[0], x) for x in v] if isinstance(sub, list) else from_wire(sub, v)
    return cls(**kw)


class Record:
    """Typed msgpack record: ``encode()`` -> stream fields, ``decode(fields)`` -> record."""
    TYPE = ""

    def encode(self) -> dict[str, bytes]:
        return {"t": self.TYPE, "d": msgpack.packb(to_wire(self), use_bin_type=True)}

    @classmethod
    def from_body(cls, body: bytes):
        return from_wire(cls, msgpack.unpackb(body, raw=False, strict_map_key=False))


@dataclass(slots=True)
class Submit(Record):
    """A new request, as the gateway validated it: the prompt, the routed tier and its sampling."""
    TYPE = "submit"
    NESTED = {"params": SamplingParams}
    request_id: str
    gateway_id: str
    prompt_ids: list[int]
    tier: int
    params: SamplingParams = field(default_factory=SamplingParams)
    model_id: str = ""
    arrival: float = 0.0
    session_id: str | None = None
    # n > 1: the request id of the first choice. This choice is placed on its worker and admitted once
    # that one's prompt is computed, so it starts from the prompt's cached blocks (one prefill).
    follow: str | None = None


@dataclass(slots=True)
class Cancel(Record):
    TYPE = "cancel"
    request_id: str
    reason: str = "abort"


@dataclass(slots=True)
class TokenLogprob:
    """One token's log-probability under the tier that produced it (log-softmax of that tier's raw
    logits), and the most likely tokens at its position, most likely first."""
    token: int
    logprob: float
    top_ids: list[int] = field(default_factory=list)
    top_logprobs: list[float] = field(default_factory=list)


# A worker's decode execution paths (worker/execution.py): eager; inductor's graphs for the trunk only
# (exit blocks eager, while theirs build), then for the exit blocks too; CUDA graphs.
EXECUTION_PATHS = ("eager", "inductor-trunk", "inductor", "cuda-graphs")


@dataclass(slots=True)
class TokenEvent(Record):
    """Tokens of one request; ``seq`` is the index of ``token_ids[0]`` among its output tokens, so
    a client-side stream can drop duplicates and notice gaps."""
    TYPE = "tokens"
    NESTED = {"logprobs": [TokenLogprob], "prompt_logprobs": [TokenLogprob]}
    request_id: str
    seq: int
    token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None
    tier: int = 0
    worker: str = ""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None        # set with finish_reason "error"
    error_code: str | None = None   # OpenAI-style code, e.g. "context_length_exceeded"
    status: int = 0                 # HTTP status the gateway should answer an error with
    draft_proposed: int = 0         # self-speculation so far (cumulative): draft tokens proposed...
    draft_accepted: int = 0         # ...and accepted by the verifying tier
    logprobs: list[TokenLogprob] = field(default_factory=list)  # one per token_ids (when asked)
    prompt_logprobs: list[TokenLogprob] = field(default_factory=list)  # prompt tokens 1.. (seq 0 only)
    # the execution path of the step that computed these tokens (one of EXECUTION_PATHS; "" from a worker
    # that runs no model): compiled graphs may round otherwise than the eager
    # ops, and a worker swaps its path while it serves, so a response names the paths that served it
    path: str = ""


@dataclass(slots=True)
class TokenBatch(Record):
    """Every token event one worker step has for one gateway, in one stream entry: one XADD per gateway
    per step instead of one per request (docs/SCALING.md: Redis commands per token)."""
    TYPE = "tokens*"
    NESTED = {"events": [TokenEvent]}
    events: list[TokenEvent]


def token_events(entry_fields: dict) -> list[TokenEvent]:
    """An ``mfs:out:`` entry -> its token events (one, or a batch's); ValueError for anything else."""
    rec = decode(entry_fields)
    if isinstance(rec, TokenEvent):
        return [rec]
    if isinstance(rec, TokenBatch):
        return rec.events
    raise ValueError(f"not a token event: {type(rec).__name__}")


def batch_entry(events: list[TokenEvent]) -> dict:
    """The stream entry for one gateway's events of a step: a single event as itself, more as a batch."""
    return events[0].encode() if len(events) == 1 else TokenBatch(events).encode()


@dataclass(slots=True)
class NewRequest:
    """What a worker must know of a request to sample it and to notice its end."""
    NESTED = {"params": SamplingParams}
    request_id: str
    gateway_id: str
    tier: int
    prompt_len: int
    params: SamplingParams  # max_tokens is what is left of it (after a re-plan)
    stop_ids: list[int]     # params' stop ids and, unless ignored, the model's EOS
    cached_tokens: int = 0  # prompt tokens whose KV came from the prefix cache
    seq_offset: int = 0     # output tokens streamed before a re-plan (after a worker was lost)
    prompt_ids: list[int] = field(default_factory=list)  # only when the worker needs them (prompt
    #                         log-probabilities, penalties); after a re-plan the streamed tokens end it


@dataclass(slots=True)
class PlanRow:
    """One row of a step: tokens of one request computed through segments ``enter..tier``. Built in
    one place (scheduler/plan.py), run by worker/runner.py as it is."""
    request_id: str
    tier: int
    token_ids: list[int]           # tokens computed this step
    start_pos: int                 # tokens of this row already in the cache
    block_tables: list[list[int]]  # one per segment 0..tier
    sample: bool                   # the row's last token is its newest: sample the next
    num_output: int  # output tokens the request already has (the seq of the token sampled now)
    enter: int = 0   # first segment computed: > 0 for a cross-tier catch-up row (from stored hidden)
    draft: bool = False       # a speculation draft row: its token is the scheduler's, never streamed
    sample_all: bool = False  # a verification row (logits at every position): the worker accepts or
    #                           rejects `drafts` and streams the committed tokens
    drafts: list[int] = field(default_factory=list)  # verification: the round's draft tokens, one per
    #                           position of token_ids ([last committed] + drafts[:-1]); a draft row of a
    #                           request with penalties: the round's drafts so far (they count)
    logits_all: bool = False  # prompt log-probabilities: logits at every position (the last one
    #                           samples when `sample`), each scoring the prompt token after it
    exit_kv: list[int] | None = None  # the lower exits whose exit-block KV this row writes as it
    #                           crosses their boundary (its own tier's exit is always written); None:
    #                           every exit it crosses. Exits nobody will read are skipped (lazy exits).
    exit_only: bool = False   # an exit fill: tier `tier`'s exit block only, over cached positions,
    #                           entering from the trunk's state stored at that boundary (its KV was skipped)


@dataclass(slots=True)
class StepPlan(Record):
    TYPE = "plan"
    NESTED = {"new": [NewRequest], "rows": [PlanRow]}
    step_id: int
    new: list[NewRequest] = field(default_factory=list)  # requests the worker sees for the first time
    rows: list[PlanRow] = field(default_factory=list)    # this step's rows, any order
    drop: list[str] = field(default_factory=list)    # requests the worker may forget
    worker_started: str = ""  # the worker life it was made for: block tables of another life are stale
    epoch: int = 0            # the leading scheduler's generation: a newer one resets the worker's requests
    # Multi-step decoding (every row plain decode): the worker runs this many steps, each row fed its
    # own sampled token, a row stopping at its end or where its block tables end.
    steps: int = 1
    # ...and sends its greedy tokens to their clients every this many steps (a request's first and last
    # tokens at once): fewer wake-ups of Redis, gateway and client a token, larger chunks of text
    stream_every: int = 1


@dataclass(slots=True)
class StepResult(Record):
    TYPE = "result"
    worker: str
    step_id: int
    tokens: dict = field(default_factory=dict)  # request_id -> sampled token id
    forward_s: float = 0.0
    num_tokens: int = 0
    epoch: int = 0  # the plan's epoch: a result for an older leader's plan is ignored
    drafts: dict = field(default_factory=dict)     # request_id -> draft token (draft rows)
    verified: dict = field(default_factory=dict)   # request_id -> committed tokens (verification rows)
    accepted: dict = field(default_factory=dict)   # request_id -> drafts accepted
    escalate: list = field(default_factory=list)   # cascade requests that move one tier up (no token)
    draft_conf: dict = field(default_factory=dict)  # request_id -> the draft tier's confidence in its draft
    decoded: dict = field(default_factory=dict)  # a multi-step plan's: request_id -> every token it made


RECORDS = {r.TYPE: r for r in (Submit, Cancel, TokenEvent, TokenBatch, StepPlan, StepResult)}


def decode(entry_fields: dict) -> Record:
    """Stream entry fields (bytes keys or str keys) -> the typed record."""
    t = entry_fields.get(b"t", entry_fields.get("t"))
    d = entry_fields.get(b"d", entry_fields.get("d"))
    t = t.decode() if isinstance(t, bytes) else t
    if t not in RECORDS:
        raise ValueError(f"unknown record type {t!r}")
    return RECORDS[t].from_body(d)
