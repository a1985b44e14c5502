"""``mfs precipitate``: Knowledge Precipitation — train every tier exit of a nested model at once.

Loss per step: ``sum_i w_i * (ce * CE_i + kl * KL(original_top || exit_i))`` over the tiers' exits,
where the *original* is the base model's top tier. With low-rank updates (``--lora-rank > 0``) the
original is the same weights with the adapters switched off, so no second copy is held; with
full-parameter updates a frozen copy is kept when ``--kl > 0``.

The output directory is a nested checkpoint (``mfs.json`` + weights) after every checkpoint, so a run
stopped at any time leaves a loadable family; ``state/trainer.pt`` holds what ``--resume`` needs. The
batch order is a function of (seed, step), so a resumed run sees exactly the batches it would have.
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from kernels import TORCH_OPS
from worker import checkpoint as ckpt
from training import data as D
from family.manifest import Manifest, parse_tiers, resolve_base_arg
from worker.family import build_model
from worker.loader import BaseWeights, load_base
from worker.model import NestedModel

STATE = "state/trainer.pt"


@dataclass(slots=True)
class StepLoss:
    total: float
    ce: list[float]
    kl: list[float]


# ---- setup ----------------------------------------------------------------------------------
def trainable_groups(model: NestedModel, args) -> list[dict]:
    exit_ps = list(model.exit_norms.parameters())
    exit_ids = {id(p) for p in exit_ps}
    body = [p for p in model.parameters() if p.requires_grad and id(p) not in exit_ids]
    return [{"params": body, "lr": args.lr, "weight_decay": args.weight_decay, "name": "body"},
            {"params": exit_ps, "lr": args.exit_lr, "weight_decay": 0.0, "name": "exits"}]


def lr_factor(step: int, warmup: int, total: int, floor: float = 0.1) -> float:
    if step < warmup:
        return (step + 1) / warmup
    t = min(1.0, (step - warmup) / max(1, total - warmup))
    return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * t))


class Teacher:
    """The original model's top-tier log-probabilities, without keeping a second copy under LoRA."""

    def __init__(self, model: NestedModel, lora: bool):
        self.model = model
        self.lora = lora
        self.top = model.num_segments - 1
        self.top_norm = model.exit_norms[self.top].detach().clone()
        self.copy = None if lora else copy.deepcopy(model).requires_grad_(False).eval()

    @contextmanager
    def _original(self):
        m = self.model
        saved = m.exit_norms[self.top].data
        ckpt.set_lora_enabled(m, False)
        m.exit_norms[self.top].data = self.top_norm
        try:
            yield m
        finally:
            m.exit_norms[self.top].data = saved
            ckpt.set_lora_enabled(m, True)

    @torch.no_grad()
    def logprobs(self, ids: torch.Tensor, temperature: float) -> torch.Tensor:
        if self.copy is not None:
            h = self.copy.exit_hidden(ids)[-1]
            return F.log_softmax(self.copy.logits(h[:, :-1]).float() / temperature, -1)
        with self._original() as m:
            h = m.exit_hidden(ids)[-1]
            return F.log_softmax(m.logits(h[:, :-1]).float() / temperature, -1)


def step_loss(model: NestedModel, ids: torch.Tensor, weights: list[float], ce_w: list[float],
              kl_w: float, teacher: Teacher | None,
              temperature: float = 1.0) -> tuple[torch.Tensor, StepLoss]:
    """ids [B, S] -> (weighted loss, per-exit CE and KL). Exits share one teacher pass."""
    t_logp = teacher.logprobs(ids, temperature) if (teacher is not None and kl_w > 0) else None
    t_p = t_logp.exp() if t_logp is not None else None
    target = ids[:, 1:].reshape(-1)
    total = ids.new_zeros((), dtype=torch.float32)
    ces, kls = [], []
    for w, cw, h in zip(weights, ce_w, model.exit_hidden(ids)):
        if w == 0:  # an exit this phase does not train: skip its head
            ces.append(float("nan"))
            kls.append(float("nan")) if t_logp is not None else None
            continue
        logp = F.log_softmax(model.logits(h[:, :-1]).float(), -1)
        ce = F.nll_loss(logp.reshape(-1, logp.shape[-1]), target)
        loss = cw * ce
        if t_logp is not None:
            s_logp = F.log_softmax(model.logits(h[:, :-1]).float() / temperature, -1) \
                if temperature != 1.0 else logp
            kl = (t_p * (t_logp - s_logp)).sum(-1).mean() * temperature ** 2
            loss = loss + kl_w * kl
            kls.append(float(kl.detach()))
        total = total + w * loss
        ces.append(float(ce.detach()))
    return total, StepLoss(float(total.detach()), ces, kls)


