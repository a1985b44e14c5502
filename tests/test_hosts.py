"""The test-hosts harness itself (tests/hosts.py): hosts reach each other by their own addresses, a cut
host is unreachable (and reaches nobody) until healed, and nothing the harness made outlives it."""
import subprocess
import sys

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from tests.support.hosts import Net, ip, reap_leftovers, why_not
from tests.support.hosts import net  # noqa: F401 - the fixture
from tests.support.redis_server import find_redis_server
from tests.support.wait import wait_for

pytestmark = [pytest.mark.timeout(120)]

# one try, 1 s to connect (redis-py retries 3 times with 1-10 s backoff by default)
PING = ("import redis, sys; from redis.retry import Retry; from redis.backoff import NoBackoff; "
        "print(redis.Redis(host=sys.argv[1], port=int(sys.argv[2]), socket_timeout=1, socket_connect_timeout=1, "
        "retry=Retry(NoBackoff(), 0)).ping())")


def ping_from(net, host, addr, port) -> bool:
    res = net.run(host, [sys.executable, "-c", PING, addr, str(port)])
    return res.returncode == 0 and res.stdout.strip() == "True"


def redis_in(net, host, tmp_path, port=6400):
    h = net[host]
    p = net.spawn(host, [find_redis_server(), "--port", str(port), "--bind", h.addr, "127.0.0.1",
                         "--save", "", "--appendonly", "no", "--dir", str(tmp_path)], tmp_path / f"{host}.log")
    r = redis.Redis(host=h.addr, port=port, socket_timeout=1, socket_connect_timeout=1, retry=Retry(NoBackoff(), 0))
    log = tmp_path / f"{host}.log"

    def up() -> bool:
        assert p.poll() is None, log.read_text()
        return r.ping()
    wait_for(up, 10, lambda: f"redis on {host}: {log.read_text()}")
    return p, r


def test_hosts_reach_each_other_and_a_cut_host_is_gone_until_healed(net, tmp_path):
    a, b = net.add("a"), net.add("b")
    assert a.addr != b.addr and a.addr.startswith(f"10.213.{net.subnet}.")
    _, r = redis_in(net, "a", tmp_path)
    assert ping_from(net, "b", a.addr, 6400)                 # host to host
    assert ping_from(net, "a", "127.0.0.1", 6400)            # a host's own loopback
    assert r.ping()                                          # the driver (root namespace)
    # loopback is each host's own: b has no Redis on its 127.0.0.1
    assert not ping_from(net, "b", "127.0.0.1", 6400)

    net.cut("a")
    assert not ping_from(net, "b", a.addr, 6400)
    with pytest.raises((redis.ConnectionError, redis.TimeoutError)):
        r.ping()
    assert ping_from(net, "a", a.addr, 6400)                 # inside the cut host all still works
    assert ping_from(net, "a", "127.0.0.1", 6400)

    net.heal("a")
    wait_for(lambda: ping_from(net, "b", a.addr, 6400), 10, "a to come back", poll=0)
    r.connection_pool.disconnect()
    assert r.ping()


def test_close_removes_everything_it_made(tmp_path):
    reason = why_not()
    if reason:
        pytest.skip(reason)
    n = Net().start()
    try:
        n.add("x")
        p = n.spawn("x", ["sleep", "300"], tmp_path / "sleep.log")
        made = [n.switch, n["x"].ns]
    finally:
        n.close()
    assert p.wait(5) is not None
    namespaces = ip("netns", "list")
    assert not any(ns in namespaces for ns in made), namespaces
    assert n.prefix not in ip("-o", "link", "show")


def test_leftovers_of_a_crashed_run_are_reaped(tmp_path):
    reason = why_not()
    if reason:
        pytest.skip(reason)
    dead = subprocess.Popen(["true"])
    dead.wait()  # a pid that no longer runs: the crashed run's
    n = Net(prefix=f"mfst{dead.pid}").start()
    n.add("y")
    orphan = n.spawn("y", ["sleep", "300"], tmp_path / "sleep.log")
    wait_for(lambda: str(orphan.pid) in ip("netns", "pids", n["y"].ns).split(), 10, "the orphan inside y")
    gone = reap_leftovers()
    assert n.switch in gone and n["y"].ns in gone
    assert orphan.wait(5) == -9
    assert f"mfst{dead.pid}" not in ip("netns", "list") + ip("-o", "link", "show")
