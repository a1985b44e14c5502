"""`mfs bench serve --multi-turn`: multi-turn sessions with prefix reuse on and off.

Each session sends ``--turns`` streamed completions with a ``session_id``; the prompt of turn t+1 is
the prompt of turn t, plus the answer of turn t (its streamed text re-tokenized, as a client sees it),
plus a new user message (sentences from a fixed word list, seeded). Sessions start at a tier drawn
from ``--mt-tier-mix``; a share of the lower-tier ones escalates to the top tier at turn
``--escalate-at`` and stays there. Every response has ``ignore_eos``, so the work is fixed.

The workload runs once per ``--reuse`` mode on a service of its own (``off``: the scheduler runs with
``--no-prefix-caching``). It reports TTFT of turn 1, of turns 2+ (all, and without the escalated
turns), and of the escalated turns, with the ``cached_tokens`` the responses report and the
scheduler's per-segment prefill counters. Then, with the service otherwise idle, ``--probes``
escalation probes: a fresh history at the lowest tier, then its next turn at the top tier (reuse on),
against the very same top-tier prompt sent to the reuse-off service (a cold top-tier prefill)."""
from __future__ import annotations

import asyncio
import json
import random
import sys
import time

import aiohttp

from engine.runtime import write_json

WORDS = ("the a of to and in that it is was for on with as his they be at one have this from or had by "
         "word but what some we can out other were all there when up use your how said an each she which "
         "do their time if will way about many then them write would like so these her long make thing see "
         "him two has look more day could go come did number sound no most people my over know water than "
         "call first who may down side been now find head stand own page should country found answer school "
         "grow study still learn plant cover food sun four between state keep eye never last let thought city "
         "tree cross farm hard start might story saw far sea draw left late run while press close night real "
         "life few north open seem together next white children begin got walk example ease paper group always "
         "music those both mark often letter until mile river car feet care second book carry took science eat "
         "room friend began idea fish mountain stop once base hear horse cut sure watch color face wood main").split()


def add_args(p) -> None:
    g = p.add_argument_group("multi-turn (--multi-turn)")
    g.add_argument("--multi-turn", action="store_true", help="the multi-turn reuse workload")
    g.add_argument("--reuse", default="on,off", help="modes to run: on (prefix caching), off (--no-prefix-caching)")
    g.add_argument("--sessions", type=int, default=6)
    g.add_argument("--turns", type=int, default=8)
    g.add_argument("--first-len", default="192,320", help="tokens of the first user message (range)")
    g.add_argument("--turn-len", default="96,160", help="tokens of each later user message (range)")
    g.add_argument("--turn-output", type=int, default=16, help="tokens generated per turn")
    g.add_argument("--mt-tier-mix", default="40,30,30", help="sessions' starting tier, percent, lowest first")
    g.add_argument("--escalate", type=float, default=0.5,
                   help="share of the sessions below the top tier that escalate to it (at least one if > 0)")
    g.add_argument("--escalate-at", type=int, default=5, help="the (1-based) turn that escalates")
    g.add_argument("--session-rate", type=float, default=0.5, help="session arrivals per second (Poisson)")
    g.add_argument("--think", type=float, default=0.5, help="mean think time between turns, seconds")
    g.add_argument("--probes", type=int, default=3, help="isolated escalation probes per mode")


# ---- the plan (the same in every mode) -------------------------------------------------------
def _message(rng: random.Random, tok, n: int) -> list[int]:
    ids: list[int] = []
    while len(ids) < n:
        words = [rng.choice(WORDS) for _ in range(rng.randint(6, 14))]
        ids += tok.encode(" " + " ".join(words).capitalize() + ".", add_special_tokens=False)
    return ids[:n]


def _range(spec: str) -> tuple[int, int]:
    lo, hi = (int(x) for x in spec.split(","))
    return lo, hi


