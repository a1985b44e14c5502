"""``mfs gpu-precipitate``: a precipitation recipe sized for one GPU, in one command, inside ``--minutes``.

``--method joint`` (default; training/joint.py) trains every tier at once through a shared low-rank trunk
delta and private exit blocks; ``--method exit-blocks`` (training/exitblocks.py) trains exit blocks on a
frozen trunk. Everything counts against ``--minutes``: the model's answers (generated with MFS's engine,
large batches, stopped at a share of the budget), the feature cache, training (a checkpoint and one
progress line a minute), the final ``mfs eval`` (a reserve kept for it) and writing. The artifact is the
nested checkpoint under ``--out`` plus ``OUT/parts/`` (the weights cut into files of at most 15 MB with a
sha256 manifest, what a device machine hands back); ``mfs precipitate --assemble OUT`` joins them.
Without CUDA it stops at once with a clear message; ``--dry-run`` runs the same pipeline on the CPU on
a tiny plan (what CI checks, on a tiny model).
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

# (option, GPU value, dry-run value): the precipitate options each method's plan sets.
PLANS = {
    "exit-blocks": [
        ("--cache-tokens", "4000000", "1024"),
        ("--cache-batch", "64", "4"),
        ("--topk", "128", "8"),
        ("--batch-size", "64", "4"),
        ("--eval-every", "200", "4"),
        ("--patience", "6", "0"),
        ("--steps", "200000", "8"),
        ("--lr", "3e-4", "1e-3"),
        ("--self-max-tokens", "160", "16"),
    ],
    "joint": [
        ("--cache-tokens", "16000000", "1024"),
        ("--topk", "64", "8"),
        ("--batch-size", "32", "4"),
        ("--eval-every", "100", "4"),
        ("--patience", "0", "0"),
        ("--steps", "200000", "8"),
        ("--rank", "16", "4"),
        ("--lr", "5e-4", "1e-3"),
        ("--block-lr", "3e-4", "1e-3"),
        ("--gen-batch", "256", "8"),
        ("--data-share", "0.25", "0.25"),
        ("--weights", "1,1,1", "1,1,1"),
        ("--self-max-tokens", "160", "16"),
    ],
}


def precipitate_argv(args, minutes: float) -> list[str]:
    col = 2 if args.dry_run else 1
    argv = ["precipitate", "--method", args.method, "--base", args.base, "--tiers", args.tiers,
            "--data", args.data, "--out", str(args.out), "--seed", str(args.seed),
            "--device", "cpu" if args.dry_run else "cuda", "--threads", str(args.threads),
            "--max-minutes", f"{minutes:.2f}", "--save-every-min", f"{args.save_every_min:g}"]
    for row in PLANS[args.method]:
        argv += [row[0], row[col]]
    if args.dry_run:
        argv += ["--seq-len", "32", "--heldout-tokens", "256"]
    if args.init_from:
        argv += ["--init-from", args.init_from]
    if args.block_layers:
        argv += ["--block-layers", args.block_layers]
    if args.resume:
        argv.append("--resume")
    return argv


def write_parts(out: Path, max_mb: float) -> dict:
    """Cuts the checkpoint's weights file into OUT/parts/ (sha256 manifest)."""
    from family.manifest import Manifest  # noqa: PLC0415
    from training import parts  # noqa: PLC0415
    m = Manifest.read(out)
    man = parts.split(out / m.weights["file"], out / "parts", int(max_mb * 1e6))
    return json.loads(man.read_text())


