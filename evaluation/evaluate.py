"""``mfs eval``: how good each tier of a nested model is, next to the original model's top tier.

Per tier: perplexity on the held-out text (:func:`training.data.heldout_docs`: pydoc of modules no
training source uses, and the original model's answers to held-out prompts), greedy top-1 agreement
with the same model's top tier and with the original top tier, and greedy answers (chat template) to
:data:`training.data.EVAL_QUESTIONS`; with ``--questions FILE`` (e.g. evals/questions/chat_keywords.jsonl),
keyword-checked answers to the file's questions: how many each tier answers, and the share of the
questions the top tier answers that the tier answers too. The *original* is the base weights cut the same way with no
precipitated weights applied: its top tier is the unmodified model. Writes JSON, prints a table,
optionally plots a PNG.
"""
from __future__ import annotations

import argparse
import math
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch
import torch.nn.functional as F

from training import data as D
from training.data import make_windows
from engine.runtime import save_figure, write_json
from evaluation import eval_questions as Q
from worker.family import build_model
from family.manifest import manifest_for, resolve_base
from family.loader import load_base
from worker.model import NestedModel


@dataclass(slots=True)
class TierResult:
    name: str
    layers: int
    ppl: dict[str, float] = field(default_factory=dict)       # source -> perplexity; "all" too
    agree_top: float = 0.0       # greedy top-1 agreement with this model's top tier
    agree_original: float = 0.0  # ... with the original model's top tier
    answers: list[str] = field(default_factory=list)
    block: int = 0               # exit-block layers
    fixed_correct: int | None = 0  # of the six fixed questions (eval_questions.FIXED_KEYS); None: not measured
    answers_large: list[str] = field(default_factory=list)
    agree_first_sentence: float | None = 0.0  # larger set: first sentence = the top tier's; None: not measured
    questions_correct: int | None = None  # --questions: answers with a keyword; None: not asked
    questions_share_of_top: float | None = None  # ... of the questions the top tier answers
    answers_questions: list[str] = field(default_factory=list)


@dataclass(slots=True)
class HeldoutStats:
    nll: list[float]        # summed NLL per tier
    count: int
    argmax: list[torch.Tensor]


@torch.no_grad()
def heldout_pass(model: NestedModel, windows: torch.Tensor, batch: int = 4) -> HeldoutStats:
    """windows [N, S] -> summed NLL per tier and every tier's greedy next token (positions 0..S-2)."""
    nt = model.num_segments
    nll = [0.0] * nt
    arg: list[list[torch.Tensor]] = [[] for _ in range(nt)]
    for i in range(0, windows.shape[0], batch):
        ids = windows[i:i + batch]
        for t, h in enumerate(model.exit_hidden(ids)):
            logits = model.logits(h[:, :-1]).float()
            nll[t] += float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                            ids[:, 1:].reshape(-1), reduction="sum"))
            arg[t].append(logits.argmax(-1).reshape(-1))
    count = windows.shape[0] * (windows.shape[1] - 1)
    return HeldoutStats(nll, count, [torch.cat(a) for a in arg])


