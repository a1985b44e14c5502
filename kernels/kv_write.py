"""Writing new K/V rows into a segment's paged pool through a slot mapping."""
from __future__ import annotations

import torch


def write_kv_torch(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """k, v: [T, Hkv, D]; k_cache, v_cache: [num_blocks, block_size, Hkv, D];
    slot_mapping: [T] int64, slot = block_id * block_size + offset. Writes in place."""
    assert k.shape == v.shape and k.dim() == 3
    assert k_cache.shape == v_cache.shape and k_cache.dim() == 4
    assert slot_mapping.shape == (k.shape[0],)
    nb, bs, h, d = k_cache.shape
    k_cache.view(nb * bs, h, d).index_copy_(0, slot_mapping, k.to(k_cache.dtype))
    v_cache.view(nb * bs, h, d).index_copy_(0, slot_mapping, v.to(v_cache.dtype))
