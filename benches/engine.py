"""`mfs bench engine`: mixed-tier workloads (by default two: a compute-bound one, many requests with
long prompts, and a decode-bound one, a few requests with short prompts and long outputs) each served
(a) nested — one model, group-batched — and
(b) independent — each tier a standalone truncated copy with its own weights, batch and KV, stepped
round-robin as separate model servers on one machine would be; plus the top tier alone against
transformers' ``generate`` on the same prompts.

All requests arrive at t=0 (an offline batch); every figure is measured in this one run, the layouts
alternating per repeat, and the medians over repeats are reported (and each repeat's tokens/s ratio).
``--compile``: both layouts run all-decode steps as compiled graphs, as ``mfs up --compile`` does (on
``--device cuda`` with the Triton kernels: CUDA graphs, worker/execution.py). Peak memory is counted,
not sampled: the weights' bytes plus the KV blocks in use at the peak (both layouts share a process,
so the allocator's own peak would not tell them apart).
"""
from __future__ import annotations

import platform
import random
import statistics
import sys
import time
from dataclasses import dataclass
from datetime import datetime, timezone

import torch
from tqdm import tqdm

from engine import Engine
from worker.execution import compile_decode
from worker.formats import may_quantize, quantize_model
from worker.formats.fp32 import FORMAT as FP32
from worker.model import standalone_tier, weight_bytes
from worker.sampling import SamplingParams
from engine.runtime import write_json


@dataclass(slots=True)
class Item:
    rid: str
    prompt: list[int]
    tier: int
    max_tokens: int


def make_workload(num: int, num_tiers: int, mix: list[float], prompt_range: tuple[int, int],
                  output_range: tuple[int, int], vocab: int, seed: int) -> list[Item]:
    rng = random.Random(seed)
    items = []
    for i in range(num):
        tier = rng.choices(range(num_tiers), weights=mix)[0]
        plen = rng.randint(*prompt_range)
        items.append(Item(f"b{i}", [rng.randrange(100, vocab) for _ in range(plen)], tier,
                          rng.randint(*output_range)))
    return items


def _drive(engines: list[tuple[Engine, list[Item]]], label: str) -> dict:
    """Submit everything, then step every engine with work, round-robin, until all finish."""
    t0 = time.perf_counter()
    for eng, items in engines:
        for it in items:
            eng.add_request(it.rid, it.prompt, 0 if len(eng.model.tiers) == 1 else it.tier,
                            SamplingParams(max_tokens=it.max_tokens, ignore_eos=True))
    first: dict[str, float] = {}
    done: dict[str, float] = {}
    ntok: dict[str, int] = {}
    total = sum(it.max_tokens for _, items in engines for it in items)
    # A bar is for a terminal; in a log file every refresh would be a line.
    bar = tqdm(total=total, desc=label, unit="tok", leave=False, disable=not sys.stderr.isatty())
    while any(e.has_unfinished() for e, _ in engines):
        for eng, _ in engines:
            if not eng.has_unfinished():
                continue
            for o in eng.step():
                now = time.perf_counter()
                first.setdefault(o.request_id, now)
                ntok[o.request_id] = o.num_output_tokens
                bar.update(len(o.new_token_ids))
                if o.finished:
                    done[o.request_id] = now
    bar.close()
    wall = time.perf_counter() - t0
    tokens = sum(ntok.values())
    per_token = [(done[r] - t0) / ntok[r] for r in done]
    tpot = [(done[r] - first[r]) / (ntok[r] - 1) for r in done if ntok[r] > 1]
    ttft = [first[r] - t0 for r in first]
    return {"wall_s": wall, "tokens": tokens, "tokens_per_s": tokens / wall,
            "mean_per_token_latency_ms": 1e3 * statistics.mean(per_token),
            "mean_tpot_ms": 1e3 * statistics.mean(tpot), "mean_ttft_s": statistics.mean(ttft),
            "steps": sum(e.stats.steps for e, _ in engines),
            "preemptions": sum(e.stats.preemptions for e, _ in engines)}


def _kv_peak_bytes(engines: list[Engine]) -> int:
    return sum(e.kv.bytes_per_block(s) * peak for e in engines
               for s, peak in enumerate(e.stats.peak_kv_blocks))


def run_nested(model, work, args) -> tuple[dict, Engine]:
    eng = Engine(model, block_size=args.block_size, num_blocks=args.num_blocks,
                 max_num_batched_tokens=args.max_batched_tokens, max_num_seqs=args.max_num_seqs)
    r = _drive([(eng, work)], "nested")
    r["weights_bytes"] = weight_bytes(model)
    r["kv_peak_bytes"] = _kv_peak_bytes([eng])
    r["peak_memory_bytes"] = r["weights_bytes"] + r["kv_peak_bytes"]
    return r, eng


