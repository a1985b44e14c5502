"""Local multiple-choice tasks (``evals/<task>/``) and the in-process scorer behind ``mfs eval --tasks``.

Each task is a JSONL file of items ``{"prompt", "choices", "answer", "source"}`` plus an lm-evaluation-
harness YAML, so ``mfs lm-eval`` can score the same file through the service. The items come from data
the project ships, none of it in any training source (training/prompts.py):

* ``capitals`` (134 items, evals/capitals/): the capital of a country among four capitals (written when
  ``mfs lm-eval`` was added; its items carry ``country`` instead of ``prompt``).
* ``stdlib_modules`` (:func:`build_stdlib_modules`): which standard-library module defines a public
  function, among four modules; the functions are read with ``inspect`` from modules that no training
  source documents (none of training.prompts.STDLIB_TRAIN; names defined by two pool modules dropped).
* ``unicode_names`` (:func:`build_unicode_names`): the Unicode name of a character, among four names,
  from the interpreter's ``unicodedata`` database (Latin-1, Latin Extended-A, Greek, arrows, math,
  currency symbols).

Scoring (:func:`score_tasks`) is what lm-eval's ``acc`` is: per item, the summed log-likelihood of each
choice's tokens after the prompt; the item is right when the answer's is the largest. Every tier is
scored from one forward pass (``NestedModel.exit_hidden``), choices batched.
"""
from __future__ import annotations

import importlib
import inspect
import json
import random
import unicodedata
import warnings
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

EVALS = Path(__file__).resolve().parents[1] / "evals"
TASKS = ("capitals", "stdlib_modules", "unicode_names")

# modules no training source documents (none is in training.prompts.STDLIB_TRAIN; checked by the builder)
_POOL = ["textwrap", "fractions", "heapq", "bisect", "calendar", "graphlib", "turtle", "builtins",
         "zipimport", "fileinput", "linecache", "webbrowser", "sysconfig", "py_compile", "compileall",
         "runpy", "atexit", "gc", "faulthandler", "getpass", "socketserver", "doctest", "pdb", "pstats",
         "tabnanny", "symtable", "copyreg", "zoneinfo", "tty", "pty", "select", "resource", "curses",
         "concurrent.futures", "multiprocessing", "ctypes", "code", "codeop", "errno", "mmap", "pwd", "grp"]
_PER_MODULE = 16


@dataclass(slots=True)
class Item:
    prompt: str
    choices: list[str]
    answer: int
    source: str


def _four(rng: random.Random, right: str, pool: list[str]) -> tuple[list[str], int]:
    others = rng.sample([p for p in pool if p != right], 3)
    choices = others + [right]
    rng.shuffle(choices)
    return choices, choices.index(right)


def build_stdlib_modules(seed: int = 0) -> list[Item]:
    from training.prompts import STDLIB_HELDOUT, STDLIB_TRAIN  # noqa: PLC0415
    assert not set(_POOL) & set(STDLIB_TRAIN)
    rng = random.Random(seed)
    funcs: dict[str, list[str]] = {}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for name in _POOL:
            try:
                mod = importlib.import_module(name)
            except ImportError:
                continue
            fs = [n for n, v in vars(mod).items() if not n.startswith("_") and len(n) > 2
                  and (inspect.isfunction(v) or inspect.isbuiltin(v))
                  and getattr(v, "__module__", None) in (name, "_" + name, None)]
            if fs:
                funcs[name] = sorted(set(fs))
    seen: dict[str, int] = {}
    for fs in funcs.values():
        for f in fs:
            seen[f] = seen.get(f, 0) + 1
    mods = sorted(funcs)
    items = []
    for m in mods:
        fs = [f for f in funcs[m] if seen[f] == 1]
        for f in rng.sample(fs, min(_PER_MODULE, len(fs))):
            choices, ans = _four(rng, m, mods)
            where = "held-out text of mfs eval" if m in STDLIB_HELDOUT else "in no training or held-out text"
            items.append(Item(f"Q: Which module of the Python standard library defines the function "
                              f"{f}()?\nA:", [" " + c for c in choices], ans,
                              f"inspect: {m}.{f} (Python's own {m} module; {where})"))
    rng.shuffle(items)
    return items


_UNICODE_RANGES = [(0x00C0, 0x00FF), (0x0100, 0x017F), (0x0391, 0x03C9), (0x2190, 0x21FF),
                   (0x2200, 0x22FF), (0x20A0, 0x20BF)]


