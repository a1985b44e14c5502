"""Where the decode-bound workload's steps spend their time, nested against each standalone tier
(compiled, as `mfs bench engine --compile`): per step the trunk segments (NestedModel._segment), the
exits (_exit: blocks and norms), the head (_logits) and the engine around the forward; medians of
60 steps after 5, rounds alternated; the exit blocks through the compiled graph and eager.
usage: python tools/probes/step_parts.py WEIGHTS [ROUNDS]"""
import argparse
import collections
import statistics
import sys
import time

import torch

from mfs.bench_engine import make_workload
from mfs.engine import Engine
from worker.family import add_model_args, load_from_args
from worker.model import NestedModel, standalone_tier
from worker.quant import quantize_model
from worker.sampling import SamplingParams

if len(sys.argv) < 2:
    sys.exit(__doc__)
torch.set_num_threads(2)
ap = argparse.ArgumentParser()
add_model_args(ap)
fam = load_from_args(ap.parse_args(["--model", "default-raw"]))
model = fam.model
n = len(model.tiers)
copies = [standalone_tier(model, k) for k in range(n)]
for m in [model, *copies]:
    quantize_model(m, sys.argv[1], gguf_path=fam.base.source, device="cpu", load_tokenizer=lambda: fam.tokenizer)


def engine(m):
    return Engine(m, block_size=16, num_blocks=2048, max_num_batched_tokens=512, max_num_seqs=64)


for m in [model, *copies]:
    m.compile_decode()
    engine(m).runner.warm_up()
acc: collections.Counter = collections.Counter()
for name in ("_segment", "_exit", "_logits", "forward_step"):
    def timed(*a, _f=getattr(NestedModel, name), _n=name, **k):
        t = time.perf_counter()
        r = _f(*a, **k)
        acc[_n] += time.perf_counter() - t
        return r
    setattr(NestedModel, name, timed)
work = make_workload(6, n, [1.0] * n, (16, 32), (96, 96), model.cfg.vocab_size, 0)


def run(m, items) -> dict:
    eng = engine(m)
    for it in items:
        eng.add_request(it.rid, it.prompt, 0 if len(m.tiers) == 1 else it.tier,
                        SamplingParams(max_tokens=200, ignore_eos=True))
    for _ in range(5):
        eng.step()
    per = collections.defaultdict(list)
    for _ in range(60):
        acc.clear()
        t = time.perf_counter()
        eng.step()
        per["step"].append(time.perf_counter() - t)
        for k in ("_segment", "_exit", "_logits"):
            per[k].append(acc[k])
        per["engine"].append(per["step"][-1] - acc["forward_step"])
    return {k: 1e3 * statistics.median(v) for k, v in per.items()}


saved = {id(m): m.compiled_exits for m in [model, *copies]}
rows = collections.defaultdict(list)
for rnd in range(int(sys.argv[2]) if len(sys.argv) > 2 else 2):
    for mode in (("compiled", "eager") if rnd % 2 == 0 else ("eager", "compiled")):
        for m in [model, *copies]:
            m._compiled_exits = saved[id(m)] if mode == "compiled" else frozenset()
        nested = run(model, work)
        tiers = [run(c, [it for it in work if it.tier == k]) for k, c in enumerate(copies)]
        indep = {k: sum(t[k] for t in tiers) for k in nested}
        rows[mode].append((nested, indep))
        print(f"round {rnd + 1}, exit blocks {mode}:")
        for k in ("step", "_segment", "_exit", "_logits", "engine"):
            print(f"  {k:9} nested {nested[k]:6.2f} ms   tiers {' + '.join(f'{t[k]:.2f}' for t in tiers)}"
                  f" = {indep[k]:6.2f} ms   ratio {indep[k] / nested[k]:.2f}")
