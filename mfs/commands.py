"""`mfs generate`, `mfs tiers` and `mfs up`: the commands a new user meets first."""
from __future__ import annotations

import argparse
import os
import sys

from core.cli import positive_int
from core.params import PARAMS
from engine.prompts import encode_prompt
from family.manifest import DEFAULT_FLOOR, floor_failures
from worker.family import add_model_args, load_from_args


def resolve_tier(model, tier: str | None) -> int:
    if tier is None:
        return model.tiers[-1].index
    for t in model.tiers:
        if tier in (t.name, str(t.index)) or tier.endswith("-" + t.name):
            return t.index
    raise ValueError(f"unknown tier {tier!r}; this family has: {', '.join(t.name for t in model.tiers)}")


# ---- generate --------------------------------------------------------------------------------
def add_generate(sub) -> None:
    p = sub.add_parser("generate", help="generate a completion at one tier (prints only the completion)")
    add_model_args(p)
    p.set_defaults(weights="auto")  # what serves: the fastest weight format this CPU runs (fp32 on CUDA)
    p.add_argument("--tier", default=None, help="tier name (default: the top tier)")
    p.add_argument("--max-tokens", type=int, default=64)
    for name in ("temperature", "top_p", "top_k", "seed"):  # as declared for requests (core/params.py)
        d = PARAMS[name]
        p.add_argument("--" + name.replace("_", "-"), type=d.kind, default=d.default,
                       help=f"{d.doc.rstrip('.')};{d.bounds()}, default {d.default}")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("prompt")
    p.set_defaults(func=run_generate)


def run_generate(args) -> int:
    from engine import Engine  # noqa: PLC0415
    from worker.sampling import SamplingParams  # noqa: PLC0415
    fam = load_from_args(args)
    tier = resolve_tier(fam.model, args.tier)
    ids = encode_prompt(fam.tokenizer, args.prompt, args.chat)
    eng = Engine(fam.model, max_model_len=len(ids) + args.max_tokens + 1)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                            top_p=args.top_p, top_k=args.top_k, seed=args.seed)
    eng.add_request("cli", ids, tier, params)
    from gateway.detok import IncrementalDetokenizer  # noqa: PLC0415
    detok = IncrementalDetokenizer(fam.tokenizer)
    while eng.has_unfinished():
        for out in eng.step():
            stop = out.finish_reason == "stop"
            text = detok.push([] if stop else out.new_token_ids)
            sys.stdout.write(text)
            sys.stdout.flush()
    sys.stdout.write(detok.flush() + "\n")
    return 0


# ---- tiers -----------------------------------------------------------------------------------
def add_tiers(sub) -> None:
    p = sub.add_parser("tiers", help="list a family's tiers: layers, parameters, KV bytes per token")
    add_model_args(p)
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=run_tiers)


def tier_table(fam) -> list[dict]:
    """Per tier: trunk layers, exit-block layers, parameters it runs, KV bytes per token it holds
    (its segments' pools, which carry the exit-block KV of every boundary below it, see
    NestedModel.segment_kv_layers) and its recorded quality."""
    m = fam.model
    cfg = m.cfg
    dtype = m.embed_tokens.weight.dtype  # the KV cache's (a quantized embedding's weight answers it too)
    embed = cfg.vocab_size * cfg.hidden_size * (1 if cfg.tie_embeddings else 2)
    weak = not fam.manifest.precipitated
    quality = fam.manifest.quality or {}
    floor = fam.usable_tiers()
    rows = []
    for t in m.tiers:
        kv_layers = sum(m.segment_kv_layers(s) for s in range(t.index + 1))
        q = quality.get(t.name)
        note = ("not precipitated: a truncated exit, weak" if weak and t.index < len(m.tiers) - 1 else "")
        if t.index not in floor:
            why = ", ".join(floor_failures(q, quality.get("floor") or DEFAULT_FLOOR))
            note = (note + "; " if note else "") + f"below the quality floor ({why}): the family id never routes here"
        rows.append({
            "tier": t.name, "model_id": fam.model_id(t), "layers": t.layers, "exit_block_layers": t.block,
            "params": cfg.param_count_layers(t.layers + t.block) + embed + cfg.hidden_size,
            "kv_bytes_per_token": cfg.kv_bytes_per_token(kv_layers, dtype),
            "quality": q, "routable": t.index in floor, "note": note,
        })
    return rows


