"""What the decode-bound nested/independent ratio is made of, and how far it could go on this machine.
The workload of `mfs bench engine --regimes decode` (seed 0: its rows per tier) is stepped compiled, nested
and as one standalone deployment per tier (w4a8; median of 60 steps after 5, two rounds). Every compiled
graph call is timed with its layer count L and row count R, and all calls of both layouts are fitted as
    call time = c + a * L + r * L * R          (c a call, a a layer, r a row and layer)
by least squares; the rest of each step (embedding, exits' norms, the head, gathers, KV writes, the
engine) is kept as measured. The ratio is then recomputed with the fitted graph costs and c, r or both
set to zero: what each kind of cost takes from the ratio. usage: python tools/probes/ratio_bound.py"""
import collections
import statistics
import time

import torch

from decode_bound import nested_and_tiers, started, time_graph_calls, workload


def main() -> None:
    model, copies = nested_and_tiers("w4a8", compile=True)
    n = len(model.tiers)

    calls: list[tuple[int, int, float]] = []  # (layers, rows, seconds) of the graph calls of one step


    for m in [model, *copies]:
        time_graph_calls(m, lambda L, R, s: calls.append((L, R, s)))
    work = workload(model)


    def run(m, items):
        """Median step (s), median graph time per step (s), and each call shape's median (s)."""
        eng = started(m, items)
        steps, graphs, shapes = [], [], collections.defaultdict(list)
        for _ in range(60):
            calls.clear()
            t = time.perf_counter()
            eng.step()
            steps.append(time.perf_counter() - t)
            graphs.append(sum(c[2] for c in calls))
            for i, (L, R, s) in enumerate(calls):
                shapes[(i, L, R)].append(s)
        return statistics.median(steps), statistics.median(graphs), {k: statistics.median(v) for k, v in shapes.items()}


    def solve3(rows, ys):
        """Least squares for y = c + a*L + r*L*R over rows (1, L, L*R): the 3x3 normal equations."""
        X = torch.tensor(rows, dtype=torch.float64)
        y = torch.tensor(ys, dtype=torch.float64)
        return torch.linalg.solve(X.T @ X, X.T @ y).tolist()


    for rnd in range(2):
        nested = run(model, work)
        tiers = [run(c, [it for it in work if it.tier == k]) for k, c in enumerate(copies)]
        pts = [(L, R, s) for _, _, shapes in [nested, *tiers] for (_, L, R), s in shapes.items()]
        c, a, r = solve3([(1.0, L, L * R) for L, R, _ in pts], [s for *_, s in pts])
        print(f"round {rnd + 1}: graph calls (layers x rows: ms) nested "
              + ", ".join(f"{L}x{R}: {s * 1e3:.2f}" for (_, L, R), s in nested[2].items())
              + "; tiers " + " | ".join(", ".join(f"{L}x{R}: {s * 1e3:.2f}" for (_, L, R), s in t[2].items()) for t in tiers))
        print(f"  fit: c = {c * 1e6:.0f} us a call, a = {a * 1e6:.1f} us a layer, r = {r * 1e6:.2f} us a row and layer; "
          "residuals " + ", ".join(f"{(s - c - a * L - r * L * R) * 1e6:+.0f}" for L, R, s in pts) + " us")
        step_n, graph_n, shapes_n = nested
        step_i, graph_i = sum(t[0] for t in tiers), sum(t[1] for t in tiers)
        rest_n, rest_i = step_n - graph_n, step_i - graph_i
        print(f"  measured: step nested {step_n * 1e3:.2f} ms (graphs {graph_n * 1e3:.2f}, rest {rest_n * 1e3:.2f}), "
          f"tiers {step_i * 1e3:.2f} ms (graphs {graph_i * 1e3:.2f}, rest {rest_i * 1e3:.2f}): ratio {step_i / step_n:.2f}x")
        shapes_i = [k for t in tiers for k in t[2]]
        for label, cc, rr in (("fitted graphs", c, r), ("no cost a call (c = 0)", 0.0, r),
                              ("no cost a row (r = 0)", c, 0.0), ("neither (c = r = 0)", 0.0, 0.0)):
            gn = sum(cc + a * L + rr * L * R for _, L, R in shapes_n)
            gi = sum(cc + a * L + rr * L * R for _, L, R in shapes_i)
            print(f"  {label:24} nested {(gn + rest_n) * 1e3:.2f} ms, tiers {(gi + rest_i) * 1e3:.2f} ms: "
              f"ratio {(gi + rest_i) / (gn + rest_n):.2f}x (graphs alone {gi / gn:.2f}x)")


if __name__ == "__main__":
    main()
