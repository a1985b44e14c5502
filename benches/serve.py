"""`mfs bench serve`: Poisson arrivals of mixed-tier requests against a running MFS (``--url``) or
against services it starts itself, one per ``--layout`` (nested and/or independent), side by side.

Every response is streamed; per request it records TTFT, inter-token latencies, TPOT and end-to-end
latency; per run: throughput, goodput under a TTFT/TPOT target, the workers' peak resident memory
(VmHWM of each worker process) and the Redis/IPC share of a worker step (the scheduler's
plan-to-result round trip against the worker's own step time, from ``mfs:stats``).

``--multi-turn`` runs the multi-turn session workload instead, with prefix reuse on and off
(``benches/multiturn.py``)."""
from __future__ import annotations

import asyncio
import json
import platform
import random
import statistics
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import aiohttp
import msgpack

from benches.lib import model_ids, summarize
from engine.runtime import write_json


def make_requests(args, model_ids: list[str], vocab_lo: int = 300, vocab_hi: int = 40000) -> list[dict]:
    rng = random.Random(args.seed)
    mix = [float(x) for x in args.tier_mix.split(",")]
    plo, phi = (int(x) for x in args.prompt_len.split(","))
    olo, ohi = (int(x) for x in args.output_len.split(","))
    t, out = 0.0, []
    for i in range(args.num):
        t += rng.expovariate(args.rate)
        tier = rng.choices(range(len(mix)), weights=mix)[0]
        out.append({"at": t, "tier": tier, "model": model_ids[tier],
                    "prompt": [rng.randrange(vocab_lo, vocab_hi) for _ in range(rng.randint(plo, phi))],
                    "max_tokens": rng.randint(olo, ohi)})
    return out


async def _one(session, url: str, req: dict, t0: float) -> dict:
    await asyncio.sleep(max(0.0, req["at"] - (time.perf_counter() - t0)))
    body = {"model": req["model"], "prompt": req["prompt"], "max_tokens": req["max_tokens"],
            "temperature": 0, "ignore_eos": True, "stream": True}
    start = time.perf_counter()
    stamps: list[float] = []
    status, err = 0, None
    try:
        async with session.post(url + "/v1/completions", json=body) as resp:
            status = resp.status
            if status != 200:
                err = (await resp.text())[:200]
            else:
                async for line in resp.content:
                    if line.startswith(b"data: {"):
                        ch = json.loads(line[6:])
                        if ch.get("choices") and ch["choices"][0].get("text") is not None:
                            stamps.append(time.perf_counter())
    except aiohttp.ClientError as e:
        err = str(e)
    end = time.perf_counter()
    return {"tier": req["tier"], "status": status, "error": err, "start": start - t0, "e2e": end - start,
            "ttft": stamps[0] - start if stamps else None, "n": len(stamps),
            "itl": [b - a for a, b in zip(stamps, stamps[1:])]}


async def drive(url: str, reqs: list[dict]) -> tuple[list[dict], float]:
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=3600)) as s:
        t0 = time.perf_counter()
        res = await asyncio.gather(*(_one(s, url, r, t0) for r in reqs))
        return res, time.perf_counter() - t0


def report(results: list[dict], wall: float, args) -> dict:
    ok = [r for r in results if r["status"] == 200 and r["ttft"] is not None]
    ttft = [r["ttft"] for r in ok]
    tpot = [(r["e2e"] - r["ttft"]) / (r["n"] - 1) for r in ok if r["n"] > 1]
    itl = [x for r in ok for x in r["itl"]]
    e2e = [r["e2e"] for r in ok]
    tokens = sum(r["n"] for r in ok)
    good = [r for r in ok if r["ttft"] <= args.slo_ttft and
            (r["n"] <= 1 or (r["e2e"] - r["ttft"]) / (r["n"] - 1) <= args.slo_tpot)]
    per_tier = {}
    for t in sorted({r["tier"] for r in ok}):
        rt = [r for r in ok if r["tier"] == t]
        per_tier[t] = {"n": len(rt), "ttft": summarize([r["ttft"] for r in rt]),
                       "tpot": summarize([(r["e2e"] - r["ttft"]) / (r["n"] - 1) for r in rt if r["n"] > 1])}
    return {"completed": len(ok), "failed": len(results) - len(ok), "wall_s": wall,
            "throughput_tok_s": tokens / wall, "request_throughput": len(ok) / wall,
            "goodput_req_s": len(good) / wall, "ttft_s": summarize(ttft), "tpot_s": summarize(tpot),
            "itl_s": summarize(itl), "e2e_s": summarize(e2e), "per_tier": per_tier,
            "errors": [r["error"] for r in results if r["error"]][:5]}


