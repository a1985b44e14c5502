"""Training and held-out text that exists offline, and the step-seeded batch order.

Sources (``--data``, comma-separated, mixed with equal weight per source):

* ``self``: the base model's own greedy answers (top tier, chat template) to :data:`SELF_PROMPTS`, a
  broad built-in prompt set. Generated once with :class:`engine.Engine`, cached as JSONL.
* ``chat``: the same, for :data:`CHAT_PROMPTS` (short factual questions and small instructions).
* ``vocab`` or ``vocab:N``: the same, for N (default :data:`VOCAB_PROMPTS_DEFAULT`) prompts about whole
  English words of the tokenizer's own vocabulary (:func:`vocab_prompts`): thousands of chat answers
  without writing thousands of prompts by hand.
* ``names`` or ``names:N``: the same, for N (default :data:`NAMES_PROMPTS_DEFAULT`) prompts about proper
  names of the tokenizer's vocabulary (:func:`names_prompts`: people, places, works).
* ``stdlib``: ``pydoc`` plain-text documentation of :data:`STDLIB_TRAIN` modules.
* ``packages``: README/METADATA/licence text of installed distributions.
* a ``.txt``/``.md`` file, a ``.jsonl`` file (a ``text`` field, or ``prompt`` + ``answer``), or a
  directory of those.

The held-out text is the pydoc of :data:`STDLIB_HELDOUT`, modules no training source uses, plus the
base model's answers to :data:`HELDOUT_PROMPTS` (disjoint from :data:`SELF_PROMPTS` and from the
evaluation questions; so is :data:`CHAT_PROMPTS`). :func:`check_disjoint` asserts it.
"""
from __future__ import annotations

import importlib
import json
import pydoc
import warnings
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import torch

# re-exported: callers use training.data's names for the prompt lists (training/prompts.py)
from training.prompts import (  # noqa: F401
    CHAT_PROMPTS, COUNTED_SOURCES, EVAL_QUESTIONS, EVAL_QUESTIONS_LARGE, HELDOUT_PROMPTS,
    NAMES_PROMPTS_DEFAULT, SELF_PROMPTS, STDLIB_HELDOUT, STDLIB_TRAIN, VOCAB_PROMPTS_DEFAULT, _eval_words,
    check_disjoint, counted_prompts, names_prompts, vocab_prompts)


# ---- text sources ----------------------------------------------------------------------------
def pydoc_text(module: str) -> str:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        mod = importlib.import_module(module)
        return pydoc.render_doc(mod, renderer=pydoc.plaintext)


def stdlib_texts(modules: list[str]) -> list[str]:
    out = []
    for m in modules:
        try:
            out.append(pydoc_text(m))
        except Exception:  # noqa: BLE001 - a module missing on this Python is simply skipped
            continue
    return out


def package_texts(limit_chars: int = 4_000_000) -> list[str]:
    """README-like long descriptions and licences of installed distributions (English prose)."""
    out, total = [], 0
    for dist in sorted(metadata.distributions(), key=lambda d: d.metadata["Name"] or ""):
        for f in dist.files or []:
            name = f.name.upper()
            if name in ("METADATA", "LICENSE", "LICENSE.TXT", "LICENSE.MD", "README.MD", "README.RST"):
                try:
                    txt = f.read_text()
                except (OSError, UnicodeDecodeError):
                    continue
                if txt and len(txt) > 500:
                    out.append(txt)
                    total += len(txt)
        if total > limit_chars:
            break
    return out


def file_texts(path: Path) -> list[str]:
    files = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    out = []
    for p in files:
        if p.suffix == ".jsonl":
            for line in p.read_text().splitlines():
                if line.strip():
                    out.append(json.loads(line))
        elif p.suffix in (".txt", ".md", ".rst", ""):
            out.append(p.read_text(errors="replace"))
    return out


# ---- self-distillation data -------------------------------------------------------------------
def chat_ids(tokenizer, prompt: str, answer: str | None = None) -> list[int]:
    msgs = [{"role": "user", "content": prompt}]
    if answer is None:
        return list(tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True,
                                                  return_dict=False))
    msgs.append({"role": "assistant", "content": answer})
    return list(tokenizer.apply_chat_template(msgs, tokenize=True, return_dict=False))


