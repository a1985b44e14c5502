"""`mfs bench load`: what the service answers past its capacity.

Against a running MFS (``--url``) or one it starts itself with `mfs up`'s defaults (one worker, a leading
and a standby scheduler, an embedded Redis; ``--gateway-args`` passes gateway flags such as
``--max-waiting``), in order:

1. *unloaded*: ``--unloaded`` requests one at a time: the TTFT the others are compared with;
2. *bursts*: for each of ``--bursts`` (300,1000), that many requests sent at once; then /health;
3. *capacity*: a closed loop of ``--probe-concurrency`` clients for ``--probe-s`` seconds: completed
   requests per second;
4. *overload*: Poisson arrivals at ``--overload-factor`` (2) times that capacity for ``--overload-s``
   seconds (default 300), then the time until every answer is in and the gateway's queue is empty.

Every request is a streamed chat completion of ``--tokens`` tokens (``ignore_eos``, greedy, the family
id). Per phase: the count of each status (and 429s without ``Retry-After``), TTFT/TPOT percentiles of the
admitted (200) requests, the time to drain. The gateway's RSS and Redis's ``used_memory`` are read before
and after the overload. A sampler polls ``/status.json`` every half second for the queue depth and the
shed count (the gateway's ``admission``): ``--plot`` draws them over time. The report checks the issue's
targets and says met or missed for each.
"""
from __future__ import annotations

import asyncio
import json
import platform
import random
import time
import urllib.error
import urllib.request
from collections import Counter
from datetime import datetime, timezone
from pathlib import Path

import aiohttp

from benches.lib import summarize
from engine.runtime import save_figure, write_json

TOPICS = ["rivers", "bread", "prime numbers", "the moon", "chess", "tea", "glaciers", "owls", "copper", "jazz"]


# ---- one request ---------------------------------------------------------------------------------
def chat_body(i: int, tokens: int, model: str) -> dict:
    return {"model": model, "max_tokens": tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": f"Tell me one fact about {TOPICS[i % len(TOPICS)]}. "
                                                     f"(request {i})"}]}


async def one(session: aiohttp.ClientSession, url: str, body: dict, t0: float) -> dict:
    """A streamed chat completion: status, Retry-After, error code, TTFT, TPOT, end time, text."""
    start = time.perf_counter()
    rec = {"t": start - t0, "status": 0, "retry_after": None, "code": None, "ttft": None, "tpot": None,
           "e2e": None, "tokens": 0, "text": ""}
    pieces, first = [], None
    try:
        async with session.post(url + "/v1/chat/completions", json=body) as resp:
            rec["status"], rec["retry_after"] = resp.status, resp.headers.get("Retry-After")
            if resp.status != 200:
                try:
                    rec["code"] = (await resp.json(content_type=None))["error"]["code"]
                except (ValueError, KeyError, TypeError, aiohttp.ClientError):
                    pass
            else:
                async for line in resp.content:
                    if not line.startswith(b"data: {"):
                        continue
                    ch = json.loads(line[6:])
                    if "error" in ch:  # failed after the 200: the stream says why
                        rec["status"], rec["code"] = -1, ch["error"].get("code")
                    for c in ch.get("choices") or ():
                        if (c.get("delta") or {}).get("content"):
                            first = first or time.perf_counter()
                            pieces.append(c["delta"]["content"])
                    if ch.get("usage"):
                        rec["tokens"] = ch["usage"]["completion_tokens"]
    except (aiohttp.ClientError, asyncio.TimeoutError, ValueError) as e:
        rec["status"], rec["code"] = 0, type(e).__name__
    end = time.perf_counter()
    rec.update(e2e=end - start, end=end - t0, text="".join(pieces))
    if first is not None:
        rec["ttft"] = first - start
        if rec["tokens"] > 1:
            rec["tpot"] = (end - first) / (rec["tokens"] - 1)
    return rec


def session(limit: int = 0) -> aiohttp.ClientSession:
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=limit),
                                 timeout=aiohttp.ClientTimeout(total=3600))


