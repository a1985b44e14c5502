"""``mfs precipitate --method exit-blocks``: a private exit block per lower tier on a frozen trunk.

The trunk (the base model) never changes, so the top tier stays the original bit for bit and every
tier shares the trunk's KV. Each lower tier ``s`` gets its own exit block (decoder layers initialised
as copies of the model's last layers) and its own norm before the shared LM head. Two stages:

1. **cache** (training/exit_features.py) — one pass of the frozen model over the training windows stores, per window, the trunk's
   residual stream at every lower tier's boundary (bf16) and the top tier's top-k log-probabilities
   (fp16 values, int32 ids) in memory-mapped files under ``OUT/cache/``. Resumable window by window.
   The held-out text of ``mfs eval`` (pydoc of held-out modules + the original's answers to held-out
   prompts) is cached the same way for the periodic evaluation.
2. **train** — only the exit blocks and exit norms learn, on KL to the teacher's top-k distribution
   (renormalised over those k ids: the student's logits are computed for them alone, which skips the
   28M-parameter head) plus a small full-vocabulary cross-entropy on a fraction of the positions.
   Every ``--eval-every`` steps the held-out perplexity and greedy agreement with the top tier are
   measured; the best state so far is exported as the nested checkpoint (``OUT/mfs.json`` +
   ``exit-blocks.safetensors``, fp16), and training stops after ``--patience`` evaluations without
   improvement, at ``--steps`` or at ``--max-minutes``. ``--resume`` continues from
   ``OUT/state/trainer.pt``; the batch order is a function of (seed, step).
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from kernels import TORCH_OPS
from training import data as D
from training.exit_features import (FeatureCache, fill_cache, from_bf16_bits, heldout_windows,
                                training_windows)
from training.loop import (Budget, Evaluation, Method, Options, RunState, StepResult, Trainer, load_tensors_state,
                           method_defaults, say, tensors_state)
from family.manifest import DEFAULT_FLOOR, Manifest, TierSpec, parse_tiers, resolve_base_arg
from worker.family import build_model
from engine.runtime import autocast_dtype
from family.loader import load_base
from worker.model import NestedModel

WEIGHTS = "exit-blocks.safetensors"


# ---- training ----------------------------------------------------------------------------------
def exit_parameters(model: NestedModel, lower: list[int]) -> list[torch.nn.Parameter]:
    ps = []
    for t in lower:
        blk = model.exit_block(t)
        if blk is not None:
            ps += list(blk.parameters())
        ps.append(model.exit_norms[t])
    return ps


def topk_kl(model: NestedModel, h: torch.Tensor, topk_ids: torch.Tensor, topk_lp: torch.Tensor,
            temperature: float = 1.0) -> torch.Tensor:
    """KL(teacher || student) over the teacher's top-k ids, both renormalised over them.
    h [T, H], topk_ids/topk_lp [T, k] -> mean over T."""
    w = model.lm_head.weight.index_select(0, topk_ids.reshape(-1)).view(*topk_ids.shape, -1)  # [T,k,H]
    s_logits = torch.bmm(w, h.unsqueeze(-1)).squeeze(-1).float() / temperature            # [T,k]
    s_lp = torch.log_softmax(s_logits, -1)
    t_lp = torch.log_softmax(topk_lp.float() / temperature, -1)
    return (t_lp.exp() * (t_lp - s_lp)).sum(-1).mean()


def batch_tensors(arrs: dict[str, np.ndarray], idx: np.ndarray, lower: list[int],
                  device: torch.device | str = "cpu") -> dict[str, torch.Tensor]:
    idx = np.sort(idx)  # sorted reads of the memmap are much faster
    out = {"ids": torch.from_numpy(arrs["ids"][idx].astype(np.int64)),
           "topk_ids": torch.from_numpy(arrs["topk_ids"][idx].astype(np.int64)),
           "topk_lp": torch.from_numpy(arrs["topk_lp"][idx].astype(np.float32))}
    for t in lower:
        out[f"trunk{t}"] = from_bf16_bits(arrs[f"trunk{t}"][idx])
    return {k: v.to(device) for k, v in out.items()}


def ce_sample(ids: torch.Tensor, ce_w: float, ce_frac: float,
              gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """The positions of ids [B, S] scored by cross-entropy this step (none when ``ce_w`` is 0), and
    their next tokens."""
    B, S = ids.shape
    n_ce = max(1, int(B * (S - 1) * ce_frac)) if ce_w > 0 else 0
    ce_pos = torch.randperm(B * (S - 1), generator=gen)[:n_ce].to(ids.device)
    return ce_pos, ids[:, 1:].reshape(-1).index_select(0, ce_pos)


def exit_loss(model: NestedModel, h: torch.Tensor, tk_ids: torch.Tensor, tk_lp: torch.Tensor,
              ce_pos: torch.Tensor, targets: torch.Tensor, kl_w: float,
              ce_w: float) -> tuple[torch.Tensor, float, float]:
    """One exit's loss from its hidden states h [B, S, H]: ``kl_w`` x top-k KL to the teacher plus
    ``ce_w`` x cross-entropy at ``ce_pos``; and the KL's and the CE's values (CE 0.0 when none)."""
    B, S = h.shape[:2]
    kl = topk_kl(model, h.reshape(B * S, -1).float(), tk_ids.view(B * S, -1), tk_lp.view(B * S, -1))
    loss, ce_v = kl_w * kl, 0.0
    if ce_pos.numel():
        hs = h[:, :-1].reshape(-1, h.shape[-1]).index_select(0, ce_pos).float()
        ce = F.cross_entropy(model.logits(hs).float(), targets)
        loss = loss + ce_w * ce
        ce_v = float(ce.detach())
    return loss, float(kl.detach()), ce_v


def build_exit_model(args):
    """The base of ``--base`` cut at ``--tiers`` with exit blocks initialised (``--init``), frozen, fp32,
    torch ops: (model, tokenizer, base_ref, family, tiers)."""
    base_path, base_ref, family = resolve_base_arg(args.base)
    base = load_base(base_path)
    tok = base.tokenizer
    if tok is None:
        raise ValueError("the base has no tokenizer; precipitation needs one to encode --data")
    tiers = tier_specs(args.tiers, base.hf_config.num_hidden_layers, args.block_layers, args.init)
    model = build_model(base, tiers, torch.float32, args.device, ops=TORCH_OPS)
    model.init_exit_blocks(args.init)
    model.requires_grad_(False).eval()
    return model, tok, base_ref, family, tiers


def step_losses(model: NestedModel, b: dict[str, torch.Tensor], lower: list[int], ce_w: float,
                ce_frac: float, gen: torch.Generator, amp: torch.dtype | None) -> tuple[torch.Tensor, list[float], list[float]]:
    ids = b["ids"]
    ce_pos, targets = ce_sample(ids, ce_w, ce_frac, gen)
    total = torch.zeros((), device=ids.device)
    kls, ces = [], []
    for t in lower:
        with torch.autocast("cpu" if not ids.is_cuda else "cuda", dtype=amp or torch.bfloat16,
                            enabled=amp is not None):
            h = model.exit_from_trunk(t, b[f"trunk{t}"])
        loss, kl, ce = exit_loss(model, h, b["topk_ids"], b["topk_lp"], ce_pos, targets, 1.0, ce_w)
        total = total + loss
        kls.append(kl)
        ces.append(ce)
    return total, kls, ces


@torch.no_grad()
def evaluate_cache(model: NestedModel, arrs: dict[str, np.ndarray], lower: list[int],
                   batch: int = 4) -> dict:
    """Held-out perplexity of each lower tier (full vocabulary) and its greedy agreement with the
    top tier, from cached trunk features; the top tier's perplexity from the teacher pass."""
    n = arrs["ids"].shape[0]
    nll = {t: 0.0 for t in lower}
    agree = {t: 0 for t in lower}
    count = 0
    for i in range(0, n, batch):
        b = batch_tensors(arrs, np.arange(i, min(n, i + batch)), lower, model.embed_tokens.weight.device)
        ids = b["ids"]
        top_arg = b["topk_ids"][:, :-1, 0]
        for t in lower:
            logits = model.logits(model.exit_from_trunk(t, b[f"trunk{t}"])[:, :-1]).float()
            nll[t] += float(F.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1),
                                            reduction="sum"))
            agree[t] += int((logits.argmax(-1) == top_arg).sum())
        count += ids[:, 1:].numel()
    top_ppl = math.exp(float(np.asarray(arrs["top_nll"], dtype=np.float64).mean()))
    out = {"top_ppl": top_ppl, "tokens": count, "tiers": {}}
    for t in lower:
        ppl = math.exp(nll[t] / count)
        out["tiers"][str(t)] = {"ppl": ppl, "ppl_vs_top": ppl / top_ppl, "agree_top": agree[t] / count}
    return out


