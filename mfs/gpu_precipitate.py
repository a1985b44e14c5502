"""``mfs gpu-precipitate``: the exit-block recipe sized for one GPU, in one command.

On CUDA it trains the default family's exit blocks from scratch with many more tokens than a CPU can
afford (a larger feature cache and top-k, bigger batches), inside a wall-clock budget (8 minutes by
default, for one H200), then writes the nested checkpoint and ``eval.json`` (``mfs eval``) under
``--out``. Without CUDA it stops at once with a clear message; ``--dry-run`` runs the same pipeline on
the CPU with a few steps (what CI checks, on a tiny model).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

# (option, GPU value, dry-run value): the precipitate options this command sets.
PLAN = [
    ("--cache-tokens", "4000000", "1024"),
    ("--cache-batch", "64", "4"),
    ("--topk", "128", "8"),
    ("--batch-size", "64", "4"),
    ("--eval-every", "200", "4"),
    ("--patience", "6", "0"),
    ("--steps", "200000", "8"),
    ("--lr", "3e-4", "1e-3"),
]


def precipitate_argv(args, minutes_for_training: float) -> list[str]:
    col = 2 if args.dry_run else 1
    argv = ["precipitate", "--method", "exit-blocks", "--base", args.base, "--tiers", args.tiers,
            "--data", args.data, "--out", str(args.out), "--seed", str(args.seed),
            "--device", "cpu" if args.dry_run else "cuda", "--threads", str(args.threads),
            "--max-minutes", f"{minutes_for_training:.2f}"]
    for row in PLAN:
        argv += [row[0], row[col]]
    if args.dry_run:
        argv += ["--seq-len", "32", "--heldout-tokens", "256", "--save-every-min", "0"]
    if args.resume:
        argv.append("--resume")
    return argv


def run(args) -> int:
    import torch  # noqa: PLC0415

    from mfs.cli import main as mfs_main  # noqa: PLC0415
    from evaluation.evaluate import evaluate  # noqa: PLC0415
    if not args.dry_run and not torch.cuda.is_available():
        print("mfs gpu-precipitate: no CUDA device here (torch.cuda.is_available() is False). This "
              "command is for a GPU machine; use `mfs precipitate --method exit-blocks` on a CPU, or "
              "--dry-run to check the pipeline.", file=sys.stderr)
        return 2
    t0 = time.monotonic()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    # the budget covers data, cache, training and the final eval: training gets what is left after
    # a reserve for the eval
    train_minutes = max(0.1, args.minutes - args.eval_reserve_minutes)
    argv = precipitate_argv(args, train_minutes)
    print("mfs " + " ".join(argv), flush=True)
    rc = mfs_main(argv)
    if rc:
        return rc
    res = evaluate(str(out), seq_len=32 if args.dry_run else 256,
                   heldout_tokens=256 if args.dry_run else 8192, max_tokens=8 if args.dry_run else 24)
    res["gpu_precipitate"] = {"argv": argv, "wall_minutes": round((time.monotonic() - t0) / 60, 2),
                              "device": "cpu (dry run)" if args.dry_run else torch.cuda.get_device_name()}
    (out / "eval.json").write_text(json.dumps(res, indent=2) + "\n")
    print(f"done in {res['gpu_precipitate']['wall_minutes']} min: {out}/mfs.json, {out}/eval.json")
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("gpu-precipitate", help="train the exit blocks on one GPU within a time budget",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", required=True, help="output folder (nested checkpoint + eval.json)")
    p.add_argument("--base", default="default")
    p.add_argument("--tiers", default="small=10,medium=20,large=30")
    p.add_argument("--data", default="self,chat,stdlib,packages")
    p.add_argument("--minutes", type=float, default=8.0, help="wall-clock budget for everything")
    p.add_argument("--eval-reserve-minutes", type=float, default=1.5,
                   help="part of the budget kept for the final mfs eval")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2, help="CPU threads (data, dry run)")
    p.add_argument("--resume", action="store_true")
    p.add_argument("--dry-run", action="store_true", help="the same pipeline on the CPU, a few steps")
    p.set_defaults(func=run)