def answer_all(model: NestedModel, tok, questions: list[str], max_tokens: int,
               tiers: list[int] | None = None) -> list[list[str]]:
    """Greedy answers [tier][question], every tier in one group batch through the engine."""
    from engine import Engine  # noqa: PLC0415
    from worker.sampling import SamplingParams  # noqa: PLC0415
    tiers = list(range(model.num_segments)) if tiers is None else tiers
    prompts = [D.chat_ids(tok, q) for q in questions]
    eng = Engine(model, num_blocks=len(prompts) * len(tiers) * ((max_tokens + 128) // 16 + 2),
                 max_num_seqs=len(prompts) * len(tiers), max_num_batched_tokens=4096)
    gen = eng.generate([p for _ in tiers for p in prompts], [t for t in tiers for _ in prompts],
                       SamplingParams(max_tokens=max_tokens))
    out = []
    for k in range(len(tiers)):
        out.append([tok.decode(g, skip_special_tokens=True).strip()
                    for g in gen[k * len(prompts):(k + 1) * len(prompts)]])
    return out


def _load_models(model_arg: str):
    """(manifest, tokenizer, the family's model, the original): the original is the model itself where
    its top tier is the base's, else its own copy of the base's weights."""
    manifest, mdir = manifest_for(model_arg)
    base = load_base(resolve_base(manifest.base, mdir))
    has_weights = bool(manifest.weights) and mdir is not None
    original = None
    if has_weights and not _top_is_original(manifest, mdir):
        # build_model adopts the loader's tensors and apply_weights merges in place: the original
        # needs its own copy of the weights, or it would silently become the precipitated model
        orig_base = replace(base, state_dict={k: v.clone() for k, v in base.state_dict.items()})
        original = build_model(orig_base, manifest.tiers[-1:]).eval()
    model = build_model(base, manifest.tiers)
    if has_weights:
        from worker.checkpoint import apply_weights  # noqa: PLC0415
        apply_weights(model, mdir / manifest.weights["file"], manifest.weights["kind"])
    model.eval()
    return manifest, base.tokenizer, model, original if original is not None else model


def _score_heldout(model, original, per_src: dict) -> tuple[list[TierResult], TierResult]:
    """Per tier and for the original: perplexity per held-out source and over all, and greedy agreement
    with the top tier and with the original."""
    results = [TierResult(t.name, t.layers, block=t.block) for t in model.tiers]
    orig = TierResult("original", original.tiers[-1].layers)
    for t in range(model.num_segments):
        nll_all, cnt_all, agree_top, agree_orig = 0.0, 0, 0, 0
        for name, (w, st, ost) in per_src.items():
            results[t].ppl[name] = math.exp(st.nll[t] / st.count)
            nll_all += st.nll[t]
            cnt_all += st.count
            agree_top += int((st.argmax[t] == st.argmax[-1]).sum())
            o_arg = (ost or st).argmax[-1]
            agree_orig += int((st.argmax[t] == o_arg).sum())
        results[t].ppl["all"] = math.exp(nll_all / cnt_all)
        results[t].agree_top = agree_top / cnt_all
        results[t].agree_original = agree_orig / cnt_all
    nll_o, cnt_o = 0.0, 0
    for name, (w, st, ost) in per_src.items():
        s = ost or st
        orig.ppl[name] = math.exp(s.nll[-1] / s.count)
        nll_o += s.nll[-1]
        cnt_o += s.count
    orig.ppl["all"] = math.exp(nll_o / cnt_o)
    orig.agree_top = orig.agree_original = 1.0
    return results, orig


def evaluate(model_arg: str, seq_len: int = 256, heldout_tokens: int = 8192, max_tokens: int = 24,
             log=print, tasks: list[str] | None = None, heldout_chat: str | Path | None = None,
             answers: bool = True, questions: str | Path | None = None,
             deadline: float | None = None) -> dict:
    """``tasks``: local multiple-choice tasks (evaluation/mc_tasks.py) scored per tier and for the
    original; ``answers=False`` skips the generated answers (reported as None: not measured).
    ``heldout_chat``: a JSONL cache of the original's answers to the held-out prompts (they
    are the original's, so any run of the same base may share it; greedy, so regenerating is equal).
    ``questions``: a keyword-checked question file (evaluation/eval_questions.py: load_questions).
    ``deadline`` (time.monotonic()): the held-out answers stop there, and each later part (answers,
    questions, each task) starts only before it; what did not start is listed in ``not_measured``."""
    t_start = time.perf_counter()
    manifest, tok, model, original = _load_models(model_arg)
    D.check_disjoint()

    # held-out text: pydoc of held-out modules + the original's answers to held-out prompts
    eos = model.cfg.eos_token_ids[0]
    srcs = {"pydoc": D.encode_docs(tok, D.stdlib_texts(D.STDLIB_HELDOUT), eos)}
    chat = D.self_records(original, tok, D.HELDOUT_PROMPTS, Path(heldout_chat) if heldout_chat else None,
                          160, log, deadline=deadline)
    srcs["chat"] = D.encode_docs(tok, chat, eos)
    if srcs["chat"].numel() < 2:
        del srcs["chat"]
    per_src = {}
    not_measured: list[str] = []

    def in_time(part: str) -> bool:
        if deadline is None or time.monotonic() < deadline:
            return True
        not_measured.append(part)
        log(f"{part}: not measured (the deadline passed)")
        return False

    for name, stream in srcs.items():
        budget = heldout_tokens if name == "pydoc" else heldout_tokens // 4
        w = make_windows(stream, seq_len if stream.numel() >= seq_len else stream.numel(), budget)
        per_src[name] = (w, heldout_pass(model, w),
                         heldout_pass(original, w) if original is not model else None)
        log(f"held-out {name}: {w.numel()} tokens")

    results, orig = _score_heldout(model, original, per_src)

    if answers and in_time("answers"):
        _answer_questions(model, original, tok, results, orig, max_tokens)
    else:  # not measured: None, never a zero that reads like a result
        for r in results + [orig]:
            r.fixed_correct, r.agree_first_sentence = None, None
    if questions and in_time("questions"):
        _keyword_questions(model, original, tok, results, orig, Q.load_questions(questions),
                           max(max_tokens, 40))
    top = results[-1].ppl["all"]
    task_res: dict = {}
    for name in tasks or []:
        if in_time(name):
            task_res.update(_score_tasks(model, original, tok, [name]))
    return {
        "tasks": task_res,
        "model": model_arg, "family": manifest.family, "precipitated": manifest.precipitated,
        "weights": manifest.weights, "seq_len": seq_len,
        "heldout": {name: {"tokens": int(w.numel()),
                           "what": ("pydoc of " + ", ".join(D.STDLIB_HELDOUT)) if name == "pydoc" else
                           "the original model's greedy answers to held-out prompts: "
                           + " | ".join(D.HELDOUT_PROMPTS)}
                    for name, (w, _, _) in per_src.items()},
        "questions": D.EVAL_QUESTIONS, "questions_large": D.EVAL_QUESTIONS_LARGE,
        "questions_file": str(questions) if questions else None,
        "max_tokens": max_tokens,
        "tiers": [asdict(r) for r in results], "original": asdict(orig),
        "ratios": {"ppl_vs_top": [r.ppl["all"] / top for r in results],
                   "top_vs_original": top / orig.ppl["all"]},
        "seconds": round(time.perf_counter() - t_start, 1), "not_measured": not_measured,
    }


def _top_is_original(manifest, mdir: Path) -> bool:
    """An ``exit`` weights file without the top tier's norm leaves the top tier the base model bit for
    bit (worker/checkpoint.py: exit files hold exit norms and blocks only): no second copy to score."""
    if manifest.weights.get("kind") != "exit":
        return False
    from safetensors import safe_open  # noqa: PLC0415
    with safe_open(str(mdir / manifest.weights["file"]), "pt") as f:
        return f"exit_norms.{len(manifest.tiers) - 1}" not in set(f.keys())


def _answer_questions(model: NestedModel, original: NestedModel, tok, results: list[TierResult],
                      orig: TierResult, max_tokens: int) -> None:
    """Greedy answers (engine) to the fixed and the larger question sets, judged (eval_questions.py)."""
    nt = model.num_segments
    answers = answer_all(model, tok, D.EVAL_QUESTIONS, max_tokens)
    large = answer_all(model, tok, D.EVAL_QUESTIONS_LARGE, max(max_tokens, 32))
    for t in range(nt):
        results[t].answers = answers[t]
        results[t].answers_large = large[t]
        results[t].agree_first_sentence = Q.agree_first_sentence(large[t], large[-1])
    orig.answers = answer_all(original, tok, D.EVAL_QUESTIONS, max_tokens,
                              [original.num_segments - 1])[0] if original is not model else answers[-1]
    orig.agree_first_sentence = 1.0
    for r in results + [orig]:
        r.fixed_correct = sum(Q.correct(i, a) for i, a in enumerate(r.answers))


def _keyword_questions(model: NestedModel, original: NestedModel, tok, results: list[TierResult],
                       orig: TierResult, questions: list[tuple[str, tuple[str, ...]]], max_tokens: int) -> None:
    """Greedy answers to a keyword-checked question file, per tier and for the original."""
    qs = [q for q, _ in questions]
    answers = answer_all(model, tok, qs, max_tokens)
    if original is not model:
        answers.append(answer_all(original, tok, qs, max_tokens, [original.num_segments - 1])[0])
    else:
        answers.append(answers[-1])
    ok = [[Q.has_keyword(a, k) for a, (_, k) in zip(tier, questions)] for tier in answers]
    for r, tier, good in zip(results + [orig], answers, ok):
        r.answers_questions = tier
        r.questions_correct = sum(good)
        r.questions_share_of_top = Q.answered_share(good, ok[len(results) - 1])


def _score_tasks(model: NestedModel, original: NestedModel, tok, tasks: list[str]) -> dict:
    from evaluation import mc_tasks  # noqa: PLC0415
    res = mc_tasks.score_tasks(model, tok, tasks)
    orig = res if original is model else mc_tasks.score_tasks(original, tok, tasks)
    for name in tasks:
        res[name]["original"] = orig[name]["acc"][-1]
    return res


def format_table(res: dict) -> str:
    srcs = list(res["heldout"])
    tasks = list(res.get("tasks") or {})
    head = ["model", "tier", "layers"] + [f"ppl {s}" for s in srcs] + [
        "ppl all", "ppl / top", "agree top", "agree orig", "fixed correct", "1st sentence = top"] + [
        f"acc {t} ({res['tasks'][t]['items']})" for t in tasks] + (
        ["questions right", "of top's answered"] if res.get("questions_file") else []) + [res["questions"][0]]
    rows = []
    top = res["tiers"][-1]["ppl"]["all"]
    for i, r in enumerate(res["tiers"] + [res["original"]]):
        accs = [res["tasks"][t]["acc"][i] if i < len(res["tiers"]) else res["tasks"][t]["original"]
                for t in tasks]
        rows.append([res["model"], r["name"], str(r["layers"])] + [f"{r['ppl'][s]:.4g}" for s in srcs] +
                    [f"{r['ppl']['all']:.4g}", f"{r['ppl']['all'] / top:.2f}x", f"{r['agree_top']:.3f}",
                     f"{r['agree_original']:.3f}",
                     "not measured" if r["fixed_correct"] is None else f"{r['fixed_correct']}/6",
                     "not measured" if r["agree_first_sentence"] is None else f"{r['agree_first_sentence']:.0%}"]
                    + [f"{a:.3f}" for a in accs] + (_question_cells(r) if res.get("questions_file") else []) +
                    [r["answers"][0][:60].replace("\n", " ").replace("|", "/") if r["answers"] else ""])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def _question_cells(r: dict) -> list[str]:
    n = len(r["answers_questions"])
    share = r["questions_share_of_top"]
    return [f"{r['questions_correct']}/{n}", "-" if share is None else f"{share:.0%}"]


def plot(res: dict, path: str | Path) -> None:
    import matplotlib  # noqa: PLC0415
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415
    tiers = res["tiers"]
    names = [f"{t['name']}\n({t['layers']} layers)" for t in tiers] + ["original\n(top)"]
    ppl = [t["ppl"]["all"] for t in tiers] + [res["original"]["ppl"]["all"]]
    agree = [t["agree_original"] for t in tiers] + [1.0]
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(10, 4))
    a1.bar(names, ppl, color=["C0"] * len(tiers) + ["C7"])
    a1.set_yscale("log")
    a1.set_ylabel("held-out perplexity (log)")
    a1.set_title(f"{res['model']}: perplexity per tier")
    for i, v in enumerate(ppl):
        a1.text(i, v, f"{v:.3g}", ha="center", va="bottom", fontsize=8)
    a2.bar(names, agree, color=["C1"] * len(tiers) + ["C7"])
    a2.set_ylim(0, 1.05)
    a2.set_ylabel("greedy top-1 agreement with the original top tier")
    a2.set_title("agreement")
    save_figure(fig, path, dpi=100)


