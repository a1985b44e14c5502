"""The worker protocol, whatever computes the steps: register (``mfs:worker:{id}``, renewed by a
heartbeat), read step plans from ``mfs:plan:{id}``, hand their rows to a runner, stream each sampled token
straight to the requesting gateway and the step result back to the scheduler. Torch-free: the model's
runner (worker/runner.py) and the null runner of the control-plane bench (worker/null.py) plug in."""
from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from typing import Protocol

import redis
import structlog

from core import protocol as P
from core.keyrecords import WorkerInfo
from core.sampling import SamplingParams, finish_reason

log = structlog.get_logger(__name__)


@dataclass(slots=True)
class Live:
    """What the worker keeps of a request between steps."""
    gateway_id: str
    tier: int
    prompt_len: int
    max_tokens: int
    stop_ids: frozenset[int]
    cached_tokens: int = 0
    seq_offset: int = 0  # tokens the client already has from a previous worker
    draft_proposed: int = 0
    draft_accepted: int = 0
    greedy: bool = True  # its tokens are the same when it is re-planned elsewhere


@dataclass(slots=True)
class WorkerSpec:
    """What a worker registers besides its life and epoch (core.protocol.WorkerInfo)."""
    tiers: list[int]
    num_tiers: int
    num_blocks: list[int]
    block_size: int
    max_model_len: int
    vocab_size: int
    eos: list[int]
    device: str = ""
    kernels: str = ""
    weights: str = "fp32"
    choice: str = ""  # what it serves and why (weights, threads, decode path): its start line
    shard: str = P.DEFAULT_SHARD  # the control-plane shard it joins
    exit_blocks: list[int] = field(default_factory=list)  # segments whose tier has an exit block
    kv_window: int = 0  # every layer's attention window (the widest) when each has one, else 0


class Runner(Protocol):
    """What the loop needs of a runner (worker/runner.py: ModelRunner)."""
    def add(self, request_id: str, params: SamplingParams, prompt_ids=None, seq_offset: int = 0) -> None: ...
    def drop(self, request_ids) -> None: ...
    def execute(self, rows: list[P.PlanRow]): ...  # -> an object shaped like runner.StepOutput


