"""The leader's gauges and counters as one StatsSnapshot (``mfs:stats``), summed over its workers'
step schedulers; /metrics of every gateway, the launcher and the benchmarks read it."""
from __future__ import annotations

import time

from core import protocol as P
from core.keyrecords import StatsSnapshot
from scheduler.registry import WorkerRegistry


def snapshot(registry: WorkerRegistry, **service) -> StatsSnapshot:
    """``service``: the service's own counters (leader, shard, epoch, takeovers, gateway_cancels, steps,
    step_roundtrip_s, step_forward_s, forward_steps)."""
    workers = registry.workers
    waiting: dict[int, int] = {}
    running: dict[int, int] = {}
    used, total = {}, {}
    sw = pre = gated = 0
    cache = {k: {} for k in ("prefill_computed", "prefill_reused", "cache_queries", "cache_hits",
                             "evictions", "exit_filled")}
    held = {}
    spec: dict[str, dict[str, int]] = {}
    escal: dict[str, int] = {}
    for w in workers.values():
        for pair, (rounds, proposed, accepted, committed) in w.core.stats.spec_pairs.items():
            d = spec.setdefault(pair, {"rounds": 0, "proposed": 0, "accepted": 0, "committed": 0})
            d["rounds"] += rounds
            d["proposed"] += proposed
            d["accepted"] += accepted
            d["committed"] += committed
        for pair, n in w.core.stats.escalations.items():
            escal[pair] = escal.get(pair, 0) + n
        for r in w.core.waiting:
            waiting[r.tier] = waiting.get(r.tier, 0) + 1
        for r in w.core.running:
            running[r.tier] = running.get(r.tier, 0) + 1
        used[w.worker_id], total[w.worker_id] = w.core.kv_usage()
        sw += w.core.stats.path_switches
        pre += w.core.stats.preemptions
        gated += w.core.stats.spec_gated
        for k, per_seg in cache.items():
            for seg, v in enumerate(getattr(w.core.stats, k)):
                per_seg[seg] = per_seg.get(seg, 0) + v
        held[w.worker_id] = registry.directory.num_held(w.worker_id)
    return StatsSnapshot(
        updated=time.time(), workers=len(workers), waiting=waiting, running=running, kv_blocks_used=used,
        kv_blocks_total=total, path_switches=sw, preemptions=pre, replanned=registry.replanned, **cache,
        directory_blocks=held, affinity_preferred=registry.affinity_preferred,
        affinity_yielded=registry.affinity_yielded, spec=spec, spec_gated=gated, escalations_by_pair=escal,
        escalations=sum(escal.values()), **service)