def run(args) -> int:
    import torch  # noqa: PLC0415

    from evaluation.evaluate import evaluate  # noqa: PLC0415
    from mfs.cli import main as mfs_main  # noqa: PLC0415
    if not args.dry_run and not torch.cuda.is_available():
        print("mfs gpu-precipitate: no CUDA device here (torch.cuda.is_available() is False). This "
              "command is for a GPU machine; use `mfs precipitate --method joint|exit-blocks` on a CPU, "
              "or --dry-run to check the pipeline.", file=sys.stderr)
        return 2
    if args.minutes <= args.eval_reserve_minutes:
        raise ValueError("--minutes must be larger than --eval-reserve-minutes")
    t0 = time.monotonic()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    # the precipitate command's --max-minutes counts from its own start (data included): it gets the
    # budget less the reserve for the final evaluation and the parts
    argv = precipitate_argv(args, args.minutes - args.eval_reserve_minutes)
    print("mfs " + " ".join(argv), flush=True)
    rc = mfs_main(argv)
    if rc:
        return rc
    t_eval = time.monotonic()
    deadline = t0 + args.minutes * 60 - args.finish_s
    if deadline - t_eval >= args.min_eval_s:
        res = evaluate(str(out), seq_len=32 if args.dry_run else 256,
                       heldout_tokens=256 if args.dry_run else 8192, max_tokens=8 if args.dry_run else 24,
                       tasks=["capitals", "stdlib_modules", "unicode_names"],
                       heldout_chat=out / "data" / "heldout_chat.jsonl", deadline=deadline)
    else:  # what is left of the budget cannot load and score the model: say so, never run late
        print(f"mfs eval: not measured ({max(0.0, deadline - t_eval):.0f} s of the budget left, "
              f"--min-eval-s {args.min_eval_s:g})", flush=True)
        res = {"not_measured": ["eval"]}
    man = write_parts(out, args.part_mb)
    wall = (time.monotonic() - t0) / 60
    res["gpu_precipitate"] = {
        "method": args.method, "argv": argv, "wall_minutes": round(wall, 2), "budget_minutes": args.minutes,
        "within_budget": wall <= args.minutes, "eval_minutes": round((time.monotonic() - t_eval) / 60, 2),
        "parts": [p["name"] for p in man["parts"]], "sha256": man["sha256"],
        "device": "cpu (dry run)" if args.dry_run else torch.cuda.get_device_name()}
    (out / "eval.json").write_text(json.dumps(res, indent=2) + "\n")
    print(f"done in {wall:.2f} of {args.minutes:g} min{'' if wall <= args.minutes else ' (OVER BUDGET)'}: "
          f"{out}/mfs.json, {out}/eval.json, {len(man['parts'])} part(s) in {out}/parts "
          f"(mfs precipitate --assemble {out})", flush=True)
    return 0


def add_parser(sub) -> None:
    p = sub.add_parser("gpu-precipitate", help="precipitate the family on one GPU within a time budget",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--out", required=True, help="output folder (nested checkpoint, parts/, eval.json)")
    p.add_argument("--method", default="joint", choices=sorted(PLANS))
    p.add_argument("--base", default="default")
    p.add_argument("--tiers", default="small=10,medium=20,large=30")
    p.add_argument("--data", default="self,chat,stdlib,packages")
    p.add_argument("--init-from", default=None, metavar="SAFETENSORS",
                   help="warm start from an exit-blocks artifact (its blocks and norms), e.g. the shipped "
                        "10/20 family's family/families/smollm2-135m-10-20/smollm2-135m-exit-blocks.safetensors")
    p.add_argument("--block-layers", default=None,
                   help="exit-block layers per lower tier (e.g. 2,1, the shipped family's); default: the "
                        "method's")
    p.add_argument("--minutes", type=float, default=7.0, help="wall-clock budget for everything")
    p.add_argument("--eval-reserve-minutes", type=float, default=1.5,
                   help="part of the budget kept for the final mfs eval and the parts")
    p.add_argument("--min-eval-s", type=float, default=30.0,
                   help="the final mfs eval starts only with at least this many seconds of the budget left")
    p.add_argument("--finish-s", type=float, default=15.0,
                   help="seconds of the budget kept after the evaluation's deadline for the parts and eval.json")
    p.add_argument("--save-every-min", type=float, default=1.0, help="checkpoint and progress-line period")
    p.add_argument("--part-mb", type=float, default=15.0, help="largest part of the written artifact (MB)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2, help="CPU threads (data, dry run)")
    p.add_argument("--resume", action="store_true")
    p.add_argument("--dry-run", action="store_true", help="the same pipeline on the CPU, a tiny plan")
    p.set_defaults(func=run)
