"""What a worker's per-step token delivery costs the forward on a 2-core machine: the compiled top tier
at one row (default family, w4a8), 60 steps a round, with no delivery, with one Redis pipeline (an
XADD of one event) a step on a writer thread as `worker/loop.py` does for multi-step plans, and with
that pipeline on the stepping thread; arms alternated over ROUNDS rounds in one process, against a
redis-server of its own. Run from the repository root with `PYTHONPATH=.` (it borrows the tests' server).
usage: PYTHONPATH=. python tools/probes/events_thread.py ROUNDS"""
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import msgpack
import redis

from decode_bound import compiled_nested, started_tiers


def main() -> None:
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    from tests.support.redis_server import redis_server  # noqa: PLC0415 (PYTHONPATH=.)
    model = compiled_nested("w4a8")
    event = msgpack.packb({"rid": "r" * 20, "tokens": [1], "seq": 5, "tier": 2, "worker": "w0", "path": "inductor"})
    with redis_server("/tmp") as url:
        r = redis.Redis.from_url(url)
        writer = ThreadPoolExecutor(1)

        def deliver() -> None:
            p = r.pipeline(transaction=False)
            p.xadd("mfs:probe:events", {"e": event}, maxlen=1000, approximate=True)
            p.execute()

        got: dict[str, list[float]] = {"none": [], "thread": [], "inline": []}
        for k in range(int(sys.argv[1])):
            for arm in (("none", "thread", "inline") if k % 2 == 0 else ("inline", "thread", "none")):
                eng = started_tiers(model, [2], prompt_len=16)
                steps, pending = [], None
                for _ in range(60):
                    t = time.perf_counter()
                    eng.step()
                    if arm == "thread":
                        if pending is not None:
                            pending.result()
                        pending = writer.submit(deliver)
                    elif arm == "inline":
                        deliver()
                    steps.append(time.perf_counter() - t)
                if pending is not None:
                    pending.result()
                got[arm].append(statistics.median(steps) * 1e3)
        r.delete("mfs:probe:events")
    for arm, v in got.items():
        print(f"{arm}: step {statistics.median(v):.2f} ms (rounds {[round(x, 2) for x in v]})")


if __name__ == "__main__":
    main()