def phase_report(recs: list[dict], wall: float) -> dict:
    ok = [r for r in recs if r["status"] == 200]
    statuses = Counter(str(r["status"]) for r in recs)
    return {"n": len(recs), "statuses": dict(sorted(statuses.items())),
            "codes": dict(Counter(r["code"] for r in recs if r["code"])),
            "429_without_retry_after": sum(1 for r in recs if r["status"] == 429 and not r["retry_after"]),
            "retry_after_s": summarize([float(r["retry_after"]) for r in recs if r["status"] == 429
                                        and r["retry_after"]]),
            "ttft_s": summarize([r["ttft"] for r in ok if r["ttft"] is not None]),
            "tpot_s": summarize([r["tpot"] for r in ok if r["tpot"] is not None]),
            "e2e_s": summarize([r["e2e"] for r in ok]), "wall_s": wall,
            "served_per_s": len(ok) / wall if wall > 0 else float("nan")}


# ---- the gateway's and Redis's side ------------------------------------------------------------
def get_json(url: str, timeout: float = 5.0) -> tuple[int, dict]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, {}
    except (OSError, ValueError):
        return 0, {}


def health(url: str) -> int:
    return get_json(url + "/health")[0]


def gateway_rss(url: str, redis_url: str | None) -> int | None:
    """The gateway's resident memory (bytes), by the pid its heartbeat key publishes."""
    if not redis_url:
        return None
    from core import protocol as P  # noqa: PLC0415
    from core.redisconn import connect  # noqa: PLC0415
    gid = get_json(url + "/health")[1].get("gateway_id")
    raw = connect(redis_url).get(P.gateway_key(gid)) if gid else None
    try:
        pid = json.loads(raw)["pid"]
        status = Path(f"/proc/{pid}/status").read_text()
        return int(next(ln for ln in status.splitlines() if ln.startswith("VmRSS")).split()[1]) * 1024
    except (TypeError, ValueError, KeyError, OSError, StopIteration):
        return None


def redis_memory(redis_url: str | None) -> int | None:
    if not redis_url:
        return None
    import redis  # noqa: PLC0415

    from core.redisconn import connect  # noqa: PLC0415
    try:
        return int(connect(redis_url).info("memory")["used_memory"])
    except redis.RedisError:
        return None


class Sampler:
    """Polls ``/status.json`` every ``period_s`` on a thread: (time, queue depth, shed so far, inflight,
    start rate, Redis used_memory every ``redis_every`` polls, else None)."""

    def __init__(self, url: str, t0: float, redis_url: str | None = None, period_s: float = 0.5,
                 redis_every: int = 10):
        import threading  # noqa: PLC0415
        self.url, self.t0, self.period_s = url, t0, period_s
        self.redis_url, self.redis_every = redis_url, redis_every
        self.points: list[tuple] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.is_set():
            code, doc = get_json(self.url + "/status.json", timeout=2.0)
            adm = doc.get("admission") if code == 200 else None
            if adm:
                mem = redis_memory(self.redis_url) if len(self.points) % self.redis_every == 0 else None
                self.points.append((time.perf_counter() - self.t0, adm["queue_depth"], adm["shed"],
                                    doc.get("inflight", 0.0), adm.get("start_rate"), mem))
            self.stop.wait(self.period_s)

    def depth(self) -> float | None:
        return self.points[-1][1] if self.points else None

    def __enter__(self) -> "Sampler":
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(5)


# ---- the phases --------------------------------------------------------------------------------
async def unloaded(url: str, n: int, tokens: int, model: str) -> dict:
    async with session() as s:
        t0 = time.perf_counter()
        recs = [await one(s, url, chat_body(i, tokens, model), t0) for i in range(n)]
        return phase_report(recs, time.perf_counter() - t0)


async def burst(url: str, n: int, tokens: int, model: str, t0: float) -> tuple[dict, list[dict]]:
    async with session() as s:
        start = time.perf_counter()
        recs = await asyncio.gather(*(one(s, url, chat_body(i, tokens, model), t0) for i in range(n)))
        return phase_report(recs, time.perf_counter() - start), recs