def generate_answers(model, tokenizer, prompts: list[str], max_tokens: int = 160,
                     batch: int = 32, tier: int | None = None, on_batch=None,
                     deadline: float | None = None) -> list[tuple[str, bool]]:
    """Greedy (answer, finished) of one tier (default: the top) through the serving engine, ``batch``
    prompts a call (the engine batches them: large batches on a GPU make this seconds, not minutes);
    ``on_batch(prompts, answers)`` is called after every batch (the caller saves them). With a
    ``deadline`` (time.monotonic()) it stops there, within one engine step: the batch under way is
    dropped, so fewer answers, never late and never a cut one."""
    import time  # noqa: PLC0415

    from engine import Engine  # noqa: PLC0415
    from engine.runtime import progress  # noqa: PLC0415
    from worker.sampling import SamplingParams  # noqa: PLC0415
    tier = model.num_segments - 1 if tier is None else tier
    eng = Engine(model, num_blocks=batch * (max_tokens + 256) // 16 + 16,
                 max_num_batched_tokens=max(2048, 64 * batch), max_num_seqs=batch)
    out = []
    bar = progress(total=len(prompts), desc="answers", unit="prompt")
    for i in range(0, len(prompts), batch):
        if deadline is not None and time.monotonic() >= deadline:
            break
        chunk = prompts[i:i + batch]
        ids = [chat_ids(tokenizer, p) for p in chunk]
        gen = _generate_until(eng, ids, tier, SamplingParams(max_tokens=max_tokens), deadline)
        if gen is None:
            break
        answers = [(tokenizer.decode(g, skip_special_tokens=True).strip(), len(g) < max_tokens)
                   for g in gen]
        out += answers
        if on_batch is not None:
            on_batch(chunk, answers)
        bar.update(len(chunk))
    bar.close()
    return out


def _generate_until(eng, prompts: list[list[int]], tier: int, params, deadline: float | None):
    """Engine.generate that gives up at ``deadline`` (checked before every step): the generated ids,
    or None when the deadline came first (the requests are aborted)."""
    import time  # noqa: PLC0415
    if deadline is None:
        return eng.generate(prompts, [tier] * len(prompts), params)
    rids = [f"answer-{id(prompts)}-{i}" for i in range(len(prompts))]
    for rid, p in zip(rids, prompts):
        eng.add_request(rid, p, tier, params)
    out: dict[str, list[int]] = {rid: [] for rid in rids}
    while eng.has_unfinished():
        if time.monotonic() >= deadline:
            for rid in rids:
                eng.abort_request(rid)
            return None
        for o in eng.step():
            out[o.request_id].extend(o.new_token_ids)
    return [out[rid] for rid in rids]


def _read_records(cache: Path) -> list[dict]:
    recs = []
    for line in cache.read_text().splitlines():
        try:
            recs.append(json.loads(line))
        except json.JSONDecodeError:  # the last line of a run killed mid-write
            break
    return recs


def self_records(model, tokenizer, prompts: list[str], cache: Path | None, max_tokens: int = 160,
                 log=print, deadline: float | None = None, batch: int = 32) -> list[dict]:
    """The base model's answers to ``prompts``, cached in ``cache`` (JSONL) batch by batch: a run
    stopped half-way resumes where it stopped; a cache of other prompts is regenerated."""
    recs: list[dict] = []
    if cache is not None and cache.exists():
        recs = _read_records(cache)
        if [r["prompt"] for r in recs] == prompts:
            return recs
        if [r["prompt"] for r in recs] != prompts[:len(recs)]:
            recs = []  # another prompt list: start over
        cache.write_text("".join(json.dumps(r) + "\n" for r in recs))
    left = prompts[len(recs):]
    log(f"generating the base model's answers to {len(left)} prompts (greedy, {max_tokens} tokens)"
        + (f"; {len(recs)} cached" if recs else ""))

    def save(chunk, answers):
        new = [{"prompt": p, "answer": a, "finished": f} for p, (a, f) in zip(chunk, answers)]
        recs.extend(new)
        if cache is not None:
            cache.parent.mkdir(parents=True, exist_ok=True)
            with cache.open("a") as fh:
                fh.write("".join(json.dumps(r) + "\n" for r in new))

    generate_answers(model, tokenizer, left, max_tokens, batch=batch, on_batch=save, deadline=deadline)
    if len(recs) < len(prompts):
        log(f"answer generation stopped at its deadline: {len(recs)} of {len(prompts)} prompts answered")
    return recs


# ---- token streams and batches -----------------------------------------------------------------
def encode_docs(tokenizer, docs: list, eos: int) -> torch.Tensor:
    """Texts or chat records -> one long token stream, documents separated by EOS."""
    ids: list[int] = []
    for d in docs:
        if isinstance(d, dict) and "prompt" in d:
            if d.get("finished", True):
                ids += chat_ids(tokenizer, d["prompt"], d["answer"])
            else:  # cut at max_tokens: no end-of-turn, or the model would learn to stop mid-sentence
                ids += chat_ids(tokenizer, d["prompt"]) + tokenizer.encode(d["answer"],
                                                                          add_special_tokens=False)
        else:
            text = d["text"] if isinstance(d, dict) else d
            ids += tokenizer.encode(text, add_special_tokens=False)
        ids.append(eos)
    return torch.tensor(ids, dtype=torch.long)


@dataclass(slots=True)
class Source:
    name: str
    stream: torch.Tensor  # [N] token ids


