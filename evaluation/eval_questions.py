"""Judging greedy answers: the six fixed questions by what a correct answer must mention, and the
larger question set by agreement with the top tier's answer in its first sentence."""
from __future__ import annotations

import re

# What a correct answer to each of training.data.EVAL_QUESTIONS must contain (any of the words, whole
# words, case-insensitive), in order: Paris, 4, a primary colour, da Vinci, honey, a sentence about dogs.
FIXED_KEYS: list[tuple[str, ...]] = [
    ("paris",), ("4", "four"), ("red", "blue", "yellow"), ("vinci", "leonardo"), ("honey",),
    ("dog", "dogs"),
]


def correct(question_index: int, answer: str) -> bool:
    words = set(re.findall(r"[a-z0-9]+", answer.lower()))
    return any(k in words for k in FIXED_KEYS[question_index])


def first_sentence(text: str) -> str:
    """The answer up to its first sentence end (. ! ? or a line break), normalised: lower case,
    words only (so 'Paris.' and 'paris' agree)."""
    text = text.strip()
    m = re.search(r"[.!?](\s|$)|\n", text)
    head = text[: m.start()] if m else text
    return " ".join(re.findall(r"[a-z0-9]+", head.lower()))


def agree_first_sentence(answers: list[str], reference: list[str]) -> float:
    pairs = [(first_sentence(a), first_sentence(r)) for a, r in zip(answers, reference)]
    return sum(a == r and a != "" for a, r in pairs) / max(1, len(pairs))


def load_questions(path) -> list[tuple[str, tuple[str, ...]]]:
    """A keyword-checked question file (JSONL: ``question``, ``keywords``) -> [(question, keywords)]."""
    import json  # noqa: PLC0415
    from pathlib import Path  # noqa: PLC0415
    out = []
    for line in Path(path).read_text().splitlines():
        if line.strip():
            d = json.loads(line)
            out.append((d["question"], tuple(k.lower() for k in d["keywords"])))
    return out


def has_keyword(answer: str, keywords: tuple[str, ...]) -> bool:
    """Whether the answer mentions any of the keywords as a whole word (case-insensitive)."""
    words = set(re.findall(r"[a-z0-9]+", answer.lower()))
    return any(k in words for k in keywords)


def answered_share(correct: list[bool], reference: list[bool]) -> float | None:
    """Of the questions the reference (the top tier) answers, the share this tier answers too."""
    ref = [i for i, r in enumerate(reference) if r]
    return sum(correct[i] for i in ref) / len(ref) if ref else None
