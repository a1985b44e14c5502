"""Greedy sampling's argmax in the compiled nested step, in one process: ``mfs::argmax_rows`` against
``torch.argmax``, alternated per round (the operator switched in and out of ``kernels.cpu_argmax``), for
16 mixed requests (11 / 3 / 2) of the default family in w4a8: per round the median of 60 steps (after
5) and of the runner's ``sample`` call in them; then the medians over rounds.
usage: python tools/probes/argmax_ab.py ROUNDS"""
import statistics
import sys
import time

import worker.runner
from decode_bound import compiled_nested, started_tiers
from kernels import cpu_argmax


def main() -> None:
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    model = compiled_nested("w4a8")
    op = cpu_argmax.argmax_kernel()
    if op is None:
        sys.exit("mfs::argmax_rows does not build here: nothing to compare")
    sample, spent = worker.runner.sample, []

    def timed(*a):
        t = time.perf_counter()
        out = sample(*a)
        spent.append(time.perf_counter() - t)
        return out

    worker.runner.sample = timed
    got: dict[str, list[tuple[float, float]]] = {"torch.argmax": [], "mfs::argmax_rows": []}
    for r in range(int(sys.argv[1])):
        for arm in (("torch.argmax", "mfs::argmax_rows") if r % 2 == 0 else ("mfs::argmax_rows", "torch.argmax")):
            cpu_argmax._choice[:] = [op if arm == "mfs::argmax_rows" else None]
            eng = started_tiers(model, [0] * 11 + [1] * 3 + [2] * 2)
            spent.clear()
            steps = []
            for _ in range(60):
                t = time.perf_counter()
                eng.step()
                steps.append(time.perf_counter() - t)
            got[arm].append((statistics.median(steps) * 1e3, statistics.median(spent) * 1e6))
    for arm, v in got.items():
        print(f"{arm}: step {statistics.median(s for s, _ in v):.2f} ms (rounds {[round(s, 2) for s, _ in v]}), "
              f"sample {statistics.median(u for _, u in v):.0f} us (rounds {[round(u) for _, u in v]})")


if __name__ == "__main__":
    main()
