"""Block accounting of one segment's KV pool: free list and reference counts (the tensors live in the
worker). "Can't allocate" is a return value (None), a double free is an assert."""
from __future__ import annotations

from collections import deque


class BlockPool:
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