def export(model: NestedModel, out: Path, base_ref: dict, family: str, tiers: list[TierSpec],
           lower: list[int], info: dict, notes: str) -> None:
    from safetensors.torch import save_file  # noqa: PLC0415
    sd = {}
    for t in lower:
        sd[model.exit_param_name(t)] = model.exit_norms[t].detach()
        blk = model.exit_block(t)
        if blk is not None:
            for k, v in blk.state_dict().items():
                sd[f"exit_blocks.{t}.{k}"] = v
    sd = {k: v.to(torch.float16).cpu().contiguous() for k, v in sd.items()}
    save_file(sd, str(out / WEIGHTS), metadata={"kind": "exit", "format": "mfs-weights",
                                                "info": json.dumps(info)})
    Manifest(family=family, base=base_ref, tiers=tiers, dtype="float32",
             weights={"kind": "exit", "file": WEIGHTS}, precipitated=True, notes=notes,
             quality=info.get("quality")).write(out)


def parse_block_layers(spec: str | int, lower: int) -> list[int]:
    """``--block-layers``: one count for every lower tier, or one per lower tier (lowest first)."""
    vals = [int(v) for v in str(spec).split(",") if v.strip()]
    if len(vals) == 1:
        vals = vals * lower
    if len(vals) != lower or any(v < 1 for v in vals):
        raise ValueError(f"--block-layers {spec!r}: give one count >= 1, or one per lower tier ({lower})")
    return vals


