"""The decode-bound workload's compiled steps split finer than step_parts.py: per step, nested and each
standalone tier (w4a8), the time in each compiled graph call (by layers x rows; "graph" their sum), in
InductorDecode.layers around them, write_segment_kv, _segment, _exit, _exit_inputs, _logits and forward_step --
and in decode_gather where worker.model still calls it (before 85bd846 moved the context slots into the
graph; to time such a commit, copy this file and decode_bound.py into its checkout). Medians of 60 steps
after 5, two rounds. usage: python tools/probes/nested_split.py"""
import collections
import statistics
import time

import worker.execution as wm  # write_segment_kv is called from there
from decode_bound import nested_and_tiers, started, time_graph_calls, workload
from worker.execution import InductorDecode
from worker.model import NestedModel


def main() -> None:
    model, copies = nested_and_tiers("w4a8", compile=True)
    acc: collections.Counter = collections.Counter()
    cnt: collections.Counter = collections.Counter()


    def wrap(obj, name):
        f = getattr(obj, name)

        def timed(*a, **k):
            t = time.perf_counter()
            r = f(*a, **k)
            acc[name] += time.perf_counter() - t
            cnt[name] += 1
            return r
        static = isinstance(obj, type) and isinstance(obj.__dict__.get(name), staticmethod)
        setattr(obj, name, staticmethod(timed) if static else timed)


    for name in ("_segment", "_exit", "_logits", "forward_step", "_exit_inputs"):
        wrap(NestedModel, name)
    wrap(InductorDecode, "layers")  # the compiled graph's call around it (worker/execution.py)
    for name in ("decode_gather", "write_segment_kv"):
        if hasattr(wm, name):
            wrap(wm, name)


    def record(layers: int, rows: int, seconds: float) -> None:
        for key in (f"graph {layers}x{rows}", "graph"):
            acc[key] += seconds
            cnt[key] += 1


    for m in [model, *copies]:
        time_graph_calls(m, record)
    work = workload(model)


    def run(m, items):
        eng = started(m, items)
        per, calls = collections.defaultdict(list), {}
        for _ in range(60):
            acc.clear()
            cnt.clear()
            t = time.perf_counter()
            eng.step()
            per["step"].append(time.perf_counter() - t)
            for k in list(acc):
                per[k].append(acc[k])
            calls = dict(cnt)
        return {k: 1e3 * statistics.median(v) for k, v in per.items()}, calls


    for rnd in range(2):
        nested, calls = run(model, work)
        tiers = [run(c, [it for it in work if it.tier == k]) for k, c in enumerate(copies)]
        print(f"round {rnd + 1} (ms a step; nested calls a step in brackets)")
        for k in nested:
            parts = " + ".join(f"{t[k]:.3f}" if k in t else "-" for t, _ in tiers)
            print(f"  {k:18} nested {nested[k]:6.3f} ({calls.get(k, '-')})  tiers {parts}")
        for k, (t, _) in enumerate(tiers):
            print(f"  tier {k} graphs:", {g: round(v, 3) for g, v in t.items() if g.startswith("graph ")})


if __name__ == "__main__":
    main()
