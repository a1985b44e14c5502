"""The compiled decode step with dynamo evaluating every guard and with only the differentiating ones
(torch.compiler.set_stance(skip_guard_eval_unsafe=True)), alternated over four rounds: the top tier at one
row and the decode-bound mix (1 small, 1 medium, 4 large), median of 40 steps after 5. A measurement of
the guards' share of a compiled call, not a setting MFS uses. usage: python tools/probes/guard_stance.py"""
import argparse
import statistics
import time

import torch

from mfs.engine import Engine
from worker.family import add_model_args, load_from_args
from worker.sampling import SamplingParams

torch.set_num_threads(2)
ap = argparse.ArgumentParser(); add_model_args(ap)
fam = load_from_args(ap.parse_args(["--model", "default-raw", "--weights", "w4a8"]))
model = fam.model
mk = lambda: Engine(model, block_size=16, num_blocks=2048, max_num_batched_tokens=512, max_num_seqs=64)
model.compile_decode(); mk().runner.warm_up()
def run(tiers):
    eng = mk()
    for i, t in enumerate(tiers):
        eng.add_request(f"r{i}", [100 + 7 * i + j for j in range(40)], t, SamplingParams(max_tokens=200, ignore_eos=True))
    for _ in range(5): eng.step()
    ts = []
    for _ in range(40):
        t = time.perf_counter(); eng.step(); ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e3
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
