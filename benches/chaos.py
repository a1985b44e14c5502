"""`mfs bench chaos`: a soak under steady load with a process SIGKILLed every ~30 s.

It starts the service itself (`mfs up`'s pieces: an embedded Redis, a leading and a standby scheduler,
``--workers`` workers) with *two* gateways behind no proxy, and restarts whatever dies as `mfs up` does
(``service.supervise.Supervisor``, with a restart limit high enough for the soak). Then:

1. *reference*: each of ``--prompts`` prompts once, alone, greedy: the fault-free answer;
2. *capacity*: a closed loop of ``--probe-concurrency`` clients for ``--probe-s`` seconds;
3. *soak*: Poisson arrivals at ``--load`` (0.7) times that capacity for ``--duration-s`` (600) seconds,
   each request (a streamed greedy chat of the prompts, in turn) to a gateway picked at random; every
   ``--kill-every-s`` (30, +-10 %) one process is SIGKILLed, chosen at random among the workers, the
   leading scheduler, the embedded Redis and the two gateways (the first at half an interval, so a
   10-minute soak has 20). After each kill a prober asks both gateways for one token every half second:
   the *recovery time* is when both have answered 200 (an upper bound: the probe queues behind the load).

Each soak request ends as one of: *equal* (200, the text equal to the reference); *differs* (200, the
text not equal: its tokens re-tokenized and diffed against the reference's, counted as lost or
duplicated); *clean failure* (an error status or an error event in the stream, with its code); *gateway
killed* (no answer from a gateway killed while the request ran, or not yet back when it was sent: that
gateway's own). A broken connection to a gateway that was not killed is counted apart
(``unexplained_disconnects``).
"""
from __future__ import annotations

import asyncio
import dataclasses
import difflib
import random
import signal
import threading
import time
from collections import Counter
from datetime import datetime, timezone

import aiohttp

from benches.load import TOPICS, capacity, machine, one, session
from engine.runtime import write_json


