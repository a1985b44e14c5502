"""`mfs bench determinism`: does a request get the same tokens however it is served?

In one process (``engine.Engine`` over the family, default format), for every tier:

1. *reference*: each of ``--prompts`` chat prompts alone, greedy, eager path, prefill in one chunk;
2. ``--runs`` runs of all the prompts under a random concurrency pattern each (the five patterns in
   turn: all at once; staggered arrivals; prefill chunks of 16 tokens; a warm prefix cache (the prompts
   run once before); the order reversed with random arrivals and chunks of 48), every prompt at a random
   tier;
3. *swap*: one run where the compiled decode graphs are swapped in after a few steps (a serving worker's
   background swap), unless ``--no-swap``;
4. *resume*: each request stopped after a random number of tokens and resumed in a fresh engine from its
   prompt and the tokens it had (what another worker does after a worker is killed), unless
   ``--no-resume``.

It reports, per tier and per kind of run, the fraction of requests whose tokens equal their reference,
and the throughput cost of the per-row operators: decode tok/s at 1 and at 16 streams with them
(the default) and with ``MFS_NONDETERMINISTIC=1`` (torch's ops), eager path, alternated.
"""
from __future__ import annotations

import argparse
import os
import random
import time
from collections import defaultdict
from dataclasses import replace
from datetime import datetime, timezone

from benches.load import TOPICS, machine
from engine.runtime import write_json

PATTERNS = ("together", "staggered", "chunked16", "warm-cache", "reversed")


def _engine(model, chunk: int = 512):
    from engine import Engine  # noqa: PLC0415
    return Engine(model, block_size=16, num_blocks=512, max_num_batched_tokens=chunk)


def _params(n: int):
    from worker.sampling import SamplingParams  # noqa: PLC0415
    return SamplingParams(max_tokens=n, ignore_eos=True)


def serve(model, reqs, *, chunk: int = 512, arrivals=None, warm: bool = False, on_step=None) -> dict:
    """reqs: (id, prompt, tier, max_tokens). Returns {id: tokens}."""
    eng = _engine(model, chunk)
    if warm:
        eng.generate([p for _, p, _, _ in reqs], [t for _, _, t, _ in reqs], _params(1))
    arrivals = arrivals or [0] * len(reqs)
    out = {r[0]: [] for r in reqs}
    step = 0
    while step <= max(arrivals) or eng.has_unfinished():
        if on_step is not None:
            on_step(step)
        for (rid, prompt, tier, n), at in zip(reqs, arrivals):
            if at == step:
                eng.add_request(rid, prompt, tier, _params(n))
        for o in eng.step():
            out[o.request_id].extend(o.new_token_ids)
        step += 1
    return out


def pattern_run(model, pattern: str, reqs, rng: random.Random, on_step=None) -> dict:
    arrivals = [0] * len(reqs)
    chunk, warm, order = 512, False, list(reqs)
    if pattern == "staggered":
        arrivals = [rng.randrange(2 * len(reqs)) for _ in reqs]
    elif pattern == "chunked16":
        chunk = 16
    elif pattern == "warm-cache":
        warm = True
    elif pattern == "reversed":
        order = order[::-1]
        arrivals, chunk = [rng.randrange(len(reqs)) for _ in reqs], 48
    return serve(model, order, chunk=chunk, arrivals=arrivals, warm=warm, on_step=on_step)


def resumed(model, req, rng: random.Random) -> list[int]:
    """The request stopped after k tokens, then served by a fresh engine from its prompt and those k."""
    rid, prompt, tier, n = req
    k = rng.randrange(1, n)
    first = serve(model, [(rid, prompt, tier, k)])[rid]
    return first + serve(model, [(rid, prompt + first, tier, n - k)])[rid]


def throughput(model, prompts: list[list[int]], streams: int, tokens: int) -> tuple[float, float]:
    """Decode tokens per wall second and per CPU second of this process (the figure other jobs on the
    machine disturb less) of ``streams`` greedy requests at the top tier (prefill excluded: timed from the
    step after every prompt is in)."""
    eng = _engine(model)
    top = len(model.tiers) - 1
    for i in range(streams):
        eng.add_request(f"t{i}", prompts[i % len(prompts)], top, _params(tokens))
    while any(r.num_computed_tokens < len(r.prompt_ids) for r in eng.running) or eng.scheduler.waiting:
        eng.step()
    n, t0, c0 = 0, time.perf_counter(), time.process_time()
    while eng.has_unfinished():
        n += sum(len(o.new_token_ids) for o in eng.step())
    return n / (time.perf_counter() - t0), n / (time.process_time() - c0)


def cost(model, prompts, tokens: int, repeats: int) -> dict:
    from kernels import switches  # noqa: PLC0415
    res: dict = {}
    base = switches.current()
    for streams in (1, 16):
        det, non = [], []
        for _ in range(repeats):  # alternated, so drift in the machine's load hits both
            for nondeterministic, into in ((False, det), (True, non)):
                switches.use(replace(base, nondeterministic=nondeterministic))
                into.append(throughput(model, prompts, streams, tokens))
        switches.use(replace(base, nondeterministic=False))
        d, nd = max(w for w, _ in det), max(w for w, _ in non)
        dc, ndc = max(c for _, c in det), max(c for _, c in non)
        res[f"{streams}_streams"] = {"deterministic_tok_s": round(d, 1), "nondeterministic_tok_s": round(nd, 1),
                                     "cost": round(1 - d / nd, 3), "deterministic_tok_per_cpu_s": round(dc, 1),
                                     "nondeterministic_tok_per_cpu_s": round(ndc, 1), "cpu_cost": round(1 - dc / ndc, 3),
                                     "runs": {"deterministic": det, "nondeterministic": non}}
    return res