class BatchSampler:
    """Batch ``k`` of step ``s`` is a pure function of (seed, s, k): resuming replays the same order."""

    def __init__(self, sources: list[Source], seq_len: int, seed: int):
        self.sources = [s for s in sources if s.stream.numel() > seq_len + 1]
        if not self.sources:
            raise ValueError(f"no data source has more than {seq_len + 1} tokens")
        self.seq_len, self.seed = seq_len, seed

    def batch(self, step: int, micro: int, batch_size: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + step * 1009 + micro)
        rows = []
        for _ in range(batch_size):
            src = self.sources[int(torch.randint(len(self.sources), (1,), generator=g))]
            start = int(torch.randint(src.stream.numel() - self.seq_len, (1,), generator=g))
            rows.append(src.stream[start:start + self.seq_len])
        return torch.stack(rows)

    @property
    def num_tokens(self) -> dict[str, int]:
        return {s.name: int(s.stream.numel()) for s in self.sources}


def heldout_docs(model=None, tokenizer=None, cache: Path | None = None) -> list:
    """The held-out evaluation text: pydoc of STDLIB_HELDOUT (+ chat answers when a model is given)."""
    docs: list = stdlib_texts(STDLIB_HELDOUT)
    if model is not None:
        docs += self_records(model, tokenizer, HELDOUT_PROMPTS, cache)
    return docs


def answer_prompts_digest(spec: str, tokenizer=None) -> str:
    """A digest of the prompt lists behind the answer sources ``spec`` names ('' if none): part of a
    feature cache's key, so editing SELF_PROMPTS, CHAT_PROMPTS or the vocab prompts never reuses a
    stale cache (``vocab`` needs the tokenizer)."""
    import hashlib  # noqa: PLC0415
    lists = {"self": SELF_PROMPTS, "chat": CHAT_PROMPTS}
    named: dict[str, list[str]] = {}
    for part in [p.strip() for p in spec.split(",") if p.strip()]:
        if part in lists:
            named[part] = lists[part]
        elif (c := counted_prompts(part, tokenizer)) is not None:
            named[c[0]] = c[2]
    if not named:
        return ""
    return hashlib.sha256(json.dumps(dict(sorted(named.items()))).encode()).hexdigest()[:16]


def read_sources(spec: str, model, tokenizer, cache_dir: Path, self_max_tokens: int = 160,
                 log=print, deadline: float | None = None, batch: int = 32) -> list[tuple[str, list]]:
    """``--data`` -> [(name, documents)]. The answer sources are generated ``batch`` prompts a call, and
    stop at ``deadline`` (time.monotonic()) if one is given."""
    check_disjoint()
    out = []
    gen = {"log": log, "deadline": deadline, "batch": batch}
    for part in [p.strip() for p in spec.split(",") if p.strip()]:
        if part == "self":
            out.append(("self", self_records(model, tokenizer, SELF_PROMPTS, cache_dir / "self.jsonl",
                                             self_max_tokens, **gen)))
        elif part == "chat":
            out.append(("chat", self_records(model, tokenizer, CHAT_PROMPTS, cache_dir / "chat.jsonl",
                                             self_max_tokens, **gen)))
        elif (c := counted_prompts(part, tokenizer)) is not None:
            name, n, prompts = c
            out.append((name, self_records(model, tokenizer, prompts, cache_dir / f"{name}-{n}.jsonl",
                                           self_max_tokens, **gen)))
        elif part == "stdlib":
            out.append(("stdlib", stdlib_texts(STDLIB_TRAIN)))
        elif part == "packages":
            out.append(("packages", package_texts()))
        else:
            p = Path(part).expanduser()
            if not p.exists():
                raise FileNotFoundError(
                    f"--data {part!r}: not 'self', 'chat', 'vocab[:N]', 'names[:N]', 'stdlib', 'packages' "
                    "or a path")
            out.append((p.name, file_texts(p)))
    return out


def answer_provenance(cache_dir: Path) -> dict[str, dict]:
    """Per answer file under ``cache_dir``: how many answers, how many finished, their characters and
    the file's sha256 (the artifact's manifest records where its data came from)."""
    import hashlib  # noqa: PLC0415
    out = {}
    for f in sorted(Path(cache_dir).glob("*.jsonl")):
        recs = _read_records(f)
        out[f.name] = {"answers": len(recs), "finished": sum(bool(r.get("finished", True)) for r in recs),
                       "chars": sum(len(r.get("answer", "")) for r in recs),
                       "sha256": hashlib.sha256(f.read_bytes()).hexdigest()[:16],
                       "by": "the base model's top tier, greedy, through engine.Engine"}
    return out


def make_windows(stream: torch.Tensor, seq_len: int, max_tokens: int) -> torch.Tensor:
    n = min(stream.numel(), max_tokens) // seq_len
    if n == 0:
        raise ValueError(f"held-out text has fewer than {seq_len} tokens")
    return stream[: n * seq_len].view(n, seq_len)
