"""Test hosts with their own addresses: Linux network namespaces joined by veth pairs to one bridge.

``Net`` (root only) makes, for one test run:

* a switch namespace ``{prefix}-sw`` holding the bridge ``br0``;
* per host ``NAME``: a namespace ``{prefix}-NAME`` with loopback up and ``eth0`` at ``10.213.N.k/24``,
  whose veth peer ``NAME`` sits in the switch namespace on the bridge;
* the driver's own link: ``{prefix}d`` in the root namespace at ``10.213.N.1/24`` (its peer on the
  bridge), so the test process reaches every host. Nothing else in the root namespace changes.

``cut(name)`` pulls the host's cable: its port on the switch goes down, the host keeps its address, and
every packet to or from it is dropped silently (no reset, no error: a partition, as TCP sees one);
``heal(name)`` plugs it back. Processes run inside a host through ``ip netns exec`` (``spawn``).
``close()`` kills every process in the run's namespaces, deletes them (their veths go with them) and the
driver's link. ``reap_leftovers()`` does the same for the namespaces of an earlier run whose process is
gone (a crashed run); a run's prefix ``mfst{pid}`` names its pytest process, so concurrent runs never
touch each other's. ``N`` is the first ``10.213.N.0/24`` no root-namespace address uses, picked under a
lock file.
"""
from __future__ import annotations

import fcntl
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.support.procs import Procs
from tests.support.wait import wait_for

PREFIX = "mfst"
LOCK = Path("/tmp/mfs-test-hosts.lock")
_NS_RE = re.compile(rf"^{PREFIX}(\d+)-")
_LINK_RE = re.compile(rf"^{PREFIX}(\d+)d$")


def ip(*args: str, check: bool = True) -> str:
    res = subprocess.run(["ip", *args], capture_output=True, text=True)
    if check and res.returncode:
        raise RuntimeError(f"ip {' '.join(args)}: {res.stderr.strip()}")
    return res.stdout


def why_not() -> str | None:
    """Why this machine cannot make test hosts, or None."""
    if sys.platform != "linux":
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "making network namespaces needs root"
    if not shutil.which("ip"):
        return "no `ip` command (iproute2)"
    probe = f"{PREFIX}{os.getpid()}-probe"
    res = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if res.returncode:
        return f"`ip netns add` failed: {res.stderr.strip()}"
    ip("netns", "del", probe, check=False)
    return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _kill_ns_processes(ns: str) -> None:
    def none_left() -> bool:
        pids = [int(p) for p in ip("netns", "pids", ns, check=False).split()]
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return not pids
    wait_for(none_left, 5, f"the processes of {ns} to be gone", poll=0.2)


def _delete_namespaces(names: list[str]) -> None:
    for ns in names:
        _kill_ns_processes(ns)
    for ns in names:
        ip("netns", "del", ns, check=False)


def reap_leftovers() -> list[str]:
    """Removes the namespaces and driver links of earlier runs whose pytest process is gone."""
    gone = []
    for line in ip("netns", "list", check=False).splitlines():
        ns = line.split()[0] if line.strip() else ""
        m = _NS_RE.match(ns)
        if m and not _alive(int(m.group(1))):
            gone.append(ns)
    # the switch last: hosts first, so no process outlives its namespace's bridge
    _delete_namespaces(sorted(gone, key=lambda n: n.endswith("-sw")))
    for line in ip("-o", "link", "show", check=False).splitlines():
        name = line.split(":")[1].strip().split("@")[0] if ":" in line else ""
        m = _LINK_RE.match(name)
        if m and not _alive(int(m.group(1))):
            ip("link", "del", name, check=False)
            gone.append(name)
    return gone


def _used_subnets() -> set[int]:
    used = set()
    for line in ip("-o", "-4", "addr", "show", check=False).splitlines():
        m = re.search(r"inet 10\.213\.(\d+)\.", line)
        if m:
            used.add(int(m.group(1)))
    return used


@dataclass
class Host:
    name: str
    ns: str
    addr: str          # its address on the bridge
    port: str          # its veth peer in the switch namespace (the cable)
    cut_at: float | None = None

    def cmd(self, argv: list[str]) -> list[str]:
        return ["ip", "netns", "exec", self.ns, *argv]


