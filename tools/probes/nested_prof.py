"""The decode-bound workload's steps: the nested engine and each standalone tier, median step and
torch's profile of 20. usage: python tools/probes/nested_prof.py WEIGHTS [compile]"""
import sys, time, argparse, torch
from torch.profiler import profile, ProfilerActivity
from mfs.engine import Engine
from mfs.bench_engine import make_workload
from worker.model import standalone_tier
from worker.family import load_from_args, add_model_args
from worker.sampling import SamplingParams
from worker.quant import quantize_model
if len(sys.argv) < 2:
    sys.exit(__doc__)
torch.set_num_threads(2)
ap = argparse.ArgumentParser(); add_model_args(ap)
args = ap.parse_args(["--model", "default-raw"])
fam = load_from_args(args); model = fam.model; n = len(model.tiers)
print("tiers", [(t.name, t.layers) for t in model.tiers])
copies = [standalone_tier(model, k) for k in range(n)]
for m in [model, *copies]:
    quantize_model(m, sys.argv[1], gguf_path=fam.base.source, device="cpu", load_tokenizer=lambda: fam.tokenizer)
comp = len(sys.argv) > 2
if comp:
    for m in [model, *copies]:
        m.compile_decode(); Engine(m, block_size=16, num_blocks=2048, max_num_batched_tokens=512, max_num_seqs=64).runner.warm_up()
work = make_workload(6, n, [1.0] * n, (16, 32), (96, 96), model.cfg.vocab_size, 0)
def run(eng, items, label):
    for it in items:
        eng.add_request(it.rid, it.prompt, 0 if len(eng.model.tiers) == 1 else it.tier, SamplingParams(max_tokens=200, ignore_eos=True))
    for _ in range(5): eng.step()
    ts = []
    for _ in range(40):
        t = time.perf_counter(); eng.step(); ts.append(time.perf_counter() - t)
    ts.sort(); print(label, f"median step {ts[20]*1e3:.2f} ms")
    with profile(activities=[ProfilerActivity.CPU]) as p:
        for _ in range(20): eng.step()
    print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=40))
run(Engine(model, block_size=16, num_blocks=2048, max_num_batched_tokens=512, max_num_seqs=64), work, "nested")
for k, c in enumerate(copies):
    run(Engine(c, block_size=16, num_blocks=2048, max_num_batched_tokens=512, max_num_seqs=64), [it for it in work if it.tier == k], f"tier{k}")
