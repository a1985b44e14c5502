"""cProfile of 100 compiled decode steps of the decode-bound mix (1 small, 1 medium, 4 large requests, 40-token
prompts) in the nested default family (w4a8), the 30 costliest functions by own time. usage: python
tools/probes/step_cprofile.py"""
import cProfile
import pstats

from decode_bound import compiled_nested, started_tiers


def main() -> None:
    model = compiled_nested("w4a8")
    eng = started_tiers(model, [0, 1, 2, 2, 2, 2], max_tokens=300)
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(100):
        eng.step()
    pr.disable()
    pstats.Stats(pr).sort_stats("tottime").print_stats(30)


if __name__ == "__main__":
    main()