# ---- checkpoints ----------------------------------------------------------------------------
def export(model: NestedModel, out: Path, base_ref: dict, family: str, tiers, kind: str,
           save_dtype: torch.dtype, info: dict) -> Path:
    fname = "delta.safetensors" if kind == "delta" else "weights.safetensors"
    tmp = out / (fname + ".tmp")
    ckpt.save_weights(model, tmp, kind, save_dtype, metadata=info)
    tmp.replace(out / fname)
    Manifest(family=family, base=base_ref, tiers=tiers, dtype="float32",
             weights={"kind": kind, "file": fname}, precipitated=True,
             notes=f"precipitated by `mfs precipitate`: {json.dumps(info)}").write(out)
    return out / fname


def save_state(model: NestedModel, opt, step: int, out: Path, extra: dict) -> None:
    trainable = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    path = out / STATE
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"step": step, "trainable": trainable, "optim": opt.state_dict(), **extra},
               str(path) + ".tmp")
    Path(str(path) + ".tmp").replace(path)


def load_state(model: NestedModel, opt, out: Path) -> dict:
    st = torch.load(out / STATE, map_location="cpu", weights_only=False)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for n, v in st["trainable"].items():
            params[n].copy_(v)
    opt.load_state_dict(st["optim"])
    return st


def _trim_log(path: Path, upto: int) -> None:
    """Drops log lines past the step a run resumes from (written after its last checkpoint)."""
    if not path.exists():
        return
    keep = [x for x in path.read_text().splitlines() if x.strip() and json.loads(x)["step"] <= upto]
    path.write_text("".join(x + "\n" for x in keep))


