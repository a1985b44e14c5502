"""``mfs precipitate``: the command that trains every tier exit of a nested model at once: its options,
which of them each method reads, and which method runs.

The methods (``--method``): ``lora`` (training/lora.py), ``exit-blocks`` (training/exitblocks.py) and
``joint`` (training/joint.py), each a plug-in of the one trainer loop (training/loop.py), which owns
the budget (``--max-minutes``, ``--steps``, ``--stop-after``), evaluations, checkpoints and ``--resume``.
``--assemble DIR`` joins an artifact written in parts (training/parts.py).
"""
from __future__ import annotations

import argparse
from pathlib import Path


def run(args) -> int:
    if args.assemble:
        from training import parts  # noqa: PLC0415
        if args.out:
            raise ValueError("--assemble DIR writes into DIR: --out is not an option of --assemble")
        print(f"assembled {parts.assemble(Path(args.assemble))}")
        return 0
    if not args.out:
        raise ValueError("--out is required (or --assemble DIR)")
    check_method_options(args, args.method)
    from training import exitblocks, joint, lora  # noqa: PLC0415
    return {"lora": lora.run, "exit-blocks": exitblocks.run, "joint": joint.run}[args.method](args)


_EXIT_BLOCK_DEFAULTS: dict = {}
_JOINT_DEFAULTS: dict = {}
# the options of --method lora alone; the trainer loop's (--steps, --stop-after, --max-minutes,
# --save-every-min, --bar-interval, --resume, ...) are every method's
_LORA_ONLY = ("accum", "weights", "kl", "temperature", "lora_rank", "lora_alpha", "exit_lr",
              "freeze_embeddings", "main_until", "repair_steps", "repair_lr", "save_dtype")
_LORA_DEFAULTS: dict = {}


def check_method_options(args, method: str) -> None:
    """Never accept an option and ignore it: each method refuses the options only others read."""
    from training.joint import JOINT_SHARED  # noqa: PLC0415
    own = {"lora": set(_LORA_DEFAULTS), "exit-blocks": set(_EXIT_BLOCK_DEFAULTS),
           "joint": set(_JOINT_DEFAULTS) | set(JOINT_SHARED)}[method]
    for name, dflt in {**_LORA_DEFAULTS, **_EXIT_BLOCK_DEFAULTS, **_JOINT_DEFAULTS}.items():
        if name not in own and getattr(args, name) != dflt:
            raise ValueError(f"--{name.replace('_', '-')} is not an option of --method {method}")


def add_parser(sub) -> None:
    p = sub.add_parser("precipitate", help="train every tier exit of a nested model at once",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--method", default="lora", choices=["lora", "exit-blocks", "joint"],
                   help="lora: low-rank updates of the whole model with a loss at every exit; "
                        "exit-blocks: a frozen trunk and a private exit block per lower tier, "
                        "trained on cached trunk features (see training/exitblocks.py); joint: every "
                        "tier at once, a shared low-rank trunk delta plus private exit blocks "
                        "(training/joint.py)")
    p.add_argument("--assemble", default=None, metavar="DIR",
                   help="join DIR/parts/ (an artifact written in parts, sha256-checked) into DIR, "
                        "so that mfs eval / serve read DIR; nothing is trained")
    p.add_argument("--base", default="default", help="HF directory, .gguf file, or 'default'")
    p.add_argument("--tiers", default="10,20,30", help="LAYERS,... or NAME=LAYERS,...")
    p.add_argument("--data", default="self,stdlib",
                   help="comma list of: self, chat, vocab[:N], names[:N], stdlib, packages, "
                   "text/JSONL files or directories")
    p.add_argument("--out", default=None, help="output nested checkpoint directory (required)")
    p.add_argument("--steps", type=int, default=None,
                   help="optimizer steps (default: 400 for lora, 20000 for exit-blocks, 2000 for joint)")
    p.add_argument("--batch-size", type=int, default=4, help="sequences per micro-batch")
    p.add_argument("--accum", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--weights", default=None, help="loss weight per tier exit, e.g. 1,1,1")
    p.add_argument("--ce", default=None,
                   help="weight of cross-entropy on the data: one value, or one per tier "
                        "(default: 0.2 for lora, 0.1 for exit-blocks)")
    p.add_argument("--kl", type=float, default=1.0,
                   help="weight of KL(original top tier || exit); 0 disables distillation")
    p.add_argument("--temperature", type=float, default=1.0, help="distillation temperature")
    p.add_argument("--lora-rank", type=int, default=32, help="0 = full-parameter updates")
    p.add_argument("--lora-alpha", type=float, default=None, help="LoRA alpha (default = rank)")
    p.add_argument("--lr", type=float, default=None,
                   help="lr of the backbone / adapters (default 5e-4) or of the exit blocks (3e-4)")
    p.add_argument("--exit-lr", type=float, default=5e-3, help="lr of the exit norms")
    p.add_argument("--weight-decay", type=float, default=0.0)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--grad-clip", type=float, default=1.0)
    p.add_argument("--freeze-embeddings", action="store_true",
                   help="full updates: keep the embedding (and a tied head) frozen")
    p.add_argument("--self-max-tokens", type=int, default=160, help="answer length for --data self")
    p.add_argument("--save-every-min", type=float, default=5.0,
                   help="checkpoint and progress-line period in minutes (0: checkpoints at evaluations and "
                        "at the end only)")
    p.add_argument("--stop-after", type=int, default=None,
                   help="stop (and save) after this many steps of this invocation; --resume goes on")
    p.add_argument("--main-until", type=int, default=None,
                   help="end the main phase at this step (the lr schedule still spans --steps)")
    p.add_argument("--repair-steps", type=int, default=0,
                   help="after the main phase: steps that train only the top segment (layers above "
                        "the second-highest exit) and the top exit on the top tier's loss")
    p.add_argument("--repair-lr", type=float, default=None, help="repair-phase lr (default --lr)")
    p.add_argument("--max-minutes", type=float, default=None,
                   help="stop (and save) after this long, counted from the start of the command (loading "
                        "and data included); training stops early enough for the final evaluation")
    p.add_argument("--save-dtype", default="auto", choices=["auto", "float16", "bfloat16", "float32"],
                   help="dtype of the exported weights (auto: float16 for delta, float32 for full)")
    p.add_argument("--resume", action="store_true", help="continue from OUT/state/trainer.pt")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu", help="cpu or cuda")
    p.add_argument("--autocast", default="auto", choices=["auto", "bf16", "none"],
                   help="bf16 matmuls in the training forward: auto = on CUDA and on CPUs with "
                        "AVX512-BF16/AMX only (on AVX2 bf16 is ~50x slower than fp32); the exported "
                        "weights stay float32/float16")
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads")
    p.add_argument("--bar-interval", type=float, default=1.0, help="progress bar refresh (s)")
    from training import exitblocks  # noqa: PLC0415
    grp = exitblocks.add_arguments(p)
    _EXIT_BLOCK_DEFAULTS.update({a.dest: a.default for a in grp._group_actions})
    _LORA_DEFAULTS.update({a.dest: a.default for a in p._actions if a.dest in _LORA_ONLY})
    from training import joint  # noqa: PLC0415
    jgrp = joint.add_arguments(p)
    _JOINT_DEFAULTS.update({a.dest: a.default for a in jgrp._group_actions})
    p.set_defaults(func=run)
