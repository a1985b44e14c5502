"""Where a gateway's requests go among the control-plane shards (core.protocol "Shards"), and the
shards' published stats merged: pure functions, used by ``gateway.backend``."""
from __future__ import annotations

from dataclasses import dataclass

from core import protocol as P


@dataclass(slots=True)
class LiveWorker:
    """What the gateway reads of a registration (core.protocol.WorkerInfo): one HMGET per worker."""
    worker_id: str
    max_model_len: int | None
    shard: str = P.DEFAULT_SHARD
    tiers: tuple[int, ...] = ()
    weights: str = ""
    choice: str = ""  # what it serves and why (its start line)


def choose_shard(tier: int, workers: list[LiveWorker], load: dict[str, float], known: list[str],
                 session_shard: str | None = None) -> str:
    """The shard for a new request: among the shards with a live worker serving ``tier`` (else any shard
    with a live worker, else the ``known`` ones: the scheduler answers what is wrong), the session's
    shard if it is one of them, else the least loaded (ties: the first by name)."""
    cands = sorted({w.shard for w in workers if tier in w.tiers}) or sorted({w.shard for w in workers})
    cands = cands or sorted(known) or [P.DEFAULT_SHARD]
    if session_shard in cands:
        return session_shard
    return min(cands, key=lambda s: (load.get(s, 0.0), s))


def merge_stats(parts: list[dict]) -> dict:
    """The shards' ``mfs:stats`` snapshots as one: numbers summed, maps merged key by key, lists summed
    element by element; text (leader, shard) from the first."""
    out: dict = {}
    for part in parts:
        for k, v in part.items():
            out[k] = _merge(out[k], v) if k in out else v
    return out


def _merge(a, b):
    if isinstance(a, bool) or isinstance(b, bool):
        return a
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return a + b
    if isinstance(a, dict) and isinstance(b, dict):
        return merge_stats([a, b])
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        n = max(len(a), len(b))
        return [_merge(a[i], b[i]) if i < len(a) and i < len(b) else (a[i] if i < len(a) else b[i])
                for i in range(n)]
    return a
