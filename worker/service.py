"""The worker process: holds the nested model (or one standalone tier) and its KV tensors, executes
the scheduler's step plans, streams each sampled token straight to the requesting gateway and the
step result back to the scheduler. A heartbeat keeps its registration alive."""
from __future__ import annotations

import argparse
import os
import threading
import time
from dataclasses import dataclass

import redis
import structlog
import torch

from core import protocol as P
from core.sampling import finish_reason
from worker.runner import ModelRunner

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


class WorkerService:
    def __init__(self, args):
        from mfs.family import load_family  # noqa: PLC0415
        from worker.model import standalone_tier  # noqa: PLC0415
        self.id = args.worker_id
        self.r = redis.Redis.from_url(args.redis_url)
        standalone = args.standalone_tier is not None
        from worker.quant import resolve_mode  # noqa: PLC0415
        self.weights = resolve_mode(args.weights, args.device)
        # A standalone tier is cut from the fp32 family, then quantized like the nested one.
        fam = load_family(args.model, tiers=args.tiers, dtype=args.dtype, device=args.device,
                          kernels=args.kernels, weights="fp32" if standalone else args.weights)
        model = fam.model
        ntiers = len(model.tiers)
        if standalone:
            k = args.standalone_tier
            if not 0 <= k < ntiers:
                raise ValueError(f"--standalone-tier {k}: the family has tiers 0..{ntiers - 1}")
            model, self.tiers, tier_map, nseg = standalone_tier(model, k), [k], {k: 0}, 1
            source = fam.base.source
            del fam  # the rest of the family is not this worker's: give its memory back
            _release_memory()
            if self.weights != "fp32":
                from worker.quant import quantize_model  # noqa: PLC0415
                quantize_model(model, self.weights, gguf_path=source, device=args.device)
        else:
            self.tiers, tier_map, nseg = list(range(ntiers)), None, ntiers
        self.num_blocks = [args.num_blocks] * nseg
        self.block_size = args.block_size
        self.max_model_len = min(args.max_model_len, model.max_positions)
        self.runner = ModelRunner(model, self.num_blocks, args.block_size, tier_map=tier_map)
        self.model = model
        self.num_tiers = ntiers
        self.live: dict[str, Live] = {}
        self.started = f"{time.time():.6f}-{os.getpid()}"
        self.stop = threading.Event()
        self.steps = 0
        self.epoch = 0  # the newest scheduler generation seen in a plan

    # ---- registration ------------------------------------------------------------------------
    def info(self) -> P.WorkerInfo:
        cfg = self.model.cfg
        return P.WorkerInfo(self.tiers, self.num_tiers, self.num_blocks, self.block_size, self.max_model_len,
                            cfg.vocab_size, list(cfg.eos_token_ids), self.started, device=str(self.runner.device),
                            kernels=self.model.ops.name, weights=self.weights, pid=os.getpid(),
                            epoch=self.epoch, heartbeat=time.time())

    def register(self) -> None:
        stream = P.plan_stream(self.id)
        self.r.delete(stream)  # plans for a previous life of this id refer to blocks it no longer has
        self._ensure_group()
        self._announce(self.r)
        log.info("worker registered", worker=self.id, tiers=self.tiers, blocks=self.num_blocks,
                 kernels=self.model.ops.name)

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
        p.sadd(P.WORKERS_SET, self.id)
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
        while not self.stop.is_set():
            try:
                resp = self.r.xreadgroup(P.WORKER_GROUP, consumer, {stream: ">"}, count=8, block=1000)
                for _, entries in resp or []:
                    for entry_id, fields in entries:
                        try:
                            self.execute(P.decode(fields))
                        except (ValueError, TypeError, KeyError) as e:
                            log.error("bad plan dropped", worker=self.id, entry=entry_id, error=str(e))
                        self.r.xack(stream, P.WORKER_GROUP, entry_id)
                        last_id = entry_id
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
                time.sleep(backoff)
                backoff = min(2.0, backoff * 2)

    def execute(self, plan: P.StepPlan) -> None:
        if plan.worker_started and plan.worker_started != self.started:
            log.warning("plan for a previous life dropped", worker=self.id, step=plan.step_id)
            return  # its block tables may point at cached KV this life never computed
        if plan.epoch < self.epoch:
            log.warning("plan from a former scheduler leader dropped", worker=self.id, epoch=plan.epoch,
                        current=self.epoch)
            return
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
                                            frozenset(nr.stop_ids), nr.cached_tokens, nr.seq_offset)
        rows = plan.rows
        out = self.runner.execute(rows)
        dt = time.perf_counter() - t0
        # What a client sees: plain rows' tokens and verification rows' committed tokens; never drafts.
        emitted = {rid: [tok] for rid, tok in out.tokens.items()}
        emitted.update(out.verified)
        # the row each emitting request sampled from: its plain row or its verification row (not a
        # draft row, not a catch-up row)
        row_of = {r.request_id: r for r in rows if r.sample_all or (r.enter == 0 and not r.draft)}
        pipe = self.r.pipeline(transaction=False)
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
                              prompt_logprobs=out.prompt_logprobs.get(rid, []) if first else [])
            pipe.xadd(P.out_stream(live.gateway_id), ev.encode(), maxlen=P.STREAM_MAXLEN, approximate=True)
            if reason:
                self.live.pop(rid, None)
                self.runner.drop([rid])
        res = P.StepResult(self.id, plan.step_id, out.tokens, dt, out.num_tokens, plan.epoch, out.drafts,
                           out.verified, out.accepted, out.escalate, out.draft_conf)
        pipe.xadd(P.DONE_STREAM, res.encode(), maxlen=P.STREAM_MAXLEN, approximate=True)
        pipe.execute()
        self.steps += 1


def _release_memory() -> None:
    import ctypes  # noqa: PLC0415
    import gc  # noqa: PLC0415
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass


def main(argv: list[str] | None = None) -> int:
    from mfs.commands import add_model_args  # noqa: PLC0415
    from core.logs import configure, install_stop_signals  # noqa: PLC0415
    p = argparse.ArgumentParser(prog="python -m worker", description="MFS worker process")
    add_model_args(p)
    p.add_argument("--worker-id", default=f"w-{os.getpid()}")
    p.add_argument("--redis-url", default=os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/0"))
    p.add_argument("--num-blocks", type=int, default=1024, help="KV blocks per segment pool")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--standalone-tier", type=int, default=None,
                   help="serve only this tier, as its own truncated copy (the independent layout)")
    p.add_argument("--threads", type=int, default=max(1, (os.cpu_count() or 2) - 1),
                   help="torch threads (default: all cores but one, which the gateway and scheduler use)")
    args = p.parse_args(argv)
    configure(json_lines=True)
    install_stop_signals()
    torch.set_num_threads(args.threads)
    svc = WorkerService(args)
    try:
        svc.run()
    except KeyboardInterrupt:
        pass
    finally:
        svc.stop.set()
        try:
            svc.r.srem(P.WORKERS_SET, svc.id)
            svc.r.delete(P.worker_key(svc.id))
        except redis.RedisError:
            pass
    return 0
