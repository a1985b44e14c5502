"""The nested model's small and medium tiers (w4a8, compiled) with their exit blocks through the compiled
graph and eager, alternated in one process over four rounds: median step of 40 after 5, 1 and 4 rows of
40-token prompts. usage: python tools/probes/exit_ab.py"""
import statistics

from decode_bound import compiled_nested, median_step_ms, started_tiers
from worker.execution import compiled_exits


def main() -> None:
    model = compiled_nested("w4a8")
    print(f"compiled exits {sorted(compiled_exits(model))}")
    compiled = compiled_exits(model)


    def run(tier: int, R: int) -> float:
        return median_step_ms(started_tiers(model, [tier] * R), 40)


    res: dict = {}
    for rnd in range(4):
        for mode in (("compiled", "eager") if rnd % 2 == 0 else ("eager", "compiled")):
            model.execution.exits = compiled if mode == "compiled" else frozenset()
            for tier in (0, 1):
                for R in (1, 4):
                    res.setdefault((tier, R, mode), []).append(run(tier, R))
    for tier in (0, 1):
        for R in (1, 4):
            c, e = res[(tier, R, "compiled")], res[(tier, R, "eager")]
            print(f"tier {tier} rows {R}: exit blocks compiled {statistics.median(c):.2f} ms {[round(x, 2) for x in c]}, "
              f"eager {statistics.median(e):.2f} ms {[round(x, 2) for x in e]}")


if __name__ == "__main__":
    main()
