"""Where Redis is, and the one way every process connects to it.

Two shapes, one flag set (``add_redis_args``) and one URL form for passing it on:

* one server: ``redis://host:port/db`` (``--redis-url``, else ``REDIS_URL``);
* a Sentinel group that follows a failover: ``redis+sentinel://h1:p1,h2:p2/MASTER/DB`` (also in
  ``REDIS_URL``), or ``--redis-sentinel h1:p1,h2:p2 --redis-master MASTER``. Connections go through
  redis-py's Sentinel support: each new connection asks the sentinels for the current master, and one
  still open to a master that was demoted fails (``ReadOnlyError`` becomes a ``ConnectionError``).

A command unanswered for ``timeout_s`` (5 s) fails (the socket timeout; a blocking read must ask for
less: the processes block for at most a second), and TCP keepalive probes with ``TCP_USER_TIMEOUT`` drop
an idle pooled connection to a peer silent that long, so a process whose Redis host is cut off sees a
connection error within about ``timeout_s``. An asyncio client may be given a bounded, *blocking* pool
(``connect_async(..., max_connections=N)``): a command that finds every connection busy waits for one
(up to ``pool_timeout_s``) instead of failing with redis-py's "Too many connections", which a burst of
requests would otherwise turn into false "Redis unreachable" answers. Synchronous clients do not retry inside redis-py (its
default is ten retries, hiding a failover): each process's own loop backs off and decides what a lost
connection means (the scheduler leader steps down and resumes; docs/RELIABILITY.md).
"""
from __future__ import annotations

import argparse
import os
import socket
from dataclasses import dataclass
from urllib.parse import quote, unquote, urlsplit

import redis
import redis.asyncio as aioredis
from redis.asyncio.connection import BlockingConnectionPool
from redis.asyncio.sentinel import Sentinel as AsyncSentinel
from redis.asyncio.sentinel import SentinelConnectionPool as AsyncSentinelPool
from redis.backoff import NoBackoff
from redis.retry import Retry
from redis.sentinel import Sentinel

DEFAULT_URL = "redis://127.0.0.1:6379/0"
DEFAULT_MASTER = "mfs"
DEFAULT_TIMEOUT_S = 5.0
SENTINEL_SCHEME = "redis+sentinel"


@dataclass(frozen=True, slots=True)
class RedisTarget:
    """One server (``url``) or a Sentinel group (``sentinels`` + ``master`` + ``db``)."""
    url: str | None = None
    sentinels: tuple[tuple[str, int], ...] = ()
    master: str = DEFAULT_MASTER
    db: int = 0
    password: str | None = None          # the master's (Sentinel mode); in ``url`` otherwise
    timeout_s: float = DEFAULT_TIMEOUT_S

    @property
    def sentinel(self) -> bool:
        return bool(self.sentinels)

    @classmethod
    def parse(cls, url: str | None = None, sentinel: str | None = None, master: str | None = None,
              timeout_s: float = DEFAULT_TIMEOUT_S) -> "RedisTarget":
        """From ``--redis-url`` (or ``REDIS_URL``) and/or ``--redis-sentinel``/``--redis-master``."""
        if timeout_s <= 0:
            raise ValueError(f"--redis-timeout must be > 0, not {timeout_s}")
        if sentinel:
            return cls(sentinels=parse_hosts(sentinel), master=master or DEFAULT_MASTER, timeout_s=timeout_s)
        url = url or DEFAULT_URL
        if not url.startswith(SENTINEL_SCHEME + "://"):
            if master:
                raise ValueError("--redis-master needs --redis-sentinel or a redis+sentinel:// URL")
            return cls(url=url, timeout_s=timeout_s)
        u = urlsplit(url)
        hosts = u.netloc.rsplit("@", 1)[-1]
        path = [p for p in u.path.split("/") if p]
        if len(path) > 2:
            raise ValueError(f"{url}: expected {SENTINEL_SCHEME}://HOST:PORT,.../MASTER/DB")
        name = master or (unquote(path[0]) if path else DEFAULT_MASTER)
        db = int(path[1]) if len(path) > 1 else 0
        return cls(sentinels=parse_hosts(hosts), master=name, db=db,
                   password=unquote(u.password) if "@" in u.netloc and u.password else None,
                   timeout_s=timeout_s)

    def as_url(self) -> str:
        """The form to hand to another process (``--redis-url``)."""
        if not self.sentinel:
            return self.url or DEFAULT_URL
        auth = f":{quote(self.password, safe='')}@" if self.password else ""
        hosts = ",".join(f"{h}:{p}" for h, p in self.sentinels)
        return f"{SENTINEL_SCHEME}://{auth}{hosts}/{quote(self.master, safe='')}/{self.db}"

    def describe(self) -> str:
        """For logs: never the password."""
        if not self.sentinel:
            u = urlsplit(self.url or DEFAULT_URL)
            return u._replace(netloc=u.netloc.rsplit("@", 1)[-1]).geturl()
        return f"sentinel {','.join(f'{h}:{p}' for h, p in self.sentinels)} master {self.master!r} db {self.db}"


