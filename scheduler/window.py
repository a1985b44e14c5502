"""Giving back the KV blocks that every layer's attention window has left behind a running request.

When every layer of the model attends within a window (``SchedulerConfig.kv_window``: the widest; Mistral
sets one on every layer; Gemma 3's global layers read every position, so it has none), the query at
position p reads the keys of positions p - W + 1 .. p only. A request's positions only grow, so once it
has computed p positions, the blocks wholly before position p - W + 1 are never read again: after each
step they go back to their pools while the request continues, and its tables keep :data:`RELEASED` in
their place (a block's index stays position // block_size). A long stream then holds at most
ceil((W - 1 + n) / block_size) + 1 blocks per segment, n the most positions one step computes for it.

Going back to the pool drops the request's reference only (scheduler/blocks.py counts them): a block
another request shares stays in use, and a block registered in the prefix cache stays findable by its
hash until the pool needs the slot. A block is given back only once it is registered (when prefix
caching is on), so its cache entry is never lost.

A confidence-cascade request (``cascade_threshold``) keeps every block: an escalation computes the new
segment's KV of its whole history from the trunk state stored in the lower segments' blocks
(scheduler/speculation.py: Cascade), and the upper layers' KV at a position depends, through their
stacked windows, on positions far more than one window back. Self-speculation needs no exception:
its draft and verification rows start at the request's computed positions, and a verification enters
from the trunk state its own round's drafts stored.
"""
from __future__ import annotations

from scheduler.blocks import BlockPool
from scheduler.request import Request, SchedulerConfig

RELEASED = -1  # a table entry whose block went back to the pool: no layer reads that position again


def releases(cfg: SchedulerConfig, req: Request) -> bool:
    """Whether this request's blocks are given back as its window moves on."""
    return cfg.kv_window > 0 and req.params.cascade_threshold is None


def blocks_held_at_most(cfg: SchedulerConfig, step_tokens: int) -> int:
    """The most blocks per segment a releasing request holds when a step computes at most
    ``step_tokens`` of its positions (one more for a block computed but not yet registered)."""
    return -(-(cfg.kv_window - 1 + step_tokens) // cfg.block_size) + 2


def release_outside_window(cfg: SchedulerConfig, pools: list[BlockPool], req: Request) -> None:
    """Gives back the request's leading blocks that lie wholly before its window (every segment)."""
    if not releases(cfg, req) or not req.block_tables:
        return
    k = max(0, (req.num_computed_tokens - cfg.kv_window + 1) // cfg.block_size)
    if cfg.prefix_caching:
        k = min(k, req.num_cached_blocks)
    done = req.num_released_blocks
    if k <= done:
        return
    for s, table in enumerate(req.block_tables):
        assert RELEASED not in table[done:k], f"request {req.request_id}: a block released twice"
        pools[s].release(reversed(table[done:k]))
        table[done:k] = [RELEASED] * (k - done)
    req.num_released_blocks = k


def held(req: Request, s: int) -> list[int]:
    """The blocks the request holds in segment s (its table less the released entries)."""
    return req.block_tables[s][req.num_released_blocks:]
