"""Host-level faults with the test hosts of tests/hosts.py: Redis on a host of its own,
two schedulers (leader and standby) and two workers each on theirs (a tiny float64 model); the test
process plays the gateway. A host is cut off while its processes keep running: a worker's host mid-stream
(its requests continue on the other worker), the leading scheduler's host (the standby takes the lease;
when the old leader's link returns, whatever it still plans carries the old epoch and the workers refuse
it). Every stream completes equal to a fault-free run, no sequence number is missing, and a token
delivered twice is the same token (the gateway drops it by seq). A real gateway's host cut off with 16
streams open: the scheduler cancels its requests and frees their KV, and the gateway, once back, fails
each of its open streams at once with the reason (``gateway_lost``) and serves new requests."""
import concurrent.futures as cf
import json
import sys
import time
from datetime import datetime
from pathlib import Path

import httpx2 as httpx  # what openai 3.x ships (the httpx API)
import pytest
import redis

from core import protocol as P
from scheduler.housekeeping import GATEWAY_LOST
from tests.support.factories import tiny_llama_with_tokenizer
from tests.support.hosts import net  # noqa: F401 - the fixture
from tests.support.faults import TIERS, assert_complete_and_equal, expected, workload
from tests.support.pipeline import Reader, stats, submit, wait_kv_idle
from tests.support.redis_group import server_argv
from tests.support.wait import pace, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

PORT = 6379
STALE = "plan from a former scheduler leader dropped"


def start(net, tmp: Path, llama_dir, schedulers=("sa",), scheduler_args=(), num_blocks=256):
    for name in ("rd", *schedulers, "wa", "wb"):
        net.add(name)
    net.spawn("rd", server_argv(PORT, [net["rd"].addr, "127.0.0.1"], tmp / "rd"), tmp / "rd.out")
    url = f"redis://{net['rd'].addr}:{PORT}/0"
    r = redis.Redis.from_url(url, socket_timeout=5)
    wait_for(lambda: r.ping(), 10, "redis")
    logs = tmp / "logs"
    procs = {}
    for host in schedulers:
        procs[host] = net.spawn(host, [sys.executable, "-m", "scheduler", "--redis-url", url, *scheduler_args],
                                logs / f"{host}.log")
    model = ["--model", str(llama_dir), "--tiers", TIERS, "--dtype", "float64", "--num-blocks", str(num_blocks),
             "--block-size", "4", "--threads", "1"]
    for host, wid in (("wa", "w0"), ("wb", "w1")):
        procs[host] = net.spawn(host, [sys.executable, "-m", "worker", "--redis-url", url, "--worker-id", wid, *model],
                                logs / f"{host}.log")
    wait_for(lambda: (s := stats(r)) is not None and s.workers >= 2, 120, "two workers")
    return r, procs, logs


def delivered_twice(rd, work) -> int:
    return sum(len(e.token_ids) for v in rd.events.values() for e in v) - sum(n for *_, n in work)


def test_worker_host_cut_off_its_requests_continue_on_the_other(net, tmp_path, llama_dir):
    r, _, _ = start(net, tmp_path, llama_dir)
    work = workload(16, 31, max_tokens=100)
    for rid, prompt, tier, n in work:
        submit(r, rid, prompt, tier, max_tokens=n, ignore_eos=True)
    rd = Reader(r)
    rd.until(lambda: sum(len(v) for v in rd.events.values() if any(e.worker == "w1" for e in v)) >= 40)
    cut = net.cut("wb")
    # A request with no token yet (still queued or in prefill) streams from no host: it is not counted as
    # on the cut one, though it must complete all the same.
    on_cut = [rid for rid, *_ in work
              if not rd.finished(rid) and rd.events.get(rid) and rd.events[rid][-1].worker == "w1"]
    rd.until(lambda: all(rd.finished(rid) for rid, *_ in work), timeout=120)
    done_in = time.monotonic() - cut
    moved = [rid for rid in on_cut if rd.events[rid][-1].worker == "w0"]
    assert on_cut and moved == on_cut
    s = wait_kv_idle(r)
    assert_complete_and_equal(rd, work, expected(llama_dir, work))
    twice = delivered_twice(rd, work)
    # The host comes back: its worker (still running) registers again and is given work.
    net.heal("wb")
    wait_for(lambda: stats(r).workers == 2, 30, "the healed worker to rejoin", poll=0.2)
    print(f"worker host cut: {len(on_cut)} of 16 streams on it moved to the other worker; all 16 complete "
          f"and equal {done_in:.1f}s after the cut (worker TTL 5 s); {twice} tokens delivered twice, dropped "
          f"by seq, 0 missing; re-planned {s.replanned}; the healed worker rejoined")