def parse_hosts(spec: str) -> tuple[tuple[str, int], ...]:
    out = []
    for part in spec.split(","):
        part = part.strip()
        if not part:
            continue
        host, sep, port = part.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"{part!r}: expected HOST:PORT")
        out.append((host.strip("[]"), int(port)))
    if not out:
        raise ValueError(f"{spec!r}: no sentinel HOST:PORT")
    return tuple(out)


def _socket_options(timeout_s: float) -> dict:
    """Keepalive probes every second after a second idle; a peer silent for timeout_s is given up."""
    opts = {}
    for name, value in (("TCP_KEEPIDLE", 1), ("TCP_KEEPINTVL", 1), ("TCP_KEEPCNT", max(1, int(timeout_s))),
                        ("TCP_USER_TIMEOUT", int(timeout_s * 1000))):
        if hasattr(socket, name):  # Linux has all four
            opts[getattr(socket, name)] = value
    return opts


def connection_kwargs(target: RedisTarget) -> dict:
    return {"socket_timeout": target.timeout_s, "socket_connect_timeout": min(2.0, target.timeout_s),
            "socket_keepalive": True,
            "socket_keepalive_options": _socket_options(target.timeout_s),
            "retry": Retry(NoBackoff(), 0)}


def _sentinel_kwargs(target: RedisTarget) -> dict:
    # a sentinel that does not answer within a second is skipped for the next one
    return {"socket_timeout": 1.0, "socket_connect_timeout": 1.0, "retry": Retry(NoBackoff(), 0)}


class BlockingSentinelPool(AsyncSentinelPool, BlockingConnectionPool):
    """A Sentinel master's pool that, when all ``max_connections`` are busy, waits up to ``timeout``
    seconds for one (BlockingConnectionPool's ``get_connection``/``release``), and asks the sentinels
    for the master on each new connection (SentinelConnectionPool's connection class)."""


def _client(target: RedisTarget | str, overrides: dict, client_cls, sentinel_cls, pool: dict | None = None):
    t = target if isinstance(target, RedisTarget) else RedisTarget.parse(target)
    kw = connection_kwargs(t) | overrides
    if not t.sentinel:
        if pool:
            return client_cls.from_pool(BlockingConnectionPool.from_url(t.url, **pool, **kw))
        return client_cls.from_url(t.url, **kw)
    s = sentinel_cls(list(t.sentinels), sentinel_kwargs=_sentinel_kwargs(t))
    if pool:
        return s.master_for(t.master, db=t.db, password=t.password, connection_pool_class=BlockingSentinelPool,
                            **pool, **kw)
    return s.master_for(t.master, db=t.db, password=t.password, **kw)


def connect(target: RedisTarget | str, **overrides) -> redis.Redis:
    """A synchronous client (scheduler, worker, launcher, benchmarks); ``overrides`` win."""
    return _client(target, overrides, redis.Redis, Sentinel)


def connect_async(target: RedisTarget | str, max_connections: int | None = None,
                  pool_timeout_s: float | None = None, **overrides) -> aioredis.Redis:
    """An asyncio client (the gateway); ``overrides`` win (the gateway retries twice, quickly).

    ``max_connections``: a blocking pool of at most that many connections, where a command waits up to
    ``pool_timeout_s`` (default: the target's ``timeout_s``) for a free one; None: redis-py's default
    pool, which fails a command when its connections are all in use."""
    pool = None
    if max_connections is not None:
        if max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, not {max_connections}")
        t = target if isinstance(target, RedisTarget) else RedisTarget.parse(target)
        timeout = t.timeout_s if pool_timeout_s is None else pool_timeout_s
        if timeout <= 0:
            raise ValueError(f"pool_timeout_s must be > 0, not {timeout}")
        pool, target = {"max_connections": max_connections, "timeout": timeout}, t
    return _client(target, overrides, aioredis.Redis, AsyncSentinel, pool)


def add_redis_args(p: argparse.ArgumentParser, url_default: str | None = DEFAULT_URL) -> None:
    """--redis-url (default REDIS_URL, else ``url_default``), --redis-sentinel, --redis-master, --redis-timeout."""
    g = p.add_argument_group("redis", "one server (--redis-url) or a Sentinel group that follows a "
                             "failover (--redis-sentinel + --redis-master, or a redis+sentinel:// URL)")
    g.add_argument("--redis-url", default=os.environ.get("REDIS_URL", url_default),
                   help="redis://HOST:PORT/DB or redis+sentinel://H1:P1,H2:P2/MASTER/DB (default: REDIS_URL, "
                        f"else {url_default or 'none'})")
    g.add_argument("--redis-sentinel", default=None, metavar="H1:P1,H2:P2",
                   help="sentinels to ask for the master (overrides --redis-url's server)")
    g.add_argument("--redis-master", default=None, help=f"the master's name at the sentinels (default {DEFAULT_MASTER})")
    g.add_argument("--redis-timeout", type=float, default=DEFAULT_TIMEOUT_S,
                   help="seconds a Redis command may go unanswered (and an idle connection's peer silent) "
                        "before the connection is dropped and the process reconnects")


def target_from_args(args: argparse.Namespace) -> RedisTarget:
    return RedisTarget.parse(args.redis_url, args.redis_sentinel, args.redis_master, args.redis_timeout)
