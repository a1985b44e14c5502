"""The OpenAI wire format of answers: typed results -> response, chunk, usage, log-probability and model
JSON. Nothing here touches Redis or the tokenizer."""
from __future__ import annotations

import time
from dataclasses import dataclass, field

LOGPROB_FLOOR = -9999.0  # what a -inf log-probability is reported as (JSON has no infinity)


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0,
          draft: tuple[str | None, int, int] | None = None) -> dict:
    """``draft``: (draft model id, proposed, accepted) of a speculated request; with proposed > 0 it
    adds OpenAI's predicted-output fields (``completion_tokens_details.accepted_prediction_tokens`` /
    ``rejected_prediction_tokens``) and ``mfs_draft``."""
    u = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
         "total_tokens": prompt_tokens + completion_tokens}
    if cached_tokens:
        u["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    if draft is not None and draft[1] > 0:
        model, proposed, accepted = draft
        accepted = max(0, min(accepted, proposed))
        u["completion_tokens_details"] = {"accepted_prediction_tokens": accepted,
                                          "rejected_prediction_tokens": proposed - accepted}
        u["mfs_draft"] = {"draft_model": model, "proposed": proposed, "accepted": accepted}
    return u


def served(tier_ids: list[str], paths: list[str] | None = None) -> dict:
    """The ``mfs`` response extension: the tiers that produced the tokens, in order, and the workers'
    execution paths that computed them (``core.protocol.EXECUTION_PATHS``: a worker swaps in its compiled
    graphs while it serves, and they may round otherwise), in order of first use; absent when no worker
    named one (a worker that runs no model)."""
    out = {"tiers": list(tier_ids), "escalations": max(0, len(tier_ids) - 1)}
    if paths:
        out["paths"] = list(paths)
    return out


@dataclass(slots=True)
class TokenInfo:
    """One token as a response shows its log-probability: its text (the token decoded alone), its
    log-probability (None: the first prompt token, which nothing predicts) and the most likely tokens
    at its position, most likely first."""
    text: str
    logprob: float | None
    top: list[tuple[str, float]] = field(default_factory=list)


def _lp(v: float) -> float:
    return v if v > LOGPROB_FLOOR else LOGPROB_FLOOR


def _bytes(text: str) -> list[int]:
    return list(text.encode("utf-8", errors="surrogatepass"))


def chat_logprobs(items: list[TokenInfo]) -> dict:
    """OpenAI's ``choices[i].logprobs`` of a chat completion (or chunk)."""
    return {"content": [{"token": t.text, "logprob": _lp(t.logprob), "bytes": _bytes(t.text),
                         "top_logprobs": [{"token": s, "logprob": _lp(v), "bytes": _bytes(s)} for s, v in t.top]}
                        for t in items],
            "refusal": None}


def completion_logprobs(items: list[TokenInfo], offset: int = 0) -> dict:
    """OpenAI's legacy ``choices[i].logprobs``; ``offset``: characters of the choice's text before the
    first item (text_offset counts from there, each token adding its own text's length)."""
    offsets = []
    for t in items:
        offsets.append(offset)
        offset += len(t.text)
    return {"tokens": [t.text for t in items],
            "token_logprobs": [None if t.logprob is None else _lp(t.logprob) for t in items],
            "top_logprobs": [None if t.logprob is None else {s: _lp(v) for s, v in t.top} for t in items],
            "text_offset": offsets}


@dataclass(slots=True)
class Choice:
    """One choice of a finished response."""
    index: int
    text: str
    finish: str
    logprobs: dict | None = None


def chat_response(rid: str, model: str, created: int, choices: list[Choice], use: dict) -> dict:
    return {"id": rid, "object": "chat.completion", "created": created, "model": model,
            "choices": [{"index": c.index, "message": {"role": "assistant", "content": c.text},
                         "logprobs": c.logprobs, "finish_reason": c.finish} for c in choices],
            "usage": use}


def completion_response(rid: str, model: str, created: int, choices: list[Choice], use: dict) -> dict:
    return {"id": rid, "object": "text_completion", "created": created, "model": model,
            "choices": [{"index": c.index, "text": c.text, "logprobs": c.logprobs, "finish_reason": c.finish}
                        for c in choices],
            "usage": use}


def chat_chunk(rid: str, model: str, created: int, delta: dict, finish: str | None,
               with_usage: bool, logprobs: dict | None = None, index: int = 0) -> dict:
    c = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
         "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]}
    if with_usage:
        c["usage"] = None
    return c


def completion_chunk(rid: str, model: str, created: int, text: str, finish: str | None,
                     with_usage: bool, logprobs: dict | None = None, index: int = 0) -> dict:
    c = {"id": rid, "object": "text_completion", "created": created, "model": model,
         "choices": [{"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}]}
    if with_usage:
        c["usage"] = None
    return c


def usage_chunk(rid: str, model: str, created: int, obj: str, use: dict) -> dict:
    return {"id": rid, "object": obj, "created": created, "model": model, "choices": [], "usage": use}


def models_list(ids: list[str], created: int | None = None, owner: str = "mfs") -> dict:
    created = created or int(time.time())
    return {"object": "list", "data": [{"id": i, "object": "model", "created": created,
                                        "owned_by": owner} for i in ids]}
