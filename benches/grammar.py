"""The per-token cost of a grammar mask on this CPU, xgrammar against llguidance, to pick the
engine by measurement. For each engine: compile a JSON schema for the default family's tokenizer,
then generate under it (a seeded draw from random logits, masked) and time, per token, filling the
next-token bitmask and applying it to the logits row [1, V] float32, and the matcher's advance.

    mfs bench grammar [--tokens 2000] [--json out.json]

llguidance is not in the lock (xgrammar won): `.venv/bin/pip install llguidance` to measure it too;
without it its row is skipped with a note.
"""
from __future__ import annotations

import importlib.util
import json
import statistics
import time

import torch

SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 24},
    "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "email": {"type": "string", "maxLength": 40},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "maxItems": 6},
    "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20},
                                                 "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["city", "zip"], "additionalProperties": False},
    "active": {"type": "boolean"},
    "role": {"enum": ["admin", "user", "guest"]}},
    "required": ["name", "age", "email", "tags", "address", "active", "role"], "additionalProperties": False}


class XGrammar:
    name = "xgrammar"

    def __init__(self, tok, vocab: int):
        import xgrammar as xgr
        self.xgr = xgr
        self.info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab)
        self.compiler = xgr.GrammarCompiler(self.info)
        self.vocab = vocab

    def compile(self, schema: str):
        return self.compiler.compile_json_schema(schema, any_whitespace=False)

    def start(self, compiled):
        self.m = self.xgr.GrammarMatcher(compiled)
        self.bm = self.xgr.allocate_token_bitmask(1, self.vocab)

    def mask(self, logits: torch.Tensor) -> None:
        self.m.fill_next_token_bitmask(self.bm, 0)
        self.xgr.apply_token_bitmask_inplace(logits, self.bm)

    def advance(self, t: int) -> bool:
        assert self.m.accept_token(t)
        return self.m.is_terminated()


class XGrammarAsRun(XGrammar):
    """xgrammar's bitmask as the runner applies it (worker/grammar.py): unpacked in torch, so any
    logits dtype and device take it (xgrammar's own CPU apply takes float32/16 only)."""
    name = "xgrammar (runner's torch unpack)"

    def __init__(self, tok, vocab: int):
        super().__init__(tok, vocab)
        from worker.grammar import Grammars
        self.grammars = Grammars(tok, vocab, [tok.eos_token_id])

    def mask(self, logits: torch.Tensor) -> None:
        from worker.grammar import mask_rows
        logits.copy_(mask_rows(logits, [0], self.grammars.allowed([self.m])))


class LLGuidance:
    name = "llguidance"

    def __init__(self, tok, vocab: int):
        import llguidance
        import llguidance.hf
        import llguidance.torch
        self.llg = llguidance
        self.tok = llguidance.hf.from_tokenizer(tok, n_vocab=vocab)
        self.vocab = vocab

    def compile(self, schema: str):
        g = self.llg.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
        return g  # llguidance compiles lazily, per matcher (its token trie is built once, per tokenizer)

    def start(self, compiled):
        self.m = self.llg.LLMatcher(self.tok, compiled)
        assert not self.m.is_error(), self.m.get_error()
        self.bm = self.llg.torch.allocate_token_bitmask(1, self.vocab)

    def mask(self, logits: torch.Tensor) -> None:
        self.llg.torch.fill_next_token_bitmask(self.m, self.bm, 0)
        self.llg.torch.apply_token_bitmask_inplace(logits, self.bm)

    def advance(self, t: int) -> bool:
        assert self.m.consume_token(t), self.m.get_error()
        return self.m.is_stopped()


def run(engine, vocab: int, tokens: int, seed: int = 0) -> dict:
    t0 = time.perf_counter()
    compiled = engine.compile(json.dumps(SCHEMA))
    compile_s = time.perf_counter() - t0
    g = torch.Generator().manual_seed(seed)
    mask_s, adv_s, first_s = [], [], []
    n = docs = 0
    while n < tokens:
        t0 = time.perf_counter()
        engine.start(compiled)
        first_s.append(time.perf_counter() - t0)
        docs += 1
        while n < tokens:
            logits = torch.randn(1, vocab, generator=g)
            t0 = time.perf_counter()
            engine.mask(logits)
            t1 = time.perf_counter()
            tok = int(torch.multinomial(torch.softmax(logits[0], -1), 1, generator=g))
            t2 = time.perf_counter()
            done = engine.advance(tok)
            adv_s.append(time.perf_counter() - t2)
            mask_s.append(t1 - t0)
            n += 1
            if done:
                break
    us = lambda xs: round(1e6 * statistics.median(xs), 1)  # noqa: E731
    return {"engine": engine.name, "compile_ms": round(1e3 * compile_s, 1),
            "matcher_start_ms": round(1e3 * statistics.median(first_s), 2), "tokens": n, "documents": docs,
            "mask_us_median": us(mask_s), "mask_us_p90": round(1e6 * sorted(mask_s)[int(0.9 * len(mask_s))], 1),
            "mask_us_mean": round(1e6 * statistics.mean(mask_s), 1), "advance_us_median": us(adv_s)}


def add_parser(sub) -> None:
    p = sub.add_parser("grammar", help="per-token cost of a structured-output mask: xgrammar vs llguidance")
    p.add_argument("--tokens", type=int, default=2000)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", default=None)
    p.set_defaults(func=cli)


def cli(a) -> int:
    from family.manifest import load_frontend  # noqa: PLC0415
    from engine.runtime import write_json  # noqa: PLC0415
    torch.set_num_threads(a.threads)
    tok = load_frontend("default").tokenizer
    vocab = len(tok)
    classes = [XGrammar, XGrammarAsRun]
    notes = []
    if importlib.util.find_spec("llguidance") is None:
        notes.append("llguidance not installed (`.venv/bin/pip install llguidance`): its row is skipped")
        print(notes[-1], flush=True)
    else:
        classes.append(LLGuidance)
    rows = []
    for cls in classes:
        t0 = time.perf_counter()
        e = cls(tok, vocab)
        setup_s = round(time.perf_counter() - t0, 2)
        r = run(e, vocab, a.tokens)
        r["tokenizer_setup_s"] = setup_s
        rows.append(r)
        print(json.dumps(r), flush=True)
    if a.json:
        write_json(a.json, {"vocab": vocab, "threads": a.threads, "notes": notes, "results": rows}, indent=1)
    return 0