def run_independent(copies, work, args) -> dict:
    pairs = []
    for k, m in enumerate(copies):
        eng = Engine(m, block_size=args.block_size, num_blocks=args.num_blocks,
                     max_num_batched_tokens=args.max_batched_tokens, max_num_seqs=args.max_num_seqs)
        pairs.append((eng, [it for it in work if it.tier == k]))
    r = _drive(pairs, "independent")
    r["weights_bytes"] = sum(weight_bytes(m) for m in copies)
    r["kv_peak_bytes"] = _kv_peak_bytes([e for e, _ in pairs])
    r["peak_memory_bytes"] = r["weights_bytes"] + r["kv_peak_bytes"]
    return r


def run_top_vs_generate(fam, work, args) -> dict:
    """The top tier alone (engine) against HF generate, batch of `concurrency`, same prompts."""
    top = len(fam.model.tiers) - 1
    n, new = args.concurrency, args.generate_tokens
    prompts = [it.prompt for it in work[:n]]
    eng = Engine(fam.model, block_size=args.block_size, num_blocks=args.num_blocks,
                 max_num_batched_tokens=args.max_batched_tokens, max_num_seqs=max(n, args.max_num_seqs))
    t0 = time.perf_counter()
    outs = eng.generate(prompts, [top] * n, SamplingParams(max_tokens=new, ignore_eos=True))
    ours = sum(map(len, outs)) / (time.perf_counter() - t0)

    hf = _hf_reference(fam)
    pad = fam.model.cfg.eos_token_ids[0] if fam.model.cfg.eos_token_ids else 0
    L = max(map(len, prompts))
    ids = torch.tensor([[pad] * (L - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in prompts])
    t0 = time.perf_counter()
    with torch.inference_mode():
        g = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                        do_sample=False, pad_token_id=pad)
    hf_tps = (g.shape[1] - L) * n / (time.perf_counter() - t0)
    del hf
    return {"concurrency": n, "new_tokens": new, "engine_tokens_per_s": ours,
            "generate_tokens_per_s": hf_tps, "ratio": ours / hf_tps}


def _hf_reference(fam):
    from transformers import AutoModelForCausalLM  # noqa: PLC0415
    from family.source import resolve_cached  # noqa: PLC0415
    folder, gguf = resolve_cached(fam.base.source)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                              **({"gguf_file": gguf} if gguf else {})).eval()
    # Serve the same weights MFS serves (precipitated ones included): copy the top tier in.
    sd = {f"model.layers.{i}.{k}": v for i, l in enumerate(fam.model.layers)
          for k, v in _hf_layer_state(l).items()}
    sd["model.norm.weight"] = fam.model.exit_norms[len(fam.model.tiers) - 1]
    emb = fam.model.embed_tokens
    sd["model.embed_tokens.weight"] = emb.weight if isinstance(emb, torch.nn.Embedding) else emb.dequantize()
    hf.load_state_dict(sd, strict=False)
    return hf


def _hf_layer_state(layer) -> dict:
    out = {}
    for ours, hf in (("q_proj", "self_attn.q_proj"), ("k_proj", "self_attn.k_proj"),
                     ("v_proj", "self_attn.v_proj"), ("o_proj", "self_attn.o_proj"),
                     ("gate_proj", "mlp.gate_proj"), ("up_proj", "mlp.up_proj"),
                     ("down_proj", "mlp.down_proj")):
        lin = getattr(layer, ours)
        out[hf + ".weight"] = lin.weight if isinstance(lin, torch.nn.Linear) else lin.dequantize()
        if lin.bias is not None:
            out[hf + ".bias"] = lin.bias
    out["input_layernorm.weight"] = layer.input_layernorm
    out["post_attention_layernorm.weight"] = layer.post_attention_layernorm
    return out


def _median(runs: list[dict]) -> dict:
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def add_parser(sub) -> None:
    from worker.family import add_model_args  # noqa: PLC0415
    p = sub.add_parser("engine", help="nested vs independent tiers in a compute-bound and a decode-bound "
                                      "workload, and the top tier vs HF generate")
    add_model_args(p)
    p.add_argument("--json", required=True, help="where to write the results")
    p.add_argument("--plot", default=None, help="PNG bar chart of both regimes")
    p.add_argument("--regimes", default="compute,decode",
                   help="workloads to run: compute (many requests, long prompts: the --num/--mix/--prompt-len/"
                        "--output-len workload) and/or decode (few requests, short prompts, long outputs: "
                        "--decode-*)")
    p.add_argument("--num", type=int, default=48, help="requests in the compute-bound workload")
    p.add_argument("--mix", default="70,20,10", help="its tier mix, lowest tier first, percent")
    p.add_argument("--prompt-len", default="64,512")
    p.add_argument("--output-len", default="64,256")
    p.add_argument("--decode-num", type=int, default=6, help="requests in the decode-bound workload")
    p.add_argument("--decode-mix", default=None, help="its tier mix (default: an equal share per tier)")
    p.add_argument("--decode-prompt-len", default="16,32")
    p.add_argument("--decode-output-len", default="96,96")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=2048)
    p.add_argument("--max-batched-tokens", type=int, default=512)
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=16, help="requests for the top-tier vs generate run")
    p.add_argument("--generate-tokens", type=int, default=64)
    p.add_argument("--skip-generate", action="store_true")
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    p.add_argument("--compile", action="store_true",
                   help="both layouts run all-decode steps as compiled graphs, as `mfs up --compile` workers "
                        "do (CPU, torch ops; worker/compiled_step.py); each model's graphs are built before "
                        "anything is timed")
    p.set_defaults(func=run)


