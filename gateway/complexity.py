"""Prompt complexity scoring: which tier serves a request that names the family (or ``"auto"``).

The scorer is a small, transparent linear model over features of the prompt. Each feature is first
squashed to ``[0, 1]`` by saturation (``sat(x, k) = min(x, k) / k``: it grows linearly and is full at
``k``), then weighted; the score is the sum::

    score = w_length    * sat(prompt_tokens,                 length_full_tokens)
          + w_structure * sat(code_fences + list_items / 2,  structure_full)
          + w_reasoning * sat(#distinct reasoning cues,      cue_full)     # "why", "explain", "prove", "step by step", ...
          + w_code      * sat(#distinct code cues,           cue_full)     # "function", "python", "bug", "def ", "```", ...
          + w_math      * sat(#distinct math cues,           cue_full)     # "integral", "solve", "equation", "3 * 4", "\\frac", ...
          + w_depth     * sat(user_turns - 1,                depth_full)   # conversation depth

The tier is the number of ``thresholds`` the score reaches: ``score < thresholds[0]`` -> tier 0,
``thresholds[0] <= score < thresholds[1]`` -> tier 1, and so on, clamped to the family's top tier (a
two-tier family sends everything at or above ``thresholds[0]`` to its large tier).

With the defaults (all weights 1 except structure and depth 0.5; thresholds 0.6 and 1.5):

* "What is the capital of France?" scores 0 -> small;
* "Explain step by step why the sky is blue." has three reasoning cues (1.0) -> medium;
* a Python question with a fenced snippet that asks why it has a bug scores about 2 -> large;
* a long prompt (1,024+ tokens) alone earns 1.0 -> medium; with two cues of one kind (+0.67) -> large.

Every number is a field of :class:`ComplexityConfig`; override any subset from a JSON object, either a
file (``--complexity-config PATH``) or inline (``--complexity-config '{"thresholds": [0.3, 1.0]}'``).
"""
from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

REASONING_CUES = ("why", "explain", "prove", "proof", "reason", "step by step", "analyze", "analyse",
                  "compare", "derive", "justify", "evaluate", "trade-off", "tradeoff", "pros and cons",
                  "think through", "implications", "critique", "argue", "in detail")
CODE_CUES = ("code", "function", "implement", "python", "javascript", "typescript", "rust", "java",
             "c++", "sql", "regex", "bug", "debug", "compile", "stack trace", "traceback", "algorithm",
             "refactor", "api", "class ", "def ", "return ", "import ", "```", "{", "=>", "();")
MATH_CUES = ("integral", "derivative", "equation", "solve", "calculate", "compute", "probability",
             "theorem", "matrix", "polynomial", "prime", "sum of", "limit", "\\frac", "\\int", "$$",
             "sqrt", "log(", "factorial", "modulo")
_ARITH = re.compile(r"(?:\d+(?:\.\d+)?|\b[a-z])\s*[-+*/^=<>]\s*\(?\d")  # "3 * 4", "n^2", "x = 5"
_LIST_ITEM = re.compile(r"^\s*(?:[-*+•]|\d+[.)])\s+\S", re.MULTILINE)
_WORD = re.compile(r"[a-z0-9+#]+")


@dataclass(slots=True)
class ComplexityConfig:
    """Weights and thresholds of the scorer (see the module docstring for the formula)."""
    w_length: float = 1.0
    w_structure: float = 0.5
    w_reasoning: float = 1.0
    w_code: float = 1.0
    w_math: float = 1.0
    w_depth: float = 0.5
    length_full_tokens: int = 1024   # prompt tokens at which the length feature is full
    structure_full: float = 2.0      # code fences + list_items/2 at which structure is full
    cue_full: int = 3                # distinct cues of one kind at which that feature is full
    depth_full: int = 4              # extra user turns at which depth is full
    thresholds: list[float] = field(default_factory=lambda: [0.6, 1.5])

    def __post_init__(self):
        if list(self.thresholds) != sorted(self.thresholds):
            raise ValueError(f"complexity thresholds must be ascending, got {self.thresholds}")
        for name in ("length_full_tokens", "structure_full", "cue_full", "depth_full"):
            if getattr(self, name) <= 0:
                raise ValueError(f"complexity {name} must be > 0")

    @classmethod
    def from_dict(cls, raw: dict) -> "ComplexityConfig":
        names = {f.name for f in fields(cls)}
        unknown = set(raw) - names
        if unknown:
            raise ValueError(f"unknown complexity settings {sorted(unknown)}; known: {sorted(names)}")
        return cls(**{**asdict(cls()), **raw})

    @classmethod
    def load(cls, spec: str | None) -> "ComplexityConfig":
        """``spec``: None (defaults), an inline JSON object, or the path of a JSON file."""
        if not spec:
            return cls()
        text = spec if spec.lstrip()[:1] in ("{", "[") else Path(spec).expanduser().read_text()
        raw = json.loads(text)
        if not isinstance(raw, dict):
            raise ValueError("complexity config must be a JSON object")
        return cls.from_dict(raw)


@dataclass(slots=True)
class Score:
    tier: int
    score: float
    features: dict[str, float]


def _sat(x: float, full: float) -> float:
    return min(max(x, 0.0), full) / full


def _cues(text: str, words: set[str], cues: tuple[str, ...]) -> int:
    n = 0
    for cue in cues:
        if cue.isalnum():  # whole words only: "why" must not match "anywhy", "api" not "capital"
            n += cue in words
        else:
            n += cue in text
    return n


def features(text: str, prompt_tokens: int, user_turns: int = 1) -> dict[str, float]:
    """The raw feature counts of a prompt (before saturation and weights)."""
    low = text.lower()
    words = set(_WORD.findall(low))
    math = _cues(low, words, MATH_CUES) + (1 if _ARITH.search(low) else 0)
    return {"prompt_tokens": float(prompt_tokens),
            "code_fences": float(low.count("```") // 2 + low.count("```") % 2),
            "list_items": float(len(_LIST_ITEM.findall(text))),
            "reasoning_cues": float(_cues(low, words, REASONING_CUES)),
            "code_cues": float(_cues(low, words, CODE_CUES)),
            "math_cues": float(math),
            "user_turns": float(max(1, user_turns))}


def score_prompt(text: str, prompt_tokens: int, user_turns: int, num_tiers: int,
                 cfg: ComplexityConfig | None = None) -> Score:
    """Scores a prompt and maps it to a tier index in ``[0, num_tiers)``."""
    cfg = cfg or ComplexityConfig()
    f = features(text, prompt_tokens, user_turns)
    parts = {
        "length": cfg.w_length * _sat(f["prompt_tokens"], cfg.length_full_tokens),
        "structure": cfg.w_structure * _sat(f["code_fences"] + f["list_items"] / 2, cfg.structure_full),
        "reasoning": cfg.w_reasoning * _sat(f["reasoning_cues"], cfg.cue_full),
        "code": cfg.w_code * _sat(f["code_cues"], cfg.cue_full),
        "math": cfg.w_math * _sat(f["math_cues"], cfg.cue_full),
        "depth": cfg.w_depth * _sat(f["user_turns"] - 1, cfg.depth_full),
    }
    total = sum(parts.values())
    tier = sum(1 for t in cfg.thresholds if total >= t)
    return Score(min(tier, max(0, num_tiers - 1)), round(total, 4), parts)


def chat_text(messages: list[dict]) -> tuple[str, int]:
    """(text to score, number of user turns) of a chat: the scorer reads all turns."""
    text = "\n".join(m["content"] for m in messages if m["role"] in ("user", "system"))
    return text, sum(1 for m in messages if m["role"] == "user")