async def capacity(url: str, seconds: float, conc: int, tokens: int, model: str) -> dict:
    """Closed loop: ``conc`` clients, each sending its next request when its last is answered."""
    end, recs = time.perf_counter() + seconds, []
    async with session() as s:
        t0 = time.perf_counter()

        async def lane(k: int) -> None:
            i = k
            while time.perf_counter() < end:
                recs.append(await one(s, url, chat_body(i, tokens, model), t0))
                i += conc
        await asyncio.gather(*(lane(k) for k in range(conc)))
        out = phase_report(recs, time.perf_counter() - t0)
    # completions per second after the first batch's (they come in batches: those with the first are the
    # wait left out), unless the rest came too close together to say: then over the whole probe
    ends = sorted(r["end"] for r in recs if r["status"] == 200)
    later = [e for e in ends if e > ends[0] + 0.5] if ends else []
    span = later[-1] - ends[0] if later else 0.0
    out["capacity_req_s"] = len(later) / span if span >= seconds / 3 else out["served_per_s"]
    return out


async def overload(url: str, rate: float, seconds: float, tokens: int, model: str, t0: float,
                   sampler: Sampler, seed: int = 0) -> tuple[dict, list[dict]]:
    """Open loop: Poisson arrivals at ``rate``/s for ``seconds``; then waits for every answer and for
    the gateway's queue to be empty (the drain)."""
    rng, tasks = random.Random(seed), []
    async with session() as s:
        start = time.perf_counter()
        at, i = 0.0, 0
        while True:
            at += rng.expovariate(rate)
            if at > seconds:
                break
            await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
            tasks.append(asyncio.ensure_future(one(s, url, chat_body(i, tokens, model), t0)))
            i += 1
        arrivals_end = time.perf_counter()
        recs = await asyncio.gather(*tasks)
        answered = time.perf_counter()
        while sampler.depth() not in (None, 0) and time.perf_counter() - answered < 120:
            await asyncio.sleep(0.25)
        drained = time.perf_counter()
    out = phase_report(recs, arrivals_end - start)
    out.update(offered_req_s=rate, arrivals=len(recs), drain_s=drained - arrivals_end)
    return out, recs


# ---- the run -----------------------------------------------------------------------------------
def targets(out: dict, args) -> dict:
    """The issue's targets, each met / missed / not measured (never redefined here)."""
    res = {}
    b = out["bursts"].get("1000")
    if b is None:
        res["burst_1000_only_200_429"] = "not measured"
    else:
        bad = {k: v for k, v in b["statuses"].items() if k not in ("200", "429")}
        ok = not bad and b["429_without_retry_after"] == 0 and b["health_after"] == 200
        res["burst_1000_only_200_429"] = ("met" if ok else "missed") + (
            f": statuses {b['statuses']}, 429 without Retry-After {b['429_without_retry_after']}, "
            f"/health after {b['health_after']}")
        served = b["statuses"].get("200", 0)
        res["burst_1000_all_served"] = (("met" if served == 1000 else "missed") + f": {served} of 1000 served"
                                        if out.get("max_waiting", 0) and out["max_waiting"] > 1000
                                        else "not measured (the bound is not above 1,000 in this run)")
    ov = out.get("overload")
    if ov is None:
        res["overload"] = "not measured"
        return res
    unl = out["unloaded"]["ttft_s"]["p99"]
    wait = out.get("queue_wait_s")
    limit = 2 * unl + (wait or 0.0)
    p99 = ov["ttft_s"]["p99"]
    res["overload_p99_ttft"] = (("met" if p99 <= limit else "missed") +
                                f": p99 {p99:.2f} s vs 2 x {unl:.2f} s unloaded + {wait or 0:.2f} s queue wait "
                                f"= {limit:.2f} s")
    for key, name in (("gateway_rss", "gateway RSS"), ("redis_used_memory", "Redis used_memory")):
        before, after = out["memory"][key + "_before"], out["memory"][key + "_after"]
        if not before or not after:
            res[f"overload_{key}_growth"] = "not measured"
            continue
        g = after / before - 1
        res[f"overload_{key}_growth"] = ("met" if g <= 0.10 else "missed") + f": {name} {100 * g:+.1f} %"
    res["overload_drain"] = ("met" if ov["drain_s"] <= 60 else "missed") + f": {ov['drain_s']:.1f} s"
    if args.overload_s < 300:
        res["overload_duration"] = f"shortened: {args.overload_s:g} s, not the 5 minutes the target asks"
    return res


