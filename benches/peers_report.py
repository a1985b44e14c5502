"""`mfs bench peers`' rounds merged, its ratios against llama.cpp and the bandwidth floor, its tables
(terminal and markdown) and its plot."""
from __future__ import annotations

import json
import statistics


RUN_SECTIONS = ("single", "concurrent", "family_mix")
RUN_FIGURES = ("tokens_per_s", "tpot_ms", "ttft_ms", "wall_s")


def merge_rounds(runs: list[dict]) -> dict:
    """One contender's rounds -> its record: each timed figure (and the long prompt's time to first
    token) the median over rounds, memory the largest, and every round's tokens/s and TPOT under
    ``rounds``."""
    out = json.loads(json.dumps(runs[0]))
    if len(runs) == 1:
        return out
    for sec in RUN_SECTIONS:
        if sec in out:
            for f in RUN_FIGURES:
                out[sec][f] = statistics.median(r[sec][f] for r in runs)
    if "long_prompt" in out:
        out["long_prompt"]["ttft_ms"] = statistics.median(r["long_prompt"]["ttft_ms"] for r in runs)
    for k in ("rss_bytes", "peak_rss_bytes", "worker_rss_bytes"):
        if k in out:
            out[k] = max(r[k] for r in runs)
    out["rounds"] = [{sec: {f: r[sec][f] for f in ("tokens_per_s", "tpot_ms")} for sec in RUN_SECTIONS if sec in r}
                     for r in runs]
    return out


def _median_of(values: list[float]) -> float | None:
    return round(statistics.median(values), 3) if values else None


def served_rss(r: dict) -> int:
    """The memory a contender's model costs: the api's workers (not its Redis, scheduler and gateway);
    llama.cpp's child less what it held before loading (the interpreter and the bench's torch); else the
    contender's process."""
    return r.get("worker_rss_bytes") or r.get("model_rss_bytes") or r["rss_bytes"]


def ratios_vs_llama_cpp(rounds: list[list[dict]]) -> dict:
    """Per MFS contender, against llama.cpp in the same round, every round's and the median: its single
    request's tokens/s and its concurrent and family-mix tokens/s over llama.cpp's single request; with
    a long prompt, its time to first token over llama.cpp's; its model's resident memory over
    llama.cpp's. Empty without llama.cpp."""
    out = {}
    for i, res in enumerate(rounds[0]):
        if not res["name"].startswith("mfs"):
            continue
        got: dict[str, list[float]] = {"single": [], "concurrent": [], "family_mix": [], "ttft_long": [], "memory": []}
        for rnd in rounds:
            ref = next((r for r in rnd if r["name"].startswith("llama.cpp")), None)
            if ref is None:
                return {}
            me, base = rnd[i], ref["single"]["tokens_per_s"]
            for sec in ("single", "concurrent", "family_mix"):
                if sec in me:
                    got[sec].append(me[sec]["tokens_per_s"] / base)
            if "long_prompt" in me and "long_prompt" in ref:
                got["ttft_long"].append(me["long_prompt"]["ttft_ms"] / ref["long_prompt"]["ttft_ms"])
            got["memory"].append(served_rss(me) / served_rss(ref))
        out[res["name"]] = {k: [round(x, 3) for x in v] for k, v in got.items()}
        out[res["name"]].update({f"{k}_median": _median_of(v) for k, v in got.items()})
    return out


def vs_floor(out: dict) -> dict:
    """Each contender's single-request tokens/s over the bandwidth floor's (None without a floor)."""
    fl = out.get("floor")
    if not fl:
        return {}
    return {r["name"]: round(r["single"]["tokens_per_s"] / fl["floor_tokens_per_s"], 3) for r in out["results"]}


def _fmt(x: float | None, spec: str = ".1f") -> str:
    return "-" if x is None else format(x, spec)


