"""`mfs bench peers`: what `mfs up` serves by default, through its HTTP API (the contender ``api``,
benches/peers_api.py), and MFS in-process in each ``--weights`` mode, side by side with
``transformers`` generate and llama.cpp (``llama-cpp-python``, checked and if need be rebuilt by
benches/llama_build.py) — same machine, same prompts, same token counts, one run. Per contender: a
single request and ``--concurrency`` concurrent ones (MFS also the family mix), tokens/s, TPOT,
resident memory and the top tier's held-out perplexity.

Each contender runs in its own child process, one after another: resident memory is its own, and no
two ever compete for the cores. This machine's speed drifts by ±10–20 % from one minute to the next, so
``--repeats N`` runs every contender N times in rounds (each round all of them, in order) and reports
each figure's median over the rounds, every round's figures, and the ratios against llama.cpp taken
within each round (neighbours in time) with their median.
"""
from __future__ import annotations

import json
import os
import platform
import shutil
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from datetime import datetime, timezone
from pathlib import Path

import torch
import torch.nn.functional as F

from benches.peers_report import merge_rounds, plot, print_table, ratios_vs_llama_cpp
from engine.runtime import write_json

@dataclass(slots=True)
class Spec:
    model: str
    threads: int
    prompts: list[list[int]]      # prompts[0] is the single request; all of them run concurrently
    mix: list[int]                # tier of each concurrent request in the family-mix run
    new_tokens: int
    windows: list[list[int]]      # held-out perplexity windows
    gguf: str | None
    device: str = "cpu"           # MFS and transformers run here; llama.cpp (a CPU build) always on CPU


# ---- measurements, run inside a child ------------------------------------------------------------
def _rss(device: str = "cpu") -> dict:
    """Resident host memory, and on CUDA the device memory torch holds (now and at peak)."""
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(("VmRSS:", "VmHWM:")):
            out[line[:5].lower()] = int(line.split()[1]) * 1024
    res = {"rss_bytes": out.get("vmrss", 0), "peak_rss_bytes": out.get("vmhwm", 0)}
    if device.startswith("cuda"):
        res.update(cuda_bytes=torch.cuda.memory_allocated(), peak_cuda_bytes=torch.cuda.max_memory_allocated())
    return res


def _release() -> None:
    import ctypes  # noqa: PLC0415
    import gc  # noqa: PLC0415
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass


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


@torch.inference_mode()
def _ppl(logits_fn, windows: list[list[int]]) -> float:
    nll, count = 0.0, 0
    for w in windows:
        ids = torch.tensor([w])
        logits = logits_fn(ids)[0, :-1].float().cpu()
        nll += float(F.cross_entropy(logits, ids[0, 1:], reduction="sum"))
        count += len(w) - 1
    return float(torch.exp(torch.tensor(nll / count)))


def run_mfs(spec: Spec, mode: str) -> dict:
    from worker.execution import compile_decode  # noqa: PLC0415
    from worker.family import load_family  # noqa: PLC0415
    from worker.model import weight_bytes  # noqa: PLC0415
    weights, compiled = mode.removesuffix("+compile"), mode.endswith("+compile")
    t0 = time.perf_counter()
    fam = load_family(spec.model, weights=weights, device=spec.device)
    model = fam.model
    load_s = time.perf_counter() - t0
    _release()
    mem = _rss(spec.device)
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
    res["ppl_top"] = _ppl(lambda ids: model.logits(model.exit_hidden(ids.to(spec.device))[-1]), spec.windows)
    res["rss_after_load_bytes"] = mem["rss_bytes"]
    res.update(_rss(spec.device))  # resident while serving: every weight page touched by now
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
    _release()
    mem = _rss(spec.device)
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
           "ppl_top": _ppl(lambda ids: hf(ids.to(spec.device)).logits, spec.windows)}
    res["rss_after_load_bytes"] = mem["rss_bytes"]
    res.update(_rss(spec.device))  # resident while serving: every weight page touched by now
    return res


def run_llama_cpp(spec: Spec) -> dict:
    """Greedy decoding through llama-cpp-python's low-level eval loop; it has no batch of independent
    sequences, so the concurrent run is the requests one after another (reported as such)."""
    from llama_cpp import Llama  # noqa: PLC0415
    t0 = time.perf_counter()
    llm = Llama(model_path=spec.gguf, n_threads=spec.threads, n_ctx=2048, logits_all=True, verbose=False)
    load_s = time.perf_counter() - t0
    mem = _rss()

    def one(prompt) -> tuple[float, float, int]:
        llm.reset()
        t = time.perf_counter()
        toks, first = list(prompt), None
        for _ in range(spec.new_tokens):
            llm.eval(toks[-1:] if first is not None else toks)
            toks.append(int(llm.scores[llm.n_tokens - 1].argmax()))
            first = first or time.perf_counter()
        return t, first, time.perf_counter()

    def measure(prompts):
        t_start = time.perf_counter()
        runs = [one(p) for p in prompts]
        wall = time.perf_counter() - t_start
        tok = spec.new_tokens * len(prompts)
        tpot = sum((e - f) / (spec.new_tokens - 1) for _, f, e in runs) / len(runs)
        return {"requests": len(prompts), "tokens": tok, "wall_s": wall, "tokens_per_s": tok / wall,
                "tpot_ms": 1e3 * tpot, "ttft_ms": 1e3 * sum(f - s for s, f, _ in runs) / len(runs),
                "sequential": len(prompts) > 1}

    def logits(ids):
        llm.reset()
        llm.eval(ids[0].tolist())
        return torch.from_numpy(llm.scores[: ids.shape[1]].copy())[None]

    res = {"name": "llama.cpp (GGUF as shipped)", "load_s": load_s,
           "weights_bytes": Path(spec.gguf).stat().st_size,
           "single": measure(spec.prompts[:1]), "concurrent": measure(spec.prompts),
           "ppl_top": _ppl(logits, spec.windows)}
    res["rss_after_load_bytes"] = mem["rss_bytes"]
    res.update(_rss())  # resident while serving: every weight page touched by now
    return res


