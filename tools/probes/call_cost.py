"""One compiled call's fixed cost: the nested model's 1-layer (medium) exit block and its 10-layer segments at
1 row, called repeatedly with one step's captured inputs (cache-hot): through torch.compile (dynamo and the graph)
and through the inductor callable alone; then torch's profile of the direct calls. usage: python tools/probes/call_cost.py"""
import statistics
import time
import types

import torch
from torch._inductor.compile_fx import compile_fx
from torch.profiler import ProfilerActivity, profile

from decode_bound import compiled_nested, engine
from worker import compiled_step as cs
from worker.sampling import SamplingParams


def main() -> None:
    model = compiled_nested("w4a8")
    mk = lambda: engine(model)  # noqa: E731
    seen = {}
    real, real_exit = model.execution.graph, model.execution.exit_graph
    def grabbing(f):
        def grab(layers, *a):
            seen.setdefault(len(layers), (f, layers, a))
            return f(layers, *a)
        return grab
    model.execution.graph, model.execution.exit_graph = grabbing(real), grabbing(real_exit)
    eng = mk()
    eng.add_request("r0", list(range(100, 140)), 1, SamplingParams(max_tokens=200, ignore_eos=True))
    for _ in range(8): eng.step()
    model.execution.graph, model.execution.exit_graph = real, real_exit
    cap = {}
    def backend(gm, ex):
        fn = compile_fx(gm, ex, config_patches=dict(cs.CPU_OPTIONS))
        cap["fn"], cap["ex"] = fn, ex
        return fn
    def timeit(f, n=400):
        for _ in range(20): f()
        ts = []
        for _ in range(n):
            t = time.perf_counter(); f(); ts.append(time.perf_counter() - t)
        return statistics.median(ts) * 1e6
    with torch.inference_mode():
        for L in sorted(seen):
            real_fn, layers, a = seen[L]
            fn = cs.make_decode_segment(model.cfg)
            code = fn.__code__.replace(co_name=f"probe_{L}")
            fn = types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)
            cb = torch.compile(fn, dynamic=True, backend=backend)
            cb(layers, *a)
            direct, ex = cap["fn"], [int(e) if isinstance(e, torch.SymInt) else e for e in cap["ex"]]
            for rnd in range(2):
                full = timeit(lambda: real_fn(layers, *a)); dyn = timeit(lambda: cb(layers, *a)); dr = timeit(lambda: direct(*ex))
                print(f"{L} layers, {a[0].shape[0]} row: torch.compile call {full:.1f} us, capture-backend call {dyn:.1f} us, inductor callable direct {dr:.1f} us ({len(ex)} inputs)")
            with profile(activities=[ProfilerActivity.CPU]) as p:
                for _ in range(100): direct(*ex)
            print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=8, max_name_column_width=50))


if __name__ == "__main__":
    main()
