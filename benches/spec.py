"""`mfs bench spec`: the top tier with and without self-speculation (a lower tier drafts, the top
tier verifies only its upper segments) on a fixed prompt set, at 1 and N concurrent requests."""
from __future__ import annotations

import statistics
import time
from datetime import datetime, timezone

import torch

from engine import Engine
from worker.sampling import SamplingParams
from engine.runtime import write_json

PROMPTS = [
    "What is the capital of France? Answer in one sentence.",
    "Summarize in two sentences: The city council met on Tuesday to discuss the new bus routes. "
    "Residents asked for more frequent service in the evening, and the council agreed to study it.",
    "Write a Python function that returns the sum of the squares of a list of numbers.",
    "Explain what a hash table is to a beginner.",
    "List three tips for writing clear emails.",
    "Translate to French: Good morning, how are you today?",
    "Write a short poem about the sea.",
    "What are the main differences between a list and a tuple in Python?",
]


def _run(eng: Engine, prompts, tier, params) -> dict:
    """One batch on a warm engine (as a server runs: the speculation gate keeps what it learned from
    earlier batches); the counters are this batch's."""
    st = eng.stats
    before = (st.spec_rounds, st.spec_proposed, st.spec_accepted, st.spec_gated)
    t0 = time.perf_counter()
    outs = eng.generate(prompts, [tier] * len(prompts), params)
    dt = time.perf_counter() - t0
    rounds, proposed, accepted, gated = (a - b for a, b in zip(
        (st.spec_rounds, st.spec_proposed, st.spec_accepted, st.spec_gated), before))
    return {"tokens": sum(map(len, outs)), "seconds": dt, "tokens_per_s": sum(map(len, outs)) / dt,
            "rounds": rounds, "proposed": proposed, "accepted": accepted, "gated": gated,
            "acceptance": accepted / proposed if proposed else None,
            "accepted_per_verification": accepted / rounds if rounds else None,
            "outputs": outs}


def add_parser(sub) -> None:
    from worker.family import add_model_args  # noqa: PLC0415
    p = sub.add_parser("spec", help="top tier with vs without self-speculative decoding")
    add_model_args(p)
    p.add_argument("--json", required=True)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--gamma", type=int, default=4)
    p.add_argument("--concurrency", default="1,8")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--temperature", type=float, default=0.0,
                   help="> 0: sampled requests (seeded), speculation by rejection sampling; outputs are "
                        "then samples of the same distribution, not equal token for token")
    p.add_argument("--min-acceptance", type=float, default=None,
                   help="the speculation gate's break-even acceptance (default: the scheduler's)")
    p.add_argument("--stop-confidence", default="0.5",
                   help="comma list of spec_stop_confidence values to compare (0: rounds always run to gamma)")
    p.set_defaults(func=run)


def run(args) -> int:
    from engine.prompts import encode_prompt  # noqa: PLC0415
    from worker.family import load_from_args  # noqa: PLC0415
    if args.threads:
        torch.set_num_threads(args.threads)
    fam = load_from_args(args)
    model, top = fam.model, len(fam.model.tiers) - 1
    ids = [encode_prompt(fam.tokenizer, p, chat=True) for p in PROMPTS]
    result = {"benchmark": "spec", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
              "model": args.model, "precipitated": fam.manifest.precipitated, "gamma": args.gamma,
              "max_tokens": args.max_tokens, "temperature": args.temperature, "runs": []}
    for conc in (int(c) for c in args.concurrency.split(",")):
        batches = [ids[i:i + conc] for i in range(0, len(ids), conc)][: max(1, 8 // conc) if conc > 1 else 4]
        seed = 0 if args.temperature > 0 else None
        base = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, temperature=args.temperature,
                              seed=seed)
        for draft, stop in ((d, float(c)) for d in range(top) for c in str(args.stop_confidence).split(",")):
            sp = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True, spec_draft_tier=draft,
                                spec_gamma=args.gamma, temperature=args.temperature, seed=seed,
                                spec_stop_confidence=stop)
            plain_tps, spec_tps, acc, per, gated = [], [], [], [], 0
            gate = {} if args.min_acceptance is None else {"spec_min_acceptance": args.min_acceptance}
            eng_plain = Engine(model, num_blocks=1024, prefix_caching=False)
            eng_spec = Engine(model, num_blocks=1024, prefix_caching=False, **gate)
            for _ in range(args.repeats):
                for b in batches:
                    a = _run(eng_plain, b, top, base)
                    s = _run(eng_spec, b, top, sp)
                    gated += s["gated"]
                    if args.temperature == 0:
                        assert s["outputs"] == a["outputs"], "speculation changed a greedy output"
                    plain_tps.append(a["tokens_per_s"])
                    spec_tps.append(s["tokens_per_s"])
                    if s["acceptance"] is not None:
                        acc.append(s["acceptance"])
                        per.append(s["accepted_per_verification"])
            row = {"concurrency": conc, "draft_tier": model.tiers[draft].name, "stop_confidence": stop,
                   "plain_tokens_per_s": statistics.median(plain_tps),
                   "spec_tokens_per_s": statistics.median(spec_tps),
                   "speedup": statistics.median(s / p for s, p in zip(spec_tps, plain_tps)),
                   "acceptance": statistics.mean(acc) if acc else None,
                   "accepted_per_verification": statistics.mean(per) if per else None,
                   "rounds": eng_spec.stats.spec_rounds, "gated_steps": gated}
            result["runs"].append(row)
            print(f"concurrency {conc}, draft {row['draft_tier']:>7}, stop {stop:.2f}: plain {row['plain_tokens_per_s']:6.1f} "
                  f"tok/s, speculative {row['spec_tokens_per_s']:6.1f} tok/s, speedup {row['speedup']:.2f}, "
                  f"acceptance {row['acceptance'] or 0:.2f}, accepted/verification "
                  f"{row['accepted_per_verification'] or 0:.2f}, rounds {row['rounds']}, "
                  f"gated steps {gated}", flush=True)
    write_json(args.json, result)
    return 0