def make_plan(args, tok, num_tiers: int) -> dict:
    rng = random.Random(args.seed)
    mix = [float(x) for x in args.mt_tier_mix.split(",")][:num_tiers]
    top = num_tiers - 1
    sessions, t = [], 0.0
    for i in range(args.sessions):
        t += rng.expovariate(args.session_rate)
        tier = rng.choices(range(len(mix)), weights=mix)[0]
        msgs = [_message(rng, tok, rng.randint(*_range(args.first_len)))]
        msgs += [_message(rng, tok, rng.randint(*_range(args.turn_len))) for _ in range(args.turns - 1)]
        sessions.append({"id": i, "at": t, "tier": tier, "escalate_at": None, "messages": msgs,
                         "think": [rng.expovariate(1 / args.think) if args.think > 0 else 0.0
                                   for _ in range(args.turns)]})
    low = [s for s in sessions if s["tier"] < top]
    n_esc = min(len(low), max(1 if args.escalate > 0 else 0, round(args.escalate * len(low))))
    if 1 < args.escalate_at <= args.turns:
        for s in low[:n_esc]:
            s["escalate_at"] = args.escalate_at
    # Probes: a history as long as an escalating session's at its escalation, then one more message.
    hist = sum(_range(args.first_len)) // 2 + (args.escalate_at - 2) * sum(_range(args.turn_len)) // 2
    # Each probe also has a control: fresh text of the escalated prompt's length, cold at the top tier.
    probes = [{"first": _message(rng, tok, hist), "next": _message(rng, tok, rng.randint(*_range(args.turn_len))),
               "control": _message(rng, tok, hist + 4 * args.turn_output + _range(args.turn_len)[1])}
              for _ in range(args.probes)]
    return {"sessions": sessions, "probes": probes, "top": top}


# ---- requests --------------------------------------------------------------------------------
async def _complete(http, url: str, model: str, prompt: list[int], max_tokens: int, session_id: str) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}, "session_id": session_id}
    start = time.perf_counter()
    first, texts, usage, err, status = None, [], {}, None, 0
    try:
        async with http.post(url + "/v1/completions", json=body) as resp:
            status = resp.status
            if status != 200:
                err = (await resp.text())[:300]
            else:
                async for line in resp.content:
                    if not line.startswith(b"data: {"):
                        continue
                    ch = json.loads(line[6:])
                    if ch.get("choices") and ch["choices"][0].get("text") is not None:
                        first = first or time.perf_counter()
                        texts.append(ch["choices"][0]["text"])
                    if ch.get("usage"):
                        usage = ch["usage"]
    except aiohttp.ClientError as e:
        err = str(e)
    end = time.perf_counter()
    return {"status": status, "error": err, "ttft": (first - start) if first else None, "e2e": end - start,
            "text": "".join(texts), "prompt_tokens": len(prompt),
            "cached_tokens": ((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)}


def _answer_ids(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


async def _session(http, url: str, ids: list[str], s: dict, args, tok, t0: float, mode: str) -> list[dict]:
    await asyncio.sleep(max(0.0, s["at"] - (time.perf_counter() - t0)))
    out, prompt, tier = [], [], s["tier"]
    for turn, msg in enumerate(s["messages"], start=1):
        escalated = s["escalate_at"] == turn
        if escalated:
            tier = len(ids) - 1
        prompt = prompt + msg
        r = await _complete(http, url, ids[tier], prompt, args.turn_output, f"mt-{mode}-{s['id']}")
        out.append({k: v for k, v in r.items() if k != "text"} |
                   {"session": s["id"], "turn": turn, "tier": tier, "escalated": escalated,
                    "start": time.perf_counter() - t0})
        if r["error"]:
            break
        prompt = prompt + _answer_ids(tok, r["text"])
        await asyncio.sleep(s["think"][turn - 1])
    return out


async def _workload(url: str, ids: list[str], plan: dict, args, tok, mode: str) -> tuple[list[dict], float]:
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=3600)) as http:
        for tier, mid in enumerate(ids):  # warm-up: one short request per tier, fresh content
            await _complete(http, url, mid, [1000 + tier] * 8, 2, f"warmup-{mode}-{tier}")
        t0 = time.perf_counter()
        per = await asyncio.gather(*(_session(http, url, ids, s, args, tok, t0, mode) for s in plan["sessions"]))
        return [r for rs in per for r in rs], time.perf_counter() - t0