def measure(url: str, redis_url: str | None, args) -> dict:
    model = args.model_id or get_json(url + "/v1/models")[1]["data"][-1]["id"]  # the family id
    out = {"model_id": model, "bursts": {}}
    t0 = time.perf_counter()
    with Sampler(url, t0, redis_url) as smp:
        print(f"bench load: unloaded, {args.unloaded} requests one at a time ...", flush=True)
        out["unloaded"] = asyncio.run(unloaded(url, args.unloaded, args.tokens, model))
        _, doc = get_json(url + "/status.json")
        adm = doc.get("admission") or {}
        out["max_waiting"], out["max_queue_wait_s"] = adm.get("max_waiting"), adm.get("max_queue_wait_s")
        phases = []
        for n in args.bursts:
            print(f"bench load: burst of {n} ...", flush=True)
            a = time.perf_counter() - t0
            rep, _ = asyncio.run(burst(url, n, args.tokens, model, t0))
            rep["health_after"] = health(url)
            out["bursts"][str(n)] = rep
            phases.append((f"burst {n}", a, time.perf_counter() - t0))
            print_phase(f"burst {n}", rep)
            _settle(url, smp)
        if args.overload_s > 0:
            print(f"bench load: capacity, {args.probe_concurrency} clients for {args.probe_s:g} s ...", flush=True)
            a = time.perf_counter() - t0
            cap = out["capacity"] = asyncio.run(capacity(url, args.probe_s, args.probe_concurrency, args.tokens, model))
            phases.append(("capacity", a, time.perf_counter() - t0))
            _settle(url, smp)
            rate = args.overload_factor * cap["capacity_req_s"]
            # the configured queue wait: --max-queue-wait, else a full queue's drain at the capacity
            if out["max_queue_wait_s"]:
                out["queue_wait_s"] = out["max_queue_wait_s"]
            elif out["max_waiting"] and cap["capacity_req_s"] > 0:
                out["queue_wait_s"] = out["max_waiting"] / cap["capacity_req_s"]
            mem = {"gateway_rss_before": gateway_rss(url, redis_url), "redis_used_memory_before": redis_memory(redis_url)}
            print(f"bench load: overload, {rate:.2f} req/s ({args.overload_factor:g} x {cap['capacity_req_s']:.2f}) "
                  f"for {args.overload_s:g} s ...", flush=True)
            a = time.perf_counter() - t0
            out["overload"], _ = asyncio.run(overload(url, rate, args.overload_s, args.tokens, model, t0, smp))
            phases.append(("overload", a, time.perf_counter() - t0))
            mem.update(gateway_rss_after=gateway_rss(url, redis_url), redis_used_memory_after=redis_memory(redis_url))
            out["memory"] = mem
            print_phase("overload", out["overload"])
    out["timeline"] = {"t": [p[0] for p in smp.points], "queue_depth": [p[1] for p in smp.points],
                       "shed": [p[2] for p in smp.points], "inflight": [p[3] for p in smp.points],
                       "start_rate": [p[4] for p in smp.points], "redis_used_memory": [p[5] for p in smp.points],
                       "phases": phases}
    out["targets"] = targets(out, args)
    return out


def _settle(url: str, smp: Sampler, timeout_s: float = 60.0) -> None:
    """Between phases: until the gateway's queue is empty (so one phase's tail is not the next's load)."""
    end = time.monotonic() + timeout_s
    time.sleep(smp.period_s * 2)
    while smp.depth() not in (None, 0) and time.monotonic() < end:
        time.sleep(0.25)


def print_phase(name: str, r: dict) -> None:
    t, e = r["ttft_s"], r["tpot_s"]
    print(f"  {name}: {r['statuses']} in {r['wall_s']:.1f} s; 429 without Retry-After "
          f"{r['429_without_retry_after']}; TTFT p50 {t['p50']:.2f} p99 {t['p99']:.2f} s; "
          f"TPOT p50 {1e3 * e['p50']:.0f} p99 {1e3 * e['p99']:.0f} ms"
          + (f"; drained in {r['drain_s']:.1f} s" if "drain_s" in r else "")
          + (f"; /health after {r['health_after']}" if "health_after" in r else ""), flush=True)


