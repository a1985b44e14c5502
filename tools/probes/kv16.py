"""Experiment (reverted with the next commit): the decode-bound step with the KV pools in fp16 instead of fp32
(mfs::decode_attention reading fp16 through F16C), alternated over four rounds. usage: python tools/probes/kv16.py"""
import argparse, statistics, time
import torch
from mfs.engine import Engine
from worker.family import add_model_args, load_from_args
from worker.sampling import SamplingParams
torch.set_num_threads(2)
ap = argparse.ArgumentParser(); add_model_args(ap)
fam = load_from_args(ap.parse_args(["--model", "default-raw", "--weights", "w4a8"]))
model = fam.model
def mk(dt):
    e = Engine(model, block_size=16, num_blocks=2048, max_num_batched_tokens=512, max_num_seqs=64)
    kv = e.runner.kv
    kv.k = [t.to(dt) for t in kv.k]; kv.v = [t.to(dt) for t in kv.v]
    return e
model.compile_decode()
for dt in (torch.float32, torch.float16):
    mk(dt).runner.warm_up()
def run(dt, tiers, ctx):
    eng = mk(dt)
    for i, t in enumerate(tiers):
        eng.add_request(f"r{i}", [100 + 7 * i + j for j in range(ctx)], t, SamplingParams(max_tokens=400, ignore_eos=True))
    for _ in range(5): eng.step()
    ts = []
    for _ in range(60):
        t = time.perf_counter(); eng.step(); ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e3
res = {}
for rnd in range(4):
    for dt in ((torch.float32, torch.float16) if rnd % 2 == 0 else (torch.float16, torch.float32)):
        for name, tiers, ctx in (("top 1 row ctx 64", [2], 64), ("mix 1/1/4 ctx 64", [0, 1, 2, 2, 2, 2], 64), ("mix 1/1/4 ctx 400", [0, 1, 2, 2, 2, 2], 400)):
            res.setdefault((name, str(dt)[6:]), []).append(run(dt, tiers, ctx))
for k, v in res.items():
    print(k, "%.2f ms" % statistics.median(v), [round(x, 2) for x in v])
