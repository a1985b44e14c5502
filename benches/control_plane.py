"""`mfs bench control-plane`: how many workers one leading scheduler can drive, and what shards add.

Null workers (worker/null.py: the real worker protocol, no model, a fixed simulated step time) and a
closed-loop synthetic client (it submits to `mfs:req` as a gateway does, with a gateway heartbeat, and
reads its `mfs:out:` stream; each finished request is replaced at once) drive the real scheduler and a
real Redis. For each worker count, after a warm-up, one measured window reports:

* steps/s the workers completed, against the ideal (workers / step time): "keeps up" means >= 90 %;
* tokens/s streamed to the client;
* the gap each null worker saw between publishing a step's results and receiving its next plan (p50,
  p99): what the control plane adds to every step;
* the leader's CPU (share of one core, and CPU ms per step), Redis's CPU, the null workers' and the
  client's CPU (they share this machine: on a small machine they compete with the leader);
* Redis commands and network bytes per generated token.

With ``--shards 1,2,4`` each point runs that many shards (core.protocol "Shards"): one scheduler per
shard, the null workers spread over them round-robin, and the client's submits too (a gateway's
least-loaded choice spreads an even load the same way); steps, CPU and the gaps are summed or pooled
over the shards, and the busiest leader's CPU share is reported beside the total.

The gateway's HTTP/SSE work is not in the loop (a gateway scales out by adding gateways); the scheduler,
Redis and the worker protocol are the real ones."""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
import threading
import time
from datetime import datetime, timezone
from pathlib import Path

import redis

from core import protocol as P
from core.keyrecords import StatsSnapshot
from core.redisconn import connect
from core.sampling import SamplingParams
from engine.runtime import write_json

WORKERS_PER_PROCESS = 32
GATEWAY_ID = "bench-cp"