@dataclass
class Net:
    prefix: str = field(default_factory=lambda: f"{PREFIX}{os.getpid()}")
    hosts: dict[str, Host] = field(default_factory=dict)
    procs: Procs = field(default_factory=Procs)
    subnet: int | None = None
    made: list[str] = field(default_factory=list)   # namespaces, in the order made
    link: str | None = None                          # the driver's link in the root namespace

    @property
    def switch(self) -> str:
        return f"{self.prefix}-sw"

    @property
    def driver_addr(self) -> str:
        return f"10.213.{self.subnet}.1"

    def start(self) -> "Net":
        reap_leftovers()
        LOCK.touch(exist_ok=True)
        with open(LOCK) as lock:  # two runs starting together must not pick the same subnet
            fcntl.flock(lock, fcntl.LOCK_EX)
            free = sorted(set(range(1, 255)) - _used_subnets())
            if not free:
                raise RuntimeError("every 10.213.N.0/24 is in use")
            self.subnet = free[0]
            ip("netns", "add", self.switch)
            self.made.append(self.switch)
            ip("-n", self.switch, "link", "add", "br0", "type", "bridge")
            ip("-n", self.switch, "link", "set", "br0", "up")
            self.link = f"{self.prefix}d"
            ip("link", "add", self.link, "type", "veth", "peer", "name", f"{self.prefix}s", "netns", self.switch)
            ip("-n", self.switch, "link", "set", "dev", f"{self.prefix}s", "master", "br0", "up")
            ip("addr", "add", f"{self.driver_addr}/24", "dev", self.link)
            ip("link", "set", self.link, "up")
        return self

    def add(self, name: str) -> Host:
        assert re.fullmatch(r"[a-z][a-z0-9]{0,9}", name) and name not in self.hosts, name
        k = len(self.hosts) + 2
        assert k < 255
        h = Host(name, f"{self.prefix}-{name}", f"10.213.{self.subnet}.{k}", name)
        ip("netns", "add", h.ns)
        self.made.append(h.ns)
        ip("-n", h.ns, "link", "set", "lo", "up")
        ip("-n", h.ns, "link", "add", "eth0", "type", "veth", "peer", "name", h.port, "netns", self.switch)
        ip("-n", h.ns, "addr", "add", f"{h.addr}/24", "dev", "eth0")
        ip("-n", h.ns, "link", "set", "eth0", "up")
        ip("-n", self.switch, "link", "set", "dev", h.port, "master", "br0", "up")
        self.hosts[name] = h
        return h

    def __getitem__(self, name: str) -> Host:
        return self.hosts[name]

    # ---- faults ---------------------------------------------------------------------------------
    def cut(self, name: str) -> float:
        """Pulls the host's cable; returns when (time.monotonic())."""
        h = self.hosts[name]
        ip("-n", self.switch, "link", "set", "dev", h.port, "down")
        h.cut_at = time.monotonic()
        return h.cut_at

    def heal(self, name: str) -> float:
        h = self.hosts[name]
        ip("-n", self.switch, "link", "set", "dev", h.port, "up")
        h.cut_at = None
        return time.monotonic()

    # ---- processes ------------------------------------------------------------------------------
    def spawn(self, name: str, argv: list[str], log: Path, env: dict | None = None) -> subprocess.Popen:
        """Runs argv inside host `name`, output to `log`; the process is killed at close()."""
        return self.procs.spawn(self.hosts[name].cmd(argv), log, env)

    def run(self, name: str, argv: list[str], timeout: float = 30) -> subprocess.CompletedProcess:
        return subprocess.run(self.hosts[name].cmd(argv), capture_output=True, text=True, timeout=timeout)

    def close(self) -> None:
        self.procs.close(sig=signal.SIGKILL)
        # hosts first, the switch last
        _delete_namespaces([ns for ns in reversed(self.made)])
        self.made.clear()
        if self.link:
            ip("link", "del", self.link, check=False)
            self.link = None
        self.hosts.clear()


@pytest.fixture
def net(request):
    """A fresh Net for the test (skips with the reason when this machine cannot make one); everything it
    made is removed when the test ends, passed or failed."""
    reason = why_not()
    if reason:
        pytest.skip(reason)
    n = Net()
    request.addfinalizer(n.close)
    return n.start()
