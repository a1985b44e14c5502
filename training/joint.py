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
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from family.manifest import DEFAULT_FLOOR, Manifest
from training import data as D
from training.exit_features import heldout_windows, training_windows
from training.exitblocks import build_exit_model, ce_sample, exit_loss, exit_parameters, warm_start
from worker import checkpoint as ckpt
from worker.model import NestedModel

STATE = "state/trainer.pt"
WEIGHTS = "joint.safetensors"
MAX_ARTIFACT_MB = 32.0


@dataclass(slots=True)
class JointState:
    step: int = 0
    tokens: int = 0
    train_s: float = 0.0
    best: dict | None = None
    bad_evals: int = 0
    history: list = field(default_factory=list)


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


def _notes(family: str, tiers, args, st: JointState, ev: dict, prov: dict) -> str:
    q = ", ".join(f"{n} {v['ppl_vs_top']:.3f}x top perplexity, {v['agree_original']:.0%} agreement"
                  for n, v in ev["tiers"].items())
    return (f"{family} cut after layers {[t.layers for t in tiers]}, trained jointly (mfs precipitate "
            f"--method joint: a shared rank-{args.rank} delta on every trunk linear, a private exit block "
            f"and norm per lower tier; lambdas {args.weights}; {st.tokens:,} trained tokens, "
            f"{st.train_s / 60:.1f} min). Held-out: {q}; top tier {ev['top_vs_original']:.4f}x the "
            f"original's perplexity (the top tier drifts: it is NOT the original bit for bit). "
            f"Data: {json.dumps(prov)}.")


# ---- the run -----------------------------------------------------------------------------------
def _defaults(args) -> None:
    args.lr = 5e-4 if args.lr is None else args.lr
    args.ce = 0.1 if args.ce is None else float(args.ce)
    args.steps = 2000 if args.steps is None else args.steps


