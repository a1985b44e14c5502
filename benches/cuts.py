"""`mfs bench cuts`: exit-block quality against depth, one cut at a time, at an equal token budget.

One frozen-trunk pass over the training mix caches the residual stream after every candidate cut
layer at once, plus the top tier's top-k log-probabilities (training/exit_features.py). Then, per cut,
one exit block (the recipe of ``mfs precipitate --method exit-blocks``: a copy of the last layer and
its own norm, top-k KL + a little full-vocabulary CE) trains for the same number of tokens, and is
measured:

* held-out perplexity / the top tier's and greedy agreement with the top tier (the held-out text of
  ``mfs eval``, from the cached features);
* keyword-checked answers to a question file (default evals/questions/chat_keywords.jsonl), and the
  share of the questions the top tier answers that the cut answers too;
* the capitals multiple-choice accuracy (evals/capitals);
* the decode cost per token of the tier, batch 1, timed beside the top tier's.

Each cut's result and exit block are written under ``OUT/cuts/`` as soon as it is measured; ``--resume``
skips the cuts already there (a cut stopped half-way trains again from its start). The JSON, a
markdown table and a plot (quality against cost) are rewritten after every cut.
"""
from __future__ import annotations

import json
import platform
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

from engine.runtime import autocast_dtype, progress, save_figure, write_json

DEFAULT_CUTS = "10,12,14,16,18,20,22,24,26,28"
ROOT = Path(__file__).resolve().parents[1]
QUESTIONS = ROOT / "evals/questions/chat_keywords.jsonl"


def add_parser(sub) -> None:
    p = sub.add_parser("cuts", help="exit-block quality against the cut layer, at an equal token budget")
    p.add_argument("--base", default="default", help="base model (default: the default family's base)")
    p.add_argument("--cuts", default=DEFAULT_CUTS, help="candidate cut layers (the top tier is the base)")
    p.add_argument("--measure", default=None,
                   help="train and measure only these of --cuts (the cache still holds every cut)")
    p.add_argument("--data", default="chat,names:300,stdlib",
                   help="training mix (sources of mfs precipitate --data)")
    p.add_argument("--out", default="runs/bench-cuts", help="work folder: data, feature cache, cut results")
    p.add_argument("--json", default="docs/bench/cuts-cpu.json",
                   help="results; the table (.md) and plot (.png) are written beside it")
    p.add_argument("--cache-tokens", type=int, default=65_536, help="training tokens to cache")
    p.add_argument("--heldout-tokens", type=int, default=8192)
    p.add_argument("--heldout-answers", default="generate", choices=["generate", "skip"])
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--topk", type=int, default=64)
    p.add_argument("--cache-batch", type=int, default=4)
    p.add_argument("--self-max-tokens", type=int, default=96, help="tokens per generated training answer")
    p.add_argument("--tokens-per-cut", type=int, default=122_880, help="training tokens of every cut")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--lr", type=float, default=3e-4)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--decay-frac", type=float, default=1 / 3,
                   help="the last fraction of the steps decays the lr linearly to 10%%")
    p.add_argument("--ce", type=float, default=0.1)
    p.add_argument("--ce-frac", type=float, default=0.125)
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--block-layers", type=int, default=1)
    p.add_argument("--questions", default=str(QUESTIONS), help="keyword-checked question file (JSONL)")
    p.add_argument("--answer-tokens", type=int, default=40)
    p.add_argument("--capitals-items", type=int, default=0, help="score the first N capitals items (0: all 134)")
    p.add_argument("--decode-tokens", type=int, default=32)
    p.add_argument("--decode-repeats", type=int, default=3)
    p.add_argument("--autocast", default="auto", choices=["auto", "bf16", "none"])
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu")
    p.add_argument("--resume", action="store_true", help="keep the cuts already measured under OUT/cuts/")
    p.set_defaults(func=run)


def _log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _load() -> float:
    try:
        return float(Path("/proc/loadavg").read_text().split()[0])
    except OSError:
        return float("nan")


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.0%}"