def _cpu_s(pid: int) -> float:
    """utime + stime of a process (all its threads), in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _machine_busy_s() -> float:
    """CPU-seconds every CPU of the machine spent busy (any process), from /proc/stat."""
    v = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return (sum(v[:8]) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK")  # all but idle and iowait


def _pct(xs: list[float], p: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, math.ceil(p / 100 * len(xs)) - 1))]


def _redis_counters(r: redis.Redis) -> dict[str, float]:
    s, c = r.info("stats"), r.info("cpu")
    return {"commands": s["total_commands_processed"],
            "bytes": s["total_net_input_bytes"] + s["total_net_output_bytes"],
            "cpu_s": c["used_cpu_user"] + c["used_cpu_sys"]}


class Client:
    """Keeps `concurrency` requests in flight: submits, reads token events, replaces each finished one."""

    def __init__(self, r: redis.Redis, concurrency: int, prompt_tokens: int, max_tokens: int, tiers: int,
                 shards: int = 1):
        self.r, self.concurrency = r, concurrency
        self.streams = [P.Shard(str(s)).req_stream for s in range(shards)]
        self.prompt_tokens, self.max_tokens, self.tiers = prompt_tokens, max_tokens, tiers
        self.next_id = 0
        self.tokens = 0
        self.finished = 0
        self.errors: list[str] = []
        self.stop = threading.Event()

    def submit(self, pipe) -> None:
        i = self.next_id
        self.next_id += 1
        prompt = [3 + (i * 7 + k) % 40000 for k in range(self.prompt_tokens)]  # distinct: no prefix reuse
        s = P.Submit(f"cp-{i}", GATEWAY_ID, prompt, i % self.tiers,
                     SamplingParams(max_tokens=self.max_tokens, ignore_eos=True), arrival=time.time())
        pipe.xadd(self.streams[i % len(self.streams)], s.encode())

    def heartbeat(self) -> None:
        while not self.stop.wait(P.HEARTBEAT_S):
            self.r.set(P.gateway_key(GATEWAY_ID), b"bench", ex=P.WORKER_TTL_S)

    def run(self) -> None:
        self.r.set(P.gateway_key(GATEWAY_ID), b"bench", ex=P.WORKER_TTL_S)
        threading.Thread(target=self.heartbeat, daemon=True).start()
        pipe = self.r.pipeline(transaction=False)
        for _ in range(self.concurrency):
            self.submit(pipe)
        pipe.execute()
        stream, last = P.out_stream(GATEWAY_ID), "0"
        while not self.stop.is_set():
            resp = self.r.xread({stream: last}, count=1000, block=200)
            pipe = self.r.pipeline(transaction=False)
            n_new = 0
            for _, entries in resp or []:
                for eid, f in entries:
                    last = eid
                    for ev in P.token_events(f):
                        self.tokens += len(ev.token_ids)
                        if ev.error:
                            self.errors.append(ev.error)
                        if ev.finished:
                            self.finished += 1
                            self.submit(pipe)
                            n_new += 1
            if n_new:
                pipe.execute()
            if resp:
                self.r.xtrim(stream, minid=last, approximate=True)


def _snapshots(r: redis.Redis) -> list[StatsSnapshot]:
    return [s for k, v in r.hgetall(P.STATS_KEY).items()
            if P.shard_of_stats_field(k.decode()) is not None and (s := StatsSnapshot.decode(v)) is not None]


class _Children:
    """The bench's child processes (schedulers, null-worker processes), each logging to ``log_dir``."""

    def __init__(self, log_dir: Path):
        self.log_dir, self.procs = log_dir, []
        self.env = dict(os.environ, PYTHONUNBUFFERED="1")

    def spawn(self, name: str, args: list[str]) -> subprocess.Popen:
        with open(self.log_dir / f"{name}.log", "ab") as out:
            p = subprocess.Popen([sys.executable, "-m"] + args, stdout=out, stderr=subprocess.STDOUT,
                                 env=self.env, start_new_session=True)
        self.procs.append(p)
        return p

    def schedulers(self, url: str, rows: int, shards: int, tag: str,
                   profile: Path | None) -> list[subprocess.Popen]:
        """One scheduler per shard (under cProfile when ``profile`` names a file)."""
        scheds = []
        for s in range(shards):
            prof = ["cProfile", "-o", f"{profile}.shard{s}" if shards > 1 else str(profile), "-m"] if profile else []
            scheds.append(self.spawn(f"scheduler-{tag}-s{s}", prof + [
                "scheduler", "--redis-url", url, "--max-num-seqs", str(max(rows, 1)), "--shard", str(s),
                # a plan a step: what is measured is the control plane of every step, which multi-step
                # plans (the scheduler's default --decode-steps) pay once per plan
                "--decode-steps", "1"]))
        return scheds

    def nulls(self, url: str, workers: int, step_ms: float, shards: int,
              tag: str) -> tuple[list[subprocess.Popen], list[Path]]:
        """``workers`` null workers, WORKERS_PER_PROCESS to a process: (processes, their stats files)."""
        shard_list = ",".join(str(s) for s in range(shards))
        procs, stats_files = [], []
        for k in range(math.ceil(workers / WORKERS_PER_PROCESS)):
            n = min(WORKERS_PER_PROCESS, workers - k * WORKERS_PER_PROCESS)
            f = self.log_dir / f"null-{tag}-{k}.json"
            stats_files.append(f)
            procs.append(self.spawn(f"null-{tag}-{k}", [
                "worker.null", "--redis-url", url, "--workers", str(n), "--prefix", f"n{k}-",
                "--step-ms", str(step_ms), "--stats-file", str(f), "--shards", shard_list]))
        return procs, stats_files

    def wait_registered(self, r: redis.Redis, workers: int, shards: int, timeout_s: float = 120) -> None:
        """Until every shard's scheduler reports and ``workers`` workers have registered with them."""
        deadline = time.monotonic() + timeout_s
        while True:
            snaps = _snapshots(r)
            if len(snaps) == shards and sum(s.workers for s in snaps) >= workers:
                return
            for p in self.procs:
                if p.poll() is not None:
                    raise RuntimeError(f"{p.args[2]} exited with {p.returncode} (logs: {self.log_dir})")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{workers} null workers did not register within {timeout_s:g} s "
                                   f"(logs: {self.log_dir})")
            time.sleep(0.2)

    def stop(self) -> None:
        """SIGINT to every child still running; a kill for one that has not exited 10 s later."""
        for p in self.procs:
            if p.poll() is None:
                p.send_signal(2)
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()


