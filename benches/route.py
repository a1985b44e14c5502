"""`mfs bench route`: quality against cost of the family id's routing policies (RouteLLM-style).

On the larger fixed question set (:data:`training.data.EVAL_QUESTIONS_LARGE`), or with ``--questions FILE`` a
keyword-checked chat workload (each policy also counts its answers with a keyword), greedy, chat template, every
policy picks a tier per prompt; its *quality* is the share of answers whose first sentence equals the
top tier's answer (:func:`evaluation.eval_questions.first_sentence`), its *cost* the mean decoder layers run
per generated token (trunk layers + exit-block layers of the tier that produced each token, plus the
upper layers a cascade escalation runs over the history, spread over the tokens). Policies:

* ``always-top`` / ``always-small``: the references (always-small ignores the quality floor);
* ``keyword``: the gateway's complexity score, raised to the quality floor (what the family id does);
* ``confidence@τ``: the lowest usable tier whose exit is at least τ sure of the first token (its max
  softmax probability after the prompt — the prefill every tier runs anyway), else the top tier;
* ``confidence@τ+cascade@c``: that start, then the confidence cascade (window 4) mid-generation.
"""
from __future__ import annotations

import time
from datetime import datetime, timezone

import torch

from training import data as D
from engine.runtime import save_figure, write_json
from evaluation import eval_questions as Q
from worker.family import load_family
from engine import Engine
from worker.sampling import SamplingParams, confidences

CONF_TAUS = (0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8)
CASCADE = ((0.4, 0.3), (0.5, 0.4), (0.6, 0.5))  # (routing tau, cascade threshold)