def plot(out: dict, path: str) -> None:
    import matplotlib  # noqa: PLC0415
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415
    tl = out["timeline"]
    t, depth, shed = tl["t"], tl["queue_depth"], tl["shed"]
    rate = [0.0] + [max(0.0, (shed[i] - shed[i - 1]) / max(t[i] - t[i - 1], 1e-6)) for i in range(1, len(t))]
    fig, (a1, a2) = plt.subplots(2, 1, figsize=(11, 5.5), sharex=True)
    a1.plot(t, depth, color="#2a6")
    if out.get("max_waiting"):
        a1.axhline(out["max_waiting"], color="#999", ls="--", lw=1, label=f"--max-waiting {out['max_waiting']:g}")
        a1.legend(loc="upper right")
    a1.set_ylabel("queue depth (requests)")
    a2.plot(t, rate, color="#c33")
    a2.set_ylabel("shed (429/s)")
    a2.set_xlabel("seconds since the run started")
    for ax in (a1, a2):
        for name, lo, hi in tl["phases"]:
            ax.axvspan(lo, hi, color="#eee", zorder=0)
            if ax is a1:
                ax.text(lo, ax.get_ylim()[1] * 0.95, name, fontsize=8, va="top")
    fig.suptitle(f"mfs bench load: gateway queue and shed rate ({out['machine']['cpu']})")
    save_figure(fig, path)


def add_parser(sub) -> None:
    p = sub.add_parser("load", help="bursts and sustained overload: admission (429), queue depth, drain")
    p.add_argument("--url", default=None, help="a running MFS; without it, one is started (mfs up's defaults)")
    p.add_argument("--redis-url", default=None, help="its Redis (for the memory figures), with --url")
    p.add_argument("--model", default="default", help="the model of the service it starts")
    p.add_argument("--model-id", default=None, help="the model id requests name (default: the family id)")
    p.add_argument("--gateway-args", default="", help="flags for the gateway it starts, e.g. '--max-waiting 2000'")
    p.add_argument("--bursts", type=_sizes, default=[300, 1000], help="burst sizes, comma-separated ('' for none)")
    p.add_argument("--tokens", type=int, default=8, help="completion tokens per request")
    p.add_argument("--unloaded", type=int, default=10, help="requests one at a time for the unloaded TTFT")
    p.add_argument("--probe-s", type=float, default=30.0, help="seconds of the capacity probe")
    p.add_argument("--probe-concurrency", type=int, default=64)
    p.add_argument("--overload-s", type=float, default=300.0, help="seconds of overload (0: none)")
    p.add_argument("--overload-factor", type=float, default=2.0, help="arrival rate / measured capacity")
    p.add_argument("--json", required=True)
    p.add_argument("--plot", default=None, help="PNG of the queue depth and shed rate over time")
    p.set_defaults(func=run)


def _sizes(s: str) -> list[int]:
    out = [int(x) for x in s.split(",") if x.strip()]
    if any(n < 1 for n in out):
        raise ValueError(f"burst sizes must be >= 1: {s!r}")
    return out


def run(args) -> int:
    from service.launch import Service  # noqa: PLC0415
    for name in ("tokens", "unloaded", "probe_concurrency"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    if args.probe_s <= 0 or args.overload_s < 0 or args.overload_factor <= 0:
        raise ValueError("--probe-s and --overload-factor must be > 0, --overload-s >= 0")
    svc = None
    url, redis_url = args.url, args.redis_url
    if url is None:
        svc = Service(args.model, workers=1, schedulers=2, gateway_args=args.gateway_args.split()).start()
        url, redis_url = svc.url, svc.redis_url
    elif args.gateway_args:
        raise ValueError("--gateway-args needs a service this bench starts (no --url)")
    try:
        out = {"benchmark": "load", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
               "machine": machine(), "args": {k: v for k, v in vars(args).items() if k != "func"}}
        out |= measure(url, redis_url, args)
    finally:
        if svc is not None:
            svc.close()
    for k, v in out["targets"].items():
        print(f"  target {k}: {v}")
    write_json(args.json, out)
    if args.plot:
        plot(out, args.plot)
    return 0


def machine() -> dict:
    """The CPU every figure is reported with."""
    cpu = platform.processor() or platform.machine()
    try:
        cpu = next(ln.split(":", 1)[1].strip() for ln in Path("/proc/cpuinfo").read_text().splitlines()
                   if ln.startswith("model name"))
    except (OSError, StopIteration):
        pass
    import os  # noqa: PLC0415

    import torch  # noqa: PLC0415
    return {"cpu": cpu, "cores": os.cpu_count(), "torch_cpu_capability": torch.backends.cpu.get_cpu_capability(),
            "platform": platform.platform()}