def run(args) -> int:
    from engine.runtime import autocast_dtype, progress  # noqa: PLC0415
    t_start = time.monotonic()
    _defaults(args)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    out = Path(args.out)
    (out / "state").mkdir(parents=True, exist_ok=True)
    stop_at = t_start + args.max_minutes * 60 if args.max_minutes else None
    amp = autocast_dtype(args.autocast, args.device)

    def log(msg: str) -> None:
        print(msg, flush=True)

    model, tok, base_ref, family, tiers = build_joint(args, log)
    nt = model.num_segments
    lambdas = [float(x) for x in args.weights.split(",")] if args.weights else [1.0] * nt
    if len(lambdas) != nt or any(x < 0 for x in lambdas):
        raise ValueError(f"--weights needs {nt} values >= 0, one lambda per tier (lowest first)")
    eos = model.cfg.eos_token_ids[0] if model.cfg.eos_token_ids else (tok.eos_token_id or 0)
    # data first, while the model is still the plain original: it writes the answers (the held-out
    # ones first: the evaluation needs them, training can do with fewer)
    t0 = time.monotonic()
    data_deadline = None if stop_at is None else t_start + args.max_minutes * 60 * args.data_share
    held_w = heldout_windows(model, tok, eos, args.seq_len, args.heldout_tokens, out / "data", log,
                             args.heldout_answers == "generate", deadline=data_deadline)
    docs = D.read_sources(args.data, model, tok, out / "data", args.self_max_tokens, log,
                          deadline=data_deadline, batch=args.gen_batch)
    train_w, mix = training_windows(docs, tok, eos, args.seq_len, args.cache_tokens, args.seed)
    prov = {"spec": args.data, "window_tokens": mix, "windows": int(train_w.shape[0]),
            "seq_len": args.seq_len, "heldout_tokens": int(held_w.numel()),
            "answers": D.answer_provenance(out / "data"), "data_seconds": round(time.monotonic() - t0, 1)}
    log(f"data: {train_w.shape[0]} windows x {args.seq_len} ({mix}) in {prov['data_seconds']} s; "
        f"held-out {held_w.numel()} tokens")
    if args.init_from and not (args.resume and (out / STATE).exists()):
        warm_start(model, args.init_from, list(range(nt - 1)), log)
    groups = make_trainable(model, args.rank, args.alpha)
    size_mb = artifact_bytes(model) / 1e6
    if size_mb > MAX_ARTIFACT_MB:
        raise ValueError(f"the artifact would be {size_mb:.1f} MB fp16 (> {MAX_ARTIFACT_MB} MB): lower "
                         "--rank or --block-layers")
    original = Original(model)
    opt = torch.optim.AdamW([{"params": groups["delta"], "lr": args.lr, "name": "delta"},
                             {"params": groups["exits"], "lr": args.block_lr, "name": "exits"}],
                            betas=(0.9, 0.98), weight_decay=args.weight_decay)
    st = JointState()
    if args.resume and (out / STATE).exists():
        saved = torch.load(out / STATE, weights_only=False)
        model.load_state_dict(saved["trainable"], strict=False)
        opt.load_state_dict(saved["opt"])
        st = JointState(**saved["st"])
        log(f"resumed at step {st.step} ({st.tokens} tokens, {st.train_s / 60:.1f} min)")
    n_train = sum(p.numel() for g in groups.values() for p in g)
    log(f"joint: tiers {[t.layers for t in tiers]}, rank {args.rank}, {n_train / 1e6:.2f}M trainable, "
        f"artifact {size_mb:.1f} MB fp16, lambdas {lambdas}, {args.threads} thread(s), autocast "
        f"{amp or 'off (fp32)'}")

    def save() -> None:
        trainable = {k: v.detach().clone() for k, v in model.state_dict().items()
                     if ".lora_" in k or k.startswith(("exit_blocks.", "exit_norms."))}
        tmp = out / (STATE + ".tmp")
        torch.save({"trainable": trainable, "opt": opt.state_dict(),
                    "st": {f: getattr(st, f) for f in JointState.__slots__}}, tmp)
        tmp.replace(out / STATE)

    def do_eval() -> None:
        model.eval()
        ev = evaluate_joint(model, original, held_w)
        model.train()
        score = sum(lam * math.log(v["ppl"]) for lam, v in zip(lambdas, ev["tiers"].values()))
        rec = {"step": st.step, "tokens": st.tokens, "train_minutes": round(st.train_s / 60, 2),
               "top_vs_original": round(ev["top_vs_original"], 4),
               **{f"{n}_{k}": round(v, 4) for n, d in ev["tiers"].items() for k, v in d.items()}}
        st.history.append(rec)
        with (out / "eval_log.jsonl").open("a") as f:
            f.write(json.dumps(rec) + "\n")
        log("eval " + " ".join(f"{k}={v}" for k, v in rec.items()))
        if st.best is not None and score >= st.best["score"] - 1e-4:
            st.bad_evals += 1
            return
        st.best, st.bad_evals = {"score": score, "step": st.step, "eval": ev}, 0
        quality = {"floor": dict(DEFAULT_FLOOR), **{n: {"ppl_vs_top": round(v["ppl_vs_top"], 3),
                                                        "agree_top": round(v["agree_top"], 3)}
                                                    for n, v in list(ev["tiers"].items())[:-1]}}
        info = {"method": "joint", "step": st.step, "tokens": st.tokens, "train_minutes": rec["train_minutes"],
                "rank": args.rank, "lambdas": lambdas, "kl": args.kl, "ce": args.ce, "topk": args.topk,
                "lr": args.lr, "block_lr": args.block_lr, "seed": args.seed, "data": prov,
                "top_vs_original": round(ev["top_vs_original"], 4), "quality": quality}
        export(model, out, base_ref, family, tiers, info, _notes(family, tiers, args, st, ev, prov))
        (out / "provenance.json").write_text(json.dumps(prov, indent=2) + "\n")

    gen = torch.Generator().manual_seed(args.seed + 1)
    n_win = train_w.shape[0]
    bar = progress(total=args.steps, initial=st.step, desc="joint", unit="step")
    eval_s = 0.0
    last_save = last_line = time.monotonic()
    model.train()
    if st.best is None:
        t_e = time.monotonic()
        do_eval()
        eval_s = time.monotonic() - t_e  # the final evaluation costs as much: the budget keeps it
    first = st.step
    last_step = min(args.steps, st.step + args.stop_after) if args.stop_after else args.steps
    reason = f"--steps {args.steps} reached"
    while st.step < last_step:
        if stop_at is not None and time.monotonic() + eval_s + args.reserve_s >= stop_at:
            reason = "--max-minutes reached (time kept for the last evaluation and the export)"
            break
        g = np.random.default_rng([args.seed, st.step])
        ids = train_w[np.sort(g.choice(n_win, size=min(args.batch_size, n_win), replace=False))]
        ids = ids.to(args.device)
        t0 = time.perf_counter()
        tk_ids, tk_lp = original.topk(ids, args.topk)  # the teacher in fp32: the original as it is
        with torch.autocast(torch.device(args.device).type, dtype=amp or torch.bfloat16,
                            enabled=amp is not None):
            loss, kls, ces = joint_loss(model, ids, tk_ids, tk_lp, lambdas, args.kl, args.ce,
                                        args.ce_frac, gen)
        lr_f = min(1.0, (st.step + 1) / max(1, args.warmup))
        if stop_at is not None and args.decay_minutes:
            lr_f *= min(1.0, max(0.1, (stop_at - time.monotonic()) / (args.decay_minutes * 60)))
        for grp in opt.param_groups:
            grp["lr"] = (args.lr if grp["name"] == "delta" else args.block_lr) * lr_f
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for g_ in groups.values() for p in g_], args.grad_clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        st.step += 1
        st.tokens += ids.numel()
        st.train_s += time.perf_counter() - t0
        bar.update(1)
        now = time.monotonic()
        if st.step == first + 1 or (args.save_every_min and now - last_line >= args.save_every_min * 60):
            log(f"step {st.step} tokens {st.tokens} {st.tokens / max(st.train_s, 1e-9):.0f} tok/s "
                + " ".join(f"{t.name}={k:.3f}/{c:.2f}" for t, k, c in zip(tiers, kls, ces)))
            last_line = now
        if st.step % args.eval_every == 0:
            t_e = time.monotonic()
            do_eval()
            eval_s = time.monotonic() - t_e
            save()
            last_save = time.monotonic()
            if args.patience and st.bad_evals >= args.patience:
                reason = f"no held-out improvement in {args.patience} evaluations"
                break
        elif now - last_save >= args.save_every_min * 60:
            save()
            last_save = now
    bar.close()
    if st.history[-1]["step"] != st.step:
        do_eval()
    save()
    log(f"stopped at step {st.step}: {reason}. Trained {st.tokens:,} tokens at "
        f"{st.tokens / max(st.train_s, 1e-9):.0f} tokens/s; best held-out at step {st.best['step']} "
        f"exported to {out}; wall {(time.monotonic() - t_start) / 60:.2f} min")
    return 0


JOINT_SHARED = ("weights", "kl", "stop_after", "block_layers", "init", "init_from", "cache_tokens",
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