# ---- the run --------------------------------------------------------------------------------
def prepare(args, log=print) -> tuple[NestedModel, BaseWeights, D.BatchSampler, dict, str, list]:
    base_path, base_ref, family = resolve_base_arg(args.base)
    t0 = time.perf_counter()
    base = load_base(base_path)
    log(f"loaded {base_path} in {time.perf_counter() - t0:.1f}s")
    tiers = parse_tiers(args.tiers, base.hf_config.num_hidden_layers)
    # torch ops: they have autograd (the Triton serving kernels do not)
    model = build_model(base, tiers, torch.float32, args.device, ops=TORCH_OPS)
    tok = base.tokenizer
    if tok is None:
        raise ValueError("the base has no tokenizer; precipitation needs one to encode --data")
    out = Path(args.out)
    docs = D.read_sources(args.data, model, tok, out / "data", args.self_max_tokens, log)
    eos = model.cfg.eos_token_ids[0] if model.cfg.eos_token_ids else (tok.eos_token_id or 0)
    sources = [D.Source(name, D.encode_docs(tok, dd, eos)) for name, dd in docs]
    sampler = D.BatchSampler(sources, args.seq_len, args.seed)
    return model, base, sampler, base_ref, family, tiers


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
    if args.method == "joint":
        from training import joint  # noqa: PLC0415
        return joint.run(args)
    if args.method == "exit-blocks":
        from training import exitblocks  # noqa: PLC0415
        return exitblocks.run(args)
    lora_defaults(args)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    def log(msg: str) -> None:
        print(msg, flush=True)

    model, base, sampler, base_ref, family, tiers = prepare(args, log)
    del base
    nt = model.num_segments
    weights = [float(x) for x in args.weights.split(",")] if args.weights else [1.0] * nt
    ce_w = [float(x) for x in str(args.ce).split(",")]
    ce_w = ce_w * nt if len(ce_w) == 1 else ce_w
    if len(weights) != nt or len(ce_w) != nt:
        raise ValueError(f"--weights and --ce need 1 (--ce only) or {nt} values, one per tier")
    lora = args.lora_rank > 0
    model.requires_grad_(not lora)
    if lora:
        ckpt.add_lora(model, args.lora_rank, args.lora_alpha)
    elif args.freeze_embeddings:
        model.embed_tokens.weight.requires_grad_(False)  # with tied embeddings: the head too
    model.exit_norms.requires_grad_(True)
    trainable = {id(p) for p in model.parameters() if p.requires_grad}
    teacher = Teacher(model, lora) if args.kl > 0 else None
    opt = torch.optim.AdamW(trainable_groups(model, args), betas=(0.9, 0.95), eps=1e-8)
    kind = "delta" if lora else "full"
    save_dtype = {"auto": torch.float16 if lora else torch.float32, "float16": torch.float16,
                  "bfloat16": torch.bfloat16, "float32": torch.float32}[args.save_dtype]

    step, tokens, train_s, st = 0, 0, 0.0, {}
    if args.resume and (out / STATE).exists():
        st = load_state(model, opt, out)
        step, tokens, train_s = st["step"], st["tokens"], st["train_s"]
        log(f"resumed at step {step} ({tokens} tokens, {train_s / 60:.1f} min trained)")
    _trim_log(out / "train_log.jsonl", step if args.resume else 0)
    logf = (out / "train_log.jsonl").open("a")
    n_train = sum(p.numel() for p in model.parameters() if p.requires_grad)
    log(f"tiers {[t.layers for t in tiers]}, {kind} updates, {n_train / 1e6:.2f}M trainable, "
        f"data {sampler.num_tokens}, {args.steps} steps x {args.accum} x {args.batch_size} x {args.seq_len}")

    def info() -> dict:
        return {"step": step, "tokens": tokens, "train_minutes": round(train_s / 60, 1),
                "data": args.data, "data_tokens": sampler.num_tokens, "seed": args.seed,
                "lora_rank": args.lora_rank, "weights": weights, "ce": ce_w, "kl": args.kl,
                "lr": args.lr, "exit_lr": args.exit_lr, "seq_len": args.seq_len,
                "batch": args.batch_size * args.accum}

    def checkpoint() -> None:
        save_state(model, opt, step, out, {"tokens": tokens, "train_s": train_s, "args": vars(args),
                                           "main_end": main_end})
        export(model, out, base_ref, family, tiers, kind, save_dtype, info())

    main_end = min(args.main_until or st.get("main_end") or args.steps, args.steps)
    total = main_end + args.repair_steps
    from tqdm import tqdm  # noqa: PLC0415
    bar = tqdm(total=total, initial=step, desc="precipitate", dynamic_ncols=True,
               mininterval=args.bar_interval)
    names = [t.name for t in tiers]
    last_save = time.monotonic()
    stop_at = time.monotonic() + args.max_minutes * 60 if args.max_minutes else None
    last_step = min(total, step + args.stop_after) if args.stop_after else total
    repair_w = [0.0] * (nt - 1) + [1.0]
    repair_ce = [0.0] * (nt - 1) + [ce_w[-1]]
    model.train()
    while step < last_step:
        repair = step >= main_end
        set_phase(model, trainable, repair)
        if repair:
            f = lr_factor(step - main_end, 0, args.repair_steps)
            lrs = {"body": (args.repair_lr or args.lr) * f, "exits": args.exit_lr * f}
        else:
            f = lr_factor(step, args.warmup, args.steps)
            lrs = {"body": args.lr * f, "exits": args.exit_lr * f}
        for g in opt.param_groups:
            g["lr"] = lrs[g["name"]]
        t0 = time.perf_counter()
        sl, gn, n = train_step(model, opt, sampler, step, args, repair_w if repair else weights,
                               repair_ce if repair else ce_w, teacher)
        step += 1
        tokens += n
        train_s += time.perf_counter() - t0
        logf.write(json.dumps({"step": step, "tokens": tokens, "phase": "repair" if repair else "main",
                               "loss": sl.total, "ce": sl.ce, "kl": sl.kl, "grad_norm": gn,
                               "lr_factor": f, "train_s": round(train_s, 1)}) + "\n")
        logf.flush()
        bar.set_postfix_str(" ".join(f"{n}={c:.2f}" + (f"/{k:.2f}" if sl.kl else "")
                                     for n, c, k in zip(names, sl.ce, sl.kl or sl.ce)), refresh=False)
        bar.update(1)
        now = time.monotonic()
        if args.save_every_min and now - last_save >= args.save_every_min * 60:
            checkpoint()
            last_save = now
        if stop_at is not None and now >= stop_at:
            if step >= main_end or not args.repair_steps:
                log(f"\n--max-minutes reached at step {step}")
                break
            log(f"\n--max-minutes reached at step {step}: the main phase ends here, repair follows")
            main_end, stop_at = step, None
            total = main_end + args.repair_steps
            last_step = min(last_step, total)
            bar.total = total
    bar.close()
    checkpoint()
    log(f"done: step {step}, {tokens} tokens, {train_s / 60:.1f} min; nested checkpoint in {out}")
    return 0


