"""Where the gateway's CPU goes per streamed token: starts `mfs up --model default`, then a second gateway
on the same Redis under cProfile, streams ROUNDS greedy requests of TOKENS tokens through that one (after
a warm-up request), stops it and prints its costliest functions (own time) per token.
usage: python tools/probes/gateway_prof.py ROUNDS [TOKENS [TOP]]   (e.g. 3 128 30)"""
import asyncio
import os
import pstats
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time

import aiohttp

from benches.lib import model_ids
from benches.peers_api import compiled_in_use, start_mfs_up, stop_mfs_up, stream_one


# the gateway's own main, with a CPU-time profiler that SIGUSR1 starts; it is written out when the gateway stops
WRAPPER = """
import cProfile, signal, sys, time
from gateway.__main__ import main
out = sys.argv[1]
prof = cProfile.Profile(time.process_time)
signal.signal(signal.SIGUSR1, lambda *_: prof.enable())
try:
    main(sys.argv[2:])
finally:
    prof.disable()
    prof.dump_stats(out)
"""


def main() -> None:
    if len(sys.argv) < 2:
        print(__doc__.rsplit("usage: ", 1)[1])
        return
    rounds = int(sys.argv[1])
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 128
    top_n = int(sys.argv[3]) if len(sys.argv) > 3 else 30
    proc, url, log, launched = start_mfs_up("default", 600)
    prof = os.path.join(tempfile.mkdtemp(prefix="mfs-gwprof-"), "gateway.prof")
    gw = None
    try:
        redis_url = re.search(r"redis://[^\s\"')]+", log.read_text()).group(0)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        gw = subprocess.Popen([sys.executable, "-c", WRAPPER, prof, "--redis-url", redis_url, "--model", "default",
                               "--host", "127.0.0.1", "--port", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        url2 = f"http://127.0.0.1:{port}"

        async def run() -> None:
            async with aiohttp.ClientSession() as s:
                for _ in range(300):
                    try:
                        async with s.get(url2 + "/health") as r:
                            if r.status == 200:
                                break
                    except aiohttp.ClientError:
                        pass
                    await asyncio.sleep(0.2)
                top = model_ids(url2)[-1]
                print("compiled decode in use", await compiled_in_use(s, url2, top, [1, 2, 3, 4], launched),
                      "s after launch")
                await stream_one(s, url2, top, [5, 6, 7, 8], n)  # warm-up
                gw.send_signal(signal.SIGUSR1)  # the profile covers the rounds only
                await asyncio.sleep(0.5)
                for _ in range(rounds):
                    one = await stream_one(s, url2, top, [10, 20, 30, 40, 50, 60, 70, 80], n)
                    print(f"tpot {1e3 * (one['end'] - one['first']) / (n - 1):.3f} ms")
        asyncio.run(run())
    finally:
        if gw is not None:
            gw.send_signal(signal.SIGTERM)
            gw.wait(30)
        stop_mfs_up(proc)
    time.sleep(0.1)
    st = pstats.Stats(prof)
    print(f"gateway: {st.total_tt:.3f} s of CPU profiled over {rounds * n} tokens "
          f"({1e3 * st.total_tt / (rounds * n):.3f} ms a token, the profiler's own cost included)")
    st.sort_stats("tottime").print_stats(top_n)


if __name__ == "__main__":
    main()
