"""``mfs precipitate --method joint``: every tier of the nested model trained at once.

Loss per step: ``L = sum_t lambda_t * (kl * KL_topk(original || tier t) + ce * CE_t)`` (``--weights``
are the lambdas). The teacher is the frozen original's top tier: the same weights with the low-rank
delta switched off, so no second copy is held. What learns:

* the trunk, through one shared low-rank delta on every linear of every trunk layer (``--rank``,
  ``worker/checkpoint.py: LoRALinear``) — the part the exit-block recipe never touches;
* each lower tier's private exit block and norm (the exit-block machinery: ``--block-layers``, ``--init``;
  ``--init-from`` warm-starts them from an exit-blocks artifact, and since the delta starts at zero,
  step 0 is that artifact exactly);
* the top tier's norm. The top tier runs on the same merged trunk, so it drifts; its own loss term holds
  it, and the held-out evaluation reports its perplexity against the original's.

The artifact is a ``delta`` weights file (adapters, exit norms, exit blocks; fp16, kept <= 32 MB by
:func:`artifact_bytes`: rank 16 with two-layer and one-layer blocks on SmolLM2-135M is 31.0 MB), merged at load and then quantized like any delta. Every ``--eval-every`` steps
the held-out set of ``mfs eval`` is scored and the best state so far exported; ``--resume`` continues
from ``OUT/state/trainer.pt`` (batch order is a function of (seed, step)). ``--max-minutes`` counts from
the start of the command (data included), so a wall-clock budget holds end to end.
"""
from __future__ import annotations

import json
import math
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from engine.runtime import autocast_dtype
from family.manifest import DEFAULT_FLOOR, Manifest
from training import data as D
from training.exit_features import heldout_windows, training_windows
from training.exitblocks import build_exit_model, ce_sample, exit_loss, exit_parameters, warm_start
from training.loop import (Budget, Evaluation, Method, Options, RunState, StepResult, Trainer, load_tensors_state,
                           method_defaults, say, tensors_state)
from worker import checkpoint as ckpt
from worker.model import NestedModel

WEIGHTS = "joint.safetensors"
MAX_ARTIFACT_MB = 32.0


# ---- the model ---------------------------------------------------------------------------------
def artifact_bytes(model: NestedModel, dtype_bytes: int = 2) -> int:
    """Bytes of the exported delta: adapters, exit blocks and every exit norm."""
    n = sum(p.numel() for n_, p in model.named_parameters() if ".lora_" in n_ or n_.startswith(
        ("exit_blocks.", "exit_norms.")))
    return n * dtype_bytes


def build_joint(args, log=print):
    """(model with exit blocks and no adapters yet, tokenizer, base_ref, family, tiers)."""
    model, tok, base_ref, family, tiers = build_exit_model(args)
    if len(tiers) < 2:
        raise ValueError("--tiers needs at least two tiers for --method joint")
    return model, tok, base_ref, family, tiers


def make_trainable(model: NestedModel, rank: int, alpha: float | None) -> dict[str, list]:
    """Adds the shared trunk delta; returns the parameter groups (delta, exits)."""
    if rank < 1:
        raise ValueError("--rank must be >= 1 for --method joint (the trunk's low-rank delta)")
    loras = ckpt.add_lora(model, rank, alpha)  # trunk layers only: exit blocks are not in model.layers
    delta = [p for m in loras for p in (m.lora_A, m.lora_B)]
    exits = exit_parameters(model, list(range(model.num_segments - 1))) + [model.exit_norms[-1]]
    for p in delta + exits:
        p.requires_grad_(True)
    return {"delta": delta, "exits": exits}