def _worker_peak_rss(redis_url: str) -> int:
    from core import protocol as P  # noqa: PLC0415
    from core.redisconn import connect  # noqa: PLC0415
    r = connect(redis_url)
    total = 0
    for w in r.smembers(P.WORKERS_SET):
        pid = r.hget(P.worker_key(w.decode()), "pid")
        try:
            status = Path(f"/proc/{int(pid)}/status").read_text()
            total += int(next(l for l in status.splitlines() if l.startswith("VmHWM")).split()[1]) * 1024
        except (OSError, TypeError, ValueError, StopIteration):
            pass
    return total


def _transport(redis_url: str) -> dict:
    from core import protocol as P  # noqa: PLC0415
    from core.redisconn import connect  # noqa: PLC0415
    raw = connect(redis_url).hget(P.STATS_KEY, "scheduler")
    s = msgpack.unpackb(raw, strict_map_key=False) if raw else {}
    n, rt, fw = s.get("steps", 0), s.get("step_roundtrip_s", 0.0), s.get("step_forward_s", 0.0)
    return {"steps": n, "mean_step_roundtrip_ms": 1e3 * rt / max(n, 1),
            "mean_worker_step_ms": 1e3 * fw / max(n, 1),
            "transport_share": (rt - fw) / fw if fw else float("nan")}


def run_layout(args, layout: str | None) -> dict:
    from service.launch import Service  # noqa: PLC0415
    svc = None
    url, redis_url = args.url, args.redis_url
    if layout is not None:
        svc = Service(args.model, tiers=args.tiers, layout=layout, workers=1,
                      worker_args=["--threads", str(args.threads), "--num-blocks", str(args.num_blocks)]).start()
        url, redis_url = svc.url, svc.redis_url
    try:
        reqs = make_requests(args, model_ids(url))
        if args.warmup:
            asyncio.run(drive(url, [dict(r, at=0.0, max_tokens=2) for r in reqs[:args.warmup]]))
        before = _transport(redis_url) if redis_url else None
        results, wall = asyncio.run(drive(url, reqs))
        out = report(results, wall, args)
        if redis_url:
            after = _transport(redis_url)
            n = after["steps"] - before["steps"]
            rt = (after["mean_step_roundtrip_ms"] * after["steps"] - before["mean_step_roundtrip_ms"] * before["steps"])
            fw = (after["mean_worker_step_ms"] * after["steps"] - before["mean_worker_step_ms"] * before["steps"])
            out["transport"] = {"steps": n, "mean_step_roundtrip_ms": rt / max(n, 1),
                                "mean_worker_step_ms": fw / max(n, 1),
                                "transport_share": (rt - fw) / fw if fw else float("nan")}
            out["worker_peak_rss_bytes"] = _worker_peak_rss(redis_url)
        return out
    finally:
        if svc is not None:  # its logs stay only when this run failed
            svc.close(clean=sys.exc_info()[0] is None)


def add_parser(sub) -> None:
    p = sub.add_parser("serve", help="Poisson load against the service (nested vs independent)")
    p.add_argument("--url", default=None, help="a running MFS; without it, services are started")
    p.add_argument("--redis-url", default=None, help="its Redis, redis:// or redis+sentinel:// (for transport share and memory)")
    p.add_argument("--layout", default="nested,independent", help="layouts to start and compare")
    p.add_argument("--model", default="default")
    p.add_argument("--tiers", default=None)
    p.add_argument("--rate", type=float, default=1.0, help="requests per second (Poisson)")
    p.add_argument("--num", type=int, default=40)
    p.add_argument("--tier-mix", default="70,20,10", help="percent per tier, lowest first")
    p.add_argument("--prompt-len", default="32,256")
    p.add_argument("--output-len", default="16,64")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--slo-ttft", type=float, default=2.0, help="goodput TTFT target, seconds")
    p.add_argument("--slo-tpot", type=float, default=0.2, help="goodput TPOT target, seconds")
    p.add_argument("--threads", type=int, default=1, help="torch threads per worker")
    p.add_argument("--num-blocks", type=int, default=1024)
    p.add_argument("--json", required=True)
    p.add_argument("--plot", default=None)
    from benches.multiturn import add_args  # noqa: PLC0415
    add_args(p)  # --multi-turn and its options
    p.set_defaults(func=run)