def _pair(spec: str, flag: str) -> tuple[int, int]:
    try:
        lo, hi = (int(x) for x in spec.split(","))
    except ValueError:
        raise ValueError(f"{flag} takes MIN,MAX, got {spec!r}") from None
    if not 0 < lo <= hi:
        raise ValueError(f"{flag} {spec!r}: need 0 < MIN <= MAX")
    return lo, hi


def _mix(spec: str | None, tiers: int, flag: str) -> list[float]:
    if spec is None:
        return [1.0] * tiers
    mix = [float(x) for x in spec.split(",")]
    if len(mix) != tiers or min(mix) < 0 or sum(mix) <= 0:
        raise ValueError(f"{flag} has {len(mix)} entries for {tiers} tiers (non-negative, not all 0)")
    return mix


def run_regime(model, copies, work, args) -> dict:
    """Nested and independent on one workload, alternating per repeat; medians and ratios."""
    nested_runs, indep_runs = [], []
    for rep in range(args.repeats):
        for layout in (("nested", "independent") if rep % 2 == 0 else ("independent", "nested")):
            if layout == "nested":
                nested_runs.append(run_nested(model, work, args)[0])
            else:
                indep_runs.append(run_independent(copies, work, args))
            print(f"  repeat {rep + 1}/{args.repeats} {layout}: "
                  f"{(nested_runs if layout == 'nested' else indep_runs)[-1]['tokens_per_s']:.1f} tok/s",
                  flush=True)
    nested, indep = _median(nested_runs), _median(indep_runs)
    return {"nested": nested, "independent": indep, "nested_runs": nested_runs, "independent_runs": indep_runs,
            "ratios": {"tokens_per_s": nested["tokens_per_s"] / indep["tokens_per_s"],
                       "mean_per_token_latency": nested["mean_per_token_latency_ms"] / indep["mean_per_token_latency_ms"],
                       "mean_tpot": nested["mean_tpot_ms"] / indep["mean_tpot_ms"],
                       "peak_memory": nested["peak_memory_bytes"] / indep["peak_memory_bytes"],
                       "weights": nested["weights_bytes"] / indep["weights_bytes"],
                       # each repeat's two runs back to back: the machine's drift cancels within a pair
                       "tokens_per_s_per_repeat": [n["tokens_per_s"] / i["tokens_per_s"]
                                                   for n, i in zip(nested_runs, indep_runs)]}}