def _nan(x: float | None) -> float:
    return float("nan") if x is None else x


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _lr_factor(step: int, steps: int, warmup: int, decay_frac: float) -> float:
    f = min(1.0, (step + 1) / max(1, warmup))
    decay_from = steps * (1 - decay_frac)
    if decay_frac > 0 and step >= decay_from:
        f *= max(0.1, 1 - 0.9 * (step - decay_from) / max(1, steps - decay_from))
    return f


def _steps(args) -> int:
    return max(1, args.tokens_per_cut // (args.batch_size * args.seq_len))


def train_cut(model, tr: dict, tier: int, args, amp, bar_desc: str) -> dict:
    """Trains tier ``tier``'s exit block and norm for ``--tokens-per-cut`` tokens; the batch of step s
    is a function of (seed, s), the same for every cut."""
    from training.exitblocks import batch_tensors, exit_parameters, step_losses  # noqa: PLC0415
    params = exit_parameters(model, [tier])
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.98), weight_decay=args.weight_decay)
    n_win = tr["ids"].shape[0]
    steps = _steps(args)
    gen = torch.Generator().manual_seed(args.seed + 1)
    tokens, train_s, kl = 0, 0.0, float("nan")
    model.train()
    bar = progress(total=steps, desc=bar_desc, unit="step")
    for step in range(steps):
        g = np.random.default_rng([args.seed, step])
        b = batch_tensors(tr, g.choice(n_win, size=min(args.batch_size, n_win), replace=False), [tier],
                          args.device)
        t0 = time.perf_counter()
        loss, kls, _ = step_losses(model, b, [tier], args.ce, args.ce_frac, gen, amp)
        for grp in opt.param_groups:
            grp["lr"] = args.lr * _lr_factor(step, steps, args.warmup, args.decay_frac)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, args.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        train_s += time.perf_counter() - t0
        tokens += b["ids"].numel()
        kl = kls[0]
        bar.set_postfix_str(f"{tokens / max(train_s, 1e-9):.0f} tok/s kl={kl:.3f}", refresh=False)
        bar.update(1)
    bar.close()
    model.eval()
    for p in params:
        p.requires_grad_(False)
    return {"steps": steps, "tokens": tokens, "train_s": round(train_s, 1),
            "train_tokens_per_s": round(tokens / max(train_s, 1e-9), 1), "final_kl": round(kl, 4)}


def answer_questions(model, tok, questions, tier: int, max_tokens: int) -> list[str]:
    from training.data import generate_answers  # noqa: PLC0415
    res = generate_answers(model, tok, [q for q, _ in questions], max_tokens, batch=len(questions), tier=tier)
    return [a for a, _ in res]


def question_scores(answers: list[str], questions, reference: list[bool] | None) -> dict:
    from evaluation.eval_questions import answered_share, has_keyword  # noqa: PLC0415
    ok = [has_keyword(a, k) for a, (_, k) in zip(answers, questions)]
    out = {"correct": sum(ok), "of": len(ok), "ok": ok}
    if reference is not None:
        out["share_of_top_answered"] = answered_share(ok, reference)
    return out


@torch.no_grad()
def capitals_accuracy(model, tok, tier: int, limit: int = 0) -> float:
    """The capitals task (evaluation/mc_tasks.py's scoring) for one tier, its first ``limit`` items
    (0: all)."""
    import torch.nn.functional as F  # noqa: PLC0415

    from evaluation.mc_tasks import accuracy, load_task  # noqa: PLC0415
    items = load_task("capitals")[:limit or None]
    scores = [[0.0] * len(it.choices) for it in items]
    dev = model.embed_tokens.weight.device
    for i, it in enumerate(items):
        ctx = tok.encode(it.prompt, add_special_tokens=False)
        rows = []
        for c in it.choices:
            cont = tok.encode(it.prompt + c, add_special_tokens=False)[len(ctx):] or tok.encode(
                c, add_special_tokens=False)
            rows.append(ctx + cont)
        L = max(map(len, rows))
        ids = torch.zeros(len(rows), L, dtype=torch.long)
        for b, r in enumerate(rows):
            ids[b, :len(r)] = torch.tensor(r)
        h = model.exit_from_trunk(tier, model.trunk_states(ids.to(dev), tier)[tier])
        for j, r in enumerate(rows):
            n = len(r) - len(ctx)
            lp = F.log_softmax(model.logits(h[j, len(ctx) - 1:len(r) - 1]).float(), -1)
            scores[i][j] = float(lp.gather(-1, torch.tensor(r[len(ctx):], device=dev)[:, None]).sum())
            assert n > 0
    return accuracy(scores, items)