def build_unicode_names(seed: int = 0, n: int = 300) -> list[Item]:
    rng = random.Random(seed)
    chars = [chr(c) for lo, hi in _UNICODE_RANGES for c in range(lo, hi + 1)
             if unicodedata.name(chr(c), "") and unicodedata.category(chr(c))[0] in "LS"]
    names = {c: unicodedata.name(c).lower() for c in chars}
    picked = rng.sample(chars, min(n, len(chars)))
    pool = sorted(names.values())
    items = []
    for c in picked:
        choices, ans = _four(rng, names[c], pool)
        items.append(Item(f"Q: What is the Unicode name of the character {c}?\nA:",
                          [" " + x for x in choices], ans,
                          f"unicodedata.name(U+{ord(c):04X}) (Python {unicodedata.unidata_version} database)"))
    return items


def load_task(name: str) -> list[Item]:
    path = EVALS / name / f"{name}.jsonl"
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such task (tasks: {', '.join(TASKS)})")
    items = []
    for line in path.read_text().splitlines():
        d = json.loads(line)
        if "country" in d:  # the capitals task's own format (its lm-eval YAML builds the prompt)
            items.append(Item(f"Q: What is the capital of {d['country']}?\nA:", d["choices"], d["answer"],
                              "evals/capitals (countries and capitals)"))
        else:
            items.append(Item(d["prompt"], d["choices"], d["answer"], d["source"]))
    return items


_YAML = """# An lm-evaluation-harness multiple-choice task defined here, read offline (no hub); built by
# `python -m evaluation.mc_tasks` (evaluation/mc_tasks.py says where every item comes from).
task: mfs_{name}
dataset_path: json
dataset_kwargs:
  data_files:
    test: DATA_FILE
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{prompt}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
    aggregation: mean
    higher_is_better: true
metadata:
  version: 1.0
"""


def write_tasks() -> list[Path]:
    """(Re)builds the generated tasks' files under evals/ (deterministic: fixed seeds)."""
    out = []
    for name, items in (("stdlib_modules", build_stdlib_modules()), ("unicode_names", build_unicode_names())):
        d = EVALS / name
        d.mkdir(parents=True, exist_ok=True)
        (d / f"{name}.jsonl").write_text("".join(json.dumps({"prompt": i.prompt, "choices": i.choices,
                                                             "answer": i.answer, "source": i.source})
                                                 + "\n" for i in items))
        (d / f"mfs_{name}.yaml").write_text(_YAML.format(name=name))
        out.append(d / f"{name}.jsonl")
    return out


@torch.no_grad()
def score_items(model, tok, items: list[Item], batch: int = 64) -> list[list[list[float]]]:
    """[tier][item][choice] summed log-likelihood of the choice's tokens after the prompt."""
    rows = []  # (item, choice, ids, n_choice_tokens)
    for i, it in enumerate(items):
        ctx = tok.encode(it.prompt, add_special_tokens=False)
        for j, c in enumerate(it.choices):
            cont = tok.encode(it.prompt + c, add_special_tokens=False)[len(ctx):] or tok.encode(
                c, add_special_tokens=False)
            rows.append((i, j, ctx + cont, len(cont)))
    nt = model.num_segments
    out = [[[0.0] * len(it.choices) for it in items] for _ in range(nt)]
    dev = model.embed_tokens.weight.device
    for k in range(0, len(rows), batch):
        chunk = rows[k:k + batch]
        L = max(len(r[2]) for r in chunk)
        ids = torch.zeros(len(chunk), L, dtype=torch.long)
        for b, r in enumerate(chunk):
            ids[b, :len(r[2])] = torch.tensor(r[2])  # right padding: causal, so it changes nothing
        hs = model.exit_hidden(ids.to(dev))
        for b, (i, j, seq, n) in enumerate(chunk):
            pos = torch.arange(len(seq) - n - 1, len(seq) - 1, device=dev)
            tgt = torch.tensor(seq[-n:], device=dev)
            for t in range(nt):
                lp = F.log_softmax(model.logits(hs[t][b, pos]).float(), -1)
                out[t][i][j] = float(lp.gather(-1, tgt[:, None]).sum())
    return out


def accuracy(scores: list[list[float]], items: list[Item]) -> float:
    return sum(max(range(len(s)), key=s.__getitem__) == it.answer for s, it in zip(scores, items)) / len(items)


def score_tasks(model, tok, names: list[str], limit: int | None = None) -> dict[str, dict]:
    """{task: {"items", "acc": [per tier], "source"}} for a NestedModel."""
    res = {}
    for name in names:
        items = load_task(name)[:limit]
        sc = score_items(model, tok, items)
        res[name] = {"items": len(items), "acc": [accuracy(s, items) for s in sc],
                     "file": f"evals/{name}/{name}.jsonl"}
    return res


if __name__ == "__main__":
    for p in write_tasks():
        print(p, sum(1 for _ in p.open()))