def body(i: int, tokens: int, model: str) -> dict:
    return {"model": model, "max_tokens": tokens, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": f"Write about {TOPICS[i % len(TOPICS)]}, part {i}."}]}


class Chaos:
    def __init__(self, args):
        from service.launch import Service, free_port  # noqa: PLC0415
        from service.supervise import RestartPolicy, Supervisor  # noqa: PLC0415
        self.args = args
        self.rng = random.Random(args.seed)
        self.svc = Service(args.model, workers=args.workers, schedulers=2)
        self.policy = RestartPolicy(limit=1000, window_s=60.0, backoff_s=0.5, max_backoff_s=2.0)
        self._supervisor_cls, self._free_port = Supervisor, free_port
        self.urls: dict[str, str] = {}
        self.kills: list[dict] = []
        self.restarts: list[str] = []
        self.baseline: dict | None = None  # a probe with no kill before it
        self.stop = threading.Event()

    # ---- the service ---------------------------------------------------------------------------
    def start(self) -> None:
        self.svc.start()
        gw = self.svc.specs["gateway"]
        port2 = self._free_port()
        args2 = list(gw.args)
        args2[args2.index("--port") + 1] = str(port2)
        # a second gateway, started and restarted as the first: its spec with its own name, port and log
        self.svc.spawn(dataclasses.replace(gw, name="gateway-2", args=tuple(args2), log=gw.log.with_name("gateway-2.log")))
        self.urls = {"gateway": self.svc.url, "gateway-2": f"http://{self.svc.host}:{port2}"}
        self._wait_healthy(self.urls.values(), 240)
        sup = self._supervisor_cls(self.svc, self.policy, say=self.restarts.append)
        threading.Thread(target=self._supervise, args=(sup,), daemon=True).start()

    def _supervise(self, sup) -> None:
        while not self.stop.is_set():
            why = sup.poll()
            if why:
                self.restarts.append(f"supervisor gave up: {why}")
                return
            time.sleep(0.1)

    @staticmethod
    def _wait_healthy(urls, timeout_s: float) -> None:
        from benches.load import health  # noqa: PLC0415
        end = time.monotonic() + timeout_s
        while not all(health(u) == 200 for u in urls):
            if time.monotonic() > end:
                raise TimeoutError(f"gateways {list(urls)} not healthy within {timeout_s:.0f} s")
            time.sleep(0.25)

    def victims(self) -> list[str]:
        alive = {n for n, p in self.svc.children().items() if p.poll() is None}  # not one still down
        names = [n for n in sorted(alive) if n.startswith("worker") or n.startswith("gateway") or n == "redis"]
        leader = self.leading_scheduler()
        return names + ([leader] if leader in alive else [])

    def leading_scheduler(self) -> str | None:
        from core import protocol as P  # noqa: PLC0415
        from core.redisconn import connect  # noqa: PLC0415
        try:
            lead = connect(self.svc.redis_url, socket_timeout=1).get(P.LEADER_KEY)
        except Exception:  # noqa: BLE001 - Redis itself may be the one down
            return None
        pid = int(lead.decode().rsplit("-", 1)[1]) if lead else None
        return next((n for n, p in self.svc.procs.items() if n.startswith("scheduler") and p.pid == pid), None)

    # ---- faults --------------------------------------------------------------------------------
    def kill_one(self, t0: float) -> dict:
        name = self.rng.choice(self.victims())
        proc = self.svc.children()[name]
        proc.send_signal(signal.SIGKILL)
        kind = ("worker" if name.startswith("worker") else "scheduler" if name.startswith("scheduler")
                else "gateway" if name.startswith("gateway") else "redis")
        k = {"t": time.perf_counter() - t0, "victim": name, "kind": kind, "pid": proc.pid, "recovery_s": None}
        self.kills.append(k)
        return k

    def probe_recovery(self, k: dict, t0: float, timeout_s: float = 60.0) -> None:
        """Both gateways answer a one-token request with 200: the seconds since the kill."""
        from benches.load import get_json  # noqa: PLC0415
        model = self.model
        ok: set[str] = set()
        end = time.perf_counter() + timeout_s

        async def probe() -> None:
            async with session() as s:
                while len(ok) < len(self.urls) and time.perf_counter() < end and not self.stop.is_set():
                    for name, url in self.urls.items():
                        if name not in ok:
                            r = await one(s, url, body(0, 1, model) | {"max_tokens": 1}, t0)
                            if r["status"] == 200:
                                ok.add(name)
                    await asyncio.sleep(0.5)
        asyncio.run(probe())
        if len(ok) == len(self.urls):
            k["recovery_s"] = time.perf_counter() - t0 - k["t"]
        k["health_after"] = {n: get_json(u + "/health")[0] for n, u in self.urls.items()}

    # ---- load ----------------------------------------------------------------------------------
    async def soak(self, rate: float, seconds: float, t0: float) -> list[dict]:
        a, tasks, i = self.args, [], 0
        async with session() as s:
            start = time.perf_counter()
            at = 0.0
            while True:
                at += self.rng.expovariate(rate)
                if at > seconds:
                    break
                await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
                gw = self.rng.choice(list(self.urls))
                p = i % a.prompts

                async def req(gw=gw, p=p):
                    r = await one(s, self.urls[gw], body(p, a.tokens, self.model), t0)
                    r.update(gateway=gw, prompt=p)
                    return r
                tasks.append(asyncio.ensure_future(req()))
                i += 1
            return await asyncio.gather(*tasks)

    def killer(self, t0: float, seconds: float) -> None:
        """A kill at half an interval, then every interval (+-10 %) on a fixed cadence, each followed by
        its own prober (a kill may come before the last one's recovery)."""
        a = self.args
        start = time.perf_counter()
        at, probes = a.kill_every_s / 2, []
        if not self.stop.wait(min(5.0, at / 2)):  # what the prober takes with no fault, under this load
            self.baseline = {"t": time.perf_counter() - t0, "recovery_s": None}
            self.probe_recovery(self.baseline, t0)
        while at < seconds and not self.stop.wait(max(0.0, start + at - time.perf_counter())):
            k = self.kill_one(t0)
            th = threading.Thread(target=self._probe_and_say, args=(k, t0, len(self.kills)), daemon=True)
            th.start()
            probes.append(th)
            at += a.kill_every_s * self.rng.uniform(0.9, 1.1)
        for th in probes:
            th.join(90)

    def _probe_and_say(self, k: dict, t0: float, n: int) -> None:
        self.probe_recovery(k, t0)
        print(f"  kill {n}: {k['victim']} at {k['t']:.0f} s; recovered in "
              f"{'never' if k['recovery_s'] is None else format(k['recovery_s'], '.1f')} s", flush=True)

    def run(self) -> dict:
        from family.manifest import load_frontend  # noqa: PLC0415
        a = self.args
        tok = load_frontend(a.model).tokenizer
        self.start()
        t0 = time.perf_counter()
        self.model = a.model_id or self._family_id()
        print(f"bench chaos: reference, {a.prompts} prompts one at a time ...", flush=True)
        ref = asyncio.run(self._reference(t0))
        print(f"bench chaos: capacity, {a.probe_concurrency} clients for {a.probe_s:g} s ...", flush=True)
        cap = asyncio.run(capacity(self.urls["gateway"], a.probe_s, a.probe_concurrency, a.tokens, self.model))
        rate = a.load * cap["capacity_req_s"]
        print(f"bench chaos: soak at {rate:.2f} req/s ({a.load:g} x {cap['capacity_req_s']:.2f}) for "
              f"{a.duration_s:g} s, a kill every ~{a.kill_every_s:g} s ...", flush=True)
        killer = threading.Thread(target=self.killer, args=(t0, a.duration_s), daemon=True)
        killer.start()
        recs = asyncio.run(self.soak(rate, a.duration_s, t0))
        killer.join(120)  # the last kill's prober; then nothing more is killed
        self.stop.set()
        return {"capacity": cap, "rate_req_s": rate, "reference": ref,
                "probe_without_fault_s": (self.baseline or {}).get("recovery_s"),
                "outcomes": classify(recs, ref, self.kills, tok), "kills": self.kills, "restarts": self.restarts}

    def _family_id(self) -> str:
        from benches.load import get_json  # noqa: PLC0415
        return get_json(self.urls["gateway"] + "/v1/models")[1]["data"][-1]["id"]

    async def _reference(self, t0: float) -> list[str]:
        out = []
        async with session() as s:
            for p in range(self.args.prompts):
                r = await one(s, self.urls["gateway"], body(p, self.args.tokens, self.model), t0)
                if r["status"] != 200:
                    raise RuntimeError(f"the fault-free reference failed: {r}")
                out.append(r["text"])
        return out

    def close(self) -> None:
        from service.launch import _stop  # noqa: PLC0415
        self.stop.set()
        extra = self.svc.procs.pop("gateway-2", None)  # Service.stop() knows only its own gateway
        if extra is not None:
            _stop(extra)
        self.svc.close()


def classify(recs: list[dict], ref: list[str], kills: list[dict], tok) -> dict:
    """Each request's outcome, and the tokens lost or duplicated on the paths that survived."""
    c: Counter = Counter()
    codes: Counter = Counter()
    lost = dup = 0
    examples = []
    for r in recs:
        # its gateway was killed while it ran, or was still down (not yet answering) when it was sent
        killed = any(k["kind"] == "gateway" and k["victim"] == r["gateway"] and
                     (r["t"] <= k["t"] <= r["end"] or k["t"] <= r["t"] <= k["t"] + (k["recovery_s"] or 1e9))
                     for k in kills)
        if r["status"] == 200:
            if r["text"] == ref[r["prompt"]]:
                c["equal"] += 1
                continue
            c["differs"] += 1
            a = tok.encode(ref[r["prompt"]], add_special_tokens=False)
            b = tok.encode(r["text"], add_special_tokens=False)
            same = sum(m.size for m in difflib.SequenceMatcher(a=a, b=b, autojunk=False).get_matching_blocks())
            lost, dup = lost + len(a) - same, dup + len(b) - same
            if len(examples) < 5:
                examples.append({"expected": ref[r["prompt"]], "got": r["text"]})
        elif r["status"] == 0 and killed:
            c["gateway_killed"] += 1
        elif r["status"] == 0:
            c["unexplained_disconnects"] += 1
            codes[r["code"]] += 1
        else:
            c["clean_failure"] += 1
            codes[f"{r['status']} {r['code']}"] += 1
    return {"requests": len(recs), **dict(c), "failure_codes": dict(codes), "tokens_lost": lost,
            "tokens_duplicated": dup, "differs_examples": examples}


def targets(out: dict) -> dict:
    o, kills = out["outcomes"], out["kills"]
    rec = [k["recovery_s"] for k in kills]
    bad = [k for k in kills if k["recovery_s"] is None or k["recovery_s"] > 10]
    res = {"kills": ("met" if len(kills) >= 20 else "missed") + f": {len(kills)} kills (>= 20 asked)",
           "no_tokens_lost_or_duplicated": ("met" if o["tokens_lost"] == 0 and o["tokens_duplicated"] == 0
                                            else "missed") + f": {o['tokens_lost']} lost, "
                                                             f"{o['tokens_duplicated']} duplicated "
                                                             f"({o.get('differs', 0)} streams differ)",
           "each_recovery_10s": ("met" if kills and not bad else "missed") + f": max "
                                f"{max((x for x in rec if x is not None), default=float('nan')):.1f} s; over 10 s or "
                                f"never: {[(k['victim'], k['recovery_s']) for k in bad]}"}
    return res


def add_parser(sub) -> None:
    p = sub.add_parser("chaos", help="soak at ~70 %% of capacity with a SIGKILL every ~30 s; streams checked")
    p.add_argument("--model", default="default")
    p.add_argument("--model-id", default=None, help="the model id requests name (default: the family id)")
    p.add_argument("--workers", type=int, default=2, help="workers (a killed one's requests move to another)")
    p.add_argument("--duration-s", type=float, default=600.0, help="seconds of soak")
    p.add_argument("--kill-every-s", type=float, default=30.0, help="mean seconds between kills (+-10 %%)")
    p.add_argument("--load", type=float, default=0.7, help="arrival rate / measured capacity")
    p.add_argument("--tokens", type=int, default=16, help="completion tokens per request")
    p.add_argument("--prompts", type=int, default=20, help="distinct prompts (each with its reference)")
    p.add_argument("--probe-s", type=float, default=20.0, help="seconds of the capacity probe")
    p.add_argument("--probe-concurrency", type=int, default=32)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", required=True)
    p.set_defaults(func=run)


def run(args) -> int:
    for name in ("workers", "tokens", "prompts", "probe_concurrency"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
    if min(args.duration_s, args.kill_every_s, args.load, args.probe_s) <= 0:
        raise ValueError("--duration-s, --kill-every-s, --load and --probe-s must be > 0")
    ch = Chaos(args)
    try:
        out = {"benchmark": "chaos", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
               "machine": machine(), "args": {k: v for k, v in vars(args).items() if k != "func"}}
        out |= ch.run()
    finally:
        ch.close()
    out["targets"] = targets(out)
    o = out["outcomes"]
    print(f"  {o['requests']} requests: {o.get('equal', 0)} equal to the reference, {o.get('differs', 0)} differ, "
          f"{o.get('clean_failure', 0)} clean failures {o['failure_codes']}, {o.get('gateway_killed', 0)} "
          f"lost with their gateway, {o.get('unexplained_disconnects', 0)} unexplained disconnects")
    for k, v in out["targets"].items():
        print(f"  target {k}: {v}")
    write_json(args.json, out)
    return 0
