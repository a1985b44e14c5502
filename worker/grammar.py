"""Structured output in the worker: grammars compiled with xgrammar, one matcher per request, and the
batched mask of the rows that sample under one.

xgrammar was picked over llguidance by the per-token mask cost on this CPU (docs/BENCHMARKS.md,
``mfs bench grammar``): about the same median, a far lower tail and mean, and compiled
grammars that are cached and shared by every request with the same spec.

A request's spec is ``SamplingParams.grammar`` = (kind, text) (core/sampling.py). The tokenizer's table
is built once per worker (:class:`Grammars`); a compiled grammar once per spec (kept in an LRU); a
matcher per request, advanced with each token the request commits (the runner owns it).
"""
from __future__ import annotations

from collections import OrderedDict

import torch

from core.grammar import grammar_of

GRAMMAR_CACHE = 256  # compiled grammars kept (by spec)


class Grammars:
    """One per worker: the tokenizer's table for xgrammar (built once) and compiled grammars by spec."""

    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int]):
        import xgrammar as xgr
        self.xgr = xgr
        self.vocab_size = vocab_size
        info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size,
                                                  stop_token_ids=list(stop_token_ids))
        self.compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
        self.compiled: OrderedDict[tuple[str, str], object] = OrderedDict()
        self.stop_token_ids = [t for t in stop_token_ids if 0 <= t < vocab_size]
        self.words = (vocab_size + 31) // 32
        self._shift = torch.arange(32, dtype=torch.int32)

    def matcher(self, spec: tuple[str, str]):
        """A fresh matcher for a request (its grammar compiled once per spec)."""
        spec = tuple(spec)
        cg = self.compiled.get(spec)
        if cg is None:
            cg = self.compiled[spec] = self.compiler.compile_grammar(grammar_of(spec))
            if len(self.compiled) > GRAMMAR_CACHE:
                self.compiled.popitem(last=False)
        else:
            self.compiled.move_to_end(spec)
        return self.xgr.GrammarMatcher(cg)

    def allowed(self, matchers: list) -> torch.Tensor:
        """[n, V] bool: what each matcher allows next (bitmasks filled on the CPU, unpacked in torch so
        any logits dtype and device take them)."""
        bm = torch.empty(len(matchers), self.words, dtype=torch.int32)
        for i, m in enumerate(matchers):
            m.fill_next_token_bitmask(bm, i)
        bits = (bm[:, :, None] >> self._shift) & 1  # [n, words, 32], little-endian within a word
        allowed = bits.reshape(len(matchers), -1)[:, :self.vocab_size].bool()
        # A grammar that allows no token of this vocabulary here (found by schemathesis: a guided_choice
        # of strings this tokenizer's table cannot spell) must not leave a row with nothing to sample,
        # which killed the worker with every request on it: the request ends here (EOS) instead.
        stuck = ~allowed.any(dim=-1)
        if bool(stuck.any()) and self.stop_token_ids:
            allowed[stuck.nonzero()[:, 0][:, None], torch.tensor(self.stop_token_ids)] = True
        return allowed


def mask_rows(logits: torch.Tensor, rows: list[int], allowed: torch.Tensor) -> torch.Tensor:
    """logits [N, V] with rows `rows` set to -inf where `allowed` [len(rows), V] is False (a copy)."""
    out = logits.clone()
    idx = torch.tensor(rows, dtype=torch.long, device=logits.device)
    out[idx] = out[idx].masked_fill(~allowed.to(logits.device), float("-inf"))
    return out
