"""Per-request sampling: greedy, temperature, top-k, top-p, with a per-request seeded generator."""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass(slots=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0            # 0 = off
    top_p: float = 1.0
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    # Self-speculative decoding: draft with this lower tier, verify `spec_gamma` tokens at a time.
    spec_draft_tier: int | None = None
    spec_gamma: int = 4

    def validate(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.spec_draft_tier is not None:
            if self.temperature != 0.0:
                raise ValueError("speculative decoding serves greedy requests only (temperature 0) for now")
            if self.spec_gamma < 1:
                raise ValueError(f"spec_gamma must be >= 1, got {self.spec_gamma}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def make_generator(params: SamplingParams) -> torch.Generator | None:
    if params.greedy:
        return None
    g = torch.Generator()
    g.manual_seed(params.seed if params.seed is not None else torch.seed())
    return g


def probs_for(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution a non-greedy request samples from: [V] float32."""
    x = logits.float() / params.temperature
    if params.top_k and params.top_k < x.shape[-1]:
        kth = torch.topk(x, params.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p < 1.0:
        sx, si = torch.sort(x, descending=True)
        p = torch.softmax(sx, -1)
        cum = torch.cumsum(p, -1)
        drop = cum - p > params.top_p  # keep the smallest prefix whose mass reaches top_p
        sx = sx.masked_fill(drop, float("-inf"))
        x = torch.full_like(x, float("-inf")).scatter(0, si, sx)
    return torch.softmax(x, -1)


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator | None]) -> list[int]:
    """logits [N, V] -> one token per row."""
    out = torch.argmax(logits, dim=-1).tolist()
    for i, p in enumerate(params):
        if not p.greedy:
            probs = probs_for(logits[i].cpu(), p)
            out[i] = int(torch.multinomial(probs, 1, generator=generators[i]).item())
    return out