async def _probes(url: str, ids: list[str], plan: dict, args, tok, mode: str, replay: list | None) -> list[dict]:
    """Isolated, one at a time: a turn at the lowest tier, then the session's next turn at the top tier
    (``kind`` "escalated"), then the control: fresh text of the same length at the top tier (``kind``
    "control", a cold top-tier prefill in the same service a moment later). With ``replay`` (the reuse-on
    probes' escalated prompts), the escalated prompt is sent at the top tier directly (on a service
    without prefix caching: a cold top-tier prefill of the very same prompt)."""
    out = []
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3600)) as http:
        for k, p in enumerate(plan["probes"]):
            sid = f"probe-{mode}-{k}"
            if replay is not None and k < len(replay):
                prompt = replay[k]
            else:
                r = await _complete(http, url, ids[0], p["first"], args.turn_output, sid)
                prompt = p["first"] + _answer_ids(tok, r["text"]) + p["next"]
                await asyncio.sleep(0.5)  # let the scheduler settle (stats, directory)
            r = await _complete(http, url, ids[-1], prompt, args.turn_output, sid)
            out.append({k2: v for k2, v in r.items() if k2 != "text"} | {"probe": k, "kind": "escalated",
                                                                         "prompt": prompt})
            await asyncio.sleep(0.5)
            control = p["control"][:len(prompt)]
            r = await _complete(http, url, ids[-1], control, args.turn_output, f"{sid}-control")
            out.append({k2: v for k2, v in r.items() if k2 != "text"} | {"probe": k, "kind": "control",
                                                                         "prompt": control})
            await asyncio.sleep(0.5)
    return out


# ---- one mode on its own service -------------------------------------------------------------
def _scheduler_stats(redis_url: str) -> dict:
    import msgpack  # noqa: PLC0415

    from core import protocol as P  # noqa: PLC0415
    from core.redisconn import connect  # noqa: PLC0415
    time.sleep(1.0)  # the scheduler writes its stats every 0.5 s
    raw = connect(redis_url).hget(P.STATS_KEY, "scheduler")
    s = msgpack.unpackb(raw, strict_map_key=False) if raw else {}
    keys = ("prefill_computed", "prefill_reused", "cache_queries", "cache_hits", "evictions", "directory_blocks",
            "affinity_preferred", "affinity_yielded", "preemptions")
    return {k: ({str(a): b for a, b in s[k].items()} if isinstance(s.get(k), dict) else s.get(k)) for k in keys}


def _reuse_metrics(url: str) -> list[str]:
    import urllib.request  # noqa: PLC0415
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        text = r.read().decode()
    return [l for l in text.splitlines() if l.startswith(("mfs_prefill_tokens", "mfs_prefix_cache_hit_rate",
                                                          "mfs_kv_evictions", "mfs_kv_directory_blocks"))]


def _summ(rs: list[dict], key: str = "ttft") -> dict:
    from benches.lib import summarize  # noqa: PLC0415
    xs = [r[key] for r in rs if r.get(key) is not None]
    return {"n": len(xs), **summarize(xs)}