def _sample(r: redis.Redis, client: Client, scheds: list, nulls: list) -> dict:
    """The counters a measured window is the difference of (times, tokens, CPU, steps, Redis)."""
    snaps = _snapshots(r)
    return {"t": time.monotonic(), "wall": time.time(), "tokens": client.tokens,
            "leader_cpu": sum(_cpu_s(p.pid) for p in scheds),
            **{f"leader_cpu_{i}": _cpu_s(p.pid) for i, p in enumerate(scheds)},
            "null_cpu": sum(_cpu_s(p.pid) for p in nulls),
            "client_cpu": time.process_time(), "machine_busy": _machine_busy_s(),
            **{f"steps_{s.shard}": s.steps for s in snaps},
            "steps": sum(s.steps for s in snaps), "roundtrip": sum(s.step_roundtrip_s for s in snaps),
            "forward": sum(s.step_forward_s for s in snaps), **_redis_counters(r)}


def _gaps(stats_files: list[Path], a: dict, b: dict) -> list[float]:
    """The null workers' result-to-next-plan gaps that fell between samples ``a`` and ``b``."""
    gaps = []
    for f in stats_files:
        for w in json.loads(f.read_text()).values():
            gaps += [g for wall, g in w["gaps"] if a["wall"] <= wall <= b["wall"]]
    return gaps


def _point(a: dict, b: dict, gaps: list[float], client_errors: int, shards: int, workers: int,
           step_ms: float, rows: int) -> dict:
    """One point of the report from the window between samples ``a`` and ``b``."""
    # stats snapshots are written every 0.5 s: the step counters lag by up to that much at both ends
    dt = b["t"] - a["t"]
    d = {k: b[k] - a[k] for k in a if k not in ("t", "wall")}
    steps = d["steps"]
    ideal = workers / (step_ms / 1000)
    tokens = d["tokens"]
    return {
        "shards": shards, "workers": workers, "step_ms": step_ms, "rows_per_worker": rows, "seconds": round(dt, 2),
        "steps_per_s": round(steps / dt, 1), "ideal_steps_per_s": round(ideal, 1),
        "keeps_up": steps / dt >= 0.9 * ideal, "efficiency": round(steps / dt / ideal, 3),
        "tokens_per_s": round(tokens / dt, 1),
        "steps_per_s_by_shard": {str(s): round(d.get(f"steps_{s}", 0) / dt, 1) for s in range(shards)},
        "gap_ms_p50": round(_pct(gaps, 50) * 1000, 2), "gap_ms_p99": round(_pct(gaps, 99) * 1000, 2),
        "gap_samples": len(gaps),
        "overhead_ms_per_step_mean": round((d["roundtrip"] - d["forward"]) / max(steps, 1) * 1000, 2),
        "leader_cpu_share": round(d["leader_cpu"] / dt, 3),  # all leaders together, in cores
        "busiest_leader_cpu_share": round(max(d[f"leader_cpu_{i}"] for i in range(shards)) / dt, 3),
        "leader_cpu_ms_per_step": round(d["leader_cpu"] / max(steps, 1) * 1000, 3),
        "redis_cpu_share": round(d["cpu_s"] / dt, 3),
        "null_workers_cpu_share": round(d["null_cpu"] / dt, 3),
        "client_cpu_share": round(d["client_cpu"] / dt, 3),
        # the whole machine (any process), in CPUs: near os.cpu_count() means the machine, not the
        # leader, was the limit
        "machine_cpus_busy": round(d["machine_busy"] / dt, 2),
        "redis_commands_per_token": round(d["commands"] / max(tokens, 1), 2),
        "redis_bytes_per_token": round(d["bytes"] / max(tokens, 1), 1),
        "client_errors": client_errors,
    }


