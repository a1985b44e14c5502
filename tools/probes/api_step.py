"""What a token costs through the API beyond the worker's forward: starts `mfs up --model default` (its
defaults), waits for the compiled path, then streams ROUNDS greedy requests of TOKENS tokens one at a
time; for each, the client's TPOT next to the scheduler's own sums (core/keyrecords.py StatsSnapshot):
plan sent -> result handled (``step_roundtrip_s``) and the worker's plan (``step_forward_s``), per plan
and per forward step (a multi-step plan runs several: ``forward_steps``). DECODE_STEPS: `mfs up
--decode-steps` (default: its own).
usage: python tools/probes/api_step.py ROUNDS [TOKENS [DECODE_STEPS]]   (e.g. 5 128 1)"""
import asyncio
import json
import re
import sys

import aiohttp
import redis

from benches.lib import model_ids
from benches.peers_api import compiled_in_use, start_mfs_up, stop_mfs_up, stream_one
from core import protocol as P
from core.keyrecords import StatsSnapshot


def main() -> None:
    if len(sys.argv) < 2:
        print(__doc__.rsplit("usage: ", 1)[1])
        return
    rounds = int(sys.argv[1])
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 128
    extra = ("--decode-steps", sys.argv[3]) if len(sys.argv) > 3 else ()
    proc, url, log, launched = start_mfs_up("default", 600, extra)
    try:
        r = redis.Redis.from_url(re.search(r"redis://[^\s\"')]+", log.read_text()).group(0))

        def sums() -> tuple[int, float, float, int]:
            s = StatsSnapshot.decode(r.hget(P.STATS_KEY, "scheduler"))
            return s.steps, s.step_roundtrip_s, s.step_forward_s, s.forward_steps

        async def run() -> None:
            top = model_ids(url)[-1]
            async with aiohttp.ClientSession() as s:
                print("compiled decode in use", await compiled_in_use(s, url, top, [1, 2, 3, 4], launched),
                      "s after launch")
                for _ in range(rounds):
                    await asyncio.sleep(1.2)  # the scheduler writes its stats every 0.5 s
                    a = sums()
                    one = await stream_one(s, url, top, [10, 20, 30, 40, 50, 60, 70, 80], n)
                    await asyncio.sleep(1.2)
                    b = sums()
                    steps, fwd = b[0] - a[0], b[3] - a[3]
                    print(json.dumps({"tpot_ms": round(1e3 * (one["end"] - one["first"]) / (n - 1), 3),
                                      "plans": steps, "forward_steps": fwd,
                                      "roundtrip_ms_per_plan": round(1e3 * (b[1] - a[1]) / steps, 3),
                                      "plan_ms": round(1e3 * (b[2] - a[2]) / steps, 3),
                                      "plan_ms_per_forward_step": round(1e3 * (b[2] - a[2]) / fwd, 3),
                                      "control_plane_ms_per_token": round(1e3 * (b[1] - b[2] - a[1] + a[2]) / fwd, 3),
                                      "paths": (one["mfs"] or {}).get("paths")}))
        asyncio.run(run())
    finally:
        stop_mfs_up(proc)


if __name__ == "__main__":
    main()
