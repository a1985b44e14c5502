"""The one process harness of the test suite: child processes started with their output in a log (or
discarded), each in its own session, and stopped on close (SIGTERM, then SIGKILL after a grace)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

MFS = [sys.executable, "-m", "mfs.cli"]
ROOT = Path(__file__).resolve().parents[2]


def run_mfs(*args: str, timeout: float = 300, env: dict | None = None) -> subprocess.CompletedProcess:
    """`mfs ARGS...` as a subprocess from the repository root, its output captured (logs at WARNING)."""
    env = dict(os.environ, MFS_LOG_LEVEL="WARNING", **(env or {}))
    return subprocess.run(MFS + list(args), capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)


def mfs_refuses(*args: str) -> subprocess.CompletedProcess:
    """`mfs ARGS...` expected to refuse its arguments, run in this process (``mfs.cli.run``: no fresh
    interpreter importing torch for an error, ~3 CPU-seconds each), its output captured: the same exit
    status and stdout/stderr as the script's. Torch's thread count is put back (a command may set it)."""
    import contextlib
    import io

    import torch

    from mfs import cli
    out, err, threads = io.StringIO(), io.StringIO(), torch.get_num_threads()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli.run(list(args))
        except SystemExit as e:  # argparse's usage errors
            code = 0 if e.code is None else e.code if isinstance(e.code, int) else 1
        finally:
            torch.set_num_threads(threads)
    return subprocess.CompletedProcess(["mfs", *args], code, out.getvalue(), err.getvalue())


class Procs:
    """A group of child processes; ``with Procs() as procs:`` stops every one of them on exit."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []

    def spawn(self, argv: list[str], log: Path | None = None, env: dict | None = None) -> subprocess.Popen:
        """Starts argv with stdout and stderr in ``log`` (appended; None: discarded)."""
        env = dict(os.environ, PYTHONUNBUFFERED="1", **(env or {}))
        if log is None:
            p = subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env,
                                 start_new_session=True)
        else:
            log.parent.mkdir(parents=True, exist_ok=True)
            with open(log, "ab") as out:
                p = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self.procs.append(p)
        return p

    @staticmethod
    def stop(p: subprocess.Popen, grace_s: float = 5.0, sig: int = signal.SIGTERM) -> None:
        """Signals p's process group (sig; SIGKILL if it outlives the grace) and reaps it."""
        for s in (sig, signal.SIGKILL):
            if p.poll() is not None:
                break
            try:
                os.killpg(p.pid, s)
            except ProcessLookupError:
                break
            try:
                p.wait(grace_s)
            except subprocess.TimeoutExpired:
                continue
        p.wait(grace_s)

    def close(self, grace_s: float = 5.0, sig: int = signal.SIGTERM) -> None:
        for p in self.procs:
            self.stop(p, grace_s, sig)
        self.procs.clear()

    def __enter__(self) -> "Procs":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
