"""The tensors of the tier-segmented paged KV cache: one pool per segment (the layers between two
exits). Which block belongs to whom is the scheduler's business (scheduler/blocks.py)."""
from __future__ import annotations

import torch


class SegmentedKVCache:
    """k[s], v[s]: [layers_in_segment, num_blocks_s, block_size, kv_heads, head_dim]."""

    def __init__(self, segment_layers: list[int], num_blocks: list[int], block_size: int,
                 kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device | str = "cpu",
                 hidden_size: int = 0):
        assert len(segment_layers) == len(num_blocks)
        self.block_size = block_size
        self.num_blocks = list(num_blocks)
        self.k = [torch.zeros(nl, nb, block_size, kv_heads, head_dim, dtype=dtype, device=device)
                  for nl, nb in zip(segment_layers, num_blocks)]
        self.v = [torch.zeros_like(t) for t in self.k]
        # hid[s]: the hidden state after segment s of every token in a segment-s block (all but the
        # last segment). A higher tier reuses a lower tier's cached prefix by starting its upper
        # segments from here instead of recomputing the lower ones.
        self.hid = [torch.zeros(nb, block_size, hidden_size, dtype=dtype, device=device)
                    for nb in num_blocks[:-1]] if hidden_size else []

    @property
    def num_segments(self) -> int:
        return len(self.k)

    @staticmethod
    def block_bytes(segment_layers: list[int], block_size: int, kv_heads: int, head_dim: int,
                    dtype: torch.dtype, hidden_size: int = 0) -> int:
        """Bytes one block id takes in every segment's pool together (k, v and, with ``hidden_size``, the
        stored hidden state of all but the last segment): what a pool of N blocks per segment costs, / N."""
        kv = sum(2 * nl * kv_heads * head_dim for nl in segment_layers)
        hid = (len(segment_layers) - 1) * hidden_size
        return block_size * (kv + hid) * torch.empty(0, dtype=dtype).element_size()

    def bytes_per_block(self, s: int) -> int:
        t = self.k[s]
        hid = self.hid[s][0].numel() * self.hid[s].element_size() if s < len(self.hid) else 0
        return 2 * t[:, 0].numel() * t.element_size() + hid

