"""Rotary position embedding (neox / Llama "rotate half" layout) from a precomputed cos/sin cache."""
from __future__ import annotations

import torch


def build_cos_sin_cache(inv_freq: torch.Tensor, max_positions: int, attention_scaling: float = 1.0,
                        dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """[max_positions, head_dim] = concat(cos, sin), each half head_dim, scaled like transformers."""
    t = torch.arange(max_positions, dtype=torch.float32)
    freqs = torch.outer(t, inv_freq.float())  # [P, D/2]
    cos = freqs.cos() * attention_scaling
    sin = freqs.sin() * attention_scaling
    return torch.cat([cos, sin], dim=-1).to(dtype)


def _rotate(x: torch.Tensor, cos2: torch.Tensor, sin2: torch.Tensor) -> torch.Tensor:
    """[x1 cos - x2 sin, x2 cos + x1 sin] as x * [cos, cos] + [x2, x1] * [-sin, sin]: four kernels
    instead of seven, and the same bits (x2 * -sin is -(x2 * sin) exactly, and a + -b is a - b)."""
    half = x.shape[-1] // 2
    return x * cos2 + torch.cat([x[..., half:], x[..., :half]], dim=-1) * sin2


def rotary_torch(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                 cos_sin_cache: torch.Tensor, memo: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [T, Hq, D], k: [T, Hkv, D], positions: [T] int64. Returns rotated (q, k) (new tensors).
    ``memo``: a dict shared by calls with the same ``positions`` (the layers of one segment in one
    step): the cos/sin rows are gathered once."""
    assert q.dim() == 3 and k.dim() == 3 and positions.dim() == 1
    assert q.shape[0] == k.shape[0] == positions.shape[0]
    ent = memo.get("rotary") if memo is not None else None
    if ent is None or ent[0] is not positions or ent[1] != q.dtype:
        cs = cos_sin_cache.index_select(0, positions)  # [T, D]
        half = cs.shape[-1] // 2
        cos, sin = cs[:, :half].unsqueeze(1).to(q.dtype), cs[:, half:].unsqueeze(1).to(q.dtype)
        ent = (positions, q.dtype, torch.cat([cos, cos], dim=-1), torch.cat([-sin, sin], dim=-1))
        if memo is not None:
            memo["rotary"] = ent
    _, _, cos2, sin2 = ent
    return _rotate(q, cos2, sin2), _rotate(k, cos2, sin2)
