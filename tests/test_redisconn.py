"""core/redisconn.py: the flags and URL forms, and a real Sentinel group on loopback (a primary, a
replica, three sentinels) whose failover both clients follow."""
import argparse
import asyncio
import subprocess

import pytest
import redis

from core.redisconn import RedisTarget, add_redis_args, connect, connect_async, target_from_args
from service.launch import free_port
from tests.support.redis_group import MASTER, master_of, sentinel_argv, sentinels_ready, server_argv
from tests.support.wait import wait_for

pytestmark = [pytest.mark.timeout(120)]


def test_targets_from_flags_and_urls(monkeypatch):
    t = RedisTarget.parse("redis+sentinel://10.0.0.1:26379,[::1]:26380/main/3")
    assert t.sentinel and t.sentinels == (("10.0.0.1", 26379), ("::1", 26380)) and t.master == "main" and t.db == 3
    assert RedisTarget.parse(t.as_url()) == t
    secret = RedisTarget.parse("redis+sentinel://:s3cret@h:1/m/0")
    assert secret.password == "s3cret" and "s3cret" not in secret.describe()
    assert RedisTarget.parse(secret.as_url()) == secret
    assert RedisTarget.parse("redis+sentinel://h:1").master == "mfs"
    plain = RedisTarget.parse("redis://:pw@h:6379/2")
    assert not plain.sentinel and plain.as_url() == "redis://:pw@h:6379/2" and "pw" not in plain.describe()
    for bad in ("redis+sentinel://h/m/0", "redis+sentinel://h:1/m/0/x"):
        with pytest.raises(ValueError):
            RedisTarget.parse(bad)
    with pytest.raises(ValueError):
        RedisTarget.parse("redis://h:1/0", master="m")  # a master name needs sentinels

    monkeypatch.setenv("REDIS_URL", "redis://envhost:7000/0")
    p = argparse.ArgumentParser()
    add_redis_args(p)
    assert target_from_args(p.parse_args([])).url == "redis://envhost:7000/0"
    t = target_from_args(p.parse_args(["--redis-sentinel", "a:1,b:2", "--redis-master", "x", "--redis-timeout", "3"]))
    assert t.sentinels == (("a", 1), ("b", 2)) and t.master == "x" and t.timeout_s == 3
    monkeypatch.delenv("REDIS_URL")
    p = argparse.ArgumentParser()
    add_redis_args(p, url_default=None)  # mfs up: nothing given means an embedded Redis
    assert p.parse_args([]).redis_url is None


def test_both_clients_follow_a_sentinel_failover(tmp_path):
    procs = []
    try:
        ports = [free_port() for _ in range(5)]
        lo = ["127.0.0.1"]
        procs.append(subprocess.Popen(server_argv(ports[0], lo, tmp_path / "a")))
        procs.append(subprocess.Popen(server_argv(ports[1], lo, tmp_path / "b", replicaof=("127.0.0.1", ports[0]))))
        sentinels = [("127.0.0.1", p) for p in ports[2:]]
        for i, (_, p) in enumerate(sentinels):
            procs.append(subprocess.Popen(sentinel_argv(p, lo, tmp_path / f"s{i}", ("127.0.0.1", ports[0]))))
        wait_for(lambda: sentinels_ready(sentinels, 1), 30, "the sentinels to find each other and the replica")
        url = "redis+sentinel://" + ",".join(f"{h}:{p}" for h, p in sentinels) + f"/{MASTER}/0"
        r = connect(url)
        r.set("k", "v")
        assert r.connection_pool.get_master_address() == ("127.0.0.1", ports[0])
        wait_for(lambda: redis.Redis(port=ports[1]).get("k") == b"v", 10, "replication")

        # NOGOODSLAVE until a sentinel has fresh INFO from the replica: ask again until one accepts
        wait_for(lambda: redis.Redis(port=ports[2]).execute_command("SENTINEL", "FAILOVER", MASTER), 30,
                 "a failover the sentinels accept")
        wait_for(lambda: master_of(sentinels) == ("127.0.0.1", ports[1]), 30, "the replica's promotion")
        # (a write the old primary takes before the sentinels demote it is lost: wait for the demotion)
        wait_for(lambda: redis.Redis(port=ports[0]).role()[0] == b"slave", 30, "the old primary's demotion")
        # the old connection fails once (the demoted primary answers READONLY)...
        wait_for(lambda: r.set("k2", "v2"), 15, "a write to the new primary")
        # ...and the client now writes to the new primary
        assert redis.Redis(port=ports[1]).get("k2") == b"v2"
        assert r.connection_pool.get_master_address() == ("127.0.0.1", ports[1])

        async def async_side():
            a = connect_async(url)
            await a.set("k3", "v3")
            got = await a.get("k2")
            await a.aclose()
            return got
        assert asyncio.run(async_side()) == b"v2"
        assert redis.Redis(port=ports[1]).get("k3") == b"v3"
    finally:
        for p in procs:
            p.kill()
            p.wait(5)
