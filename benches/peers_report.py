"""`mfs bench peers`' rounds merged, its ratios against llama.cpp, its table and its plot."""
from __future__ import annotations

import json
import statistics


RUN_SECTIONS = ("single", "concurrent", "family_mix")
RUN_FIGURES = ("tokens_per_s", "tpot_ms", "ttft_ms", "wall_s")


def merge_rounds(runs: list[dict]) -> dict:
    """One contender's rounds -> its record: each timed figure the median over rounds, memory the
    largest, and every round's tokens/s and TPOT under ``rounds``."""
    out = json.loads(json.dumps(runs[0]))
    if len(runs) == 1:
        return out
    for sec in RUN_SECTIONS:
        if sec in out:
            for f in RUN_FIGURES:
                out[sec][f] = statistics.median(r[sec][f] for r in runs)
    for k in ("rss_bytes", "peak_rss_bytes"):
        if k in out:
            out[k] = max(r[k] for r in runs)
    out["rounds"] = [{sec: {f: r[sec][f] for f in ("tokens_per_s", "tpot_ms")} for sec in RUN_SECTIONS if sec in r}
                     for r in runs]
    return out


def ratios_vs_llama_cpp(rounds: list[list[dict]]) -> dict:
    """Per MFS contender: its single-request (and family-mix) tokens/s over llama.cpp's single request
    in the same round, every round's and the median. Empty without llama.cpp."""
    out = {}
    for i, res in enumerate(rounds[0]):
        if not res["name"].startswith("mfs"):
            continue
        single, mix = [], []
        for rnd in rounds:
            ref = next((r for r in rnd if r["name"].startswith("llama.cpp")), None)
            if ref is None:
                return {}
            base = ref["single"]["tokens_per_s"]
            single.append(rnd[i]["single"]["tokens_per_s"] / base)
            if "family_mix" in rnd[i]:
                mix.append(rnd[i]["family_mix"]["tokens_per_s"] / base)
        out[res["name"]] = {"single": [round(x, 3) for x in single], "single_median": round(statistics.median(single), 3),
                            "family_mix": [round(x, 3) for x in mix],
                            "family_mix_median": round(statistics.median(mix), 3) if mix else None}
    return out


def print_table(out: dict) -> None:
    c = out["concurrency"]
    print(f"\n{'':<30}{'1 req tok/s':>12}{'TPOT ms':>9}{f'{c} req tok/s':>13}{'TPOT ms':>9}"
          f"{'mix tok/s':>11}{'RSS MB':>8}{'weights MB':>11}{'ppl top':>9}")
    for r in out["results"]:
        mix = r.get("family_mix", {}).get("tokens_per_s")
        weights = f"{r['weights_bytes'] / 1e6:.0f}" if r.get("weights_bytes") else "-"  # api: not one file
        print(f"{r['name']:<30}{r['single']['tokens_per_s']:>12.1f}{r['single']['tpot_ms']:>9.1f}"
              f"{r['concurrent']['tokens_per_s']:>13.1f}{r['concurrent']['tpot_ms']:>9.1f}"
              f"{(f'{mix:.1f}' if mix else '-'):>11}{r['rss_bytes'] / 2**20:>8.0f}"
              f"{weights:>11}"
              f"{r['ppl_top']:>9.3f}")
        if "first_token_after_launch_s" in r:
            print(f"{'':<30}first token {r['first_token_after_launch_s']:.1f} s after `mfs up` was launched; "
                  f"served as {r['first_answer_mfs']} first, {r['last_answer_mfs']} last")
            if r.get("compiled_after_launch_s") is not None:
                full = r.get("compiled_all_after_launch_s")
                print(f"{'':<30}compiled decode in use {r['compiled_after_launch_s']:.1f} s after launch (top "
                      f"tier), every tier's {'-' if full is None else f'{full:.1f} s'} (the timed runs waited)")
    if out.get("repeats", 1) > 1:
        print(f"(medians over {out['repeats']} rounds)")
    for name, r in out.get("vs_llama_cpp", {}).items():
        print(f"{name} / llama.cpp, 1 request: {r['single_median']:.2f}x (rounds "
              f"{', '.join(f'{x:.2f}' for x in r['single'])})"
              + (f"; family mix / llama.cpp 1 request: {r['family_mix_median']:.2f}x" if r["family_mix"] else ""))
    for n in out["notes"]:
        print(n)


def plot(out: dict, path: str) -> None:
    import matplotlib  # noqa: PLC0415
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415
    rs = out["results"]
    names = [r["name"].replace("transformers generate", "HF generate") for r in rs]
    panels = [("1 request, tokens/s", [r["single"]["tokens_per_s"] for r in rs]),
              (f"{out['concurrency']} concurrent, tokens/s", [r["concurrent"]["tokens_per_s"] for r in rs]),
              ("resident memory, MB", [r["rss_bytes"] / 2**20 for r in rs]),
              ("held-out perplexity, top tier", [r["ppl_top"] for r in rs])]
    fig, axes = plt.subplots(1, 4, figsize=(15, 3.8))
    for ax, (title, vals) in zip(axes, panels):
        ax.bar(range(len(vals)), vals, color=["#2a7" if n.startswith("mfs") else "#999" for n in names])
        ax.set_xticks(range(len(vals)), names, rotation=30, ha="right", fontsize=8)
        ax.set_title(title, fontsize=10)
        for x, v in enumerate(vals):
            ax.text(x, v, f"{v:.1f}" if v < 1000 else f"{v:.0f}", ha="center", va="bottom", fontsize=8)
    fig.suptitle(f"mfs bench peers — {out['model']}, prompt {out['prompt_len']}, {out['new_tokens']} new "
                 f"tokens, {out['machine']['threads']} threads"
                 + (f" (medians of {out['repeats']} rounds)" if out.get("repeats", 1) > 1 else ""))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
