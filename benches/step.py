"""`mfs bench step`: the time of one decode step of the in-process engine, per weight format and batch
size: the figure the lean decode step is about. Each (format, batch) point loads the
family, starts `batch` requests of 16-token prompts on one tier, runs a few warm-up steps, then times
`--steps` decode steps and reports the median and the 10th percentile (other jobs on the machine only
ever slow a step down). ``--no-fuse`` serves the quantized formats with q/k/v and gate/up as separate
linears (worker/formats/swap.py: fuse_projections), to measure what fusing buys side by side; ``--profile``
prints torch's operator table of the timed steps; ``--compile`` times all-decode steps with each layer as
one compiled graph (worker/compiled_step.py), the warm-up steps paying for the compilation.
``--exit-kv lazy,all`` times the same loaded model in two engines side by side, steps alternated: rows
writing only the exit-block KV their request reads (the default, scheduler/core.py: lazy exits) and
rows writing every lower exit's KV they cross (``--no-lazy-exits``)."""
from __future__ import annotations

import os
import platform
import statistics
import time
from datetime import datetime, timezone

import torch

from engine.runtime import write_json


def measure(model: str, weights: str, batch: int, steps: int, tier: int | None, fuse: bool,
            profile: bool = False, compile: bool = False, exit_kv: tuple[str, ...] = ("lazy",)) -> list[dict]:
    """One point per `exit_kv` mode: an engine each over the same loaded model, their steps alternated."""
    from engine import Engine  # noqa: PLC0415
    from worker.execution import compile_decode  # noqa: PLC0415
    from worker.family import load_family  # noqa: PLC0415
    from worker.formats import FORMATS, linear_bytes_per_step  # noqa: PLC0415
    from worker.sampling import SamplingParams  # noqa: PLC0415
    fam = load_family(model, weights=weights, fuse=fuse)
    if len(exit_kv) > 1 and not fam.model.exit_block_segments:
        print(f"note: {model} has no lower exit blocks, so --exit-kv {','.join(exit_kv)} runs alike", flush=True)
    if compile:
        compile_decode(fam.model)
    top = fam.model.num_segments - 1
    tier = top if tier is None else tier
    if not 0 <= tier <= top:
        raise ValueError(f"--tier {tier}: the family has tiers 0..{top}")
    engines, warm_s = {}, {}
    for mode in exit_kv:
        eng = engines[mode] = Engine(fam.model, block_size=16, num_blocks=max(64, batch * 24),
                                     lazy_exits=mode == "lazy")
        for i in range(batch):
            eng.add_request(f"r{i}", [100 + (i * 17 + k) % 20000 for k in range(16)], tier,
                            SamplingParams(max_tokens=steps + 16, ignore_eos=True))
        t_warm = time.perf_counter()
        for _ in range(6):  # the prefill and a few decode steps (and any compilation)
            eng.step()
        warm_s[mode] = time.perf_counter() - t_warm
    times = {mode: [] for mode in exit_kv}
    prof = None
    if profile:
        from torch.profiler import ProfilerActivity  # noqa: PLC0415
        from torch.profiler import profile as torch_profile  # noqa: PLC0415
        prof = torch_profile(activities=[ProfilerActivity.CPU])
        prof.__enter__()
    try:
        for _ in range(steps):
            for mode, eng in engines.items():
                t0 = time.perf_counter()
                eng.step()
                times[mode].append(time.perf_counter() - t0)
    finally:
        if prof is not None:
            prof.__exit__(None, None, None)
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=25))
    points = []
    for mode, ts in times.items():
        ts.sort()
        med = statistics.median(ts)
        points.append({"weights": weights, "fused": fuse and FORMATS[weights].quantizes, "compiled": compile,
                       "exit_kv": mode, "warmup_s": round(warm_s[mode], 2), "batch": batch, "tier": tier,
                       "steps": steps, "median_ms": round(med * 1e3, 2),
                       "p10_ms": round(ts[max(0, len(ts) // 10 - 1)] * 1e3, 2), "tokens_per_s": round(batch / med, 1),
                       "linear_mb_per_step": round(linear_bytes_per_step(fam.model) / 1e6, 1)})
    return points


def add_parser(sub) -> None:
    p = sub.add_parser("step", help="median time of one decode step per weight format and batch size")
    p.add_argument("--model", default="default-raw")
    p.add_argument("--weights", default="fp32,int8,int4", help="comma list of weight formats (mfs up --help lists them)")
    p.add_argument("--batch", default="1,16", help="comma list of batch sizes (requests decoding together)")
    p.add_argument("--tier", type=int, default=None, help="the requests' tier (default: the top tier)")
    p.add_argument("--steps", type=int, default=40, help="decode steps timed per point")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--no-fuse", action="store_true", help="keep q/k/v and gate/up separate (quantized formats)")
    p.add_argument("--profile", action="store_true", help="print torch's operator table of the timed steps")
    p.add_argument("--compile", action="store_true",
                   help="all-decode steps with each layer one compiled graph (CPU; worker/compiled_step.py)")
    p.add_argument("--exit-kv", default="lazy",
                   help="comma list of lazy (rows write only the exit-block KV their request reads) and all "
                        "(every lower exit a row crosses); several: one engine each, steps alternated")
    p.add_argument("--json", default=None)
    p.set_defaults(func=run)


def run(args) -> int:
    from worker.formats import FORMATS  # noqa: PLC0415
    weights = [w.strip() for w in args.weights.split(",") if w.strip()]
    if not weights or any(w not in FORMATS for w in weights):
        raise ValueError(f"--weights: a comma list of {', '.join(FORMATS)}, got {args.weights!r}")
    try:
        batches = [int(b) for b in args.batch.split(",")]
    except ValueError:
        raise ValueError(f"--batch must be comma-separated integers, got {args.batch!r}") from None
    if not batches or min(batches) < 1 or args.steps < 5:
        raise ValueError("--batch >= 1 each, --steps >= 5")
    exit_kv = tuple(dict.fromkeys(m.strip() for m in args.exit_kv.split(",") if m.strip()))
    if not exit_kv or any(m not in ("lazy", "all") for m in exit_kv):
        raise ValueError(f"--exit-kv: a comma list of lazy, all, got {args.exit_kv!r}")
    if args.threads:
        torch.set_num_threads(args.threads)
    print(f"mfs bench step: {torch.get_num_threads()} torch thread(s), {os.cpu_count()} CPUs, "
          f"capability {torch.backends.cpu.get_cpu_capability()}", flush=True)
    points = []
    for w in weights:
        for b in batches:
            for pt in measure(args.model, w, b, args.steps, args.tier, not args.no_fuse, args.profile,
                              args.compile, exit_kv):
                points.append(pt)
                print(f"{w:>5}{' fused' if pt['fused'] else '':6}{' compiled' if pt['compiled'] else ''} "
                      f"exit KV {pt['exit_kv']:4} batch {b:3d}: median {pt['median_ms']:8.2f} ms "
                      f"(p10 {pt['p10_ms']:.2f}), {pt['tokens_per_s']:7.1f} tok/s, linears "
                      f"{pt['linear_mb_per_step']} MB/step", flush=True)
    if args.json:
        write_json(args.json, {"benchmark": "step", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
                               "model": args.model, "threads": torch.get_num_threads(), "cpus": os.cpu_count(),
                               "cpu": platform.processor() or platform.machine(),
                               "capability": torch.backends.cpu.get_cpu_capability(), "points": points}, indent=1)
    return 0