def run(args) -> int:
    from worker.family import load_from_args  # noqa: PLC0415
    regimes = [r.strip() for r in args.regimes.split(",") if r.strip()]
    if not regimes or any(r not in ("compute", "decode") for r in regimes):
        raise ValueError(f"--regimes: compute and/or decode, got {args.regimes!r}")
    if args.num < 1 or args.decode_num < 1 or args.repeats < 1:
        raise ValueError("--num, --decode-num and --repeats must be >= 1")
    if args.threads:
        torch.set_num_threads(args.threads)
    weights, args.weights = args.weights, FP32.name
    fam = load_from_args(args)  # fp32 first: the standalone copies are cut from it, then quantized
    model = fam.model
    n = len(model.tiers)
    specs = {"compute": (args.num, _mix(args.mix, n, "--mix"), _pair(args.prompt_len, "--prompt-len"),
                         _pair(args.output_len, "--output-len")),
             "decode": (args.decode_num, _mix(args.decode_mix, n, "--decode-mix"),
                        _pair(args.decode_prompt_len, "--decode-prompt-len"),
                        _pair(args.decode_output_len, "--decode-output-len"))}
    copies = [standalone_tier(model, k) for k in range(n)]
    if may_quantize(weights):  # both layouts quantized alike
        for m in [model, *copies]:
            quantize_model(m, weights, gguf_path=fam.base.source, device=args.device,
                           load_tokenizer=lambda: fam.tokenizer)
    args.weights = weights
    warm_s = []
    if args.compile:  # both layouts alike; the graphs are built (and cached on each model) before timing
        for m in [model, *copies]:
            compile_decode(m)
            warm_s.append(Engine(m, block_size=args.block_size, num_blocks=args.num_blocks,
                                 max_num_batched_tokens=args.max_batched_tokens,
                                 max_num_seqs=args.max_num_seqs).runner.warm_up())
        print(f"compiled: graphs built in {sum(warm_s):.0f} s (nested, then each standalone tier)", flush=True)
    result = {
        "benchmark": "engine", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": {"platform": platform.platform(), "cpus": torch.get_num_threads(),
                    "device": args.device, "torch": torch.__version__,
                    "gpu": torch.cuda.get_device_name() if str(args.device).startswith("cuda") else None},
        "model": args.model, "weights": args.weights, "compiled": args.compile, "compile_warmup_s": warm_s,
        "tiers": [(t.name, t.layers) for t in model.tiers],
        "repeats": args.repeats, "regimes": {}}
    for name in regimes:
        num, mix, pr, orr = specs[name]
        work = make_workload(num, n, mix, pr, orr, model.cfg.vocab_size, args.seed)
        print(f"{name}-bound workload: {num} requests, mix {mix}, prompts {pr}, outputs {orr}", flush=True)
        result["regimes"][name] = {
            "workload": {"num": num, "mix": mix, "prompt_len": pr, "output_len": orr, "seed": args.seed,
                         "tokens": sum(it.max_tokens for it in work)},
            **run_regime(model, copies, work, args)}
    if not args.skip_generate:
        num, mix, pr, orr = specs[regimes[0]]
        work = make_workload(num, n, mix, pr, orr, model.cfg.vocab_size, args.seed)
        result["top_tier_vs_generate"] = run_top_vs_generate(fam, work, args)
    write_json(args.json, result)
    print_table(result)
    if args.plot:
        plot(result, args.plot)
    return 0


def print_table(r: dict) -> None:
    for name, reg in r["regimes"].items():
        n, i, q = reg["nested"], reg["independent"], reg["ratios"]
        w = reg["workload"]
        print(f"\n{name}-bound ({w['num']} requests, prompts {w['prompt_len']}, outputs {w['output_len']})")
        print(f"{'':<28}{'nested':>14}{'independent':>14}{'ratio':>9}")
        rows = [("generated tokens/s", "tokens_per_s", "{:.1f}", q["tokens_per_s"]),
                ("mean per-token latency ms", "mean_per_token_latency_ms", "{:.1f}", q["mean_per_token_latency"]),
                ("mean TPOT ms", "mean_tpot_ms", "{:.1f}", q["mean_tpot"]),
                ("weights MB", "weights_bytes", "{:.0f}", q["weights"]),
                ("KV peak MB", "kv_peak_bytes", "{:.1f}", n["kv_peak_bytes"] / max(1, i["kv_peak_bytes"])),
                ("peak memory MB", "peak_memory_bytes", "{:.0f}", q["peak_memory"])]
        for label, key, fmt, ratio in rows:
            scale = 1e-6 if key.endswith("bytes") else 1
            print(f"{label:<28}{fmt.format(n[key] * scale):>14}{fmt.format(i[key] * scale):>14}{ratio:>9.2f}")
        print("tokens/s ratio per repeat: " + ", ".join(f"{x:.2f}" for x in q["tokens_per_s_per_repeat"]))
    g = r.get("top_tier_vs_generate")
    if g:
        print(f"\ntop tier alone, {g['concurrency']} concurrent, {g['new_tokens']} new tokens each: "
              f"engine {g['engine_tokens_per_s']:.1f} tok/s, HF generate {g['generate_tokens_per_s']:.1f} "
              f"tok/s, ratio {g['ratio']:.2f}")


def plot(r: dict, path: str) -> None:
    import matplotlib  # noqa: PLC0415
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415
    regs = list(r["regimes"].items())
    fig, axes = plt.subplots(len(regs), 3, figsize=(11, 3.4 * len(regs)), squeeze=False)
    for row, (name, reg) in zip(axes, regs):
        n, i = reg["nested"], reg["independent"]
        for ax, (title, key, scale) in zip(row, [("generated tokens/s", "tokens_per_s", 1),
                                                  ("mean per-token latency (ms)", "mean_per_token_latency_ms", 1),
                                                  ("peak memory (MB)", "peak_memory_bytes", 1e-6)]):
            vals = [n[key] * scale, i[key] * scale]
            ax.bar(["nested", "independent"], vals, color=["#2a7", "#999"])
            ax.set_title(f"{name}-bound: {title}", fontsize=9)
            for x, v in enumerate(vals):
                ax.text(x, v, f"{v:.1f}", ha="center", va="bottom")
    fig.suptitle(f"mfs bench engine — {r['model']} ({r['weights']})")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
