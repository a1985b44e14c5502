"""How long a SIGKILLed gateway's requests keep running: `Service` with the default family (one worker),
ROWS streamed requests of 2,000 greedy tokens through its gateway, the gateway killed once all run; then
the time until the scheduler's stats show none running (cancelled as its gateway's). Alternated: "ttl"
(no supervisor: the 5 s heartbeat TTL ends them), "supervised" (`service.supervise.Supervisor` polling,
which gives back the dead gateway's heartbeat). usage: python tools/probes/gateway_kill.py ROUNDS [ROWS]"""
import json
import os
import signal
import statistics
import sys
import threading
import time
import urllib.request

from core import protocol as P
from core.keyrecords import StatsSnapshot
from core.redisconn import connect
from service.launch import Service
from service.supervise import RestartPolicy, Supervisor


def stream(url: str, i: int) -> None:
    body = json.dumps({"model": "smollm2-135m-large", "prompt": f"Count slowly from {i}:", "max_tokens": 2000,
                       "temperature": 0, "ignore_eos": True, "stream": True}).encode()
    req = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=300) as r:
            for _ in r:
                pass
    except OSError:
        pass  # the gateway was killed: what this probe does


def running(r) -> int:
    """Requests the leading scheduler holds (running or waiting), from its stats of the last half second."""
    snap = StatsSnapshot.decode(r.hget(P.STATS_KEY, "scheduler"))
    if snap is None:
        raise RuntimeError("no scheduler stats in Redis")
    return sum(snap.running.values()) + sum(snap.waiting.values())


def one(svc: Service, r, rows: int, supervised: bool) -> float:
    for i in range(rows):
        threading.Thread(target=stream, args=(svc.url, i), daemon=True).start()
    deadline = time.monotonic() + 120
    while running(r) < rows:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{rows} requests were not all running within 120 s")
        time.sleep(0.05)
    os.kill(svc.procs["gateway"].pid, signal.SIGKILL)
    t0 = time.monotonic()
    sup = Supervisor(svc, RestartPolicy(backoff_s=30, max_backoff_s=30), say=lambda m: None)
    while running(r) > 0:
        if time.monotonic() - t0 > 120:
            raise TimeoutError("the killed gateway's requests still ran 120 s after the kill")
        if supervised:
            sup.poll()
        time.sleep(0.05)
    took = time.monotonic() - t0
    svc.procs["gateway"].wait()
    svc.restart("gateway")
    svc.wait_ready(120)
    return took


def main() -> None:
    if len(sys.argv) < 2:
        print(__doc__.rsplit("usage: ", 1)[1])
        return
    rounds, rows = int(sys.argv[1]), int(sys.argv[2]) if len(sys.argv) > 2 else 8
    with Service("default", workers=1, schedulers=1) as svc:
        r = connect(svc.redis_url)
        got: dict[str, list[float]] = {"ttl": [], "supervised": []}
        for k in range(rounds):
            for mode in (("ttl", "supervised") if k % 2 == 0 else ("supervised", "ttl")):
                got[mode].append(one(svc, r, rows, mode == "supervised"))
                print(f"round {k + 1} {mode}: {rows} requests ended {got[mode][-1]:.2f} s after the kill", flush=True)
        for mode, v in got.items():
            print(f"{mode}: median {statistics.median(v):.2f} s ({', '.join(f'{x:.2f}' for x in v)})")


if __name__ == "__main__":
    main()