def run(args) -> int:
    torch.set_num_threads(args.threads)
    tasks = [t for t in (args.tasks or "").split(",") if t]
    if args.skip_answers and args.record_quality:
        raise ValueError("--record-quality needs the answers: drop --skip-answers")
    runs = [evaluate(m, args.seq_len, args.heldout_tokens, args.max_tokens, tasks=tasks,
                     heldout_chat=args.heldout_chat, answers=not args.skip_answers,
                     questions=args.questions)
            for m in args.model or ["default"]]
    table = [format_table(r).splitlines() for r in runs]
    print("\n".join(table[0] + [line for t in table[1:] for line in t[2:]]))
    for res in runs:
        print(f"\n{res['model']}: top / original perplexity {res['ratios']['top_vs_original']:.3f}; "
              f"tiers / top: {', '.join(f'{x:.3g}' for x in res['ratios']['ppl_vs_top'])}")
        for i, q in enumerate(res["questions"] if res["original"]["answers"] else []):
            print(f"Q: {q}")
            for r in res["tiers"] + [res["original"]]:
                print(f"  {r['name']:>8}: {r['answers'][i][:100]!r}")
    out = runs[0] if len(runs) == 1 else {"runs": runs}
    if args.json:
        write_json(args.json, out)
    if args.plot:
        plot(runs[0], args.plot) if len(runs) == 1 else plot_compare(runs, args.plot)
    if args.record_quality:
        for res in runs:
            print(f"quality recorded in {record_quality(res)}/mfs.json")
    return 0