def run_mode(args, mode: str, plan: dict, tok, replay: list | None) -> dict:
    from benches.lib import model_ids  # noqa: PLC0415
    from service.launch import Service  # noqa: PLC0415
    svc = None
    url, redis_url = args.url, args.redis_url
    if not args.url:
        svc = Service(args.model, tiers=args.tiers, layout="nested", workers=1,
                      worker_args=["--threads", str(args.threads), "--num-blocks", str(args.num_blocks)],
                      scheduler_args=[] if mode == "on" else ["--no-prefix-caching"]).start()
        url, redis_url = svc.url, svc.redis_url
    try:
        ids = model_ids(url)
        turns, wall = asyncio.run(_workload(url, ids, plan, args, tok, mode))
        stats = _scheduler_stats(redis_url) if redis_url else {}
        probes = asyncio.run(_probes(url, ids, plan, args, tok, mode, replay))
        ok = [r for r in turns if r["ttft"] is not None]
        later = [r for r in ok if r["turn"] >= 2]
        out = {"wall_s": wall, "failed": len(turns) - len(ok) + sum(r["ttft"] is None for r in probes),
               "errors": [r["error"] for r in turns + probes if r["error"]][:5],
               "ttft_turn1": _summ([r for r in ok if r["turn"] == 1]),
               "ttft_turn2plus": _summ(later),
               "ttft_turn2plus_same_tier": _summ([r for r in later if not r["escalated"]]),
               "ttft_escalated": _summ([r for r in later if r["escalated"]]),
               "ttft_per_turn": {t: _summ([r for r in ok if r["turn"] == t])["mean"] for t in range(1, args.turns + 1)},
               "prompt_tokens_turn2plus": sum(r["prompt_tokens"] for r in later),
               "cached_tokens_turn2plus": sum(r["cached_tokens"] for r in later),
               "cached_tokens_escalated": sum(r["cached_tokens"] for r in later if r["escalated"]),
               "max_prompt_tokens": max((r["prompt_tokens"] for r in turns), default=0),
               "probes": [{k: v for k, v in p.items() if k != "prompt"} for p in probes],
               "probe_ttft": _summ([p for p in probes if p["kind"] == "escalated"]),
               "probe_control_ttft": _summ([p for p in probes if p["kind"] == "control"]),
               "scheduler": stats, "turns": turns}
        try:
            out["metrics"] = _reuse_metrics(url)
        except OSError:
            out["metrics"] = []
        out["_probe_prompts"] = [p["prompt"] for p in probes if p["kind"] == "escalated"]
        return out
    finally:
        if svc is not None:  # its logs stay only when this run failed
            svc.close(clean=sys.exc_info()[0] is None)


def run(args) -> int:
    from datetime import datetime, timezone  # noqa: PLC0415
    import platform  # noqa: PLC0415
    from family.manifest import load_frontend  # noqa: PLC0415
    fe = load_frontend(args.model, args.tiers)
    tok = fe.tokenizer
    plan = make_plan(args, tok, len(fe.tiers))
    modes = ["url"] if args.url else [m.strip() for m in args.reuse.split(",") if m.strip()]
    out = {"benchmark": "serve-multi-turn", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
           "machine": platform.platform(), "args": {k: v for k, v in vars(args).items() if k != "func"},
           "plan": [{"session": s["id"], "tier": s["tier"], "escalate_at": s["escalate_at"], "start_s": round(s["at"], 2),
                     "message_tokens": [len(m) for m in s["messages"]]} for s in plan["sessions"]],
           "runs": {}}
    replay = None
    for mode in modes:
        print(f"bench serve --multi-turn: reuse {mode}: {args.sessions} sessions x {args.turns} turns ...", flush=True)
        r = run_mode(args, mode, plan, tok, replay if mode == "off" else None)
        prompts = r.pop("_probe_prompts")
        if mode == "on":
            replay = prompts
        out["runs"][mode] = r
        print_mode(mode, r)
    runs = out["runs"]
    if "on" in runs and "off" in runs:
        on, off = runs["on"], runs["off"]
        q = lambda a, b: a / b if b else float("nan")  # noqa: E731
        out["ratios"] = {
            "turn2plus_mean_ttft_off_over_on": q(off["ttft_turn2plus"]["mean"], on["ttft_turn2plus"]["mean"]),
            "turn2plus_p99_ttft_off_over_on": q(off["ttft_turn2plus"]["p99"], on["ttft_turn2plus"]["p99"]),
            "same_tier_turn2plus_mean_ttft_off_over_on": q(off["ttft_turn2plus_same_tier"]["mean"],
                                                           on["ttft_turn2plus_same_tier"]["mean"]),
            "escalated_in_load_mean_ttft_cold_over_on": q(off["ttft_escalated"]["mean"], on["ttft_escalated"]["mean"]),
            "escalated_probe_mean_ttft_cold_replay_over_on": q(off["probe_ttft"]["mean"], on["probe_ttft"]["mean"]),
            "escalated_probe_mean_ttft_control_over_on": q(on["probe_control_ttft"]["mean"], on["probe_ttft"]["mean"]),
        }
        print_ratios(out["ratios"])
    write_json(args.json, out)
    if args.plot:
        plot(out, args.plot)
    return 0


