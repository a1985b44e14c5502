"""Whose CPU a streamed token costs through the API: starts `mfs up --model default [EXTRA...]`, waits for
the compiled path, then streams ROUNDS rounds of STREAMS concurrent greedy requests (default 1) of TOKENS
tokens each to the top tier and prints, per round, each process's CPU milliseconds per token (utime + stime from /proc, `mfs up` and its children:
Redis, scheduler, gateway, worker) and this client's own, next to the client's TPOT. On 2 cores, what the
others spend a token is time the worker's two OpenMP threads wait for a core.
usage: python tools/probes/api_cpu.py ROUNDS [TOKENS [STREAMS [EXTRA...]]]   (e.g. 3 128 1 --stream-interval 1)"""
import asyncio
import os
import resource
import sys
import time
from pathlib import Path

import aiohttp

from benches.lib import model_ids
from benches.peers_api import compiled_in_use, start_mfs_up, stop_mfs_up, stream_one

TICK = os.sysconf("SC_CLK_TCK")


def group_cpu(root: int) -> dict[str, float]:
    """CPU seconds of `root` and its descendants, keyed by a short name from each command line."""
    stats: dict[int, list[str]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            stats[int(stat.parent.name)] = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, ValueError):
            continue
    tree, grew = {root}, True
    while grew:
        more = {pid for pid, f in stats.items() if int(f[1]) in tree} - tree
        tree |= more
        grew = bool(more)
    out: dict[str, float] = {}
    for pid in tree:
        stat, fields = Path(f"/proc/{pid}/stat"), stats.get(pid)
        try:
            cmd = (stat.parent / "cmdline").read_bytes().split(b"\0")
            words = [w.decode() for w in cmd if w and not w.startswith(b"-")]
            name = next((w for w in words if w in ("gateway", "scheduler", "worker", "supervise")), None) \
                or Path(words[0]).name if words else "?"
            if name == "worker" or "redis" in name:
                name = f"{name}:{stat.parent.name}"
            out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / TICK
        except (OSError, IndexError, TypeError, ValueError):
            continue
    return out


def own_cpu() -> float:
    u = resource.getrusage(resource.RUSAGE_SELF)
    return u.ru_utime + u.ru_stime


def main() -> None:
    if len(sys.argv) < 2:
        print(__doc__.rsplit("usage: ", 1)[1])
        return
    rounds = int(sys.argv[1])
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 128
    streams = int(sys.argv[3]) if len(sys.argv) > 3 else 1
    proc, url, log, launched = start_mfs_up("default", 600, tuple(sys.argv[4:]))
    try:
        async def run() -> None:
            top = model_ids(url)[-1]
            async with aiohttp.ClientSession() as s:
                print("compiled decode in use", await compiled_in_use(s, url, top, [1, 2, 3, 4], launched),
                      "s after launch")
                for _ in range(rounds):
                    await asyncio.sleep(1.0)
                    a, ca = group_cpu(proc.pid), own_cpu()
                    t = time.perf_counter()
                    runs = await asyncio.gather(*(stream_one(s, url, top, [10 + i, 20, 30, 40, 50, 60, 70, 80], n)
                                                  for i in range(streams)))
                    wall = time.perf_counter() - t
                    b, cb = group_cpu(proc.pid), own_cpu()
                    tokens = n * streams
                    per = {k: round(1e3 * (b[k] - a.get(k, 0.0)) / tokens, 3) for k in b}
                    per["client"] = round(1e3 * (cb - ca) / tokens, 3)
                    tpot = sum(r["end"] - r["first"] for r in runs) / len(runs) / (n - 1)
                    print(f"tpot {1e3 * tpot:.3f} ms, {tokens / wall:.1f} tok/s; CPU ms a token: "
                          f"{dict(sorted(per.items(), key=lambda kv: -kv[1]))}")
        asyncio.run(run())
    finally:
        stop_mfs_up(proc)


if __name__ == "__main__":
    main()
