"""`mfs bench startup`: how long a process takes to be ready, each figure in a fresh interpreter (imports
included, caches warm: run it once before for cold caches to be filled): a worker's model
(``load_family``, the ``--weights`` asked), a gateway's tokenizer (``load_frontend``), and ``mfs generate``
of ``--tokens`` tokens end to end. ``--runs`` of each, alternated; medians with every run. The report
names the CPU and the load average before and after."""
from __future__ import annotations

import os
import statistics
import subprocess
import sys
from datetime import datetime, timezone

from benches.load import machine
from engine.runtime import write_json

# each child prints the seconds of what it times, on its last line
_LOAD = ("import sys, time; t = time.perf_counter(); from worker.family import load_family; "
         "load_family(sys.argv[1], weights=sys.argv[2]); print(time.perf_counter() - t)")
_FRONTEND = ("import sys, time; t = time.perf_counter(); from family.manifest import load_frontend; "
             "load_frontend(sys.argv[1]); print(time.perf_counter() - t)")


def add_parser(sub) -> None:
    p = sub.add_parser("startup", help="seconds until a worker's model, a gateway's tokenizer and `mfs generate` "
                                       "are ready, each in a fresh process")
    p.add_argument("--model", default="default", help="model id or path (default: the default family)")
    p.add_argument("--weights", default="auto", help="the worker's --weights (default: auto)")
    p.add_argument("--runs", type=int, default=3, help="runs of each figure (default 3)")
    p.add_argument("--tokens", type=int, default=20, help="tokens `mfs generate` answers (default 20)")
    p.add_argument("--json", default=None, help="write the results here")
    p.set_defaults(func=run)


def _child(what: str, argv: list[str]) -> float:
    """Seconds the child reports (its last stdout line); RuntimeError with its last error line where it fails."""
    env = {**os.environ, "MFS_LOG_LEVEL": os.environ.get("MFS_LOG_LEVEL", "warning")}
    r = subprocess.run(argv, capture_output=True, text=True, env=env)
    if r.returncode != 0:
        last = r.stderr.strip().splitlines()[-1:] or ["(no message)"]
        raise RuntimeError(f"{what} failed (exit {r.returncode}): {last[0]}")
    return float(r.stdout.strip().splitlines()[-1])


def _generate(model: str, weights: str, tokens: int) -> float:
    """Wall seconds of ``mfs generate`` end to end (interpreter start to exit)."""
    code = ("import subprocess, sys, time; t = time.perf_counter(); "
            "subprocess.run([sys.executable, '-m', 'mfs.cli', 'generate', '--model', sys.argv[1], '--weights', "
            "sys.argv[2], '--max-tokens', sys.argv[3], 'Name three colours.'], check=True); "
            "print(time.perf_counter() - t)")
    return _child("mfs generate", [sys.executable, "-c", code, model, weights, str(tokens)])


def run(args) -> int:
    if args.runs < 1 or args.tokens < 1:
        print(f"mfs bench startup: --runs and --tokens must be at least 1 (got {args.runs}, {args.tokens})",
              file=sys.stderr)
        return 2
    figures = {"load_family": [], "load_frontend": [], "generate": []}
    load_start = os.getloadavg()
    for i in range(args.runs):  # alternated, so drift in the machine's load spreads over all three
        try:
            py = [sys.executable, "-c"]
            figures["load_family"].append(_child("load_family", [*py, _LOAD, args.model, args.weights]))
            figures["load_frontend"].append(_child("load_frontend", [*py, _FRONTEND, args.model]))
            figures["generate"].append(_generate(args.model, args.weights, args.tokens))
        except RuntimeError as e:
            print(f"mfs bench startup: {e}", file=sys.stderr)
            return 1
        print(f"run {i + 1}/{args.runs}: " + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in figures.items()),
              flush=True)
    out = {"benchmark": "startup", "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
           "model": args.model, "weights": args.weights, "tokens": args.tokens, "machine": machine(),
           "load_start": list(load_start), "load_end": list(os.getloadavg()),
           "seconds": figures, "median_s": {k: statistics.median(v) for k, v in figures.items()}}
    m = out["machine"]
    print(f"{m['cpu']} ({m['torch_cpu_capability']}), load {load_start[0]:.2f} -> {out['load_end'][0]:.2f}")
    for k, v in figures.items():
        print(f"{k:14s} median {out['median_s'][k]:6.2f} s   runs {', '.join(f'{x:.2f}' for x in v)}")
    if args.json:
        write_json(args.json, out)
    return 0
