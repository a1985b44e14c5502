"""The tier-segmented paged KV cache: one block pool per segment (the layers between two exits).

A tier-k request holds one block table per segment 0..k, all covering the same token positions.
The pool owns the tensors and the free lists; requests own only their block ids.
"""
from __future__ import annotations

from collections import deque

import torch


class BlockPool:
    """Free list and reference counts of one segment's blocks. "Can't allocate" returns None."""

    def __init__(self, num_blocks: int):
        if num_blocks < 1:
            raise ValueError("a block pool needs at least one block")
        self.num_blocks = num_blocks
        self.ref = [0] * num_blocks
        self.free = deque(range(num_blocks))

    @property
    def num_free(self) -> int:
        return len(self.free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self.free)

    def allocate(self, n: int) -> list[int] | None:
        if n > len(self.free):
            return None
        out = [self.free.popleft() for _ in range(n)]
        for b in out:
            assert self.ref[b] == 0
            self.ref[b] = 1
        return out

    def release(self, blocks: list[int]) -> None:
        for b in blocks:
            assert self.ref[b] > 0, f"block {b} released twice"
            self.ref[b] -= 1
            if self.ref[b] == 0:
                self.free.append(b)


class SegmentedKVCache:
    """k[s], v[s]: [layers_in_segment, num_blocks_s, block_size, kv_heads, head_dim]."""

    def __init__(self, segment_layers: list[int], num_blocks: list[int], block_size: int,
                 kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device | str = "cpu"):
        assert len(segment_layers) == len(num_blocks)
        self.block_size = block_size
        self.segment_layers = segment_layers
        self.pools = [BlockPool(n) for n in num_blocks]
        self.k = [torch.zeros(nl, nb, block_size, kv_heads, head_dim, dtype=dtype, device=device)
                  for nl, nb in zip(segment_layers, num_blocks)]
        self.v = [torch.zeros_like(t) for t in self.k]

    @property
    def num_segments(self) -> int:
        return len(self.pools)

    def bytes_per_block(self, s: int) -> int:
        t = self.k[s]
        return 2 * t[:, 0].numel() * t.element_size()

    def total_bytes(self) -> int:
        return sum(self.bytes_per_block(s) * p.num_blocks for s, p in enumerate(self.pools))

    def used_bytes(self) -> int:
        return sum(self.bytes_per_block(s) * p.num_used for s, p in enumerate(self.pools))

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)