def run_tiers(args) -> int:
    import json  # noqa: PLC0415
    fam = load_from_args(args)
    rows = tier_table(fam)
    if args.json:
        print(json.dumps({"family": fam.manifest.family, "precipitated": fam.manifest.precipitated,
                          "tiers": rows}, indent=2))
        return 0
    print(f"family {fam.manifest.family}  (precipitated: {'yes' if fam.manifest.precipitated else 'no'})")
    print(f"{'tier':<8} {'model id':<26} {'layers':>10} {'params':>12} {'KV B/token':>11} "
          f"{'ppl/top':>8} {'agree':>6}  note")
    for r in rows:
        q = r["quality"] or {}
        layers = f"{r['layers']}+{r['exit_block_layers']}" if r["exit_block_layers"] else str(r["layers"])
        ppl = f"{q['ppl_vs_top']:.2f}x" if "ppl_vs_top" in q else "-"
        agree = f"{q['agree_top']:.0%}" if "agree_top" in q else "-"
        print(f"{r['tier']:<8} {r['model_id']:<26} {layers:>10} {r['params']:>12,} "
              f"{r['kv_bytes_per_token']:>11,} {ppl:>8} {agree:>6}  {r['note']}")
    if fam.manifest.notes:
        import textwrap  # noqa: PLC0415
        print("\n" + textwrap.fill(fam.manifest.notes, 100))
    return 0


# ---- up --------------------------------------------------------------------------------------
def add_up(sub) -> None:
    p = sub.add_parser("up", help="start the service (Redis, scheduler, workers, gateway)")
    add_model_args(p)
    p.set_defaults(weights="auto")  # the fastest weight format this CPU runs (fp32 on CUDA)
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--layout", default="nested", choices=["nested", "independent"],
                   help="independent: each tier a standalone copy on its own worker (the baseline)")
    p.add_argument("--threads", type=int, default=0,
                   help="torch threads per worker (0: the cores this process may use, split between the workers)")
    p.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="all-decode steps as compiled graphs, built in the background while each worker already "
                        "serves eagerly, then swapped in (responses name the path in mfs.paths): on CPU inductor's "
                        "(cached under $MFS_CACHE/inductor; needs a C++ compiler), on CUDA CUDA graphs. Default: on "
                        "where they build; --compile: refused where they cannot; --no-compile: eager")
    p.add_argument("--kv-cache-mb", type=positive_int, default=None,
                   help="each worker's memory for its KV pools, every segment's together (default: the worker's "
                        "--kv-cache-mb; each worker's log names its pool): more holds more tokens of concurrent "
                        "requests before the scheduler preempts")
    p.add_argument("--nondeterministic", action="store_true",
                   help="torch's ops for the norms, activations and attention instead of the per-row operators "
                        "(kernels/cpu_rows.py): a request's tokens may then depend on its batch, its prefill chunks "
                        "and the decode path (sets MFS_NONDETERMINISTIC=1 for the workers)")
    p.add_argument("--schedulers", type=int, default=2,
                   help="scheduler processes per shard: one leads, the others stand by to take over (1: no standby)")
    p.add_argument("--shards", type=int, default=1,
                   help="control-plane shards, each with its own leader and request stream; worker i joins "
                        "shard i mod SHARDS (docs/SCALING.md)")
    from scheduler.config import SchedulerProcessConfig, parse_steps  # noqa: PLC0415
    p.add_argument("--decode-steps", type=parse_steps, default=SchedulerProcessConfig.__dataclass_fields__["decode_steps"].default,
                   help="multi-step decoding: while a worker's requests all decode plainly and none waits, one "
                        "plan runs this many forward steps (the scheduler's round trip paid once); 1: plan "
                        "every step (default %(default)s)")
    p.add_argument("--stream-interval", type=parse_steps,
                   default=SchedulerProcessConfig.__dataclass_fields__["stream_interval"].default,
                   help="a multi-step plan sends its greedy tokens every this many of its steps and at its end "
                        "(a request's first and last at once): fewer wake-ups a token on a machine whose cores "
                        "the model keeps busy, larger chunks of text; 1: every token (default %(default)s)")
    p.add_argument("--log-dir", default=None, help="one log file per process (default: a new temp dir)")
    p.add_argument("--restart-limit", type=int, default=5,
                   help="a process that exits is restarted with backoff; more than this many restarts of "
                        "one process within --restart-window stops everything (0: never restart)")
    p.add_argument("--restart-window", type=float, default=120.0, help="seconds (see --restart-limit)")
    from core.redisconn import add_redis_args  # noqa: PLC0415
    add_redis_args(p, url_default=None)  # neither URL nor sentinels: an embedded Redis
    p.set_defaults(func=run_up)


