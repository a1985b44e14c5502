"""The compiled top tier alone (a standalone copy, w4a8) at 1-8 decode rows of 48-token prompts: median
step and trunk segment over 30 steps after 5, rows in alternating order over three rounds; with `prof`,
then torch's profile of 20 steps at 1 and at 8 rows. usage: python tools/probes/rows_step.py [prof]"""
import argparse
import collections
import statistics
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from engine import Engine
from worker.execution import compile_decode
from worker.family import add_model_args, load_from_args
from worker.model import NestedModel, standalone_tier
from worker.formats import quantize_model
from worker.sampling import SamplingParams


def main() -> None:
    torch.set_num_threads(2)
    ap = argparse.ArgumentParser()
    add_model_args(ap)
    fam = load_from_args(ap.parse_args(["--model", "default-raw"]))
    top = standalone_tier(fam.model, len(fam.model.tiers) - 1)
    quantize_model(top, "w4a8", gguf_path=fam.base.source, device="cpu", load_tokenizer=lambda: fam.tokenizer)


    def engine():
        return Engine(top, block_size=16, num_blocks=2048, max_num_batched_tokens=512, max_num_seqs=64)


    compile_decode(top)
    engine().runner.warm_up()
    seg_s = [0.0]
    _segment = NestedModel._segment


    def timed(*a, **k):
        t = time.perf_counter()
        r = _segment(*a, **k)
        seg_s[0] += time.perf_counter() - t
        return r


    NestedModel._segment = timed


    def run(R: int, prof: bool = False) -> tuple[float, float]:
        eng = engine()
        for i in range(R):
            eng.add_request(f"r{i}", [100 + 7 * i + j for j in range(48)], 0,
                            SamplingParams(max_tokens=200, ignore_eos=True))
        for _ in range(5):
            eng.step()
        seg_s[0] = 0.0
        ts = []
        for _ in range(30):
            t = time.perf_counter()
            eng.step()
            ts.append(time.perf_counter() - t)
        if prof:
            with profile(activities=[ProfilerActivity.CPU]) as p:
                for _ in range(20):
                    eng.step()
            print(f"rows {R}")
            print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=40))
        return statistics.median(ts) * 1e3, seg_s[0] / 30 * 1e3


    rows = [1, 2, 4, 6, 8]
    res = collections.defaultdict(list)
    for rnd in range(3):
        for R in (rows if rnd % 2 == 0 else rows[::-1]):
            res[R].append(run(R))
    for R in rows:
        print(f"rows {R}: step ms {[round(a, 2) for a, _ in res[R]]}, segment ms {[round(b, 2) for _, b in res[R]]}")
    if len(sys.argv) > 1 and sys.argv[1] == "prof":
        run(1, True)
        run(8, True)


if __name__ == "__main__":
    main()