def _engine(model, n: int, max_tokens: int, **kw) -> Engine:
    return Engine(model, num_blocks=n * ((max_tokens + 160) // 16 + 2), max_num_seqs=n,
                  max_num_batched_tokens=4096, **kw)


def first_token_confidence(model, prompts: list[list[int]], tiers: list[int]) -> dict[int, list[float]]:
    """Each lower tier's max softmax probability for the first output token of each prompt."""
    eng = _engine(model, len(prompts) * len(tiers), 1, keep_logits=True)
    order = [(t, i) for t in tiers for i in range(len(prompts))]
    for k, (t, i) in enumerate(order):
        eng.add_request(f"c{k}", prompts[i], t, SamplingParams(max_tokens=1, ignore_eos=True))
    conf: dict[int, list[float]] = {t: [0.0] * len(prompts) for t in tiers}
    while eng.has_unfinished():
        for o in eng.step():
            t, i = order[int(o.request_id[1:])]
            conf[t][i] = confidences(o.logits[None])[0]
    return conf


def run_cascade(model, prompts, starts, threshold: float, max_tokens: int) -> list[dict]:
    eng = _engine(model, len(prompts), max_tokens)
    res = [{"tokens": [], "tiers": [s], "escalated_at": []} for s in starts]
    for i, (p, s) in enumerate(zip(prompts, starts)):
        eng.add_request(f"q{i}", p, s, SamplingParams(max_tokens=max_tokens, cascade_threshold=threshold,
                                                      cascade_window=4) if s < model.num_segments - 1
                        else SamplingParams(max_tokens=max_tokens))
    while eng.has_unfinished():
        for o in eng.step():
            r = res[int(o.request_id[1:])]
            r["tokens"] += o.new_token_ids
            if o.finished and o.tiers:
                r["tiers"], r["escalated_at"] = list(o.tiers), list(o.escalated_at)
    return res


def cascade_cost(model, r: dict, prompt_len: int) -> tuple[float, int]:
    """(layers run for this request's generated tokens, including escalation catch-up; tokens)."""
    tiers = model.tiers
    per_tier = [t.layers + t.block for t in tiers]
    n = len(r["tokens"])
    bounds = [0] + r["escalated_at"] + [n]
    total = 0.0
    for k, t in enumerate(r["tiers"]):
        total += (bounds[k + 1] - bounds[k]) * per_tier[t]
        if k:  # catch-up: the new tier's upper segment and block over the history
            prev = r["tiers"][k - 1]
            total += (prompt_len + bounds[k]) * (tiers[t].layers - tiers[prev].layers + tiers[t].block)
    return total, n


def run(args) -> int:
    torch.set_num_threads(args.threads)
    t0 = time.perf_counter()
    fam = load_family(args.model)
    model, tok = fam.model, fam.tokenizer
    top = model.num_segments - 1
    usable = list(range(top + 1)) if args.ignore_floor else fam.usable_tiers()
    layers = [t.layers + t.block for t in model.tiers]
    keyed = Q.load_questions(args.questions) if args.questions else None
    qs = [q for q, _ in keyed] if keyed else D.EVAL_QUESTIONS_LARGE
    qs = qs[: args.num_prompts] if args.num_prompts else qs
    prompts = [D.chat_ids(tok, q) for q in qs]
    n = len(prompts)
    gen = _engine(model, n * (top + 1), args.max_tokens).generate(
        [p for _ in range(top + 1) for p in prompts], [t for t in range(top + 1) for _ in prompts],
        SamplingParams(max_tokens=args.max_tokens))
    answers = {t: gen[t * n:(t + 1) * n] for t in range(top + 1)}
    ref = [Q.first_sentence(tok.decode(a, skip_special_tokens=True)) for a in answers[top]]

    def agree(toks: list[list[int]]) -> float:
        return sum(Q.first_sentence(tok.decode(a, skip_special_tokens=True)) == r and r != ""
                   for a, r in zip(toks, ref)) / n

    def answered(toks: list[list[int]]) -> dict:
        """--questions: the answers with one of their question's keywords."""
        if not keyed:
            return {}
        return {"answered": sum(Q.has_keyword(tok.decode(a, skip_special_tokens=True), keyed[i][1])
                                for i, a in enumerate(toks))}

    def static(name: str, tiers: list[int]) -> dict:
        toks = [answers[t][i] for i, t in enumerate(tiers)]
        cost = sum(len(a) * layers[t] for a, t in zip(toks, tiers)) / max(1, sum(map(len, toks)))
        return {"policy": name, "agreement": agree(toks), "layers_per_token": cost,
                "tier_share": [tiers.count(t) / n for t in range(top + 1)],
                "below_top": sum(t < top for t in tiers) / n, **answered(toks)}

    from gateway import complexity  # noqa: PLC0415
    points = [static("always-top", [top] * n), static("always-small", [0] * n)]
    kw = [min(t for t in usable if t >= complexity.score_prompt(q, len(p), 1, top + 1).tier)
          for q, p in zip(qs, prompts)]
    points.append(static("keyword", kw))
    lower = [t for t in usable if t < top]
    conf = first_token_confidence(model, prompts, lower) if lower else {}

    def conf_route(tau: float) -> list[int]:
        return [next((t for t in lower if conf[t][i] >= tau), top) for i in range(n)]

    for tau in CONF_TAUS:
        points.append({**static(f"confidence@{tau}", conf_route(tau)), "tau": tau})
    for tau, c in CASCADE:
        starts = conf_route(tau)
        res = run_cascade(model, prompts, starts, c, args.max_tokens)
        costs = [cascade_cost(model, r, len(p)) for r, p in zip(res, prompts)]
        points.append({"policy": f"confidence@{tau}+cascade@{c}", "tau": tau, "cascade_threshold": c,
                       "agreement": agree([r["tokens"] for r in res]), **answered([r["tokens"] for r in res]),
                       "below_top": sum(r["tiers"][0] < top for r in res) / n,
                       "layers_per_token": sum(c_ for c_, _ in costs) / max(1, sum(k for _, k in costs)),
                       "escalations": sum(len(r["escalated_at"]) for r in res)})
    top_cost = points[0]["layers_per_token"]
    for p in points:
        p["cost_vs_top"] = p["layers_per_token"] / top_cost
        p["agreement_vs_top"] = p["agreement"] / max(points[0]["agreement"], 1e-9)
        p["meets_target"] = p["agreement_vs_top"] >= 0.9 and p["cost_vs_top"] <= 0.6
        if keyed:
            p["answered_vs_top"] = p["answered"] / max(points[0]["answered"], 1)
    out = {"model": args.model, "ignore_floor": args.ignore_floor, "questions_file": args.questions,
           "usable_tiers": [model.tiers[t].name for t in usable],
           "prompts": n, "max_tokens": args.max_tokens, "points": points,
           "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
           "seconds": round(time.perf_counter() - t0, 1)}
    report(points, bool(keyed))
    if args.json:
        write_json(args.json, out)
    if args.plot:
        plot(out, args.plot)
    return 0


def report(points: list[dict], keyed: bool) -> None:
    print(f"{'policy':<32} {'agree':>6} {'layers/tok':>10} {'cost/top':>8} {'below top':>9}"
          + (f" {'answered':>8} {'÷ top':>6}" if keyed else ""))
    for p in points:
        print(f"{p['policy']:<32} {p['agreement']:>6.0%} {p['layers_per_token']:>10.1f} {p['cost_vs_top']:>8.2f} "
              f"{p['below_top']:>9.0%}" + (f" {p['answered']:>8} {p['answered_vs_top']:>6.0%}" if keyed else "")
              + ("  <- meets the target" if p["meets_target"] else ""))


def plot(out: dict, path: str) -> None:
    import matplotlib  # noqa: PLC0415
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415
    fig, ax = plt.subplots(figsize=(7, 5))
    for p in out["points"]:
        kind = p["policy"].split("@")[0].split("+")[0]
        marker = {"always-top": "s", "always-small": "s", "keyword": "D"}.get(kind, "o")
        color = "C2" if "cascade" in p["policy"] else ("C0" if kind == "confidence" else "C3")
        ax.scatter(p["cost_vs_top"], p["agreement"], marker=marker, color=color)
        ax.annotate(p["policy"], (p["cost_vs_top"], p["agreement"]), fontsize=6, xytext=(3, 3),
                    textcoords="offset points")
    ax.axvline(0.6, color="grey", lw=0.5, ls="--")
    ax.axhline(0.9 * out["points"][0]["agreement"], color="grey", lw=0.5, ls="--")
    ax.set_xlabel("layers per generated token / always-top's")
    ax.set_ylabel(f"first sentence = top tier's ({out['prompts']} prompts)")
    ax.set_title(f"{out['model']}: routing quality against cost (target: upper left of the dashes)",
                 fontsize=9)
    save_figure(fig, path, dpi=110)


def add_parser(sub) -> None:
    import argparse  # noqa: PLC0415
    p = sub.add_parser("route", help="routing policies of the family id: quality against cost",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="default")
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--num-prompts", type=int, default=0, help="first N prompts only (0: all)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--questions", default=None, metavar="JSONL",
                   help="the workload: keyword-checked chat questions (e.g. evals/questions/chat_keywords.jsonl) "
                        "instead of the larger fixed set; each policy also counts the answers with a keyword")
    p.add_argument("--ignore-floor", action="store_true",
                   help="let every policy use every tier (the curve the quality floor cuts off)")
    p.add_argument("--json", default=None)
    p.add_argument("--plot", default=None)
    p.set_defaults(func=run)