def _describe(p: dict) -> str:
    return (f"{p['shards']} shard(s), {p['workers']:4d} null workers @ {p['step_ms']:g} ms: "
            f"{p['steps_per_s']:8.1f} steps/s of {p['workers'] / (p['step_ms'] / 1000):8.1f} ideal "
            f"({p['efficiency']:.0%}), {p['tokens_per_s']:8.1f} tok/s, gap p50 "
            f"{p['gap_ms_p50']:.2f} / p99 {p['gap_ms_p99']:.2f} ms, leader CPU "
            f"{p['leader_cpu_share']:.0%} ({p['leader_cpu_ms_per_step']:.2f} ms/step; busiest leader "
            f"{p['busiest_leader_cpu_share']:.0%}), "
            f"{p['redis_commands_per_token']:.1f} Redis cmds and {p['redis_bytes_per_token']:.0f} B/token; "
            f"machine {p['machine_cpus_busy']:.1f} of {os.cpu_count()} CPUs busy")


def measure_point(workers: int, step_ms: float, rows: int, prompt_tokens: int, max_tokens: int,
                  warmup_s: float, seconds: float, log_dir: Path, say, profile: Path | None = None,
                  shards: int = 1) -> dict:
    """One point: Redis, the schedulers and the null workers started, a closed-loop client warmed up
    for ``warmup_s``, then one window of ``seconds`` measured; everything stopped again."""
    from service.launch import EmbeddedRedis  # noqa: PLC0415
    tag = f"{shards}x{workers}"
    rs = EmbeddedRedis(data_dir=str(log_dir / f"redis-{tag}")).start()
    kids = _Children(log_dir)
    client = None
    try:
        r = connect(rs.url)
        scheds = kids.schedulers(rs.url, rows, shards, tag, profile)
        nulls, stats_files = kids.nulls(rs.url, workers, step_ms, shards, tag)
        kids.wait_registered(r, workers, shards)
        client = Client(connect(rs.url), workers * rows, prompt_tokens, max_tokens, 3, shards)
        ct = threading.Thread(target=client.run, daemon=True)
        ct.start()
        time.sleep(warmup_s)
        a = _sample(r, client, scheds, nulls)
        time.sleep(seconds)
        b = _sample(r, client, scheds, nulls)
        client.stop.set()
        ct.join(5)
        for p in nulls:
            p.send_signal(2)
        for p in nulls:
            p.wait(20)
        point = _point(a, b, _gaps(stats_files, a, b), len(client.errors), shards, workers, step_ms, rows)
        say(_describe(point))
        return point
    finally:
        if client is not None:
            client.stop.set()
        kids.stop()
        rs.stop()


def plot(out: dict, path: str) -> None:
    import matplotlib  # noqa: PLC0415
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    from engine.runtime import save_figure  # noqa: PLC0415
    pts = out["points"]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    ideal = sorted({(p["workers"], p["ideal_steps_per_s"]) for p in pts})
    ax1.plot([w for w, _ in ideal], [i for _, i in ideal], "k--", label="ideal (workers / step time)")
    for n in sorted({p.get("shards", 1) for p in pts}):
        sp = [p for p in pts if p.get("shards", 1) == n]
        ws = [p["workers"] for p in sp]
        ax1.plot(ws, [p["steps_per_s"] for p in sp], "o-", label=f"achieved, {n} shard(s)")
        ax2.plot(ws, [p["gap_ms_p99"] for p in sp], "s-", label=f"gap p99, {n} shard(s)")
        ax2.plot(ws, [p["busiest_leader_cpu_share"] * 100 for p in sp], "^:",
                 label=f"busiest leader CPU %, {n} shard(s)")
    ax1.set_xscale("log", base=2)
    ax1.set_yscale("log")
    ax1.set_xlabel("null workers")
    ax1.set_ylabel("steps/s")
    ax1.legend(fontsize=7)
    ax1.set_title(f"step time {pts[0]['step_ms']:g} ms, {pts[0]['rows_per_worker']} rows/worker")
    ax2.set_xscale("log", base=2)
    ax2.set_xlabel("null workers")
    ax2.set_ylabel("ms  /  %")
    ax2.legend(fontsize=7)
    ax2.set_title("what the control plane adds per step")
    save_figure(fig, path)


