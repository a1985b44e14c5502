"""A structured-output spec (``SamplingParams.grammar`` = (kind, text)) made an xgrammar ``Grammar``:
the one translation, used by the gateway to check a request's spec (a 400 naming the field) and by the
worker to compile it for its tokenizer (worker/grammar.py). The only core module that loads xgrammar,
and only inside :func:`grammar_of` (xgrammar loads torch: the processes that import core stay
torch-free until a grammar is checked)."""
from __future__ import annotations

import json
import re


class GrammarError(ValueError):
    """A spec xgrammar cannot compile; the message says why, in xgrammar's words."""


def _message(e: Exception) -> str:
    text = str(e).strip()
    first = text.splitlines()[0] if text else ""
    return re.sub(r"^\[[^\]]*\]\s*\S+:\d+:\s*", "", first)  # xgrammar's "[time] file.cc:line: "


def choice_ebnf(choices: list[str]) -> str:
    """guided_choice as a grammar: exactly one of the strings (EBNF string literals take JSON's escapes)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def grammar_of(spec: tuple[str, str]):
    """The tokenizer-free xgrammar.Grammar of a spec; raises GrammarError."""
    import xgrammar as xgr  # noqa: PLC0415 - loads torch: only where a grammar is checked or compiled
    kind, text = spec
    try:
        if kind == "json":
            # compact separators (", " and ": ") and no free whitespace: a small model cannot run away in
            # whitespace, and the output reads as json.dumps writes it
            return xgr.Grammar.from_json_schema(text, any_whitespace=False)
        if kind == "regex":
            return xgr.Grammar.from_regex(text)
        if kind == "choice":
            return xgr.Grammar.from_ebnf(choice_ebnf(json.loads(text)))
    except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError for any bad input
        raise GrammarError(_message(e) or f"the {kind} grammar does not compile") from None
    raise GrammarError(f"unknown grammar kind {kind!r}")