def decode_ms(model, tok, tier: int, tokens: int) -> float:
    """Milliseconds per decoded token of one request at ``tier`` (steps after the first token)."""
    from engine import Engine  # noqa: PLC0415
    from training.data import chat_ids  # noqa: PLC0415
    from worker.sampling import SamplingParams  # noqa: PLC0415
    eng = Engine(model, num_blocks=64, max_num_seqs=1)
    eng.add_request("d", chat_ids(tok, "Tell me about the sea."), tier,
                    SamplingParams(max_tokens=tokens + 1, ignore_eos=True))
    eng.step()  # prefill and the first token
    n, t0 = 0, time.perf_counter()
    while eng.has_unfinished():
        n += sum(len(o.new_token_ids) for o in eng.step())
    return (time.perf_counter() - t0) * 1000 / max(1, n)


def decode_cost(model, tok, tier: int, top: int, args) -> dict:
    """The tier's and the top tier's ms/token, interleaved (so that load drifts hit both); medians."""
    mine, tops = [], []
    for _ in range(args.decode_repeats):
        mine.append(decode_ms(model, tok, tier, args.decode_tokens))
        tops.append(decode_ms(model, tok, top, args.decode_tokens))
    a, b = statistics.median(mine), statistics.median(tops)
    return {"ms_per_token": round(a, 2), "top_ms_per_token": round(b, 2), "cost_vs_top": round(a / b, 3)}


def save_block(model, tier: int, path: Path) -> None:
    from safetensors.torch import save_file  # noqa: PLC0415
    sd = {model.exit_param_name(tier): model.exit_norms[tier].detach()}
    for k, v in model.exit_block(tier).state_dict().items():
        sd[f"exit_blocks.{tier}.{k}"] = v
    save_file({k: v.to(torch.float16).contiguous() for k, v in sd.items()}, str(path))


def build_cuts_model(args, cuts: list[int]):
    """The base cut after every layer of ``cuts`` (each a tier with a fresh exit block) and whole:
    (model, tokenizer, family, tier specs); frozen, fp32, torch ops."""
    from family.manifest import resolve_base_arg  # noqa: PLC0415
    from kernels import TORCH_OPS  # noqa: PLC0415
    from training.exitblocks import tier_specs  # noqa: PLC0415
    from worker.family import build_model  # noqa: PLC0415
    from family.loader import load_base  # noqa: PLC0415
    base_path, _, family = resolve_base_arg(args.base)
    base = load_base(base_path)
    n = base.hf_config.num_hidden_layers
    if not cuts or cuts[0] < 1 or cuts[-1] >= n:
        raise ValueError(f"--cuts {cuts}: every cut must lie in 1..{n - 1} ({n} is the top tier)")
    tiers = tier_specs(",".join(map(str, [*cuts, n])), n, args.block_layers, "copy:last")
    model = build_model(base, tiers, torch.float32, args.device, ops=TORCH_OPS)
    model.init_exit_blocks("copy:last")
    model.requires_grad_(False).eval()
    return model, base.tokenizer, family, tiers