def tier_specs(spec: str, num_layers: int, block_layers: str | int, init: str) -> list[TierSpec]:
    tiers = parse_tiers(spec, num_layers)
    for t, n in zip(tiers[:-1], parse_block_layers(block_layers, len(tiers) - 1)):
        t.exit = {"norm": "own", "block": {"layers": n, "init": init}, "head": "shared"}
    return tiers


_RESIDUAL_OUT = ("o_proj", "down_proj")


def warm_start(model: NestedModel, path: str | Path, lower: list[int], log=print) -> None:
    """Loads the exit norms and exit-block layers of an earlier exit-blocks artifact. A tier whose
    block now has more layers than the file gives it keeps the loaded layers first; each extra layer
    (already a copy of a trunk layer, from ``--init``) gets zero output projections (o_proj,
    down_proj), so it starts as the identity on the residual stream and the tier starts exactly
    where the artifact left it."""
    from safetensors.torch import load_file  # noqa: PLC0415
    sd = load_file(str(path))
    with torch.no_grad():
        for t in lower:
            name = model.exit_param_name(t)
            if name not in sd:
                raise ValueError(f"--init-from {path}: no exit norm {name!r} for tier {t}")
            model.exit_norms[t].copy_(sd[name].float())
            blk = model.exit_block(t)
            have = sorted({int(k.split(".")[2]) for k in sd if k.startswith(f"exit_blocks.{t}.")})
            if len(have) > len(blk):
                raise ValueError(f"--init-from {path}: tier {t} has {len(have)} block layers there, "
                                 f"{len(blk)} here (--block-layers may only add layers)")
            for i in have:
                pre = f"exit_blocks.{t}.{i}."
                blk[i].load_state_dict({k[len(pre):]: v.float() for k, v in sd.items() if k.startswith(pre)})
            for layer in list(blk)[len(have):]:
                for lin in _RESIDUAL_OUT:
                    getattr(layer, lin).weight.zero_()
            log(f"warm start: tier {t} loads {len(have)} block layer(s) from {path}, "
                f"{len(blk) - len(have)} new identity layer(s)")