def set_phase(model: NestedModel, trainable: set[int], repair: bool) -> None:
    """Main phase: every trainable parameter. Repair phase: only the top segment's layers and exit,
    which no lower tier uses, so the top tier is pulled back to the original at no cost to the others."""
    top = model.num_segments - 1
    top_ids = {id(p) for i in model.segment_layers(top) for p in model.layers[i].parameters()}
    top_ids.add(id(model.exit_norms[top]))
    for p in model.parameters():
        p.requires_grad_(id(p) in trainable and (not repair or id(p) in top_ids))


def train_step(model, opt, sampler, step: int, args, weights, ce_w, teacher) -> tuple[StepLoss, float, int]:
    """One optimizer step over ``--accum`` micro-batches: (mean losses, grad norm, tokens)."""
    agg, n = None, 0
    for micro in range(args.accum):
        ids = sampler.batch(step, micro, args.batch_size).to(args.device)
        with torch.autocast(torch.device(args.device).type, dtype=torch.bfloat16,
                            enabled=args.autocast == "bf16"):
            loss, sl = step_loss(model, ids, weights, ce_w, args.kl, teacher, args.temperature)
        (loss / args.accum).backward()
        agg = sl if agg is None else StepLoss(agg.total + sl.total,
                                              [a + b for a, b in zip(agg.ce, sl.ce)],
                                              [a + b for a, b in zip(agg.kl, sl.kl)])
        n += ids.numel()
    params = [p for g in opt.param_groups for p in g["params"] if p.grad is not None]
    gn = float(torch.nn.utils.clip_grad_norm_(params, args.grad_clip))
    opt.step()
    opt.zero_grad(set_to_none=True)
    k = args.accum
    return StepLoss(agg.total / k, [c / k for c in agg.ce], [x / k for x in agg.kl]), gn, n


_EXIT_BLOCK_DEFAULTS: dict = {}
_JOINT_DEFAULTS: dict = {}
_LORA_ONLY = ("accum", "weights", "kl", "temperature", "lora_rank", "lora_alpha", "exit_lr",
              "freeze_embeddings", "stop_after", "main_until", "repair_steps", "repair_lr", "save_dtype",
              "bar_interval")
_LORA_DEFAULTS: dict = {}


def check_method_options(args, method: str) -> None:
    """Never accept an option and ignore it: each method refuses the options only others read."""
    from training.joint import JOINT_SHARED  # noqa: PLC0415
    own = {"lora": set(_LORA_DEFAULTS), "exit-blocks": set(_EXIT_BLOCK_DEFAULTS),
           "joint": set(_JOINT_DEFAULTS) | set(JOINT_SHARED)}[method]
    for name, dflt in {**_LORA_DEFAULTS, **_EXIT_BLOCK_DEFAULTS, **_JOINT_DEFAULTS}.items():
        if name not in own and getattr(args, name) != dflt:
            raise ValueError(f"--{name.replace('_', '-')} is not an option of --method {method}")


def lora_defaults(args) -> None:
    """Fills the options whose default depends on --method (None on the command line)."""
    from engine.runtime import autocast_dtype  # noqa: PLC0415
    args.lr = 5e-4 if args.lr is None else args.lr
    args.ce = "0.2" if args.ce is None else args.ce
    args.steps = 400 if args.steps is None else args.steps
    args.autocast = "bf16" if autocast_dtype(args.autocast, args.device) else "none"


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
    p.add_argument("--save-every-min", type=float, default=5.0, help="checkpoint period (minutes)")
    p.add_argument("--stop-after", type=int, default=None,
                   help="stop (and save) after this many steps of this invocation; --resume goes on")
    p.add_argument("--main-until", type=int, default=None,
                   help="end the main phase at this step (the lr schedule still spans --steps)")
    p.add_argument("--repair-steps", type=int, default=0,
                   help="after the main phase: steps that train only the top segment (layers above "
                        "the second-highest exit) and the top exit on the top tier's loss")
    p.add_argument("--repair-lr", type=float, default=None, help="repair-phase lr (default --lr)")
    p.add_argument("--max-minutes", type=float, default=None,
                   help="stop (and save) after this long (joint: counted from the start of the command, "
                        "data included)")
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