def record_quality(res: dict) -> Path:
    """Writes an evaluation's per-tier figures into the evaluated checkpoint's manifest (``quality``):
    held-out perplexity / top, greedy agreement, the larger question set's first-sentence agreement,
    the fixed questions answered correctly and (with ``--questions``) the share of the top tier's
    answered questions answered too. The family id's routing reads them (quality floor)."""
    from family.manifest import DEFAULT_FLOOR, Manifest  # noqa: PLC0415
    if res["model"] == "default-raw":
        raise ValueError("default-raw has no checkpoint of its own to record quality in")
    manifest, mdir = manifest_for(res["model"])
    if mdir is None:
        raise ValueError(f"{res['model']} is not a nested checkpoint directory: nothing to record into")
    top = res["tiers"][-1]["ppl"]["all"]
    q = dict(manifest.quality or {})
    q.setdefault("floor", dict(DEFAULT_FLOOR))
    for t in res["tiers"][:-1]:
        q[t["name"]] = {"ppl_vs_top": round(t["ppl"]["all"] / top, 3), "agree_top": round(t["agree_top"], 3),
                        "answer_agree": round(t["agree_first_sentence"], 3),
                        "fixed_correct": t["fixed_correct"]}
        if t.get("questions_share_of_top") is not None:  # --questions: the keyword-checked answers
            q[t["name"]]["answers_of_top"] = round(t["questions_share_of_top"], 3)
    raw = Manifest.read(mdir)
    raw.quality = q
    raw.write(mdir)
    return mdir


