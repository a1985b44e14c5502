"""Per-request sampling: logit_bias and penalties, greedy, temperature, min-p, typical-p, top-k, top-p, with a
per-request seeded generator; the acceptance rule of speculative decoding and the confidence the
cascade watches."""
from __future__ import annotations

import torch

from core.protocol import TokenLogprob
from kernels.cpu_argmax import argmax_rows
# SamplingParams lives in the torch-free leaf (core/); re-exported for the callers that import it here.
from core.sampling import SamplingParams

__all__ = ["SamplingParams", "accept_greedy", "accept_sampled", "confidences", "draw", "make_generator",
           "probs_for", "process_logits", "sample", "token_logprobs"]


def make_generator(params: SamplingParams) -> torch.Generator | None:
    if params.greedy:
        return None
    g = torch.Generator()
    g.manual_seed(params.seed if params.seed is not None else torch.seed())
    return g


def process_logits(logits: torch.Tensor, params: list[SamplingParams], counts: list[torch.Tensor | None],
                   seen: list[torch.Tensor | None]) -> torch.Tensor:
    """logits [N, V] -> the logits each row samples from: its logit_bias added, then its penalties
    (vLLM's order and formulas). counts[i] [V]: how often each token occurs in row i's output so far;
    seen[i] [V] bool: which tokens occur in its prompt or output (None for rows without penalties).
    Rows that ask for neither are untouched, and with none in the batch the logits come back as they
    are (no copy)."""
    rows = [i for i, p in enumerate(params) if p.processed]
    if not rows:
        return logits
    out = logits.clone()
    idx = torch.tensor(rows, dtype=torch.long, device=logits.device)
    x = out.index_select(0, idx)
    for j, i in enumerate(rows):
        bias = params[i].logit_bias
        if bias:
            ids = torch.tensor(list(bias), dtype=torch.long, device=x.device)
            x[j].index_add_(0, ids, torch.tensor(list(bias.values()), dtype=x.dtype, device=x.device))
    pen = [j for j, i in enumerate(rows) if params[i].penalized]
    if pen:
        ps = [params[rows[j]] for j in pen]
        col = lambda v: torch.tensor(v, dtype=x.dtype, device=x.device)[:, None]  # noqa: E731
        c = torch.stack([counts[rows[j]] for j in pen]).to(x.dtype)
        sn = torch.stack([seen[rows[j]] for j in pen])
        rp = col([p.repetition_penalty for p in ps])
        y = x[pen]
        y = torch.where(sn, torch.where(y > 0, y / rp, y * rp), y)
        y = y - col([p.frequency_penalty for p in ps]) * c - col([p.presence_penalty for p in ps]) * (c > 0)
        x[pen] = y
    # A penalty near 0 (or a huge bias) may overflow: keep every logit a number, so the ranking stays
    # and sampling never meets inf - inf (a request must not be able to crash its worker).
    x = torch.nan_to_num(x, nan=float("-inf"), posinf=torch.finfo(x.dtype).max)
    out[idx] = x
    return out