class WorkerLoop:
    def __init__(self, worker_id: str, r: redis.Redis, runner: Runner, spec: WorkerSpec):
        self.id = worker_id
        self.r = r
        self.runner = runner
        self.spec = spec
        self.shard = P.Shard(spec.shard)
        self.max_model_len = spec.max_model_len
        self.live: dict[str, Live] = {}
        self.started = f"{time.time():.6f}-{os.getpid()}"
        self.stop = threading.Event()
        self.steps = 0
        self.epoch = 0  # the newest scheduler generation seen in a plan

    # ---- registration ------------------------------------------------------------------------
    def info(self) -> WorkerInfo:
        s = self.spec
        return WorkerInfo(s.tiers, s.num_tiers, s.num_blocks, s.block_size, s.max_model_len, s.vocab_size,
                            list(s.eos), self.started, device=s.device, kernels=s.kernels, weights=s.weights, choice=s.choice,
                            shard=s.shard, pid=os.getpid(), epoch=self.epoch, heartbeat=time.time(),
                            exit_blocks=list(s.exit_blocks), kv_window=s.kv_window)

    def register(self) -> None:
        stream = P.plan_stream(self.id)
        self.r.delete(stream)  # plans for a previous life of this id refer to blocks it no longer has
        self._ensure_group()
        self._announce(self.r)
        log.info("worker registered", worker=self.id, shard=self.shard.name, tiers=self.spec.tiers, blocks=self.spec.num_blocks,
                 kernels=self.spec.kernels)

    def deregister(self) -> None:
        """Stops the heartbeat and removes the registration: a clean stop is seen at once."""
        self.stop.set()
        try:
            self.r.srem(self.shard.workers_set, self.id)
            self.r.delete(P.worker_key(self.id))
        except redis.RedisError:
            pass

    def _ensure_group(self) -> None:
        try:
            self.r.xgroup_create(P.plan_stream(self.id), P.WORKER_GROUP, id="0", mkstream=True)
        except redis.ResponseError as e:
            if "BUSYGROUP" not in str(e):
                raise

    def _announce(self, client: redis.Redis) -> None:
        """The whole registration every time: after a Redis restart that lost it, the next heartbeat
        brings it back complete."""
        p = client.pipeline()
        p.hset(P.worker_key(self.id), mapping=self.info().to_hash())
        p.expire(P.worker_key(self.id), P.WORKER_TTL_S)
        p.sadd(self.shard.workers_set, self.id)
        p.execute()

    def _heartbeat(self) -> None:
        hb = redis.Redis(connection_pool=self.r.connection_pool)
        down_since = None
        while not self.stop.wait(P.HEARTBEAT_S):
            try:
                self._announce(hb)
                if down_since is not None:
                    log.info("redis reachable again", worker=self.id, down_s=round(time.monotonic() - down_since, 1))
                    down_since = None
            except redis.RedisError as e:
                if down_since is None:
                    down_since = time.monotonic()
                    log.warning("heartbeat failed", worker=self.id, error=str(e))

    # ---- the loop ----------------------------------------------------------------------------
    def run(self) -> None:
        self.register()
        threading.Thread(target=self._heartbeat, daemon=True, name="heartbeat").start()
        stream = P.plan_stream(self.id)
        consumer = f"{self.id}-{os.getpid()}"
        backoff, last_id, trimmed = 0.1, None, time.monotonic()
        # After a lost connection, read this consumer's pending plans first: a reply that was on its way
        # when the connection died delivered plans Redis now counts as ours, which '>' never returns.
        recover = False
        while not self.stop.is_set():
            try:
                resp = self.r.xreadgroup(P.WORKER_GROUP, consumer, {stream: "0" if recover else ">"}, count=8,
                                         block=None if recover else 1000)
                recover = False
                for _, entries in resp or []:
                    for entry_id, fields in entries:
                        acked = False
                        if last_id is None or _entry_key(entry_id) > _entry_key(last_id):
                            try:
                                acked = self.execute(P.decode(fields), ack=(stream, entry_id))
                            except (ValueError, TypeError, KeyError) as e:
                                log.error("bad plan dropped", worker=self.id, entry=entry_id, error=str(e))
                            last_id = entry_id
                        if not acked:  # a plan dropped or already executed: acknowledged on its own
                            self.r.xack(stream, P.WORKER_GROUP, entry_id)
                if last_id is not None and time.monotonic() - trimmed > 5.0:
                    self.r.xtrim(stream, minid=last_id, approximate=True)  # executed plans can go
                    trimmed = time.monotonic()
                backoff = 0.1
            except redis.ResponseError as e:
                if "NOGROUP" not in str(e):
                    raise
                log.warning("plan stream lost (Redis restarted without it); recreating", worker=self.id)
                self._ensure_group()
            except redis.RedisError as e:
                log.warning("plan read failed; retrying", worker=self.id, error=str(e), retry_in_s=backoff)
                recover = True
                time.sleep(backoff)
                backoff = min(2.0, backoff * 2)

    def execute(self, plan: P.StepPlan, ack: tuple | None = None) -> bool:
        """Runs one plan and delivers its token events and result. ``ack`` (stream, entry id): the plan's
        acknowledgement goes in the same round trip as the result (one less per step on the worker's path
        to its next plan); True when it did, False when the plan was dropped unexecuted."""
        if plan.worker_started and plan.worker_started != self.started:
            log.warning("plan for a previous life dropped", worker=self.id, step=plan.step_id)
            return False  # its block tables may point at cached KV this life never computed
        if plan.epoch < self.epoch:
            log.warning("plan from a former scheduler leader dropped", worker=self.id, epoch=plan.epoch,
                        current=self.epoch)
            return False
        if plan.epoch > self.epoch:
            if self.live:  # the new leader re-plans them from what it knows; forget this life's copies
                log.info("new scheduler leader: requests reset", worker=self.id, epoch=plan.epoch,
                         dropped=len(self.live))
            self.runner.drop(list(self.live))
            self.live.clear()
            self.epoch = plan.epoch
        t0 = time.perf_counter()
        self.runner.drop(plan.drop)
        for rid in plan.drop:
            self.live.pop(rid, None)
        for nr in plan.new:
            self.runner.add(nr.request_id, nr.params, nr.prompt_ids, nr.seq_offset)
            self.live[nr.request_id] = Live(nr.gateway_id, nr.tier, nr.prompt_len, nr.params.max_tokens,
                                            frozenset(nr.stop_ids), nr.cached_tokens, nr.seq_offset,
                                            greedy=nr.params.greedy)
        # A multi-step plan streams its greedy tokens every `stream_every` steps of the plan (a request's
        # first and last at once, the rest at the plan's end); a sampling request's wait for the result's
        # round trip: should this worker die before it, the request is re-planned from the tokens the
        # scheduler knows, and a client must not hold sampled tokens it will not continue from.
        rows, num_tokens, decoded, held, writing = plan.rows, 0, {}, [], 0.0
        pending: dict[str, tuple[str, P.TokenEvent]] = {}  # greedy events not sent yet, one per request
        for i in range(plan.steps):
            out = self.runner.execute(rows)
            num_tokens += out.num_tokens
            pipe = self.r.pipeline(transaction=False)
            if plan.steps == 1:
                self._send_events(self._emit(rows, out)[0], pipe)
                break
            now, urgent = self._emit(rows, out, held)
            for rid, tok in out.tokens.items():
                decoded.setdefault(rid, []).append(tok)
            rows = self._next_rows(rows, out) if i + 1 < plan.steps else []
            if any(pending.get(ev.request_id, (0, ev))[1].path != ev.path for _, ev in now):
                self._send_events(list(pending.values()), pipe)  # one event, one path: the swap's step
                pending.clear()
            pending_merge(pending, now)
            if not rows:
                break
            if pending and (urgent or (i + 1) % max(1, plan.stream_every) == 0):
                self._send_events(list(pending.values()), pipe)
                pending.clear()
            if pipe.command_stack:  # these greedy tokens reach their clients now, before the next step:
                # written here, not from a writer thread while it computes (on 2 cores that thread
                # slowed the forward's OpenMP threads more than the round trip costs)
                tw = time.perf_counter()
                self._deliver(pipe.command_stack[:])
                writing += time.perf_counter() - tw
        dt = time.perf_counter() - t0 - writing  # the plan's own work (forward_s), not its writes
        self._send_events(list(pending.values()) + held, pipe)
        res = P.StepResult(self.id, plan.step_id, {} if decoded else out.tokens, dt, num_tokens, plan.epoch,
                           out.drafts, out.verified, out.accepted, out.escalate, out.draft_conf, decoded)
        pipe.xadd(self.shard.done_stream, res.encode(), maxlen=P.STREAM_MAXLEN, approximate=True)
        if ack is not None:
            pipe.xack(ack[0], P.WORKER_GROUP, ack[1])
        self._deliver(pipe.command_stack[:])
        self.steps += 1
        return ack is not None

    def _emit(self, rows: list[P.PlanRow], out, held: list | None = None
              ) -> tuple[list[tuple[str, P.TokenEvent]], bool]:
        """One step's token events to send now, as (gateway, event), and whether one of them is a request's
        first or last (not to be held back); a request that ends is forgotten. `held`: where a multi-step
        plan keeps a sampling request's events until its result goes."""
        # What a client sees: plain rows' tokens and verification rows' committed tokens; never drafts.
        emitted = {rid: [tok] for rid, tok in out.tokens.items()}
        emitted.update(out.verified)
        # the row each emitting request sampled from: its plain row or its verification row (not a
        # draft row, not a catch-up row, not an exit fill)
        row_of = {r.request_id: r for r in rows
                  if r.sample_all or (r.enter == 0 and not r.draft and not r.exit_only)}
        now: list[tuple[str, P.TokenEvent]] = []
        urgent = False
        for rid, toks in emitted.items():
            live, row = self.live.get(rid), row_of.get(rid)
            if live is None or row is None:
                continue
            live.tier = row.tier  # a cascade moves a request up
            if row.sample_all:
                live.draft_proposed += len(row.drafts)
                live.draft_accepted += out.accepted.get(rid, 0)
            sent, reason = [], None
            for tok in toks:
                sent.append(tok)
                n = row.num_output + len(sent)
                reason = finish_reason(tok, n, live.prompt_len + n, live.max_tokens, live.stop_ids,
                                       self.max_model_len)
                if reason:
                    break
            first = row.num_output == 0
            ev = P.TokenEvent(rid, live.seq_offset + row.num_output, sent, reason is not None, reason,
                              live.tier, self.id, live.prompt_len - live.seq_offset,
                              live.cached_tokens if first else 0, draft_proposed=live.draft_proposed,
                              draft_accepted=live.draft_accepted, logprobs=out.logprobs.get(rid, [])[:len(sent)],
                              prompt_logprobs=out.prompt_logprobs.get(rid, []) if first else [],
                              path=getattr(out, "path", ""))  # the null runner's steps name none
            if held is None or live.greedy:
                now.append((live.gateway_id, ev))
                urgent = urgent or first or reason is not None
            else:
                held.append((live.gateway_id, ev))
            if reason:
                self.live.pop(rid, None)
                self.runner.drop([rid])
        return now, urgent

    @staticmethod
    def _send_events(events: list[tuple[str, P.TokenEvent]], pipe) -> None:
        by_gateway: dict[str, list[P.TokenEvent]] = {}
        for gw, ev in events:
            by_gateway.setdefault(gw, []).append(ev)
        for gw, evs in by_gateway.items():  # one entry per gateway per step
            pipe.xadd(P.out_stream(gw), P.batch_entry(evs), maxlen=P.STREAM_MAXLEN, approximate=True)

    def _next_rows(self, rows: list[P.PlanRow], out) -> list[P.PlanRow]:
        """A multi-step plan's next rows: each live row fed the token it sampled, while its block tables
        hold the next position (the scheduler grew them for the plan's steps)."""
        nxt = []
        for r in rows:
            tok = out.tokens.get(r.request_id)
            pos = r.start_pos + len(r.token_ids)
            if tok is None or r.request_id not in self.live \
                    or pos >= min(len(t) for t in r.block_tables) * self.spec.block_size:
                continue
            nxt.append(P.PlanRow(r.request_id, r.tier, [tok], pos, r.block_tables, True, r.num_output + 1,
                                 exit_kv=r.exit_kv))
        return nxt

    def _deliver(self, commands: list) -> None:
        """Writes a step's token events and result, retrying through a lost connection: the step is done
        and its result is what the scheduler waits for. A copy written twice (the first write landed, its
        reply did not) is harmless: the gateway drops events by seq, the scheduler a result it has."""
        backoff, deadline = 0.1, time.monotonic() + 2 * P.WORKER_TTL_S
        while True:
            pipe = self.r.pipeline(transaction=False)
            for args, options in commands:
                pipe.execute_command(*args, **options)
            try:
                pipe.execute()
                return
            except (redis.ConnectionError, redis.TimeoutError) as e:
                if self.stop.is_set() or time.monotonic() > deadline:
                    raise  # by now the scheduler has dropped this worker and re-planned its requests
                log.warning("step result not delivered; retrying", worker=self.id, error=str(e), retry_in_s=backoff)
                time.sleep(backoff)
                backoff = min(2.0, backoff * 2)


def pending_merge(pending: dict[str, tuple[str, P.TokenEvent]], events: list[tuple[str, P.TokenEvent]]) -> None:
    """A multi-step plan's greedy events into the ones not sent yet: a request's later tokens extend its
    pending event (the same seq start, its tokens and log-probabilities appended, the latest state)."""
    for gw, ev in events:
        prev = pending.get(ev.request_id)
        if prev is None:
            pending[ev.request_id] = (gw, ev)
            continue
        p = prev[1]
        p.token_ids = p.token_ids + ev.token_ids
        p.logprobs = p.logprobs + ev.logprobs
        p.finished, p.finish_reason, p.tier = ev.finished, ev.finish_reason, ev.tier
        p.draft_proposed, p.draft_accepted = ev.draft_proposed, ev.draft_accepted


def _entry_key(entry_id) -> tuple[int, int]:
    ms, _, seq = (entry_id.decode() if isinstance(entry_id, bytes) else entry_id).partition("-")
    return int(ms), int(seq or 0)
