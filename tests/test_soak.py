"""Soak: the whole service (gateway, leader + standby scheduler, one worker, the real default family)
under steady mixed load from the `openai` client for a few rounds: chat and completions, streamed and
not, every tier and the family id, sessions that come back, clients that disconnect mid-stream.
After each round the worker's KV blocks in use return to zero, nothing stays pending, and Redis's
memory and stream lengths stay flat from round to round. Prints the figures (docs/RELIABILITY.md)."""
import asyncio
import random
import time

import aiohttp
import openai
import pytest
import redis

from core import protocol as P
from service.launch import Service
from tests.support.pipeline import stats, wait_kv_idle
from tests.support.wait import wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
MODELS = ["smollm2-135m-small", "smollm2-135m-medium", "smollm2-135m-large", "smollm2-135m"]
ROUNDS, ROUND_S, CONCURRENCY = 3, 12.0, 6  # three rounds: the flatness check compares the last to the second


def redis_figures(r) -> dict:
    streams = [k.decode() for k in r.scan_iter("mfs:*") if r.type(k) == b"stream"]
    kinds: dict[str, int] = {}
    for k in r.scan_iter("*"):
        kind = ":".join(k.decode().split(":")[:3 if k.startswith(b"mfs:kv:") else 2])
        kinds[kind] = kinds.get(kind, 0) + 1
    return {"used_memory": int(r.info("memory")["used_memory"]), "keys": r.dbsize(), "kinds": kinds,
            "held": sum(r.scard(k) for k in r.scan_iter(P.kv_held_key("*"))),
            "stream_entries": sum(r.xlen(s) for s in streams),
            "pending": r.xpending(P.REQ_STREAM, P.SCHEDULER_GROUP)["pending"],
            "progress_keys": len(list(r.scan_iter(P.progress_key("*"))))}


async def one(client, http, url, rng, counts):
    model = rng.choice(MODELS)
    kind = rng.random()
    n = rng.randint(4, 24)
    topic = rng.choice(["rivers", "bread", "prime numbers", "the moon", "chess", "tea"])
    msgs = [{"role": "user", "content": f"Tell me one fact about {topic}. ({rng.randint(0, 10**6)})"}]
    if kind < 0.35:
        r = await client.chat.completions.create(model=model, messages=msgs, max_tokens=n,
                                                 temperature=rng.choice([0.0, 0.8]))
        assert r.usage.completion_tokens >= 1
    elif kind < 0.65:
        stream = await client.chat.completions.create(model=model, messages=msgs, max_tokens=n, stream=True,
                                                      extra_headers={"X-Session-ID": f"s{rng.randint(0, 7)}"})
        async for _ in stream:
            pass
    elif kind < 0.85:
        r = await client.completions.create(model=model, prompt=f"A short note on {topic}:", max_tokens=n)
        assert r.choices[0].text is not None
    else:  # a client that goes away after the first chunk
        body = {"model": model, "messages": msgs, "max_tokens": 64, "stream": True}
        async with http.post(url + "/v1/chat/completions", json=body) as resp:
            assert resp.status == 200
            await resp.content.readline()
        counts["disconnects"] += 1
    counts["requests"] += 1


async def load(url, seconds, seed, counts):
    rng = random.Random(seed)
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120)
    end = time.monotonic() + seconds
    async with aiohttp.ClientSession() as http:
        async def lane(k):
            lr = random.Random(rng.random())
            while time.monotonic() < end:
                await one(client, http, url, lr, counts)
        await asyncio.gather(*(lane(k) for k in range(CONCURRENCY)))
    await client.close()


def test_soak_redis_memory_and_kv_pools_return_to_baseline():
    with Service("default", workers=1, schedulers=2,
                 worker_args=["--threads", "1", "--num-blocks", "256"]) as svc:
        r = redis.Redis.from_url(svc.redis_url)
        base = redis_figures(r)
        rounds = []
        for k in range(ROUNDS):
            counts = {"requests": 0, "disconnects": 0}
            asyncio.run(load(svc.url, ROUND_S, k, counts))
            wait_kv_idle(r, timeout=30)  # every block back (cached prefixes are evictable, not in use)
            # the scheduler's housekeeping (every 2 s) trims the streams and ends what is left: within 15 s
            wait_for(lambda: (f := redis_figures(r))["pending"] == 0 and f["progress_keys"] == 0
                     and f["stream_entries"] < 200, 15, "the streams trimmed, nothing pending", poll=0.25)
            rounds.append({**redis_figures(r), **counts})
        total_blocks = sum(sum(v) for v in stats(r).kv_blocks_total.values())
        for f in rounds:
            assert f["pending"] == 0 and f["progress_keys"] == 0, f
            assert f["stream_entries"] < 200, f  # trimmed below what is pending or unread
            # The KV directory lists at most what the pools can hold; everything else is a handful.
            assert 0 < f["held"] <= total_blocks, f
            assert f["keys"] < 100, f
        # Flat: after the first round (directory entries, the session keys, rate buckets exist),
        # later rounds of the same load add nothing that stays.
        grow = rounds[-1]["used_memory"] - rounds[1]["used_memory"]
        assert grow < max(256 * 1024, 0.1 * rounds[1]["used_memory"]), rounds
    total = sum(f["requests"] for f in rounds)
    print(f"soak: {ROUNDS} rounds x {ROUND_S:.0f}s, {CONCURRENCY} lanes, {total} requests "
          f"({sum(f['disconnects'] for f in rounds)} client disconnects); Redis used_memory "
          f"baseline {base['used_memory']:,} B, after each round "
          + ", ".join(f"{f['used_memory']:,}" for f in rounds)
          + "; stream entries " + ", ".join(str(f["stream_entries"]) for f in rounds)
          + "; keys " + ", ".join(str(f["keys"]) for f in rounds) + f" (KV blocks in the pools: {total_blocks})"
          + f"; key kinds after the last round: {rounds[-1]['kinds']}")
