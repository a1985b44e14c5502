"""The gateway's side of the protocol, for tests that drive the scheduler and workers over a real Redis:
submitting requests, reading their token events, and waiting on the scheduler's published stats."""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from core import protocol as P
from core.keyrecords import StatsSnapshot
from tests.support.wait import wait_for
from worker.sampling import SamplingParams

GW = "gw-test"


def submit(r, rid, prompt, tier, session_id=None, **params):
    sub = P.Submit(rid, GW, prompt, tier, SamplingParams(**params), arrival=time.time(), session_id=session_id)
    r.xadd(P.REQ_STREAM, sub.encode())


class Reader:
    def __init__(self, r, gw=GW):
        self.r, self.stream, self.last = r, P.out_stream(gw), "0"
        self.events: dict[str, list[P.TokenEvent]] = {}

    def until(self, pred, timeout=60.0, not_yet: tuple = ()):
        """Reads token events until ``pred()`` holds (each read blocks up to half a second); an error in
        ``not_yet`` (a connection lost in a failover) is retried, any other one fails the test."""
        def read_then_check():
            if pred():
                return True
            self.read(block_ms=500)
            return pred()
        wait_for(read_then_check, timeout, lambda: f"the condition; got {self.summary()}", poll=0, not_yet=not_yet)

    def read(self, block_ms: int | None) -> None:
        """Adds the token events on the stream (block_ms: how long to wait for one; None: no wait)."""
        for _, entries in self.r.xread({self.stream: self.last}, block=block_ms) or []:
            for eid, f in entries:
                self.last = eid
                for ev in P.token_events(f):
                    self.events.setdefault(ev.request_id, []).append(ev)

    def finished(self, rid):
        return any(e.finished for e in self.events.get(rid, []))

    def tokens(self, rid):
        evs = sorted(self.events.get(rid, []), key=lambda e: e.seq)
        seqs = [e.seq + i for e in evs for i in range(len(e.token_ids))]
        toks = [t for e in evs for t in e.token_ids]
        assert seqs == list(range(len(toks))), f"{rid}: sequence numbers {seqs}"
        return toks

    def summary(self):
        return {k: (len(v), v[-1].finish_reason) for k, v in self.events.items()}


def stats(r) -> StatsSnapshot | None:
    return StatsSnapshot.decode(r.hget(P.STATS_KEY, "scheduler"))


def stats_after(r, pred: Callable[[StatsSnapshot], bool], timeout: float, what: str,
                since: float | None = None) -> StatsSnapshot:
    """The first stats snapshot written after `since` (default: this call) for which pred holds. (The
    scheduler writes one every half second: an older one may predate the work just done — a fast
    test's requests can all finish within one interval — and look idle with none of it.)"""
    since = time.time() if since is None else since
    return wait_for(lambda: (s := stats(r)) is not None and s.updated >= since and pred(s) and s, timeout, what,
                    poll=0.1)


def idle(s: StatsSnapshot) -> bool:
    return not any(s.running.values()) and not any(s.waiting.values())


def wait_kv_idle(r, timeout=10) -> StatsSnapshot:
    """Every KV block free and nothing running."""
    return stats_after(r, lambda s: all(sum(v) == 0 for v in s.kv_blocks_used.values()) and not any(s.running.values()),
                       timeout, "every KV block free and nothing running")


def wait_idle(r, timeout=10) -> StatsSnapshot:
    """No request left, running or waiting."""
    return stats_after(r, idle, timeout, "the scheduler to be idle")


@dataclass(slots=True)
class Served:
    """What :func:`serve_each_tier` got: the prompts by request id ((prompt, tier)), the reader holding
    their token events, and each registered worker's hash (bytes keys and values, as Redis gives them)."""
    prompts: dict[str, tuple[list[int], int]]
    reader: Reader
    workers: dict[str, dict[bytes, bytes]]


def serve_each_tier(model: str, tiers: str, prefix: str, prompt: Callable[[int], list[int]], *, dtype: str,
                    worker_args: tuple[str, ...] = (), layout: str = "nested", max_tokens: int = 6) -> Served:
    """One greedy request of ``max_tokens`` per tier of ``tiers`` (``prompt(tier)``) through the scheduler
    and workers (no gateway; 64 blocks of 4, one thread a worker), read until all have finished."""
    import redis  # noqa: PLC0415

    from service.launch import Service  # noqa: PLC0415
    prompts = {f"{prefix}{t}": (prompt(t), t) for t in range(len(tiers.split(",")))}
    with Service(model, tiers=tiers, layout=layout, gateway=False, dtype=dtype,
                 worker_args=["--num-blocks", "64", "--block-size", "4", "--threads", "1", *worker_args]) as svc:
        r = redis.Redis.from_url(svc.redis_url)
        for rid, (p, t) in prompts.items():
            submit(r, rid, p, t, max_tokens=max_tokens, ignore_eos=True)
        rd = Reader(r)
        rd.until(lambda: all(rd.finished(rid) for rid in prompts))
        workers = {w.decode(): r.hgetall(P.worker_key(w.decode())) for w in r.smembers(P.WORKERS_SET)}
    return Served(prompts, rd, workers)