# ---- the run -----------------------------------------------------------------------------------
def run(args) -> int:
    from evaluation.eval_questions import load_questions  # noqa: PLC0415
    from training.exitblocks import evaluate_cache, feature_caches  # noqa: PLC0415

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    out = Path(args.out)
    (out / "cuts").mkdir(parents=True, exist_ok=True)
    cuts = sorted({int(c) for c in args.cuts.split(",") if c.strip()})
    amp = autocast_dtype(args.autocast, args.device)
    t_run = time.monotonic()
    model, tok, family, tiers = build_cuts_model(args, cuts)
    top = model.num_segments - 1
    lower = list(range(top))
    _log(f"bench cuts: {family}, cuts {cuts} of {tiers[-1].layers} layers, {args.threads} thread(s), "
         f"autocast {amp or 'off (fp32)'}, {args.tokens_per_cut:,} training tokens per cut, load {_load():.2f}")
    t0 = time.monotonic()
    tc, hc, mix, rates = feature_caches(args, model, tok, lower, out, _log)
    tr, ho = tc.open("r"), hc.open("r")
    cache_min = (time.monotonic() - t0) / 60
    questions = load_questions(args.questions)

    top_path = out / "cuts/top.json"
    if args.resume and top_path.exists():
        top_res = json.loads(top_path.read_text())
    else:
        t0 = time.monotonic()
        ans = answer_questions(model, tok, questions, top, args.answer_tokens)
        top_res = {"layers": tiers[-1].layers, "answers": ans, "questions": question_scores(ans, questions, None),
                   "capitals_acc": capitals_accuracy(model, tok, top, args.capitals_items),
                   "ms_per_token": round(statistics.median(
                       decode_ms(model, tok, top, args.decode_tokens) for _ in range(args.decode_repeats)), 2),
                   "eval_s": round(time.monotonic() - t0, 1)}
        top_path.write_text(json.dumps(top_res, indent=1) + "\n")
    ref = top_res["questions"]["ok"]
    _log(f"top ({top_res['layers']} layers): {top_res['questions']['correct']}/{len(questions)} questions, "
         f"capitals {top_res['capitals_acc']:.3f}, {top_res['ms_per_token']} ms/token")

    rows = []
    measure = {int(c) for c in args.measure.split(",")} if args.measure else set(cuts)
    for i, cut in zip(lower, cuts):
        if cut not in measure:
            continue
        res_path = out / f"cuts/{cut}.json"
        if args.resume and res_path.exists():
            row = json.loads(res_path.read_text())
            if row["train"]["tokens"] == _steps(args) * args.batch_size * args.seq_len:
                rows.append(row)
                _log(f"cut {cut}: measured before, kept")
                continue
            _log(f"cut {cut}: measured before at another budget, measured again")
        t0 = time.monotonic()
        tr_info = train_cut(model, tr, i, args, amp, f"cut {cut}")
        ev = evaluate_cache(model, ho, [i])
        q = ev["tiers"][str(i)]
        ans = answer_questions(model, tok, questions, i, args.answer_tokens)
        row = {"cut": cut, "train": tr_info, "ppl": round(q["ppl"], 3), "ppl_vs_top": round(q["ppl_vs_top"], 3),
               "agree_top": round(q["agree_top"], 4), "top_ppl": round(ev["top_ppl"], 3),
               "questions": question_scores(ans, questions, ref), "answers": ans,
               "capitals_acc": capitals_accuracy(model, tok, i, args.capitals_items), **decode_cost(model, tok, i, top, args),
               "layers_vs_top": round((cut + args.block_layers) / tiers[-1].layers, 3),
               "minutes": round((time.monotonic() - t0) / 60, 2), "load": _load()}
        save_block(model, i, out / f"cuts/{cut}.safetensors")
        res_path.write_text(json.dumps(row, indent=1) + "\n")
        rows.append(row)
        qs = row["questions"]
        _log(f"cut {cut}: ppl {row['ppl_vs_top']}x top, agreement {row['agree_top']:.1%}, questions "
             f"{qs['correct']}/{qs['of']} ({_pct(qs['share_of_top_answered'])} of top's), capitals "
             f"{row['capitals_acc']:.3f}, {row['ms_per_token']} ms/token ({row['cost_vs_top']}x top), "
             f"trained {tr_info['tokens']:,} tokens at {tr_info['train_tokens_per_s']:.0f}/s, "
             f"{row['minutes']} min")
        write_results(args, rows, top_res, mix, rates, cache_min, t_run)
    write_results(args, rows, top_res, mix, rates, cache_min, t_run)
    return 0


