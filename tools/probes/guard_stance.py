"""The compiled decode step with dynamo evaluating every guard and with only the differentiating ones
(torch.compiler.set_stance(skip_guard_eval_unsafe=True)), alternated over four rounds: the top tier at one
row and the decode-bound mix (1 small, 1 medium, 4 large), median of 40 steps after 5. A measurement of
the guards' share of a compiled call, not a setting MFS uses. usage: python tools/probes/guard_stance.py"""
import statistics

import torch

from decode_bound import compiled_nested, median_step_ms, started_tiers


def main() -> None:
    model = compiled_nested("w4a8")


    def run(tiers):
        return median_step_ms(started_tiers(model, tiers), 40)


    res = {}
    for rnd in range(4):
        for skip in ((False, True) if rnd % 2 == 0 else (True, False)):
            torch.compiler.set_stance("default", skip_guard_eval_unsafe=skip)
            for name, tiers in (("top 1 row", [2]), ("mix 1/1/4", [0, 1, 2, 2, 2, 2])):
                res.setdefault((name, skip), []).append(run(tiers))
    torch.compiler.set_stance("default")
    for name in ("top 1 row", "mix 1/1/4"):
        a, b = res[(name, False)], res[(name, True)]
        print(f"{name}: guards {statistics.median(a):.2f} ms {[round(x,2) for x in a]}  skip_guard_eval_unsafe {statistics.median(b):.2f} ms {[round(x,2) for x in b]}")


if __name__ == "__main__":
    main()