def print_mode(mode: str, r: dict) -> None:
    ms = lambda v: f"{v * 1e3:8.0f}" if v == v else "     n/a"  # noqa: E731
    print(f"  reuse {mode}: {r['wall_s']:.1f}s, failed {r['failed']}, longest prompt {r['max_prompt_tokens']} tokens, "
          f"cached {r['cached_tokens_turn2plus']}/{r['prompt_tokens_turn2plus']} prompt tokens of turns 2+")
    print(f"    {'TTFT (ms)':<34} {'n':>3} {'mean':>8} {'p50':>8} {'p99':>8}")
    for key, name in (("ttft_turn1", "turn 1"), ("ttft_turn2plus", "turns 2+"),
                      ("ttft_turn2plus_same_tier", "turns 2+, not escalating"),
                      ("ttft_escalated", "escalated turns (under load)"),
                      ("probe_ttft", "probes: escalated turn (isolated)"),
                      ("probe_control_ttft", "probes: cold top-tier control")):
        v = r[key]
        print(f"    {name:<34} {v['n']:>3} {ms(v['mean'])} {ms(v['p50'])} {ms(v['p99'])}")
    if r.get("errors"):
        print(f"    errors: {r['errors']}")


def print_ratios(x: dict) -> None:
    print("  reuse off / on (TTFT):")
    for k, v in x.items():
        print(f"    {k:<48} {v:6.2f}x")


def plot(out: dict, path: str) -> None:
    import matplotlib  # noqa: PLC0415
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415
    runs = out["runs"]
    fig, (a0, a1) = plt.subplots(1, 2, figsize=(12, 4))
    groups = [("turns 2+\nmean", "ttft_turn2plus", "mean"), ("turns 2+\np99", "ttft_turn2plus", "p99"),
              ("escalated\n(load) mean", "ttft_escalated", "mean"), ("escalation\nprobe mean", "probe_ttft", "mean"),
              ("cold top-tier\ncontrol mean", "probe_control_ttft", "mean")]
    for j, (mode, r) in enumerate(runs.items()):
        label = {"on": "reuse on", "off": "reuse off (cold)"}.get(mode, mode)
        a0.bar([x + 0.4 * j for x in range(len(groups))], [r[k][q] for _, k, q in groups], width=0.4, label=label)
        turns = sorted(int(t) for t in r["ttft_per_turn"])
        a1.plot(turns, [r["ttft_per_turn"][t] if t in r["ttft_per_turn"] else r["ttft_per_turn"][str(t)]
                        for t in turns], marker="o", label=label)
    a0.set_xticks([x + 0.2 for x in range(len(groups))], [g[0] for g in groups])
    a0.set_ylabel("TTFT (s)")
    a0.legend()
    a0.set_title("TTFT")
    a1.set_xticks(range(1, out["args"]["turns"] + 1))
    a1.set_xlabel("turn")
    a1.set_ylabel("mean TTFT (s)")
    a1.set_title("mean TTFT per turn")
    a1.legend()
    a = out["args"]
    fig.suptitle(f"mfs bench serve --multi-turn — {a['sessions']} sessions x {a['turns']} turns, "
                 f"{a['turn_output']} tokens out per turn, model {a['model']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
