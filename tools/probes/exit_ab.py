"""The nested model's small and medium tiers (w4a8, compiled) with their exit blocks through the compiled
graph and eager, alternated in one process over four rounds: median step of 40 after 5, 1 and 4 rows of
40-token prompts. usage: python tools/probes/exit_ab.py"""
import argparse
import statistics
import time

import torch

from mfs.engine import Engine
from worker.family import add_model_args, load_from_args
from worker.sampling import SamplingParams

torch.set_num_threads(2)
ap = argparse.ArgumentParser()
add_model_args(ap)
model = load_from_args(ap.parse_args(["--model", "default-raw", "--weights", "w4a8"])).model


def engine():
    return Engine(model, block_size=16, num_blocks=2048, max_num_batched_tokens=512, max_num_seqs=64)


model.compile_decode()
print(f"warm-up {engine().runner.warm_up():.1f} s, compiled exits {sorted(model.compiled_exits)}")
compiled = model.compiled_exits


def run(tier: int, R: int) -> float:
    eng = engine()
    for i in range(R):
        eng.add_request(f"r{i}", [100 + 7 * i + j for j in range(40)], tier,
                        SamplingParams(max_tokens=200, ignore_eos=True))
    for _ in range(5):
        eng.step()
    ts = []
    for _ in range(40):
        t = time.perf_counter()
        eng.step()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e3


res: dict = {}
for rnd in range(4):
    for mode in (("compiled", "eager") if rnd % 2 == 0 else ("eager", "compiled")):
        model._compiled_exits = compiled if mode == "compiled" else frozenset()
        for tier in (0, 1):
            for R in (1, 4):
                res.setdefault((tier, R, mode), []).append(run(tier, R))
for tier in (0, 1):
    for R in (1, 4):
        c, e = res[(tier, R, "compiled")], res[(tier, R, "eager")]
        print(f"tier {tier} rows {R}: exit blocks compiled {statistics.median(c):.2f} ms {[round(x, 2) for x in c]}, "
              f"eager {statistics.median(e):.2f} ms {[round(x, 2) for x in e]}")