def compile_choice(args) -> str:
    """A worker's ``--compile`` from `mfs up`'s: auto (the default: compiled decode where it builds), on
    (``--compile``: refused where it cannot be), off (``--no-compile``)."""
    asked = getattr(args, "compile", None)
    if asked is None:
        return "auto"
    if not asked:
        return "off"
    cuda = str(getattr(args, "device", None) or "cpu").startswith("cuda")
    kernels = getattr(args, "kernels", None)
    if cuda and kernels == "torch":  # on CUDA --compile records CUDA graphs of the Triton ops
        raise ValueError("--compile on CUDA records CUDA graphs of the Triton ops: drop --kernels torch")
    if not cuda and kernels == "triton":
        raise ValueError("--compile on CPU compiles the torch ops: drop --kernels triton (or add --device cuda)")
    from worker.formats import resolve, served  # noqa: PLC0415
    # a weight format whose schemes cannot be compiled: refused (the registry's one check)
    device = "cuda" if cuda else "cpu"
    resolve(served(getattr(args, "weights", "auto"), device, model_source(args)), device, compile=True)
    return "on"


def model_source(args) -> str | None:
    """The base weights' path of the family a command serves (what ``--weights auto`` reads of a GGUF);
    None without a ``--model``."""
    if getattr(args, "model", None) is None:
        return None
    from family.manifest import manifest_for, resolve_base  # noqa: PLC0415
    manifest, mdir = manifest_for(args.model, getattr(args, "tiers", None))
    return str(resolve_base(manifest.base, mdir))


def run_up(args) -> int:
    from mfs.up import up  # noqa: PLC0415
    from service.launch import worker_threads  # noqa: PLC0415
    args.compile = compile_choice(args)
    if args.nondeterministic:  # the workers inherit it (kernels/cpu_rows.py)
        os.environ["MFS_NONDETERMINISTIC"] = "1"
    n = args.workers
    if args.layout == "independent":  # a worker per tier per --workers (service/launch.py: worker_plan)
        from family.manifest import manifest_for  # noqa: PLC0415
        n *= len(manifest_for(args.model, args.tiers)[0].tiers)
    print(f"mfs up: {chosen(args, args.threads or worker_threads(n))}", flush=True)
    return up(args)


def chosen(args, threads: int) -> str:
    """One line: the ISA, weights, threads and decode path `mfs up` asks its workers for, and why (each
    worker logs what it took: an ``auto`` compile it cannot build stays eager, saying why)."""
    import torch  # noqa: PLC0415

    from worker.formats import resolve_mode, served, served_why  # noqa: PLC0415
    device = args.device or "cpu"
    isa = torch.backends.cpu.get_cpu_capability()
    source = model_source(args)
    weights = resolve_mode(served(args.weights, device, source), device)
    why_w = served_why(args.weights, device, source)
    why_t = f"--threads {args.threads}" if args.threads else f"the cores split between {args.workers} worker(s)"
    decode = {"auto": "compiled where it builds, in the background: eager until then (--no-compile: off)",
              "on": "compiled (--compile), in the background: eager until then", "off": "eager (--no-compile)"}
    from worker.formats import FORMATS  # noqa: PLC0415
    stuck = FORMATS[weights].uncompilable("groups" if str(device).startswith("cuda") else "cpu")
    if args.compile == "auto" and stuck and not str(device).startswith("cuda"):
        decode["auto"] = f"eager (auto: --weights {weights} runs eager, its {', '.join(stuck)} break the compiled graph)"
    return (f"{isa} on {device}; weights {weights} ({why_w}); {threads} torch threads per worker ({why_t}); "
            f"decode {decode[args.compile]}")
