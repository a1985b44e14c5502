"""Compiled decode step medians of three workloads in the nested default family (w4a8): the top tier at one
row, the decode-bound mix (1 small, 1 medium, 4 large) and 16 mixed requests (11 / 3 / 2); 40-token prompts,
median of 60 steps after 5, three rounds, the median printed with LABEL. For an A/B of two commits run it
alternately in two checkouts, e.g. `git worktree add /tmp/before HEAD~1` and
`cd /tmp/before && PYTHONPATH=$PWD python tools/probes/step_medians.py before`.
usage: python tools/probes/step_medians.py LABEL"""
import statistics
import sys

from decode_bound import compiled_nested, median_step_ms, started_tiers


def main() -> None:
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    model = compiled_nested("w4a8")
    WORKLOADS = (("top 1 row", [2]), ("mix 1/1/4", [0, 1, 2, 2, 2, 2]), ("16 mixed", [0] * 11 + [1] * 3 + [2] * 2))


    def run(tiers) -> float:
        return median_step_ms(started_tiers(model, tiers), 60)


    out = [(name, run(tiers)) for _ in range(3) for name, tiers in WORKLOADS]
    for name, _ in WORKLOADS:
        print(sys.argv[1], name, f"{statistics.median(v for n, v in out if n == name):.2f} ms")


if __name__ == "__main__":
    main()
