"""Block accounting of one segment's KV pool: reference counts, the free list and the prefix cache
(the tensors live in the worker).

A full block can be registered under its chained hash (:func:`block_hash`). When its last user
releases it, a cached block is not freed but becomes *evictable*: it stays findable by hash until the
pool needs its slot or its TTL passes (delayed reclamation). Never-cached free blocks are handed out
first; evictable ones go least recently released first, and a request releases its tail blocks first
so a shared head outlives the tails. Blocks in use (refcount > 0) are never evicted.
"Can't allocate" is a return value (None); a double free is an assert.

A cached block may be *partial*: its trunk KV is there but not its exit block's (requests of higher
tiers skip the KV of exits they never read; see scheduler/core.py). It is found by the same hash; a
request that reads that exit fills it first (:meth:`BlockPool.mark_complete` afterwards), and a
complete block computed under the same hash replaces a partial one."""
from __future__ import annotations

import hashlib
import time
from array import array
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable


def block_hash(parent: bytes | None, segment: int, tokens: Iterable[int]) -> bytes:
    """The key of a full block: its tokens, its whole prefix (through `parent`) and its segment, so a
    segment-0 block is found by every tier and never confused with another segment's block."""
    h = hashlib.blake2b(digest_size=16)
    h.update(parent or b"\0" * 16)
    h.update(segment.to_bytes(4, "little", signed=True))
    h.update(array("q", tokens).tobytes())
    return h.digest()


class BlockPool:
    def __init__(self, num_blocks: int, on_evict: Callable[[int, bytes], None] | None = None,
                 clock: Callable[[], float] = time.monotonic):
        if num_blocks < 1:
            raise ValueError("a block pool needs at least one block")
        self.num_blocks = num_blocks
        self.ref = [0] * num_blocks
        self.free = deque(range(num_blocks))                    # refcount 0, not cached
        self.evictable: OrderedDict[int, float] = OrderedDict()  # refcount 0, cached: block -> release time
        self.hash_of: dict[int, bytes] = {}
        self.cached: dict[bytes, int] = {}
        self.partial: set[int] = set()  # cached blocks without their exit block's KV
        self.on_evict = on_evict
        self.clock = clock  # release times and the TTL of evictable blocks
        self.num_evictions = 0

    @property
    def num_free(self) -> int:
        """Blocks an allocation may take: free ones and cached ones nobody uses."""
        return len(self.free) + len(self.evictable)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def num_cached(self) -> int:
        return len(self.cached)

    def allocate(self, n: int) -> list[int] | None:
        if n > self.num_free:
            return None
        out = []
        for _ in range(n):
            if self.free:
                b = self.free.popleft()
            else:
                b, _ = self.evictable.popitem(last=False)
                self._uncache(b)
            assert self.ref[b] == 0
            self.ref[b] = 1
            out.append(b)
        return out

    def release(self, blocks: Iterable[int]) -> None:
        """Drops one reference from each block; pass a request's blocks tail first."""
        now = self.clock()
        for b in blocks:
            assert self.ref[b] > 0, f"block {b} released twice"
            self.ref[b] -= 1
            if self.ref[b] == 0:
                if b in self.hash_of:
                    self.evictable[b] = now
                else:
                    self.free.append(b)

    # ---- the prefix cache ---------------------------------------------------------------------
    def lookup(self, hashes: Iterable[bytes]) -> list[int]:
        """The cached blocks of the longest prefix of `hashes` this pool holds."""
        out = []
        for h in hashes:
            b = self.cached.get(h)
            if b is None:
                break
            out.append(b)
        return out

    def num_evictable_among(self, blocks: Iterable[int]) -> int:
        return sum(1 for b in blocks if self.ref[b] == 0)

    def touch(self, blocks: Iterable[int]) -> None:
        """Takes a reference on cached blocks a new request reuses."""
        for b in blocks:
            if self.ref[b] == 0:
                del self.evictable[b]
            self.ref[b] += 1

    def cache(self, block: int, h: bytes, complete: bool = True) -> bool:
        """Registers a full, computed block under its hash; False if that hash is cached already
        (the block then stays private and is freed plainly) — unless the cached one is partial and
        this one `complete`: it takes the hash, and the partial one becomes private."""
        assert self.ref[block] > 0, f"block {block} is not in use"
        if block in self.hash_of:
            return False
        old = self.cached.get(h)
        if old is not None:
            if not complete or old not in self.partial:
                return False
            del self.hash_of[old]
            self.partial.discard(old)
            if self.ref[old] == 0:
                del self.evictable[old]
                self.free.append(old)
        self.cached[h] = block
        self.hash_of[block] = h
        if not complete:
            self.partial.add(block)
        return True

    def first_partial(self, blocks: list[int]) -> int | None:
        """Index of the first partial block among `blocks` (cached ones), None if none is."""
        if self.partial:
            for i, b in enumerate(blocks):
                if b in self.partial:
                    return i
        return None

    def mark_complete(self, blocks: Iterable[int]) -> None:
        """Their exit block's KV has been filled."""
        self.partial.difference_update(blocks)

    def reclaim_expired(self, ttl_s: float) -> int:
        """Uncaches evictable blocks released more than `ttl_s` ago (by the pool's clock); returns how many."""
        now = self.clock()
        n = 0
        while self.evictable:
            b, t = next(iter(self.evictable.items()))
            if now - t < ttl_s:
                break
            del self.evictable[b]
            self._uncache(b)
            self.free.append(b)
            n += 1
        return n

    def _uncache(self, b: int) -> None:
        h = self.hash_of.pop(b)
        self.partial.discard(b)
        del self.cached[h]
        self.num_evictions += 1
        if self.on_evict is not None:
            self.on_evict(b, h)
