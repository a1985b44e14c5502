"""worker/batch.py's build_step for a family mix's decode step (11 small, 3 medium, 2 large rows at 40
positions, blocks of 16, lazy exits): median of 2000 calls. usage: python tools/probes/build_step.py"""
import statistics
import time

from core.protocol import PlanRow
from worker.batch import build_step, order_rows


def main() -> None:
    rows = []
    for i in range(16):
        tier = 0 if i < 11 else 1 if i < 14 else 2
        tables = [[100 * i + s * 10 + b for b in range(3)] for s in range(tier + 1)]
        rows.append(PlanRow(f"r{i}", tier, [5], 40, tables, True, 20, exit_kv=[]))
    rows = [rows[i] for i in order_rows(rows)]
    ts = []
    for _ in range(2000):
        t = time.perf_counter()
        build_step(rows, 3, 16, exit_blocks=(0, 1))
        ts.append(time.perf_counter() - t)
    print(f"build_step, 16 mixed decode rows: median {statistics.median(ts) * 1e6:.0f} us")


if __name__ == "__main__":
    main()