def feature_caches(args, model: NestedModel, tok, lower: list[int], out: Path,
                   log=print) -> tuple[FeatureCache, FeatureCache, dict, dict]:
    """Stage 1: the answer sources, the training and held-out windows and their feature caches under
    ``OUT/cache/`` (reused when complete and of the same key); (train cache, held-out cache, the
    training mix in tokens, {"cache_tokens_per_s"})."""
    eos = model.cfg.eos_token_ids[0] if model.cfg.eos_token_ids else (tok.eos_token_id or 0)
    H = model.cfg.hidden_size
    key = {"data": args.data, "seq_len": args.seq_len, "cache_tokens": args.cache_tokens,
           "heldout_tokens": args.heldout_tokens, "topk": args.topk, "lower": lower, "seed": args.seed,
           "hidden": H, "prompts": D.answer_prompts_digest(args.data, tok),
           **({"heldout_answers": "skip"} if args.heldout_answers == "skip" else {})}  # old keys unchanged
    meta_path = out / "cache/meta.json"
    meta = json.loads(meta_path.read_text()) if meta_path.exists() else None
    if meta is not None and meta["key"] == key:  # a complete cache of the same data: no data stage
        tc = FeatureCache(out / "cache/train", meta["train_windows"], args.seq_len, H, args.topk, lower)
        hc = FeatureCache(out / "cache/heldout", meta["heldout_windows"], args.seq_len, H, args.topk, lower)
        mix, rates = meta["mix"], {"cache_tokens_per_s": meta["cache_tokens_per_s"]}
        log(f"feature cache complete ({meta['train_windows']} training windows, {mix}): reusing it")
    else:
        docs = D.read_sources(args.data, model, tok, out / "data", args.self_max_tokens, log)
        train_w, mix = training_windows(docs, tok, eos, args.seq_len, args.cache_tokens, args.seed)
        held_w = heldout_windows(model, tok, eos, args.seq_len, args.heldout_tokens, out / "data", log,
                                 args.heldout_answers == "generate")
        tc = FeatureCache(out / "cache/train", train_w.shape[0], args.seq_len, H, args.topk, lower)
        hc = FeatureCache(out / "cache/heldout", held_w.shape[0], args.seq_len, H, args.topk, lower)
        log(f"training windows: {train_w.shape[0]} x {args.seq_len} ({mix}); held-out: {held_w.shape[0]}")
        rate = fill_cache(model, train_w, tc, args.cache_batch, "cache train", log)
        fill_cache(model, held_w, hc, args.cache_batch, "cache held-out", log)
        # a resumed fill measures only its own part: keep the rate of the pass that did the most
        rate = max(rate, meta["cache_tokens_per_s"]) if meta and meta.get("key") == key else rate
        rates = {"cache_tokens_per_s": rate}
        meta_path.write_text(json.dumps({"key": key, "train_windows": tc.n, "heldout_windows": hc.n,
                                         "mix": mix, "cache_tokens_per_s": rate}) + "\n")
    return tc, hc, mix, rates


# ---- the method --------------------------------------------------------------------------------
class ExitBlocks(Method):
    """Exit blocks on a frozen trunk, trained on the feature cache; a plug-in of training/loop.py."""

    def __init__(self, args, budget: Budget, log=say):
        method_defaults(args, lr=3e-4, ce=0.1, steps=20_000)
        self.args, self.budget, self.log, self.total = args, budget, log, args.steps

    def prepare(self, resuming: bool) -> None:
        a, log = self.args, self.log
        self.amp = autocast_dtype(a.autocast, a.device)
        log(f"exit-block precipitation: {a.threads} thread(s), autocast {self.amp or 'off (fp32)'}")
        model, tok, self.base_ref, self.family, self.tiers = build_exit_model(a)
        self.model, self.lower = model, list(range(model.num_segments - 1))
        if not self.lower:
            raise ValueError("--tiers needs at least two tiers: exit blocks are for the lower ones")
        if a.init_from and not resuming:
            warm_start(model, a.init_from, self.lower, log)
        # stage 1: data and the feature cache (the top tier is the frozen original: it writes the
        # self-distillation answers and is the teacher)
        tc, hc, self.mix, self.rates = feature_caches(a, model, tok, self.lower, Path(a.out), log)
        self.train_arrays, self.heldout = tc.open("r"), hc.open("r")
        # stage 2: the exit blocks learn
        self.params = exit_parameters(model, self.lower)
        for p in self.params:
            p.requires_grad_(True)
        self.opt = torch.optim.AdamW(self.params, lr=a.lr, betas=(0.9, 0.98), weight_decay=a.weight_decay)
        self.gen = torch.Generator().manual_seed(a.seed + 1)  # the cross-entropy positions
        self.names = [model.tiers[t].name for t in self.lower]
        model.train()

    def batch(self, step: int) -> dict[str, torch.Tensor]:
        a, n_win = self.args, self.train_arrays["ids"].shape[0]
        g = np.random.default_rng([a.seed, step])
        return batch_tensors(self.train_arrays, g.choice(n_win, size=min(a.batch_size, n_win), replace=False),
                             self.lower, a.device)

    def step(self, step: int, batch: dict[str, torch.Tensor]) -> StepResult:
        a = self.args
        loss, kls, ces = step_losses(self.model, batch, self.lower, a.ce, a.ce_frac, self.gen, self.amp)
        lr_f = min(1.0, (step + 1) / max(1, a.warmup)) * self.budget.decay(a.decay_minutes)
        for grp in self.opt.param_groups:
            grp["lr"] = a.lr * lr_f
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.params, a.grad_clip)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return StepResult(batch["ids"].numel(),
                          " ".join(f"{n}={k:.3f}/{c:.2f}" for n, k, c in zip(self.names, kls, ces)))

    def evaluate(self) -> Evaluation:
        self.model.eval()
        ev = evaluate_cache(self.model, self.heldout, self.lower)
        self.model.train()
        tiers = [ev["tiers"][str(t)] for t in self.lower]
        metrics = {**{f"{n}_{k}": round(v, 4) for n, d in zip(self.names, tiers) for k, v in d.items()},
                   "top_ppl": round(ev["top_ppl"], 4)}
        return Evaluation(metrics, sum(math.log(d["ppl"]) for d in tiers), ev)

    def export(self, run: RunState, ev: Evaluation) -> None:
        a, model = self.args, self.model
        quality = {"floor": dict(DEFAULT_FLOOR), **{
            n: {"ppl_vs_top": round(ev.detail["tiers"][str(t)]["ppl_vs_top"], 3),
                "agree_top": round(ev.detail["tiers"][str(t)]["agree_top"], 3)}
            for n, t in zip(self.names, self.lower)}}
        minutes = ev.record["train_minutes"]
        info = {"step": run.step, "tokens": run.tokens, "train_minutes": minutes, "data": a.data,
                "data_tokens": self.mix, "topk": a.topk, "seed": a.seed, "lr": a.lr, "ce": a.ce,
                "quality": quality, **self.rates}
        notes = (f"{self.family} cut after layers {[t.layers for t in self.tiers]}: the trunk is the frozen "
                 f"original; each lower tier has an exit block ("
                 + ", ".join(f"{n} {len(model.exit_block(t))} layer(s)" for n, t in zip(self.names, self.lower))
                 + f") and its own norm (mfs precipitate --method exit-blocks, {run.tokens:,} trained tokens"
                 + (f" after a warm start from {Path(a.init_from).name}" if a.init_from else "")
                 + f", {minutes} min). Held-out: " + ", ".join(
                     f"{n} perplexity {q['ppl_vs_top']}x top, greedy agreement {q['agree_top']:.0%}"
                     for n, q in quality.items() if n != "floor") + ".")
        export(model, Path(a.out), self.base_ref, self.family, self.tiers, self.lower, info, notes)

    def state_dict(self, run: RunState) -> dict:
        return tensors_state(self.model, lambda k: k.startswith(("exit_blocks.", "exit_norms.")), "exit_state",
                             self.opt, self.gen, run)

    def load_state_dict(self, saved: dict) -> RunState:
        return load_tensors_state(self.model, "exit_state", self.opt, self.gen, saved)