class Original:
    """The frozen original's top tier on the same module (delta off, its own top norm)."""

    def __init__(self, model: NestedModel):
        self.model = model
        self.norm = model.exit_norms[-1].detach().clone()

    @torch.no_grad()
    def hidden(self, ids: torch.Tensor) -> torch.Tensor:
        m = self.model
        ckpt.set_lora_enabled(m, False)
        try:
            x = m.trunk_states(ids)[-1]
        finally:
            ckpt.set_lora_enabled(m, True)
        return m.ops.rms_norm(x, self.norm, m.cfg.rms_eps)

    @torch.no_grad()
    def topk(self, ids: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        lp = torch.log_softmax(self.model.logits(self.hidden(ids)).float(), -1)
        v, ix = lp.topk(k, dim=-1)
        return ix, v


# ---- loss --------------------------------------------------------------------------------------
def joint_loss(model: NestedModel, ids: torch.Tensor, tk_ids: torch.Tensor, tk_lp: torch.Tensor,
               lambdas: list[float], kl_w: float, ce_w: float, ce_frac: float,
               gen: torch.Generator) -> tuple[torch.Tensor, list[float], list[float]]:
    """ids [B, S]; teacher top-k [B, S, k] -> (sum_t lambda_t L_t, KL per tier, CE per tier)."""
    ce_pos, targets = ce_sample(ids, ce_w, ce_frac, gen)
    total = torch.zeros((), device=ids.device)
    kls, ces = [], []
    for lam, h in zip(lambdas, model.exit_hidden(ids)):
        if lam == 0:
            kls.append(float("nan"))
            ces.append(float("nan"))
            continue
        loss, kl, ce = exit_loss(model, h, tk_ids, tk_lp, ce_pos, targets, kl_w, ce_w)
        total = total + lam * loss
        kls.append(kl)
        ces.append(ce)
    return total, kls, ces


@torch.no_grad()
def evaluate_joint(model: NestedModel, original: Original, windows: torch.Tensor,
                   batch: int = 4) -> dict:
    """Held-out perplexity of every tier and of the original; greedy agreement with the original."""
    nt = model.num_segments
    nll, agree, agree_top, count, nll_o = [0.0] * nt, [0] * nt, [0] * nt, 0, 0.0
    for i in range(0, windows.shape[0], batch):
        ids = windows[i:i + batch].to(model.embed_tokens.weight.device)
        tgt = ids[:, 1:].reshape(-1)
        o_logits = model.logits(original.hidden(ids)[:, :-1]).float().reshape(tgt.numel(), -1)
        nll_o += float(F.cross_entropy(o_logits, tgt, reduction="sum"))
        o_arg = o_logits.argmax(-1)
        argm = []
        for t, h in enumerate(model.exit_hidden(ids)):
            lg = model.logits(h[:, :-1]).float().reshape(tgt.numel(), -1)
            nll[t] += float(F.cross_entropy(lg, tgt, reduction="sum"))
            argm.append(lg.argmax(-1))
            agree[t] += int((argm[-1] == o_arg).sum())
        for t in range(nt):
            agree_top[t] += int((argm[t] == argm[-1]).sum())
        count += tgt.numel()
    top = math.exp(nll[-1] / count)
    out = {"original_ppl": math.exp(nll_o / count), "top_ppl": top, "tokens": count, "tiers": {}}
    out["top_vs_original"] = top / out["original_ppl"]
    for t in range(nt):
        ppl = math.exp(nll[t] / count)
        out["tiers"][model.tiers[t].name] = {"ppl": ppl, "ppl_vs_top": ppl / top,
                                             "agree_original": agree[t] / count,
                                             "agree_top": agree_top[t] / count}
    return out


# ---- export ------------------------------------------------------------------------------------
def export(model: NestedModel, out: Path, base_ref: dict, family: str, tiers, info: dict,
           notes: str) -> Path:
    """A ``delta`` file with the exit blocks (worker/checkpoint.py: apply_weights copies them)."""
    from safetensors.torch import save_file  # noqa: PLC0415
    sd = ckpt.delta_state(model, train_layer_norms=False)
    for k, v in model.state_dict().items():
        if k.startswith("exit_blocks."):
            sd[k] = v.detach()
    sd = {k: v.to(torch.float16).cpu().contiguous() for k, v in sd.items()}
    tmp = out / (WEIGHTS + ".tmp")
    save_file(sd, str(tmp), metadata={"kind": "delta", "format": "mfs-weights", "info": json.dumps(info)})
    tmp.replace(out / WEIGHTS)
    Manifest(family=family, base=base_ref, tiers=tiers, dtype="float32",
             weights={"kind": "delta", "file": WEIGHTS}, precipitated=True, notes=notes,
             quality=info.get("quality")).write(out)
    return out / WEIGHTS


def _notes(family: str, tiers, args, st: RunState, ev: dict, prov: dict) -> str:
    q = ", ".join(f"{n} {v['ppl_vs_top']:.3f}x top perplexity, {v['agree_original']:.0%} agreement"
                  for n, v in ev["tiers"].items())
    return (f"{family} cut after layers {[t.layers for t in tiers]}, trained jointly (mfs precipitate "
            f"--method joint: a shared rank-{args.rank} delta on every trunk linear, a private exit block "
            f"and norm per lower tier; lambdas {args.weights}; {st.tokens:,} trained tokens, "
            f"{st.train_s / 60:.1f} min). Held-out: {q}; top tier {ev['top_vs_original']:.4f}x the "
            f"original's perplexity (the top tier drifts: it is NOT the original bit for bit). "
            f"Data: {json.dumps(prov)}.")


# ---- the method --------------------------------------------------------------------------------
class Joint(Method):
    """Every tier at once: a shared trunk delta and private exit blocks; a plug-in of training/loop.py."""

    def __init__(self, args, budget: Budget, log=say):
        method_defaults(args, lr=5e-4, ce=0.1, steps=2000)
        self.args, self.budget, self.log, self.total = args, budget, log, args.steps

    def prepare(self, resuming: bool) -> None:
        a, log = self.args, self.log
        self.amp = autocast_dtype(a.autocast, a.device)
        model, tok, self.base_ref, self.family, self.tiers = build_joint(a, log)
        nt = model.num_segments
        self.lambdas = [float(x) for x in a.weights.split(",")] if a.weights else [1.0] * nt
        if len(self.lambdas) != nt or any(x < 0 for x in self.lambdas):
            raise ValueError(f"--weights needs {nt} values >= 0, one lambda per tier (lowest first)")
        self.model = model
        self.train_w, self.held_w, self.prov = self._data(tok)
        if a.init_from and not resuming:
            warm_start(model, a.init_from, list(range(nt - 1)), log)
        groups = make_trainable(model, a.rank, a.alpha)
        size_mb = artifact_bytes(model) / 1e6
        if size_mb > MAX_ARTIFACT_MB:
            raise ValueError(f"the artifact would be {size_mb:.1f} MB fp16 (> {MAX_ARTIFACT_MB} MB): lower "
                             "--rank or --block-layers")
        self.original = Original(model)  # before a resume loads the trained top norm
        self.opt = torch.optim.AdamW([{"params": groups["delta"], "lr": a.lr, "name": "delta"},
                                      {"params": groups["exits"], "lr": a.block_lr, "name": "exits"}],
                                     betas=(0.9, 0.98), weight_decay=a.weight_decay)
        self.params = [p for g in groups.values() for p in g]
        self.gen = torch.Generator().manual_seed(a.seed + 1)  # the cross-entropy positions
        log(f"joint: tiers {[t.layers for t in self.tiers]}, rank {a.rank}, "
            f"{sum(p.numel() for p in self.params) / 1e6:.2f}M trainable, artifact {size_mb:.1f} MB fp16, "
            f"lambdas {self.lambdas}, {a.threads} thread(s), autocast {self.amp or 'off (fp32)'}")
        model.train()

    def _data(self, tok) -> tuple[torch.Tensor, torch.Tensor, dict]:
        """Training and held-out windows, read while the model is still the plain original: it writes
        the answers (the held-out ones first: the evaluation needs them, training can do with fewer),
        within ``--data-share`` of the budget. (training windows, held-out windows, provenance)."""
        a, model, log = self.args, self.model, self.log
        eos = model.cfg.eos_token_ids[0] if model.cfg.eos_token_ids else (tok.eos_token_id or 0)
        t0 = time.monotonic()
        deadline = self.budget.share(a.data_share)
        held_w = heldout_windows(model, tok, eos, a.seq_len, a.heldout_tokens, Path(a.out) / "data", log,
                                 a.heldout_answers == "generate", deadline=deadline)
        docs = D.read_sources(a.data, model, tok, Path(a.out) / "data", a.self_max_tokens, log,
                              deadline=deadline, batch=a.gen_batch)
        train_w, mix = training_windows(docs, tok, eos, a.seq_len, a.cache_tokens, a.seed)
        prov = {"spec": a.data, "window_tokens": mix, "windows": int(train_w.shape[0]),
                "seq_len": a.seq_len, "heldout_tokens": int(held_w.numel()),
                "answers": D.answer_provenance(Path(a.out) / "data"),
                "data_seconds": round(time.monotonic() - t0, 1)}
        log(f"data: {train_w.shape[0]} windows x {a.seq_len} ({mix}) in {prov['data_seconds']} s; "
            f"held-out {held_w.numel()} tokens")
        return train_w, held_w, prov

    def batch(self, step: int) -> torch.Tensor:
        a, n_win = self.args, self.train_w.shape[0]
        g = np.random.default_rng([a.seed, step])
        return self.train_w[np.sort(g.choice(n_win, size=min(a.batch_size, n_win), replace=False))].to(a.device)

    def step(self, step: int, ids: torch.Tensor) -> StepResult:
        a = self.args
        tk_ids, tk_lp = self.original.topk(ids, a.topk)  # the teacher in fp32: the original as it is
        with torch.autocast(torch.device(a.device).type, dtype=self.amp or torch.bfloat16,
                            enabled=self.amp is not None):
            loss, kls, ces = joint_loss(self.model, ids, tk_ids, tk_lp, self.lambdas, a.kl, a.ce, a.ce_frac,
                                        self.gen)
        lr_f = min(1.0, (step + 1) / max(1, a.warmup)) * self.budget.decay(a.decay_minutes)
        for grp in self.opt.param_groups:
            grp["lr"] = (a.lr if grp["name"] == "delta" else a.block_lr) * lr_f
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, a.grad_clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return StepResult(ids.numel(), " ".join(f"{t.name}={k:.3f}/{c:.2f}"
                                                for t, k, c in zip(self.tiers, kls, ces)))

    def evaluate(self) -> Evaluation:
        self.model.eval()
        ev = evaluate_joint(self.model, self.original, self.held_w)
        self.model.train()
        score = sum(lam * math.log(v["ppl"]) for lam, v in zip(self.lambdas, ev["tiers"].values()))
        metrics = {"top_vs_original": round(ev["top_vs_original"], 4),
                   **{f"{n}_{k}": round(v, 4) for n, d in ev["tiers"].items() for k, v in d.items()}}
        return Evaluation(metrics, score, ev)

    def export(self, run: RunState, ev: Evaluation) -> None:
        a, d, out = self.args, ev.detail, Path(self.args.out)
        quality = {"floor": dict(DEFAULT_FLOOR), **{n: {"ppl_vs_top": round(v["ppl_vs_top"], 3),
                                                        "agree_top": round(v["agree_top"], 3)}
                                                    for n, v in list(d["tiers"].items())[:-1]}}
        info = {"method": "joint", "step": run.step, "tokens": run.tokens,
                "train_minutes": ev.record["train_minutes"], "rank": a.rank, "lambdas": self.lambdas,
                "kl": a.kl, "ce": a.ce, "topk": a.topk, "lr": a.lr, "block_lr": a.block_lr, "seed": a.seed,
                "data": self.prov, "top_vs_original": round(d["top_vs_original"], 4), "quality": quality}
        export(self.model, out, self.base_ref, self.family, self.tiers, info,
               _notes(self.family, self.tiers, a, run, d, self.prov))
        (out / "provenance.json").write_text(json.dumps(self.prov, indent=2) + "\n")

    def state_dict(self, run: RunState) -> dict:
        return tensors_state(self.model, lambda k: ".lora_" in k or k.startswith(("exit_blocks.", "exit_norms.")),
                             "trainable", self.opt, self.gen, run)

    def load_state_dict(self, saved: dict) -> RunState:
        return load_tensors_state(self.model, "trainable", self.opt, self.gen, saved)


def run(args) -> int:
    budget = Budget(args.max_minutes)  # counted from here: model, data and answers included
    opts = Options.of(args, "joint", eval_every=args.eval_every, patience=args.patience, reserve_s=args.reserve_s)
    return Trainer(Joint(args, budget), opts, budget).run()


JOINT_SHARED = ("weights", "kl", "block_layers", "init", "init_from", "cache_tokens",
                "heldout_tokens", "heldout_answers",
                "topk", "ce_frac", "eval_every", "patience", "decay_minutes")


def add_arguments(p):
    """The options of ``--method joint`` alone (it also reads JOINT_SHARED of the other groups)."""
    g = p.add_argument_group("--method joint (also: --weights as the lambdas, --kl, --block-layers, "
                             "--init, --cache-tokens as the training-window budget, --topk, --ce-frac, "
                             "--eval-every, --patience, --decay-minutes, --heldout-tokens)")
    g.add_argument("--rank", type=int, default=16, help="rank of the shared trunk delta (every linear)")
    g.add_argument("--alpha", type=float, default=None, help="delta scale alpha/rank (default alpha = rank)")
    g.add_argument("--block-lr", type=float, default=3e-4, help="lr of the exit blocks and exit norms")
    g.add_argument("--data-share", type=float, default=0.3,
                   help="with --max-minutes: answer generation stops at this share of the budget")
    g.add_argument("--gen-batch", type=int, default=32, help="prompts per engine batch when generating answers")
    g.add_argument("--reserve-s", type=float, default=10.0,
                   help="with --max-minutes: seconds kept for the final export beyond the last eval's time")
    return g