def print_table(out: dict) -> None:
    c = out["concurrency"]
    print(f"\n{'':<30}{'1 req tok/s':>12}{'TPOT ms':>9}{f'{c} req tok/s':>13}{'TPOT ms':>9}"
          f"{'mix tok/s':>11}{'TTFT long ms':>13}{'RSS MB':>8}{'model MB':>9}{'weights MB':>11}{'ppl top':>14}")
    for r in out["results"]:
        conc = r.get("concurrent", {})
        weights = f"{r['weights_bytes'] / 1e6:.0f}" if r.get("weights_bytes") else "-"  # api: not one file
        print(f"{r['name']:<30}{r['single']['tokens_per_s']:>12.1f}{r['single']['tpot_ms']:>9.1f}"
              f"{_fmt(conc.get('tokens_per_s')):>13}{_fmt(conc.get('tpot_ms')):>9}"
              f"{_fmt(r.get('family_mix', {}).get('tokens_per_s')):>11}"
              f"{_fmt(r.get('long_prompt', {}).get('ttft_ms'), '.0f'):>13}{r['rss_bytes'] / 2**20:>8.0f}"
              f"{served_rss(r) / 2**20:>9.0f}{weights:>11}{r['ppl_top']:>14.3f}")
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
        print(f"{name} / llama.cpp 1 request: single {_fmt(r['single_median'], '.2f')}x (rounds "
              f"{', '.join(f'{x:.2f}' for x in r['single'])}); {c} requests {_fmt(r['concurrent_median'], '.2f')}x; "
              f"family mix {_fmt(r['family_mix_median'], '.2f')}x; TTFT long {_fmt(r['ttft_long_median'], '.2f')}x; "
              f"model memory {_fmt(r['memory_median'], '.2f')}x")
    fl = out.get("floor")
    if fl:
        print(f"bandwidth {fl['bandwidth_gbs']:.1f} GB/s, {fl['bytes_per_token'] / 1e6:.0f} MB a token: floor "
              f"{fl['floor_tokens_per_s']:.1f} tok/s; 1 request / floor: "
              + ", ".join(f"{k} {v:.2f}" for k, v in vs_floor(out).items()))
    m = out["machine"]
    print(f"{m.get('cpu', '')}, {m['threads']} threads; load {m.get('load_start')} at start, {m.get('load_end')} at end")
    for n in out["notes"]:
        print(n)


def markdown(out: dict) -> str:
    """The results as a markdown table, with the machine, the load and the floor above it."""
    c, m, fl = out["concurrency"], out["machine"], out.get("floor")
    ratios, floor = out.get("vs_llama_cpp", {}), vs_floor(out)
    lines = [f"`{out['model']}`, {m.get('cpu', '')} ({m['cpu_capability']}), {m['threads']} threads, {out['date']}; "
             f"load (1, 5, 15 min) {m.get('load_start')} at start, {m.get('load_end')} at end.", ""]
    if fl:
        lines += [f"Bandwidth floor: {fl['bandwidth_gbs']:.1f} GB/s (probes {', '.join(f'{x:.1f}' for x in fl['bandwidth_probes_gbs'])}) "
                  f"/ {fl['bytes_per_token'] / 1e6:.0f} MB read a token = {fl['floor_tokens_per_s']:.1f} tok/s.", ""]
    lines += [f"| contender | 1 stream tok/s | ÷ floor | ÷ llama.cpp | {c} streams tok/s | ÷ llama.cpp 1 stream "
              f"| TTFT {out.get('long_prompt') or '-'} tok ms | ÷ llama.cpp | model RSS MB | ÷ llama.cpp | load before / after |",
              "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in out["results"]:
        q = ratios.get(r["name"], {})
        lines.append("| " + " | ".join([
            r["name"], _fmt(r["single"]["tokens_per_s"]), _fmt(floor.get(r["name"]), ".2f"),
            _fmt(q.get("single_median"), ".2f"), _fmt(r.get("concurrent", {}).get("tokens_per_s")),
            _fmt(q.get("concurrent_median"), ".2f"), _fmt(r.get("long_prompt", {}).get("ttft_ms"), ".0f"),
            _fmt(q.get("ttft_long_median"), ".2f"), f"{served_rss(r) / 2**20:.0f}", _fmt(q.get("memory_median"), ".2f"),
            f"{r.get('load_before', ['-'])[0]} / {r.get('load_after', ['-'])[0]}"]) + " |")
    return "\n".join(lines + [""] + [f"- {n}" for n in out["notes"]]) + "\n"


def plot(out: dict, path: str) -> None:
    import matplotlib  # noqa: PLC0415
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415
    rs = out["results"]
    names = [r["name"].replace("transformers generate", "HF generate") for r in rs]
    panels = [("1 request, tokens/s", [r["single"]["tokens_per_s"] for r in rs]),
              (f"{out['concurrency']} concurrent, tokens/s", [r.get("concurrent", {}).get("tokens_per_s", 0) for r in rs]),
              ("model resident memory, MB", [served_rss(r) / 2**20 for r in rs]),
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
