"""The compiled decode step at one row: median of 100 steps, then torch's profile of 30.
usage: python tools/probes/one_row.py WEIGHTS [TIER]   (default-raw; TIER defaults to the top;
MFS_CPU_ATTENTION=0 takes the graph's gather + SDPA instead of mfs::decode_attention)"""
import sys, time, torch
from torch.profiler import profile, ProfilerActivity
from engine import Engine
from worker.execution import compile_decode
from worker.family import load_from_args, add_model_args
from worker.sampling import SamplingParams
import argparse


def main() -> None:
    torch.set_num_threads(2)
    if len(sys.argv) < 2:
        sys.exit(__doc__)
    ap = argparse.ArgumentParser(); add_model_args(ap)
    args = ap.parse_args(["--model", "default-raw", "--weights", sys.argv[1]])
    fam = load_from_args(args); model = fam.model
    compile_decode(model)
    eng = Engine(model, block_size=16, num_blocks=2048, max_num_batched_tokens=512, max_num_seqs=64)
    print("warm", eng.runner.warm_up())
    top = int(sys.argv[2]) if len(sys.argv) > 2 else len(model.tiers) - 1
    eng.add_request("r", list(range(100, 116)), top, SamplingParams(max_tokens=400, ignore_eos=True))
    for _ in range(5): eng.step()
    ts = []
    for _ in range(100):
        t = time.perf_counter(); eng.step(); ts.append(time.perf_counter() - t)
    ts.sort(); print(f"median step {ts[50]*1e3:.2f} ms  p10 {ts[10]*1e3:.2f}")
    with profile(activities=[ProfilerActivity.CPU]) as p:
        for _ in range(30): eng.step()
    print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=60))


if __name__ == "__main__":
    main()