def plot_compare(runs: list[dict], path: str | Path) -> None:
    """Side by side: per model and tier, held-out perplexity / top (log), greedy agreement with the
    top tier, and first-sentence agreement on the larger question set."""
    import matplotlib  # noqa: PLC0415
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    names = [t["name"] for t in runs[0]["tiers"]]
    width = 0.8 / len(runs)
    metrics = [("held-out perplexity / top tier (log)", lambda r, t: t["ppl"]["all"] / r["tiers"][-1]["ppl"]["all"]),
               ("greedy top-1 agreement with the top tier", lambda r, t: t["agree_top"]),
               ("first sentence = top tier's (44 questions)", lambda r, t: t["agree_first_sentence"])]
    for ax, (title, f) in zip(axes, metrics):
        for k, r in enumerate(runs):
            vals = [f(r, t) for t in r["tiers"]]
            xs = [i + (k - (len(runs) - 1) / 2) * width for i in range(len(vals))]
            ax.bar(xs, vals, width, label=r["model"])
            for x, v in zip(xs, vals):
                ax.text(x, v, f"{v:.2g}", ha="center", va="bottom", fontsize=7)
        ax.set_xticks(range(len(names)), names)
        ax.set_title(title, fontsize=9)
        if "log" in title:
            ax.set_yscale("log")
        else:
            ax.set_ylim(0, 1.1)
    axes[0].legend(fontsize=7)
    save_figure(fig, path, dpi=100)


def add_parser(sub) -> None:
    p = sub.add_parser("eval", help="per-tier perplexity, agreement and answers of a nested model",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", action="append", default=None,
                   help="nested checkpoint dir, default, default-raw, default-lora, ...; repeat it to "
                        "compare models side by side (default: default)")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("--plot", default=None, help="write a PNG plot here")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--heldout-tokens", type=int, default=8192, help="pydoc tokens (chat: a quarter)")
    p.add_argument("--max-tokens", type=int, default=24, help="answer length")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--tasks", default=None,
                   help="comma list of local multiple-choice tasks scored per tier (evals/: capitals, "
                        "stdlib_modules, unicode_names; evaluation/mc_tasks.py), e.g. "
                        "capitals,stdlib_modules,unicode_names")
    p.add_argument("--heldout-chat", default=None, metavar="JSONL",
                   help="cache of the original's answers to the held-out prompts (written if missing)")
    p.add_argument("--questions", default=None, metavar="JSONL",
                   help="keyword-checked questions (question, keywords), e.g. "
                        "evals/questions/chat_keywords.jsonl: per tier, the answers with a keyword and the "
                        "share of the top tier's answered questions it answers too")
    p.add_argument("--skip-answers", action="store_true",
                   help="no generated answers (fixed and larger question sets): perplexity, agreement "
                        "and --tasks only, forward passes alone")
    p.add_argument("--record-quality", action="store_true",
                   help="write each tier's figures into the evaluated checkpoint's mfs.json (the "
                        "quality floor of the family id's routing reads them)")
    p.set_defaults(func=run)