def test_leading_scheduler_host_cut_off_the_standby_leads_and_stale_plans_are_refused(net, tmp_path, llama_dir):
    # A lease of 2 s; the old leader's Redis timeout (10 s) outlasts the 4 s cut, so it never notices
    # the outage and carries on as leader once its link is back, until its next renewal fails.
    r, procs, logs = start(net, tmp_path, llama_dir, schedulers=("sa", "sb"),
                           scheduler_args=["--lease-s", "2", "--redis-timeout", "10"])
    wait_for(lambda: r.get(P.LEADER_KEY), 10, "a leader")
    leader_pid = int(r.get(P.LEADER_KEY).decode().rsplit("-", 1)[1])
    old, new = ("sa", "sb") if procs["sa"].pid == leader_pid else ("sb", "sa")
    assert procs[old].pid == leader_pid
    epoch = int(r.get(P.EPOCH_KEY))
    work = workload(16, 32, max_tokens=100)
    for rid, prompt, tier, n in work:
        submit(r, rid, prompt, tier, max_tokens=n, ignore_eos=True)
    rd = Reader(r)
    rd.until(lambda: sum(len(v) for v in rd.events.values()) >= 150)
    cut = net.cut(old)
    wait_for(lambda: int(r.get(P.EPOCH_KEY)) == epoch + 1, 15, "the standby to take the lease")
    took_over_in = time.monotonic() - cut
    assert int(r.get(P.LEADER_KEY).decode().rsplit("-", 1)[1]) == procs[new].pid
    pace(4.0 - took_over_in)  # the partition lasts 4 s
    net.heal(old)
    healed = time.time()
    rd.until(lambda: all(rd.finished(rid) for rid, *_ in work), timeout=120)
    done_in = time.monotonic() - cut
    assert_complete_and_equal(rd, work, expected(llama_dir, work))
    # The old leader, back, learns at its next renewal that it no longer leads...
    old_log = logs / f"{old}.log"
    line = wait_for(lambda: next((ln for ln in old_log.read_text().splitlines()
                                  if "another scheduler took over" in ln), None), 20, "the old leader to step down")
    stepped_down_in = datetime.fromisoformat(json.loads(line)["timestamp"]).timestamp() - healed
    s = wait_kv_idle(r)
    assert s.epoch == epoch + 1 and procs[old].poll() is None
    # ...and whatever it planned meanwhile was refused by the workers' epoch fence.
    refused = sum((logs / f"{w}.log").read_text().count(STALE) for w in ("wa", "wb"))
    twice = delivered_twice(rd, work)
    print(f"scheduler host cut: the standby led {took_over_in:.1f}s after the cut (lease 2 s), epoch "
          f"{epoch} -> {epoch + 1}; the old leader's link back after 4 s, it stepped down "
          f"{stepped_down_in:.1f}s later; {refused} stale plans of epoch {epoch} refused by the workers; all 16 "
          f"complete and equal {done_in:.1f}s after the cut; {twice} tokens delivered twice, dropped by seq, "
          f"0 missing")


def _healthy(base: str) -> bool:
    try:
        return httpx.get(base + "/health", timeout=2).status_code == 200
    except httpx.HTTPError:
        return False


