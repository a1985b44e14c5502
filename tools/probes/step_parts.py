"""Where the decode-bound workload's steps spend their time, nested against each standalone tier
(compiled, as `mfs bench engine --compile`): per step the trunk segments (NestedModel._segment), the
exits (_exit: blocks and norms), the head (_logits) and the engine around the forward; medians of
60 steps after 5, rounds alternated; the exit blocks through the compiled graph and eager.
usage: python tools/probes/step_parts.py WEIGHTS [ROUNDS]"""
import collections
import statistics
import sys
import time

from decode_bound import nested_and_tiers, started, workload
from worker.execution import compiled_exits
from worker.model import NestedModel


def main() -> None:
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    model, copies = nested_and_tiers(sys.argv[1], compile=True)
    n = len(model.tiers)
    acc: collections.Counter = collections.Counter()
    for name in ("_segment", "_exit", "_logits", "forward_step"):
        def timed(*a, _f=getattr(NestedModel, name), _n=name, **k):
            t = time.perf_counter()
            r = _f(*a, **k)
            acc[_n] += time.perf_counter() - t
            return r
        setattr(NestedModel, name, timed)
    work = workload(model)


    def run(m, items) -> dict:
        eng = started(m, items)
        per = collections.defaultdict(list)
        for _ in range(60):
            acc.clear()
            t = time.perf_counter()
            eng.step()
            per["step"].append(time.perf_counter() - t)
            for k in ("_segment", "_exit", "_logits"):
                per[k].append(acc[k])
            per["engine"].append(per["step"][-1] - acc["forward_step"])
        return {k: 1e3 * statistics.median(v) for k, v in per.items()}


    saved = {id(m): compiled_exits(m) for m in [model, *copies]}
    rows = collections.defaultdict(list)
    for rnd in range(int(sys.argv[2]) if len(sys.argv) > 2 else 2):
        for mode in (("compiled", "eager") if rnd % 2 == 0 else ("eager", "compiled")):
            for m in [model, *copies]:
                m.execution.exits = saved[id(m)] if mode == "compiled" else frozenset()
            nested = run(model, work)
            tiers = [run(c, [it for it in work if it.tier == k]) for k, c in enumerate(copies)]
            indep = {k: sum(t[k] for t in tiers) for k in nested}
            rows[mode].append((nested, indep))
            print(f"round {rnd + 1}, exit blocks {mode}:")
            for k in ("step", "_segment", "_exit", "_logits", "engine"):
                print(f"  {k:9} nested {nested[k]:6.2f} ms   tiers {' + '.join(f'{t[k]:.2f}' for t in tiers)}"
                  f" = {indep[k]:6.2f} ms   ratio {indep[k] / nested[k]:.2f}")


if __name__ == "__main__":
    main()
