"""``mfs precipitate --method lora``: Knowledge Precipitation, every tier exit of a nested model trained
at once, with low-rank updates (``--lora-rank``) or full-parameter ones (``--lora-rank 0``).

Loss per step: ``sum_i w_i * (ce * CE_i + kl * KL(original_top || exit_i))`` over the tiers' exits,
where the *original* is the base model's top tier. With low-rank updates the original is the same
weights with the adapters switched off, so no second copy is held; with full-parameter updates a frozen
copy is kept when ``--kl > 0``. After the main phase, ``--repair-steps`` train the top segment alone.

The method is a plug-in of training/loop.py, which runs it: the output directory is a nested
checkpoint (``mfs.json`` + weights) after every checkpoint, so a run stopped at any time leaves a
loadable family; ``state/trainer.pt`` holds what ``--resume`` needs; ``train_log.jsonl`` has a line per
step. The batch order is a function of (seed, step), so a resumed run sees exactly the batches it would
have.
"""
from __future__ import annotations

import copy
import json
import math
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from family.manifest import Manifest, parse_tiers, resolve_base_arg
from kernels import TORCH_OPS
from training import data as D
from training.loop import Budget, Method, Options, RunState, StepResult, Trainer, method_defaults, say
from worker import checkpoint as ckpt
from worker.family import build_model
from family.loader import BaseWeights, load_base
from worker.model import NestedModel

SAVE_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


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


# ---- the artifact ---------------------------------------------------------------------------
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


# ---- the method ----------------------------------------------------------------------------
def load_data(args, log=print) -> tuple[NestedModel, BaseWeights, D.BatchSampler, dict, str, list]:
    """The base cut at ``--tiers`` (fp32, torch ops) and the batch sampler over ``--data``:
    (model, base, sampler, base_ref, family, tiers)."""
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


def set_phase(model: NestedModel, trainable: set[int], repair: bool) -> None:
    """Main phase: every trainable parameter. Repair phase: only the top segment's layers and exit,
    which no lower tier uses, so the top tier is pulled back to the original at no cost to the others."""
    top = model.num_segments - 1
    top_ids = {id(p) for i in model.segment_layers(top) for p in model.layers[i].parameters()}
    top_ids.add(id(model.exit_norms[top]))
    for p in model.parameters():
        p.requires_grad_(id(p) in trainable and (not repair or id(p) in top_ids))


def train_step(model, opt, micro: list[torch.Tensor], args, weights, ce_w, teacher) -> tuple[StepLoss, float]:
    """One optimizer step over the micro-batches of a step: (mean losses, grad norm)."""
    agg = None
    for ids in micro:
        with torch.autocast(torch.device(args.device).type, dtype=torch.bfloat16,
                            enabled=args.autocast == "bf16"):
            loss, sl = step_loss(model, ids, weights, ce_w, args.kl, teacher, args.temperature)
        (loss / len(micro)).backward()
        agg = sl if agg is None else StepLoss(agg.total + sl.total,
                                              [a + b for a, b in zip(agg.ce, sl.ce)],
                                              [a + b for a, b in zip(agg.kl, sl.kl)])
    params = [p for g in opt.param_groups for p in g["params"] if p.grad is not None]
    gn = float(torch.nn.utils.clip_grad_norm_(params, args.grad_clip))
    opt.step()
    opt.zero_grad(set_to_none=True)
    k = len(micro)
    return StepLoss(agg.total / k, [c / k for c in agg.ce], [x / k for x in agg.kl]), gn


def lora_defaults(args) -> None:
    """Fills the options whose default depends on --method (None on the command line)."""
    from engine.runtime import autocast_dtype  # noqa: PLC0415
    method_defaults(args, lr=5e-4, ce="0.2", steps=400)
    args.autocast = "bf16" if autocast_dtype(args.autocast, args.device) else "none"