def write_results(args, rows: list[dict], top_res: dict, mix: dict, rates: dict, cache_min: float,
                  t_run: float) -> None:
    res = {"bench": "cuts", "command": "mfs " + " ".join(sys.argv[1:]), "cpu": _cpu(),
           "threads": args.threads, "load_at_write": _load(),
           "recipe": {"block_layers": args.block_layers, "init": "copy:last", "tokens_per_cut": args.tokens_per_cut,
                      "batch": [args.batch_size, args.seq_len], "lr": args.lr, "warmup": args.warmup,
                      "decay_frac": args.decay_frac, "ce": args.ce, "ce_frac": args.ce_frac, "topk": args.topk},
           "data": {"spec": args.data, "cached_tokens_by_source": mix, "heldout_tokens": args.heldout_tokens,
                    "answer_max_tokens": args.self_max_tokens, **rates,
                    "cache_minutes_this_run": round(cache_min, 1)},
           "questions_file": _shown(args.questions), "capitals_items": args.capitals_items or 134, "top": top_res, "cuts": rows,
           "minutes_this_run": round((time.monotonic() - t_run) / 60, 1)}
    write_json(args.json, res)
    base = Path(args.json).with_suffix("")
    Path(f"{base}.md").write_text(table(res) + "\n")
    plot(res, f"{base}.png")


def table(res: dict) -> str:
    top = res["top"]
    lines = ["| cut (layers + block) | ppl / top | greedy agreement | questions right | of top's answered "
             "| capitals acc | ms / token (x top) | trained tokens |",
             "|---|---|---|---|---|---|---|---|"]
    for r in res["cuts"]:
        q = r["questions"]
        lines.append(f"| {r['cut']} + 1 | {r['ppl_vs_top']:.2f}x | {r['agree_top']:.1%} | {q['correct']}/{q['of']} "
                     f"| {_pct(q['share_of_top_answered'])} | {r['capitals_acc']:.3f} | {r['ms_per_token']:.1f} "
                     f"({r['cost_vs_top']:.2f}x) | {r['train']['tokens']:,} |")
    tq = top["questions"]
    lines.append(f"| {top['layers']} (top) | 1.00x | 100% | {tq['correct']}/{tq['of']} | 100% "
                 f"| {top['capitals_acc']:.3f} | {top['ms_per_token']:.1f} (1.00x) | - |")
    return "\n".join(lines)


def plot(res: dict, path: str) -> None:
    import matplotlib  # noqa: PLC0415
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415
    rows = res["cuts"]
    if not rows:
        return
    cost = [r["cost_vs_top"] for r in rows] + [1.0]
    fig, ax = plt.subplots(1, 2, figsize=(11, 4.2))
    ax[0].plot(cost, [r["agree_top"] for r in rows] + [1.0], "o", label="greedy agreement with top")
    ax[0].plot(cost, [_nan(r["questions"]["share_of_top_answered"]) for r in rows] + [1.0], "s",
               label="share of top's answered questions")
    ax[0].plot(cost, [r["capitals_acc"] for r in rows] + [res["top"]["capitals_acc"]], "^",
               label="capitals accuracy")
    ax[0].axhline(0.75, color="grey", ls=":", lw=1)
    ax[0].axhline(0.60, color="grey", ls="--", lw=1)
    ax[1].plot(cost, [r["ppl_vs_top"] for r in rows] + [1.0], "o", color="C3")
    ax[1].axhline(1.3, color="grey", ls=":", lw=1)
    ax[1].set_yscale("log")
    for a in ax:
        a.set_xlabel("decode cost per token / top tier's (measured, batch 1, interleaved)")
        for r, c in zip(rows, cost):
            a.annotate(str(r["cut"]), (c, a.get_lines()[0].get_ydata()[rows.index(r)]), fontsize=7,
                       textcoords="offset points", xytext=(3, 3))
    ax[0].set_ylabel("quality")
    ax[0].legend(fontsize=8)
    ax[1].set_ylabel("held-out perplexity / top (log)")
    fig.suptitle(f"exit block per cut, {res['recipe']['tokens_per_cut']:,} tokens each ({res['cpu']}, "
                 f"{res['threads']} thread(s))", fontsize=9)
    save_figure(fig, path)


def _shown(path: str) -> str:
    """A path as the results show it: relative to the repository where it lies inside it."""
    p = Path(path).resolve()
    return str(p.relative_to(ROOT)) if p.is_relative_to(ROOT) else str(p)