def run(args) -> int:
    if getattr(args, "multi_turn", False):
        from benches import multiturn as bench_multiturn  # noqa: PLC0415
        return bench_multiturn.run(args)
    layouts = [None] if args.url else [x.strip() for x in args.layout.split(",") if x.strip()]
    out = {"benchmark": "serve", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
           "machine": platform.platform(), "args": {k: v for k, v in vars(args).items() if k != "func"},
           "runs": {}}
    for layout in layouts:
        name = layout or "url"
        print(f"bench serve: {name}: {args.num} requests at {args.rate}/s ...", flush=True)
        out["runs"][name] = run_layout(args, layout)
        print_run(name, out["runs"][name])
    runs = out["runs"]
    if "nested" in runs and "independent" in runs:
        n, i = runs["nested"], runs["independent"]
        out["ratios"] = {"mean_tpot": n["tpot_s"]["mean"] / i["tpot_s"]["mean"],
                         "p99_e2e": n["e2e_s"]["p99"] / i["e2e_s"]["p99"],
                         "mean_ttft": n["ttft_s"]["mean"] / i["ttft_s"]["mean"],
                         "throughput": n["throughput_tok_s"] / i["throughput_tok_s"],
                         "worker_peak_rss": n.get("worker_peak_rss_bytes", 0) / max(1, i.get("worker_peak_rss_bytes", 1))}
        print("nested / independent: " + ", ".join(f"{k} {v:.2f}" for k, v in out["ratios"].items()))
    write_json(args.json, out)
    if args.plot:
        plot(out, args.plot)
    return 0


def print_run(name: str, r: dict) -> None:
    print(f"  {name}: completed {r['completed']} failed {r['failed']} in {r['wall_s']:.1f}s, "
          f"{r['throughput_tok_s']:.1f} tok/s, goodput {r['goodput_req_s']:.2f} req/s")
    for k in ("ttft_s", "tpot_s", "itl_s", "e2e_s"):
        v = r[k]
        print(f"    {k[:-2]:<5} mean {v['mean'] * 1e3:8.1f} ms  p50 {v['p50'] * 1e3:8.1f}  "
              f"p90 {v['p90'] * 1e3:8.1f}  p99 {v['p99'] * 1e3:8.1f}")
    if "transport" in r:
        t = r["transport"]
        print(f"    step: worker {t['mean_worker_step_ms']:.1f} ms, round trip {t['mean_step_roundtrip_ms']:.1f} ms "
              f"-> transport {100 * t['transport_share']:.1f}%; worker peak RSS "
              f"{r.get('worker_peak_rss_bytes', 0) / 2**20:.0f} MiB")


def plot(out: dict, path: str) -> None:
    import matplotlib  # noqa: PLC0415
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415
    runs = out["runs"]
    fig, axes = plt.subplots(1, 4, figsize=(14, 3.6))
    for ax, key in zip(axes, ("ttft_s", "tpot_s", "e2e_s")):
        for j, (name, r) in enumerate(runs.items()):
            vals = [r[key][q] * 1e3 for q in ("mean", "p50", "p90", "p99")]
            ax.bar([x + 0.4 * j for x in range(4)], vals, width=0.4, label=name)
        ax.set_xticks([x + 0.2 for x in range(4)], ["mean", "p50", "p90", "p99"])
        ax.set_title(key[:-2].upper() + " (ms)")
    axes[0].legend()
    names = list(runs)
    axes[3].bar(names, [runs[n].get("worker_peak_rss_bytes", 0) / 2**20 for n in names], color="#777")
    axes[3].set_title("workers' peak RSS (MiB)")
    fig.suptitle(f"mfs bench serve — {out['args']['num']} requests, {out['args']['rate']}/s, "
                 f"mix {out['args']['tier_mix']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