def run(args) -> int:
    import torch  # noqa: PLC0415

    from engine.prompts import encode_prompt  # noqa: PLC0415
    from kernels import switches  # noqa: PLC0415
    from worker.execution import compile_decode  # noqa: PLC0415
    from worker.family import load_family  # noqa: PLC0415
    if min(args.prompts, args.runs, args.tokens) < 1:
        raise ValueError("--prompts, --runs and --tokens must be >= 1")
    torch.set_num_threads(args.threads)
    switches.use(replace(switches.current(), nondeterministic=False))  # the served default, whatever the environment says
    fam = load_family(args.model, tiers=args.tiers, weights=args.weights)
    model, rng = fam.model, random.Random(args.seed)
    tiers = len(model.tiers)
    prompts = [encode_prompt(fam.base.tokenizer, f"Write about {TOPICS[i % len(TOPICS)]}, part {i}.", True)
               for i in range(args.prompts)]
    t0 = time.perf_counter()
    ref = {(i, t): serve(model, [("x", p, t, args.tokens)])["x"] for i, p in enumerate(prompts) for t in range(tiers)}
    counts: dict = defaultdict(lambda: [0, 0])  # (kind, tier) -> [equal, total]

    def tally(kind: str, reqs, got) -> None:
        for rid, _, tier, _ in reqs:
            i = int(rid.split("-")[1])
            c = counts[(kind, tier)]
            c[0] += got[rid] == ref[(i, tier)]
            c[1] += 1

    def workload(k: int):
        return [(f"r{k}-{i}", p, rng.randrange(tiers), args.tokens) for i, p in enumerate(prompts)]

    for k in range(args.runs):
        pattern = PATTERNS[k % len(PATTERNS)]
        reqs = workload(k)
        tally(pattern, reqs, pattern_run(model, pattern, reqs, rng))
    if args.swap:
        reqs = workload(args.runs)
        t_swap = time.perf_counter()
        tally("swap", reqs, serve(model, reqs, arrivals=[rng.randrange(4) for _ in reqs],
                                  on_step=lambda s: s == 3 and compile_decode(model)))
        t_swap = time.perf_counter() - t_swap
        compile_decode(model, enable=False)
    if args.resume:
        reqs = workload(args.runs + 1)
        tally("resume", reqs, {r[0]: resumed(model, r, rng) for r in reqs})
    checked_s = time.perf_counter() - t0
    by_tier: dict = defaultdict(dict)
    for (kind, tier), (eq, n) in sorted(counts.items()):
        by_tier[model.tiers[tier].name][kind] = {"identical": eq, "requests": n, "fraction": round(eq / n, 4)}
    out = {"benchmark": "determinism", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
           "machine": machine(), "load_avg": os.getloadavg(),
           "args": {k: v for k, v in vars(args).items() if k != "func"},
           "identical": by_tier, "all_identical": all(eq == n for eq, n in counts.values()),
           "checked_s": round(checked_s, 1)}
    if args.swap:
        out["swap_run_s"] = round(t_swap, 1)
    if args.cost_repeats:
        out["throughput"] = cost(model, prompts, args.tokens, args.cost_repeats)
    for tier, kinds in by_tier.items():
        print(f"  {tier}: " + ", ".join(f"{k} {v['identical']}/{v['requests']}" for k, v in kinds.items()))
    for k, v in out.get("throughput", {}).items():
        print(f"  {k}: {v['deterministic_tok_s']} tok/s deterministic vs {v['nondeterministic_tok_s']} "
              f"(cost {v['cost']:.1%}); per CPU second {v['deterministic_tok_per_cpu_s']} vs "
              f"{v['nondeterministic_tok_per_cpu_s']} (cost {v['cpu_cost']:.1%})")
    if args.json:
        write_json(args.json, out)
    return 0 if out["all_identical"] else 1


def add_parser(sub) -> None:
    p = sub.add_parser("determinism", help="same request, same tokens? N prompts x K runs under random concurrency, "
                                           "a path swap and a resume, per tier; and the cost in tok/s")
    p.add_argument("--model", default="default")
    p.add_argument("--tiers", default=None)
    p.add_argument("--weights", default="w4a8", help="the served format (default w4a8, the CPU default)")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--runs", type=int, default=5, help="runs under random concurrency (five patterns in turn)")
    p.add_argument("--tokens", type=int, default=32, help="greedy tokens per request")
    p.add_argument("--swap", action=argparse.BooleanOptionalAction, default=True, help="a run with the compiled graphs swapped in")
    p.add_argument("--resume", action=argparse.BooleanOptionalAction, default=True, help="each request stopped and resumed")
    p.add_argument("--cost-repeats", type=int, default=2, help="alternations of the tok/s probe (0: none)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    p.set_defaults(func=run)

