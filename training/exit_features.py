"""Stage 1 of ``mfs precipitate --method exit-blocks`` (training/exitblocks.py): the training and held-out
windows, and the feature cache — one pass of the frozen model stores, per window, the trunk's residual
stream at every lower tier's boundary (bf16) and the top tier's top-k log-probabilities, memory-mapped
under ``OUT/cache/``, resumable window by window."""
from __future__ import annotations

import json
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from training import data as D
from engine.runtime import progress
from worker.model import NestedModel

# ---- the feature cache -------------------------------------------------------------------------
@dataclass
class FeatureCache:
    """Memory-mapped arrays of one window set: ids [N, S], trunk[s] [N, S, H] (bf16 bits), topk ids
    and log-probs [N, S, k], the top tier's NLL of the next token [N, S-1]."""
    root: Path
    n: int
    seq_len: int
    hidden: int
    k: int
    lower: list[int]

    def _mm(self, name: str, dtype, shape, mode: str):
        return np.lib.format.open_memmap(self.root / f"{name}.npy", mode=mode, dtype=dtype, shape=shape)

    def open(self, mode: str = "r") -> dict[str, np.ndarray]:
        n, s, h, k = self.n, self.seq_len, self.hidden, self.k
        if mode == "w+":
            self.root.mkdir(parents=True, exist_ok=True)
        arrs = {"ids": self._mm("ids", np.int32, (n, s), mode),
                "topk_ids": self._mm("topk_ids", np.int32, (n, s, k), mode),
                "topk_lp": self._mm("topk_lp", np.float16, (n, s, k), mode),
                "top_nll": self._mm("top_nll", np.float32, (n, s - 1), mode)}
        for t in self.lower:
            arrs[f"trunk{t}"] = self._mm(f"trunk{t}", np.uint16, (n, s, h), mode)
        return arrs

    @property
    def done_path(self) -> Path:
        return self.root / "done.json"

    def num_done(self) -> int:
        return json.loads(self.done_path.read_text())["windows"] if self.done_path.exists() else 0


def _bf16_bits(x: torch.Tensor) -> np.ndarray:
    return x.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)


def from_bf16_bits(a: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(np.ascontiguousarray(a).view(np.int16)).view(torch.bfloat16).float()


@torch.no_grad()
def fill_cache(model: NestedModel, windows: torch.Tensor, cache: FeatureCache, batch: int,
               desc: str, log=print) -> float:
    """Runs the frozen model over the windows not cached yet; returns tokens/s of this call."""
    start = cache.num_done()
    mode = "r+" if start and (cache.root / "ids.npy").exists() else "w+"
    if mode == "w+":
        start = 0
    arrs = cache.open(mode)
    top = model.num_segments - 1
    t0, done = time.perf_counter(), 0
    bar = progress(total=cache.n, initial=start, desc=desc, unit="win")
    dev = model.embed_tokens.weight.device
    for i in range(start, cache.n, batch):
        ids = windows[i:i + batch].to(dev)
        states = model.trunk_states(ids)
        logits = model.logits(model.exit_from_trunk(top, states[top])).float()
        lp = torch.log_softmax(logits, -1)
        v, ix = lp.topk(cache.k, dim=-1)
        sl = slice(i, i + ids.shape[0])
        arrs["ids"][sl] = ids.cpu().numpy()
        arrs["topk_ids"][sl] = ix.cpu().numpy()
        arrs["topk_lp"][sl] = v.half().cpu().numpy()
        arrs["top_nll"][sl] = (-lp[:, :-1].gather(-1, ids[:, 1:, None]).squeeze(-1)).cpu().numpy()
        for t in cache.lower:
            arrs[f"trunk{t}"][sl] = _bf16_bits(states[t].cpu())
        for a in arrs.values():
            a.flush()
        cache.done_path.write_text(json.dumps({"windows": i + ids.shape[0]}))
        done += ids.numel()
        bar.update(ids.shape[0])
    bar.close()
    rate = done / max(time.perf_counter() - t0, 1e-9)
    if done:
        log(f"{desc}: cached {done} tokens at {rate:.0f} tokens/s")
    return rate


ANSWER_SOURCES = ("self", "chat", "vocab", "names")


def training_windows(docs: list[tuple[str, list]], tok, eos: int, seq_len: int, max_tokens: int,
                     seed: int) -> tuple[torch.Tensor, dict[str, int]]:
    """Non-overlapping windows of every source, mixed: all windows of the answer sources
    (:data:`ANSWER_SOURCES`) first in the budget, the rest filled from the text sources; shuffled by seed."""
    per: dict[str, torch.Tensor] = {}
    for name, dd in docs:
        stream = D.encode_docs(tok, dd, eos)
        n = stream.numel() // seq_len
        if n:
            per[name] = stream[: n * seq_len].view(n, seq_len)
    g = torch.Generator().manual_seed(seed)
    budget = max_tokens // seq_len
    chosen, counts, left = [], {}, budget
    # the model's answers first ('self' before 'chat': a 'self'-only run's windows are unchanged),
    # then the text sources
    rank = {k: i for i, k in enumerate(ANSWER_SOURCES)}
    order = sorted(per, key=lambda k: (rank.get(k, len(rank)), k))
    for i, name in enumerate(order):
        w = per[name][torch.randperm(per[name].shape[0], generator=g)]
        # an answer source takes what it has; each text source an equal share of what is left
        take = w[: left if name in ANSWER_SOURCES else left // (len(order) - i)]
        chosen.append(take)
        counts[name] = int(take.shape[0])
        left -= counts[name]
    allw = torch.cat(chosen)
    allw = allw[torch.randperm(allw.shape[0], generator=g)]
    return allw, {k: v * seq_len for k, v in counts.items()}


def heldout_windows(original: NestedModel, tok, eos: int, seq_len: int, heldout_tokens: int,
                    cache_dir: Path, log=print, answers: bool = True,
                    deadline: float | None = None) -> torch.Tensor:
    """The held-out text of ``mfs eval`` (same sources, same budgets) as windows. ``answers=False``:
    the pydoc part alone (no generation; for a machine too busy to write the original's answers).
    ``deadline`` (time.monotonic()): the answers stop there (fewer held-out chat windows, or none)."""
    from training.data import make_windows  # noqa: PLC0415
    pydoc = D.encode_docs(tok, D.stdlib_texts(D.STDLIB_HELDOUT), eos)
    if not answers:
        log("held-out: pydoc only (--heldout-answers skip)")
        return make_windows(pydoc, seq_len, heldout_tokens)
    recs = D.self_records(original, tok, D.HELDOUT_PROMPTS, cache_dir / "heldout_chat.jsonl", 160, log,
                          deadline=deadline)
    chat = D.encode_docs(tok, recs, eos)
    windows = make_windows(pydoc, seq_len, heldout_tokens)
    if chat.numel() < seq_len:
        log(f"held-out: pydoc only ({len(recs)} of {len(D.HELDOUT_PROMPTS)} answers before the deadline)")
        return windows
    return torch.cat([windows, make_windows(chat, seq_len, heldout_tokens // 4)])