def probs_for(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The distribution a non-greedy request samples from (its logits already processed): [V] float32.
    Temperature, then min-p, typical-p, top-k and top-p. The top logit is subtracted before dividing by the
    temperature, in float64 (a temperature below float32's range would divide by zero), so a tiny
    temperature gives a (near) one-hot distribution instead of overflowing."""
    x = logits.double()
    x = (x - x.max()) / params.temperature
    if params.min_p > 0.0:
        p = torch.softmax(x, -1)
        x = x.masked_fill(p < params.min_p * p.max(), float("-inf"))
    if params.typical_p < 1.0:  # the tokens closest to the entropy in surprisal, until typical_p of the mass
        logp = torch.log_softmax(x, -1)
        p = logp.exp()
        entropy = -torch.where(p > 0, p * logp, 0.0).sum()
        order = torch.argsort((-logp - entropy).abs(), stable=True)
        ps = p[order]
        drop = torch.cumsum(ps, -1) - ps > params.typical_p
        x = x.masked_fill(torch.zeros_like(drop).scatter(0, order, drop), float("-inf"))
    if 0 < params.top_k < x.shape[-1]:  # 0 or -1: off (core/params.py)
        kth = torch.topk(x, params.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    if params.top_p < 1.0:
        sx, si = torch.sort(x, descending=True)
        p = torch.softmax(sx, -1)
        cum = torch.cumsum(p, -1)
        drop = cum - p > params.top_p  # keep the smallest prefix whose mass reaches top_p
        sx = sx.masked_fill(drop, float("-inf"))
        x = torch.full_like(x, float("-inf")).scatter(0, si, sx)
    return torch.softmax(x, -1).float()


def draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token from a [V] distribution."""
    return int(torch.multinomial(probs, 1, generator=generator).item())


def skip_draws(generator: torch.Generator | None, n: int, vocab: int) -> None:
    """Advances ``generator`` past ``n`` calls of :func:`draw` over [vocab] distributions: a request resumed
    with ``n`` output tokens (another worker's) draws its next token as its fault-free run does. A draw
    takes the same random numbers whatever the probabilities (one sample: ``vocab`` exponentials), so
    uniform ones stand in. Plain sampled decoding draws once per token; a sampled speculative round draws
    more, so its resumes are not covered."""
    if generator is None or n <= 0:
        return
    u = torch.full((vocab,), 1.0 / vocab)
    for _ in range(n):
        draw(u, generator)


def sample(logits: torch.Tensor, params: list[SamplingParams],
           generators: list[torch.Generator | None]) -> list[int]:
    """logits [N, V] -> one token per row."""
    out = argmax_rows(logits).tolist()  # torch.argmax's answer; our operator on CPU fp32 (a tenth of the time)
    for i, p in enumerate(params):
        if not p.greedy:
            out[i] = draw(probs_for(logits[i].cpu(), p), generators[i])
    return out


def token_logprobs(logits: torch.Tensor, tokens: list[int], top: list[int]) -> list[TokenLogprob]:
    """logits [N, V] (raw: no temperature, penalties or bias), one chosen token per row -> its
    log-softmax value and the row's `top[i]` most likely tokens, in one batched pass."""
    x = logits if logits.dtype in (torch.float32, torch.float64) else logits.float()
    lp = torch.log_softmax(x, dim=-1)
    chosen = lp.gather(1, torch.tensor(tokens, dtype=torch.long, device=lp.device)[:, None])[:, 0].tolist()
    k = max(top, default=0)
    if k:
        vals, ids = torch.topk(lp, k, dim=-1)
        vals, ids = vals.tolist(), ids.tolist()
    return [TokenLogprob(t, c, ids[i][:top[i]] if k else [], vals[i][:top[i]] if k else [])
            for i, (t, c) in enumerate(zip(tokens, chosen))]


def confidences(logits: torch.Tensor) -> list[float]:
    """logits [N, V] -> each row's max softmax probability (temperature 1, no top-k/p)."""
    return torch.softmax(logits.float(), dim=-1).amax(dim=-1).tolist()


def accept_greedy(drafts: list[int], targets: list[int]) -> tuple[list[int], int]:
    """Greedy verification: keep the drafts the target's argmax agrees with, then the target's own
    token at the first disagreement. Returns (committed tokens, drafts accepted)."""
    k = 0
    while k < len(drafts) and drafts[k] == targets[k]:
        k += 1
    return drafts[:k] + targets[k:k + 1], k


def accept_sampled(p: torch.Tensor, q: list[torch.Tensor | None], drafts: list[int],
                   generator: torch.Generator | None) -> tuple[list[int], int]:
    """Speculative rejection sampling (Leviathan et al. 2023; Chen et al. 2023). p [g, V]: the
    target's distributions at the round's positions; q[i] [V]: the distribution draft i was drawn
    from. Draft i is accepted with probability min(1, p_i(x)/q_i(x)); at the first rejection the
    replacement comes from normalize(max(0, p_i - q_i)) and the round stops. Every committed token is
    then distributed exactly as plain sampling from p would make it. A position whose q is unknown is
    sampled from p outright (still exact; its draft is simply not used).
    Returns (committed tokens, drafts accepted): all g drafts, or k accepted plus the replacement."""
    for i, x in enumerate(drafts):
        pi, qi = p[i], q[i]
        if qi is None:
            return drafts[:i] + [draw(pi, generator)], i
        px, qx = float(pi[x]), float(qi[x])
        if qx > 0.0 and (px >= qx or float(torch.rand((), generator=generator)) * qx < px):
            continue
        residual = torch.clamp(pi - qi, min=0.0)
        mass = float(residual.sum())
        return drafts[:i] + [draw(residual / mass if mass > 1e-12 else pi, generator)], i
    return list(drafts), len(drafts)
