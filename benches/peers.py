"""`mfs bench peers`: what `mfs up` serves by default, through its HTTP API (the contender ``api``,
benches/peers_api.py), and MFS in-process in each ``--weights`` mode, side by side with
``transformers`` generate and llama.cpp (``llama-cpp-python``, checked and if need be rebuilt by
benches/llama_build.py) — same machine, same prompts, same token counts, one run. Per contender: a
single request and ``--concurrency`` concurrent ones (MFS also the family mix), tokens/s, TPOT,
resident memory, the top tier's held-out perplexity and, with ``--long-prompt N``, the time to first
token of one N-token prompt. On a GGUF (``--model FILE``, or a file ``--make-synthetic`` makes:
benches/peers_synth.py) the machine's streaming-read bandwidth, probed before and after, gives the
single stream's floor (benches/peers_floor.py); the CPU and the load are recorded with every figure.

Each contender runs in its own child process, one after another: resident memory is its own, and no
two ever compete for the cores. This machine's speed drifts by ±10–20 % from one minute to the next, so
``--repeats N`` runs every contender N times in rounds (each round all of them, in order) and reports
each figure's median over the rounds, every round's figures, and the ratios against llama.cpp taken
within each round (neighbours in time) with their median.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path

import torch

from benches import peers_synth
from benches.peers_common import Spec, perplexity, rss
from benches.peers_floor import bandwidth_gbs, bytes_per_token, cpu_name, floor_record, load_avg
from benches.peers_report import markdown, merge_rounds, plot, print_table, ratios_vs_llama_cpp
from engine.runtime import write_json
from worker.memory import release_memory


def _engine(model, n: int):
    """One engine per run, all alike: a compiled graph is specialized to the KV pool it was built on."""
    from engine import Engine  # noqa: PLC0415
    return Engine(model, max_num_seqs=max(64, n), num_blocks=1024)


def _engine_run(model, prompts, tiers, new: int) -> dict:
    from worker.sampling import SamplingParams  # noqa: PLC0415
    eng = _engine(model, len(prompts))
    t0 = time.perf_counter()
    for i, (p, t) in enumerate(zip(prompts, tiers)):
        eng.add_request(f"r{i}", p, t, SamplingParams(max_tokens=new, ignore_eos=True))
    first, last, n = {}, {}, {}
    while eng.has_unfinished():
        for o in eng.step():
            now = time.perf_counter()
            first.setdefault(o.request_id, now)
            last[o.request_id], n[o.request_id] = now, o.num_output_tokens
    wall = time.perf_counter() - t0
    tpot = [(last[r] - first[r]) / (n[r] - 1) for r in n if n[r] > 1]
    return {"requests": len(prompts), "tokens": sum(n.values()), "wall_s": wall,
            "tokens_per_s": sum(n.values()) / wall, "tpot_ms": 1e3 * sum(tpot) / len(tpot),
            "ttft_ms": 1e3 * (sum(first.values()) / len(first) - t0)}


def run_mfs(spec: Spec, mode: str) -> dict:
    from worker.execution import compile_decode  # noqa: PLC0415
    from worker.family import load_family  # noqa: PLC0415
    from worker.model import weight_bytes  # noqa: PLC0415
    weights, compiled = mode.removesuffix("+compile"), mode.endswith("+compile")
    t0 = time.perf_counter()
    fam = load_family(spec.model, weights=weights, device=spec.device)
    model = fam.model
    load_s = time.perf_counter() - t0
    release_memory()  # freed memory returned before the contender's memory is read
    mem = rss(spec.device)
    warm_s = None
    if compiled:  # the graphs are built as a serving worker builds them, before anything is timed
        compile_decode(model)
        warm_s = _engine(model, len(spec.prompts)).runner.warm_up()
    top = len(model.tiers) - 1
    n = len(spec.prompts)
    res = {"name": f"mfs {mode}", "load_s": load_s, "compile_warmup_s": warm_s, "weights_bytes": weight_bytes(model),
           "single": _engine_run(model, spec.prompts[:1], [top], spec.new_tokens),
           "concurrent": _engine_run(model, spec.prompts, [top] * n, spec.new_tokens),
           "family_mix": _engine_run(model, spec.prompts, spec.mix, spec.new_tokens)}
    if spec.long_prompt:
        run = _engine_run(model, [spec.long_prompt], [top], 2)
        res["long_prompt"] = {"prompt_tokens": len(spec.long_prompt), "ttft_ms": run["ttft_ms"]}
    res["ppl_top"] = perplexity(lambda ids: model.logits(model.exit_hidden(ids.to(spec.device))[-1]), spec.windows)
    res["rss_after_load_bytes"] = mem["rss_bytes"]
    res.update(rss(spec.device))  # resident while serving: every weight page touched by now
    return res


def run_hf(spec: Spec) -> dict:
    from transformers import AutoModelForCausalLM  # noqa: PLC0415
    from family.manifest import manifest_for, resolve_base  # noqa: PLC0415
    from family.source import resolve_cached  # noqa: PLC0415
    manifest, mdir = manifest_for(spec.model)
    if manifest.weights:
        raise ValueError("transformers serves the base weights: compare with --model default-raw")
    folder, gguf = resolve_cached(resolve_base(manifest.base, mdir))
    t0 = time.perf_counter()
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32,
                                              **({"gguf_file": gguf} if gguf else {})).eval().to(spec.device)
    load_s = time.perf_counter() - t0
    release_memory()  # freed memory returned before the contender's memory is read
    mem = rss(spec.device)
    pad = hf.generation_config.eos_token_id
    pad = pad[0] if isinstance(pad, list) else pad

    def gen(prompts, new):
        L = max(map(len, prompts))
        ids = torch.tensor([[pad] * (L - len(p)) + p for p in prompts], device=spec.device)
        mask = torch.tensor([[0] * (L - len(p)) + [1] * len(p) for p in prompts], device=spec.device)
        t = time.perf_counter()
        with torch.inference_mode():
            out = hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new,
                              do_sample=False, pad_token_id=pad)
        out.cpu()  # waits for the device
        return time.perf_counter() - t

    def measure(prompts):
        ttft, wall = gen(prompts, 1), gen(prompts, spec.new_tokens)
        tok = spec.new_tokens * len(prompts)
        return {"requests": len(prompts), "tokens": tok, "wall_s": wall, "tokens_per_s": tok / wall,
                "tpot_ms": 1e3 * (wall - ttft) / (spec.new_tokens - 1), "ttft_ms": 1e3 * ttft}

    res = {"name": "transformers generate fp32", "load_s": load_s,
           "weights_bytes": sum(p.numel() * p.element_size() for p in hf.parameters()),
           "single": measure(spec.prompts[:1]), "concurrent": measure(spec.prompts),
           "ppl_top": perplexity(lambda ids: hf(ids.to(spec.device)).logits, spec.windows)}
    if spec.long_prompt:
        res["long_prompt"] = {"prompt_tokens": len(spec.long_prompt), "ttft_ms": 1e3 * gen([spec.long_prompt], 1)}
    res["rss_after_load_bytes"] = mem["rss_bytes"]
    res.update(rss(spec.device))  # resident while serving: every weight page touched by now
    return res


def child_main(argv: list[str]) -> int:
    kind, mode, spec_path, out_path = argv
    spec = Spec(**json.loads(Path(spec_path).read_text()))
    torch.set_num_threads(spec.threads)
    if kind == "api":
        from benches.peers_api import run_api  # noqa: PLC0415
        res = run_api(spec)
    else:
        from benches.peers_llama import run_llama_cpp  # noqa: PLC0415
        res = run_mfs(spec, mode) if kind == "mfs" else run_hf(spec) if kind == "hf" else run_llama_cpp(spec)
    res["threads"] = torch.get_num_threads()
    Path(out_path).write_text(json.dumps(res, indent=2))
    return 0


# ---- the parent ----------------------------------------------------------------------------------
def make_spec(args) -> Spec:
    from training import data as D  # noqa: PLC0415
    from training.data import make_windows  # noqa: PLC0415
    from family.manifest import load_frontend, manifest_for, resolve_base  # noqa: PLC0415
    fe = load_frontend(args.model)
    tok = fe.tokenizer
    manifest, mdir = manifest_for(args.model)
    base = str(resolve_base(manifest.base, mdir))
    eos = tok.eos_token_id
    stream = D.encode_docs(tok, D.stdlib_texts(D.STDLIB_HELDOUT), eos)
    windows = make_windows(stream, args.seq_len, args.heldout_tokens)
    # Prompts: real text from held-in modules' pydoc, a different stretch per request.
    text = D.encode_docs(tok, D.stdlib_texts(["json", "random"]), eos)
    n, L = args.concurrency, args.prompt_len
    prompts = [text[i * L:(i + 1) * L].tolist() for i in range(n)]
    long_prompt = text[n * L:n * L + args.long_prompt].tolist()  # shares no prefix with the others
    if len(long_prompt) < args.long_prompt:
        raise ValueError(f"--long-prompt {args.long_prompt}: the prompt text holds {len(text) - n * L} tokens "
                         f"after the {n} short prompts")
    counts = [int(x) for x in args.mix.split(",")]
    if sum(counts) != n or len(counts) != len(manifest.tiers):
        raise ValueError(f"--mix {args.mix}: one count per tier ({len(manifest.tiers)}), summing to "
                         f"--concurrency {n}")
    mix = [t for t, c in enumerate(counts) for _ in range(c)]
    return Spec(args.model, args.threads, prompts, mix, args.new_tokens, windows.tolist(),
                base if base.endswith(".gguf") else None, args.device, long_prompt,
                shlex.split(args.up_args), args.llama_cpp_sequential)


def _child(kind: str, mode: str, spec_path: Path, out: Path, log_dir: Path) -> dict:
    load_before = load_avg()
    with open(log_dir / f"{kind}-{mode}.log", "w") as logf:
        r = subprocess.run([sys.executable, "-m", "benches.peers", kind, mode, str(spec_path), str(out)],
                           stdout=logf, stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    if r.returncode != 0:
        tail = (log_dir / f"{kind}-{mode}.log").read_text()[-2000:]
        raise RuntimeError(f"{kind} {mode} failed (exit {r.returncode}):\n{tail}")
    return {**json.loads(out.read_text()), "load_before": load_before, "load_after": load_avg()}


def add_parser(sub) -> None:
    p = sub.add_parser("peers", help="MFS per --weights mode vs transformers generate vs llama.cpp")
    p.add_argument("--model", default=None,
                   help="default-raw (the default): the GGUF as shipped, the weights every contender can serve; "
                        "or a .gguf file, a HF directory, a family checkpoint")
    p.add_argument("--make-synthetic", default=None, metavar="NAME",
                   help=f"make (once, in $MFS_CACHE/peers) and bench a Q4_K_M GGUF: {', '.join(peers_synth.NAMES)} "
                        "(random weights of that Llama shape with SmolLM2's tokenizer; smollm2-q4km: the default "
                        "GGUF requantized); without --json it only makes the file and prints its path")
    p.add_argument("--seed", type=int, default=0, help="--make-synthetic: the random weights' seed")
    p.add_argument("--modes", default="api",
                   help="what MFS contenders to run: 'api' is `mfs up --model M` with its defaults, measured "
                        "through HTTP (gateway -> Redis -> worker); a --weights format (mfs up --help lists them) "
                        "runs in-process; MODE+compile adds the compiled decode segments (CPU), compiled "
                        "in an untimed warm-up")
    p.add_argument("--up-args", default="", help="api: more `mfs up` flags, e.g. '--weights auto --threads 2'")
    p.add_argument("--build-llama-cpp", action="store_true",
                   help="when llama-cpp-python is missing or its build crashes on this CPU, build it here with "
                        "GGML_NATIVE=OFF and AMX off (about 12 minutes on 2 cores)")
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--mix", default="11,3,2", help="family-mix run: requests per tier, lowest first")
    p.add_argument("--long-prompt", type=int, default=0,
                   help="also each contender's time to first token on one prompt of this many tokens (0: not run)")
    p.add_argument("--llama-cpp-sequential", action=argparse.BooleanOptionalAction, default=True,
                   help="llama.cpp's concurrent run, the requests one after another (llama-cpp-python has no "
                        "batch of sequences); --no-llama-cpp-sequential: its single stream is the comparison")
    p.add_argument("--heldout-tokens", type=int, default=2048)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--repeats", type=int, default=1,
                   help="rounds of every contender, one after another; figures are medians over rounds")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N] for MFS and transformers "
                   "(llama-cpp-python as pip builds it is a CPU build: it stays on the CPU)")
    p.add_argument("--json", default=None, help="where the results go (required unless only --make-synthetic)")
    p.add_argument("--markdown", default=None, help="also a markdown table of the results here")
    p.add_argument("--plot", default=None)
    p.set_defaults(func=run)


def _arg_error(args) -> str | None:
    """What is wrong with the flags, before anything is made or run."""
    from worker.formats import FORMATS  # noqa: PLC0415  (the registry: a new format is a mode here too)
    modes = args.modes.split(",")
    bad = [m for m in modes if m != "api" and (m.removesuffix("+compile") not in FORMATS or (
        m.endswith("+compile") and FORMATS[m.removesuffix("+compile")].uncompilable()))]
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        return f"--device {args.device}: CUDA is not available here"
    if not args.device.startswith(("cpu", "cuda")):
        return f"--device {args.device}: expected cpu or cuda[:N]"
    if bad:
        compiled = ", ".join(f for f, fmt in FORMATS.items() if not fmt.uncompilable())
        return f"--modes: unknown {', '.join(bad)} (api; {', '.join(FORMATS)}; +compile after {compiled})"
    if args.repeats < 1:
        return f"--repeats {args.repeats}: at least 1"
    if args.threads < 1:
        return f"--threads {args.threads}: at least 1"
    if args.long_prompt < 0:
        return f"--long-prompt {args.long_prompt}: a token count, or 0 for none"
    if args.up_args and "api" not in modes:
        return "--up-args: flags for `mfs up`, which only --modes api starts"
    if args.make_synthetic is not None:
        if args.model is not None:
            return "--make-synthetic makes the model: give it or --model, not both"
        if args.make_synthetic not in peers_synth.NAMES:
            return f"--make-synthetic {args.make_synthetic!r}: expected one of {', '.join(peers_synth.NAMES)}"
    elif args.json is None:
        return "--json is required (only --make-synthetic without it makes a file and stops)"
    return None


def _make_model(args, llama_build) -> str:
    """--make-synthetic's file, made here (llama.cpp's quantizer first built where allowed and missing)."""
    if not llama_build.installed():
        if not args.build_llama_cpp:
            raise RuntimeError("--make-synthetic quantizes with llama.cpp's quantizer: llama-cpp-python is not "
                               "installed; add --build-llama-cpp to build it here")
        llama_build.build(say=lambda m: print(m, flush=True))
    return str(peers_synth.make(args.make_synthetic, args.threads, args.seed))


def run(args) -> int:
    import tempfile  # noqa: PLC0415

    from benches import llama_build  # noqa: PLC0415
    err = _arg_error(args)
    if err:
        print(err, file=sys.stderr)
        return 2
    if args.make_synthetic:
        try:
            args.model = _make_model(args, llama_build)
        except RuntimeError as e:
            print(e, file=sys.stderr)
            return 2
        print(args.model, flush=True)
        if args.json is None:
            return 0
    args.model = args.model or "default-raw"
    load_start = load_avg()
    spec = make_spec(args)
    # each contender's log and result: kept only when one fails (the error says where)
    work = Path(tempfile.mkdtemp(prefix="mfs-peers-"))
    spec_path = work / "spec.json"
    spec_path.write_text(json.dumps(asdict(spec)))
    plan = [("api", "default") if m == "api" else ("mfs", m) for m in args.modes.split(",")]
    if not args.skip_hf:
        plan.append(("hf", "fp32"))
    notes = []
    if spec.gguf is None:
        notes.append("llama.cpp skipped: the model is not a GGUF")
    else:
        usable, note = llama_build.ensure(spec.gguf, args.build_llama_cpp, say=lambda m: print(m, flush=True))
        notes.append(note)
        print(note, flush=True)
        if usable:
            plan.append(("llama.cpp", "gguf"))
    bandwidth = [bandwidth_gbs(args.threads)] if spec.gguf else []
    rounds: list[list[dict]] = []
    for k in range(args.repeats):
        rounds.append([])
        for kind, mode in plan:
            print(f"running {kind} {mode}{f' (round {k + 1} of {args.repeats})' if args.repeats > 1 else ''} ...",
                  flush=True)
            try:
                rounds[-1].append(_child(kind, mode, spec_path, work / f"{kind}-{mode}.json", work))
            except RuntimeError:
                print(f"logs in {work}", file=sys.stderr, flush=True)
                raise
    bandwidth += [bandwidth_gbs(args.threads)] if spec.gguf else []
    results = [merge_rounds([r[i] for r in rounds]) for i in range(len(plan))]
    out = {"benchmark": "peers", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
           "machine": {"platform": platform.platform(), "cpu": cpu_name(), "threads": args.threads,
                       "device": args.device, "load_start": load_start, "load_end": load_avg(),
                       "gpu": torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else None,
                       "cpu_capability": torch.backends.cpu.get_cpu_capability(), "torch": torch.__version__},
           "model": args.model, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
           "concurrency": args.concurrency, "mix": args.mix, "heldout_tokens": len(spec.windows) * args.seq_len,
           "long_prompt": args.long_prompt, "up_args": spec.up_args,
           "floor": floor_record(bytes_per_token(spec.gguf) if spec.gguf else None, bandwidth),
           "repeats": args.repeats, "notes": notes,
           "results": results, "vs_llama_cpp": ratios_vs_llama_cpp(rounds)}
    write_json(args.json, out)
    shutil.rmtree(work, ignore_errors=True)

    print_table(out)
    if args.markdown:
        Path(args.markdown).write_text(markdown(out))
    if args.plot:
        plot(out, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(child_main(sys.argv[1:]))
