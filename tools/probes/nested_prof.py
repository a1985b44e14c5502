"""The decode-bound workload's steps: the nested engine and each standalone tier, median step and
torch's profile of 20. usage: python tools/probes/nested_prof.py WEIGHTS [compile]"""
import sys
import time

from torch.profiler import ProfilerActivity, profile

from decode_bound import nested_and_tiers, started, workload


def main() -> None:
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    model, copies = nested_and_tiers(sys.argv[1], compile=len(sys.argv) > 2)
    print("tiers", [(t.name, t.layers) for t in model.tiers])
    work = workload(model)


    def run(m, items, label):
        eng = started(m, items)
        ts = []
        for _ in range(40):
            t = time.perf_counter(); eng.step(); ts.append(time.perf_counter() - t)
        ts.sort(); print(label, f"median step {ts[20]*1e3:.2f} ms")
        with profile(activities=[ProfilerActivity.CPU]) as p:
            for _ in range(20): eng.step()
        print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=40))
    run(model, work, "nested")
    for k, c in enumerate(copies):
        run(c, [it for it in work if it.tier == k], f"tier{k}")


if __name__ == "__main__":
    main()