class LoRA(Method):
    """The LoRA (or full-parameter) method: a loss at every exit, a repair phase at the end."""

    def __init__(self, args, log=say):
        lora_defaults(args)
        self.args, self.log = args, log

    @property
    def total(self) -> int:
        return self.main_end + self.args.repair_steps

    def prepare(self, resuming: bool) -> None:
        a = self.args
        model, base, self.sampler, self.base_ref, self.family, self.tiers = load_data(a, self.log)
        del base
        nt = model.num_segments
        self.weights = [float(x) for x in a.weights.split(",")] if a.weights else [1.0] * nt
        ce_w = [float(x) for x in str(a.ce).split(",")]
        self.ce_w = ce_w * nt if len(ce_w) == 1 else ce_w
        if len(self.weights) != nt or len(self.ce_w) != nt:
            raise ValueError(f"--weights and --ce need 1 (--ce only) or {nt} values, one per tier")
        lora = a.lora_rank > 0
        model.requires_grad_(not lora)
        if lora:
            ckpt.add_lora(model, a.lora_rank, a.lora_alpha)
        elif a.freeze_embeddings:
            model.embed_tokens.weight.requires_grad_(False)  # with tied embeddings: the head too
        model.exit_norms.requires_grad_(True)
        self.model, self.kind = model, "delta" if lora else "full"
        self.trainable = {id(p) for p in model.parameters() if p.requires_grad}
        self.teacher = Teacher(model, lora) if a.kl > 0 else None
        self.opt = torch.optim.AdamW(trainable_groups(model, a), betas=(0.9, 0.95), eps=1e-8)
        self.save_dtype = (torch.float16 if lora else torch.float32) if a.save_dtype == "auto" \
            else SAVE_DTYPES[a.save_dtype]
        self.main_end = min(a.main_until or a.steps, a.steps)
        n_train = sum(p.numel() for p in model.parameters() if p.requires_grad)
        self.log(f"tiers {[t.layers for t in self.tiers]}, {self.kind} updates, {n_train / 1e6:.2f}M "
                 f"trainable, data {self.sampler.num_tokens}, {a.steps} steps x {a.accum} x {a.batch_size} "
                 f"x {a.seq_len}")
        model.train()

    def batch(self, step: int) -> list[torch.Tensor]:
        a = self.args
        return [self.sampler.batch(step, micro, a.batch_size).to(a.device) for micro in range(a.accum)]

    def step(self, step: int, batch: list[torch.Tensor]) -> StepResult:
        a, nt = self.args, self.model.num_segments
        repair = step >= self.main_end
        set_phase(self.model, self.trainable, repair)
        if repair:
            f = lr_factor(step - self.main_end, 0, a.repair_steps)
            lrs = {"body": (a.repair_lr or a.lr) * f, "exits": a.exit_lr * f}
            weights, ce_w = [0.0] * (nt - 1) + [1.0], [0.0] * (nt - 1) + [self.ce_w[-1]]
        else:
            f = lr_factor(step, a.warmup, a.steps)
            lrs = {"body": a.lr * f, "exits": a.exit_lr * f}
            weights, ce_w = self.weights, self.ce_w
        for g in self.opt.param_groups:
            g["lr"] = lrs[g["name"]]
        sl, gn = train_step(self.model, self.opt, batch, a, weights, ce_w, self.teacher)
        losses = " ".join(f"{t.name}={c:.2f}" + (f"/{k:.2f}" if sl.kl else "")
                          for t, c, k in zip(self.tiers, sl.ce, sl.kl or sl.ce))
        return StepResult(sum(ids.numel() for ids in batch), losses,
                          {"phase": "repair" if repair else "main", "loss": sl.total, "ce": sl.ce,
                           "kl": sl.kl, "grad_norm": gn, "lr_factor": f})

    def on_budget(self, step: int) -> int | None:
        if step >= self.main_end or not self.args.repair_steps:
            return None
        self.log(f"--max-minutes reached at step {step}: the main phase ends here, repair follows")
        self.main_end = step
        return self.total

    def export(self, run: RunState, ev=None) -> None:
        a = self.args
        info = {"step": run.step, "tokens": run.tokens, "train_minutes": round(run.train_s / 60, 1),
                "data": a.data, "data_tokens": self.sampler.num_tokens, "seed": a.seed,
                "lora_rank": a.lora_rank, "weights": self.weights, "ce": self.ce_w, "kl": a.kl,
                "lr": a.lr, "exit_lr": a.exit_lr, "seq_len": a.seq_len, "batch": a.batch_size * a.accum}
        export(self.model, Path(a.out), self.base_ref, self.family, self.tiers, self.kind, self.save_dtype,
               info)

    def state_dict(self, run: RunState) -> dict:
        # every trainable tensor, also those the repair phase leaves alone (requires_grad off)
        trainable = {n: p.detach().clone() for n, p in self.model.named_parameters() if id(p) in self.trainable}
        return {"step": run.step, "trainable": trainable, "optim": self.opt.state_dict(),
                "tokens": run.tokens, "train_s": run.train_s, "args": vars(self.args), "main_end": self.main_end}

    def load_state_dict(self, saved: dict) -> RunState:
        a = self.args
        params = dict(self.model.named_parameters())
        with torch.no_grad():
            for n, v in saved["trainable"].items():
                params[n].copy_(v)
        self.opt.load_state_dict(saved["optim"])
        self.main_end = min(a.main_until or saved.get("main_end") or a.steps, a.steps)
        return RunState(step=saved["step"], tokens=saved["tokens"], train_s=saved["train_s"])


def run(args) -> int:
    budget = Budget(args.max_minutes)
    return Trainer(LoRA(args), Options.of(args, "precipitate"), budget).run()