def add_parser(sub) -> None:
    p = sub.add_parser("control-plane", help="one scheduler leader driving null workers: steps/s, "
                                             "latency added per step, CPU, Redis cost per token")
    p.add_argument("--workers", default="8,32,128", help="comma-separated null-worker counts")
    p.add_argument("--shards", default="1", help="comma-separated shard counts (each point: a leader per shard)")
    p.add_argument("--step-ms", type=float, default=15.0, help="simulated step time of every worker")
    p.add_argument("--rows", type=int, default=8, help="requests in flight per worker (its batch)")
    p.add_argument("--prompt-tokens", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--warmup", type=float, default=5.0, help="seconds before the measured window")
    p.add_argument("--seconds", type=float, default=15.0, help="the measured window")
    p.add_argument("--log-dir", default=None)
    p.add_argument("--profile-leader", default=None, metavar="DIR",
                   help="run the leader under cProfile, one stats file per point in DIR (read with pstats; "
                        "the profiler slows the leader, so its figures are not the unprofiled ones)")
    p.add_argument("--json", default=None)
    p.add_argument("--plot", default=None, help="PNG: steps/s and the added latency against workers")
    p.set_defaults(func=run)


def run(args) -> int:
    try:
        counts = [int(x) for x in args.workers.split(",")]
        shard_counts = [int(x) for x in args.shards.split(",")]
    except ValueError:
        raise ValueError(f"--workers and --shards must be comma-separated integers, got {args.workers!r}, "
                         f"{args.shards!r}") from None
    if not counts or min(counts) < 1 or args.rows < 1 or args.step_ms <= 0 or args.seconds <= 0:
        raise ValueError("--workers >= 1 each, --rows >= 1, --step-ms > 0, --seconds > 0")
    if not shard_counts or min(shard_counts) < 1 or any(n > w for n in shard_counts for w in counts):
        raise ValueError("--shards >= 1 each, and no more shards than workers at any point")
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="mfs-cp-"))
    log_dir.mkdir(parents=True, exist_ok=True)

    def say(msg: str) -> None:
        print(msg, flush=True)

    say(f"mfs bench control-plane: {os.cpu_count()} CPUs here (leader, Redis, null workers and the client "
        f"share them); logs in {log_dir}")
    prof_dir = Path(args.profile_leader) if args.profile_leader else None
    if prof_dir:
        prof_dir.mkdir(parents=True, exist_ok=True)
    points = [measure_point(n, args.step_ms, args.rows, args.prompt_tokens, args.max_tokens, args.warmup,
                            args.seconds, log_dir, say,
                            profile=prof_dir / f"leader-{k}x{n}.pstats" if prof_dir else None, shards=k)
              for k in shard_counts for n in counts]
    out = {"benchmark": "control-plane", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
           "cpus": os.cpu_count(), "shards": shard_counts, "prompt_tokens": args.prompt_tokens,
           "max_tokens": args.max_tokens, "leader_profiled": bool(prof_dir), "points": points}
    if args.json:
        write_json(args.json, out, indent=1)
    if args.plot:
        plot(out, args.plot)
    return 0
