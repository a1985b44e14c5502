"""Null workers, for measuring the control plane (`mfs bench control-plane`): the real worker protocol
(worker/loop.py: registration, heartbeat, plans in, token events and step results out) around a runner
with no model, which answers every step after a fixed simulated step time. Many run in one process,
one thread each, so 128 of them fit on a small machine; torch is never loaded.

Each null worker also records the control plane's share of its step: the gap between publishing a step's
results and receiving its next plan (the scheduler's planning plus the Redis round trips). On a stop
(SIGINT/SIGTERM) the process writes those gaps, with the wall-clock time each ended, to --stats-file."""
from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
import zlib
from dataclasses import dataclass, field

import redis

from core import protocol as P
from core.cli import add_args, from_args, opt
from core.redisconn import add_redis_args, connect, target_from_args
from core.sampling import SamplingParams
from worker.loop import WorkerLoop, WorkerSpec

VOCAB = 49152
EOS = [0]


@dataclass(slots=True)
class NullOutput:
    """Shaped like worker.runner.StepOutput."""
    tokens: dict[str, int] = field(default_factory=dict)
    logits: None = None
    num_tokens: int = 0
    drafts: dict[str, int] = field(default_factory=dict)
    draft_conf: dict[str, float] = field(default_factory=dict)
    verified: dict[str, list[int]] = field(default_factory=dict)
    accepted: dict[str, int] = field(default_factory=dict)
    escalate: list[str] = field(default_factory=list)
    logprobs: dict = field(default_factory=dict)          # null workers compute none
    prompt_logprobs: dict = field(default_factory=dict)


def null_token(request_id: str, position: int) -> int:
    """The token a null worker 'samples' at a position: a function of the request and the position
    only, so a request moved to another worker continues the same sequence; never an EOS."""
    return 1 + zlib.crc32(f"{request_id}:{position}".encode()) % (VOCAB - 1)


class NullRunner:
    """Sleeps `step_s` per step (the simulated forward), then samples `null_token` for every sampled row;
    a verification row accepts all its drafts."""

    def __init__(self, step_s: float):
        self.step_s = step_s
        self.params: dict[str, SamplingParams] = {}

    def add(self, request_id: str, params: SamplingParams, prompt_ids=None, seq_offset: int = 0) -> None:
        self.params[request_id] = params

    def drop(self, request_ids) -> None:
        for rid in request_ids:
            self.params.pop(rid, None)

    def execute(self, rows: list[P.PlanRow]) -> NullOutput:
        time.sleep(self.step_s)
        out = NullOutput(num_tokens=sum(len(r.token_ids) for r in rows))
        for r in rows:
            if r.sample_all:
                out.verified[r.request_id] = list(r.drafts)
                out.accepted[r.request_id] = len(r.drafts)
            elif r.sample:
                tok = null_token(r.request_id, r.start_pos + len(r.token_ids))
                (out.drafts if r.draft else out.tokens)[r.request_id] = tok
        return out


class NullWorker(WorkerLoop):
    def __init__(self, worker_id: str, r: redis.Redis, step_s: float, num_tiers: int = 3,
                 num_blocks: int = 4096, block_size: int = 16, max_model_len: int = 4096,
                 shard: str = P.DEFAULT_SHARD):
        spec = WorkerSpec(list(range(num_tiers)), num_tiers, [num_blocks] * num_tiers, block_size,
                          max_model_len, VOCAB, EOS, device="null", kernels="null", weights="none",
                          shard=shard)
        super().__init__(worker_id, r, NullRunner(step_s), spec)
        self.gaps: list[tuple[float, float]] = []  # (wall clock when the plan arrived, gap in s)
        self._published: float | None = None

    def execute(self, plan: P.StepPlan, ack: tuple | None = None) -> bool:
        arrived = time.perf_counter()
        if self._published is not None:
            self.gaps.append((time.time(), arrived - self._published))
        done = super().execute(plan, ack)
        self._published = time.perf_counter()
        return done


def parse_shards(spec: str) -> list[str]:
    """``a,b`` -> the shard names, each checked (core.protocol.Shard.check)."""
    return [P.Shard.check(s.strip()) for s in spec.split(",")]


@dataclass(slots=True)
class NullConfig:
    """The knobs of one ``python -m worker.null`` process (its flags are generated from these fields)."""
    workers: int = opt(1, "null workers in this process (one thread each)")
    prefix: str = opt(default_factory=lambda: f"null-{os.getpid()}-", help="worker ids are PREFIX0, PREFIX1, ...")
    step_ms: float = opt(15.0, "simulated step time (a GPU decode step: ~15)")
    num_tiers: int = opt(3, "tiers of the simulated family")
    stats_file: str | None = opt(None, "JSON of the measured gaps, written on stop")
    shards: list[str] = opt(default_factory=lambda: [P.DEFAULT_SHARD], parse=parse_shards,
                            help="comma list of control-plane shards; worker i joins shard i mod their number")

    def check(self) -> None:
        if self.workers < 1 or self.step_ms < 0 or self.num_tiers < 1:
            raise ValueError("--workers and --num-tiers must be >= 1, --step-ms >= 0")


def main(argv: list[str] | None = None) -> int:
    from core.logs import configure, install_stop_signals  # noqa: PLC0415
    p = argparse.ArgumentParser(prog="python -m worker.null",
                                description="null workers (no model) for the control-plane benchmark")
    add_redis_args(p)
    add_args(p, NullConfig)
    a = p.parse_args(argv)
    args = from_args(NullConfig, a)
    try:
        args.check()
    except ValueError as e:
        p.error(str(e))
    shards = args.shards
    configure(json_lines=True)
    install_stop_signals()
    target = target_from_args(a)
    loops = [NullWorker(f"{args.prefix}{i}", connect(target), args.step_ms / 1000,
                        num_tiers=args.num_tiers, shard=shards[i % len(shards)]) for i in range(args.workers)]
    threads = [threading.Thread(target=w.run, name=w.id, daemon=True) for w in loops]
    for t in threads:
        t.start()
    try:
        while any(t.is_alive() for t in threads):
            time.sleep(0.5)
        print("python -m worker.null: every worker thread ended", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 0
    finally:
        for w in loops:
            w.deregister()
        for t in threads:
            t.join(3)
        if args.stats_file:
            with open(args.stats_file, "w") as f:
                json.dump({w.id: {"gaps": w.gaps, "steps": w.steps} for w in loops}, f)


if __name__ == "__main__":
    sys.exit(main())