def run(args) -> int:
    budget = Budget(args.max_minutes)  # counted from here: model, data and feature cache included
    opts = Options.of(args, "train exit blocks", eval_every=args.eval_every, patience=args.patience)
    return Trainer(ExitBlocks(args, budget), opts, budget).run()


def add_arguments(p):
    """The exit-block options of ``mfs precipitate`` (shared ones live in training.precipitate)."""
    g = p.add_argument_group("--method exit-blocks")
    g.add_argument("--block-layers", default="1",
                   help="decoder layers per exit block: one count, or one per lower tier (e.g. 2,1)")
    g.add_argument("--init", default="copy:last", help="exit-block init: copy:last or copy:N")
    g.add_argument("--init-from", default=None, metavar="SAFETENSORS",
                   help="warm start from an earlier exit-blocks artifact; layers added by --block-layers "
                        "start as the identity (zero output projections)")
    g.add_argument("--cache-tokens", type=int, default=160_000, help="training tokens to cache")
    g.add_argument("--cache-batch", type=int, default=4, help="windows per teacher forward")
    g.add_argument("--heldout-tokens", type=int, default=8192, help="held-out pydoc tokens (as mfs eval)")
    g.add_argument("--heldout-answers", default="generate", choices=["generate", "skip"],
                   help="the held-out set's chat part (the original's answers, OUT/data/heldout_chat.jsonl): "
                        "generate (or read) it, or skip it (pydoc alone)")
    g.add_argument("--topk", type=int, default=64, help="teacher log-probabilities kept per position")
    g.add_argument("--ce-frac", type=float, default=0.125,
                   help="fraction of positions that also get the full-vocabulary cross-entropy")
    g.add_argument("--eval-every", type=int, default=100, help="steps between held-out evaluations")
    g.add_argument("--decay-minutes", type=float, default=0.0,
                   help="with --max-minutes: decay the lr linearly to 10%% over this many final minutes")
    g.add_argument("--patience", type=int, default=4,
                   help="stop after this many evaluations without improvement (0: never)")
    return g