def _stream(url: str, model: str, i: int, got: list[int], out: dict) -> None:
    """One streamed chat completion of up to 2,000 tokens (about 25 s of decoding: far longer than the
    gateway's 5 s heartbeat TTL, so none can end on its own before the reaping; with 400, two of 16 once
    did); ``got[i]`` counts its content chunks, ``out[i]`` is how it ended: ("done", None) or
    ("error", code), and when (time.monotonic())."""
    body = {"model": model, "messages": [{"role": "user", "content": f"Tell me about {i}."}], "stream": True,
            "max_tokens": 2000, "ignore_eos": True, "temperature": 0}
    end = ("done", None)
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=httpx.Timeout(5, read=90)) as resp:
        assert resp.status_code == 200, resp.read()
        for line in resp.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            obj = json.loads(line[6:])
            if "error" in obj:
                end = ("error", obj["error"].get("code"))
            elif obj.get("choices") and obj["choices"][0]["delta"].get("content"):
                got[i] += 1
    out[i] = (*end, time.monotonic())


def test_gateway_host_cut_off_its_requests_are_reaped_and_it_fails_them_when_back(net, tmp_path, frontend):
    family = tiny_llama_with_tokenizer(tmp_path / "family", frontend.tokenizer, max_positions=4096)
    # 4,096 blocks of 4: 16k tokens per worker, room for its 8 streams without preemption
    r, procs, logs = start(net, tmp_path, family, scheduler_args=["--housekeeping-s", "0.25"], num_blocks=4096)
    net.add("gw")
    url = f"redis://{net['rd'].addr}:{PORT}/0"
    procs["gw"] = net.spawn("gw", [sys.executable, "-m", "gateway", "--redis-url", url, "--model", str(family),
                                   "--tiers", TIERS, "--host", "0.0.0.0", "--port", "8000",
                                   "--gateway-id", "gw-cut"], logs / "gw.log")
    base = f"http://{net['gw'].addr}:8000"
    wait_for(lambda: _healthy(base), 60, "the gateway", poll=0.3)
    model = next(m["id"] for m in httpx.get(base + "/v1/models").json()["data"] if m["id"].endswith("-large"))
    got, out = [0] * 16, {}
    with cf.ThreadPoolExecutor(16) as ex:
        futs = [ex.submit(_stream, base, model, i, got, out) for i in range(16)]
        wait_for(lambda: all(n >= 3 for n in got), 60, "every stream to have begun", poll=0.05)
        cut = net.cut("gw")
        # Redis and the scheduler live on: the gateway's heartbeat (5 s TTL) lapses, the scheduler
        # cancels its 16 requests and frees their KV, while the gateway and its clients hear nothing.
        wait_for(lambda: (s := stats(r)) is not None and s.gateway_cancels >= 16, 30, "the scheduler to reap",
                 poll=0.1)
        reaped_in = time.monotonic() - cut
        s = wait_kv_idle(r)
        assert not out, "a stream ended while its gateway was cut off"
        assert r.ttl(P.out_stream("gw-cut")) > 0  # the stream expires unless the gateway comes back
        healed = net.heal("gw")
        for f in futs:
            f.result(timeout=90)
    failed_in = max(t for *_, t in out.values()) - healed
    ends = sorted({(kind, code) for kind, code, _ in out.values()})
    assert ends == [("error", GATEWAY_LOST)], ends
    # Back, the gateway keeps its stream (its heartbeat PERSISTs it) and serves as before.
    wait_for(lambda: r.ttl(P.out_stream("gw-cut")) == -1, 10, "the gateway to keep its stream", poll=0.2)
    resp = httpx.post(base + "/v1/chat/completions", timeout=60, json={
        "model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 8})
    assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] >= 1, resp.text
    assert procs["gw"].poll() is None
    print(f"gateway host cut: 16 streams open; the scheduler cancelled all 16 and freed their KV {reaped_in:.1f}s "
          f"after the cut (gateway heartbeat TTL 5 s, housekeeping 0.25 s); healed after "
          f"{healed - cut:.1f}s, the gateway failed all 16 streams ({GATEWAY_LOST}, 503) within "
          f"{failed_in:.1f}s and then served a new request")