def child_main(argv: list[str]) -> int:
    kind, mode, spec_path, out_path = argv
    spec = Spec(**json.loads(Path(spec_path).read_text()))
    torch.set_num_threads(spec.threads)
    if kind == "api":
        from benches.peers_api import run_api  # noqa: PLC0415
        res = run_api(spec)
    else:
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
    counts = [int(x) for x in args.mix.split(",")]
    if sum(counts) != n or len(counts) != len(manifest.tiers):
        raise ValueError(f"--mix {args.mix}: one count per tier ({len(manifest.tiers)}), summing to "
                         f"--concurrency {n}")
    mix = [t for t, c in enumerate(counts) for _ in range(c)]
    return Spec(args.model, args.threads, prompts, mix, args.new_tokens, windows.tolist(),
                base if base.endswith(".gguf") else None, args.device)


def _child(kind: str, mode: str, spec_path: Path, out: Path, log_dir: Path) -> dict:
    with open(log_dir / f"{kind}-{mode}.log", "w") as logf:
        r = subprocess.run([sys.executable, "-m", "benches.peers", kind, mode, str(spec_path), str(out)],
                           stdout=logf, stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    if r.returncode != 0:
        tail = (log_dir / f"{kind}-{mode}.log").read_text()[-2000:]
        raise RuntimeError(f"{kind} {mode} failed (exit {r.returncode}):\n{tail}")
    return json.loads(out.read_text())


def add_parser(sub) -> None:
    p = sub.add_parser("peers", help="MFS per --weights mode vs transformers generate vs llama.cpp")
    p.add_argument("--model", default="default-raw",
                   help="default-raw: the GGUF as shipped, the weights every contender can serve")
    p.add_argument("--modes", default="api",
                   help="what MFS contenders to run: 'api' is `mfs up --model M` with its defaults, measured "
                        "through HTTP (gateway -> Redis -> worker); a --weights format (mfs up --help lists them) "
                        "runs in-process; MODE+compile adds the compiled decode segments (CPU), compiled "
                        "in an untimed warm-up")
    p.add_argument("--build-llama-cpp", action="store_true",
                   help="when llama-cpp-python is missing or its build crashes on this CPU, build it here with "
                        "GGML_NATIVE=OFF and AMX off (about 12 minutes on 2 cores)")
    p.add_argument("--prompt-len", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=128)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--mix", default="11,3,2", help="family-mix run: requests per tier, lowest first")
    p.add_argument("--heldout-tokens", type=int, default=2048)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--skip-hf", action="store_true")
    p.add_argument("--repeats", type=int, default=1,
                   help="rounds of every contender, one after another; figures are medians over rounds")
    p.add_argument("--device", default="cpu", help="cpu or cuda[:N] for MFS and transformers "
                   "(llama-cpp-python as pip builds it is a CPU build: it stays on the CPU)")
    p.add_argument("--json", required=True)
    p.add_argument("--plot", default=None)
    p.set_defaults(func=run)


def run(args) -> int:
    import tempfile  # noqa: PLC0415

    from benches import llama_build  # noqa: PLC0415
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        print(f"--device {args.device}: CUDA is not available here", file=sys.stderr)
        return 2
    if not args.device.startswith(("cpu", "cuda")):
        print(f"--device {args.device}: expected cpu or cuda[:N]", file=sys.stderr)
        return 2
    modes = args.modes.split(",")
    from worker.formats import FORMATS  # noqa: PLC0415  (the registry: a new format is a mode here too)
    bad = [m for m in modes if m != "api" and (m.removesuffix("+compile") not in FORMATS or (
        m.endswith("+compile") and FORMATS[m.removesuffix("+compile")].uncompilable()))]
    if bad:
        compiled = ", ".join(f for f, fmt in FORMATS.items() if not fmt.uncompilable())
        print(f"--modes: unknown {', '.join(bad)} (api; {', '.join(FORMATS)}; +compile after {compiled})",
              file=sys.stderr)
        return 2
    if args.repeats < 1:
        print(f"--repeats {args.repeats}: at least 1", file=sys.stderr)
        return 2
    spec = make_spec(args)
    # each contender's log and result: kept only when one fails (the error says where)
    work = Path(tempfile.mkdtemp(prefix="mfs-peers-"))
    spec_path = work / "spec.json"
    spec_path.write_text(json.dumps(asdict(spec)))
    plan = [("api", "default") if m == "api" else ("mfs", m) for m in modes]
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
    results = [merge_rounds([r[i] for r in rounds]) for i in range(len(plan))]
    out = {"benchmark": "peers", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
           "machine": {"platform": platform.platform(), "threads": args.threads, "device": args.device,
                       "gpu": torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else None,
                       "cpu_capability": torch.backends.cpu.get_cpu_capability(), "torch": torch.__version__},
           "model": args.model, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
           "concurrency": args.concurrency, "mix": args.mix, "heldout_tokens": len(spec.windows) * args.seq_len,
           "repeats": args.repeats, "notes": notes, "results": results,
           "vs_llama_cpp": ratios_vs_llama_cpp(rounds)}
    write_json(args.json, out)
    shutil.rmtree(work, ignore_errors=True)

    print_table(out)
    if args.plot:
        plot(out, args.plot)
    return 0


if __name__ == "__main__":
    sys.exit(child_main(sys.argv[1:]))
