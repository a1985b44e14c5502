"""The status page's numbers (``GET /status.json``, drawn by ``status.html`` at ``GET /``).

Everything here is read from the samples of the registry ``/metrics`` renders (``Metrics.registry``,
after the view's ``refresh_scheduler``), so the page and a Prometheus scrape show the same numbers,
interpreted once (``gateway.metrics``). What the registry does not hold comes from the backend as plain
values: live workers with their heartbeats, and each shard's leading scheduler (its ``mfs:stats``
snapshot's ``leader``, ``epoch`` and ``updated``).

Request numbers (tokens, requests, TTFT/TPOT) are this gateway's, cumulative since it started;
scheduler numbers (running, waiting, KV blocks, prefix cache, speculation, escalations) are the whole
system's, as in ``/metrics``. Rates (tokens/s) are the page's business: it divides the difference of
two snapshots by the difference of their ``time``.
"""
from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path

from prometheus_client import CollectorRegistry

PAGE = Path(__file__).with_name("status.html")  # plain HTML + a script, no build step
QUANTILES = (0.5, 0.9, 0.99)

Samples = dict[str, list[tuple[dict[str, str], float]]]


def samples(registry: CollectorRegistry) -> Samples:
    """Every sample of the registry by sample name (``mfs_requests_total``, ``…_bucket``, …)."""
    out: Samples = defaultdict(list)
    for family in registry.collect():
        for s in family.samples:
            out[s.name].append((s.labels, s.value))
    return out


def by_label(smp: Samples, name: str, label: str) -> dict[str, float]:
    """``name``'s values summed per value of ``label`` (over the other labels)."""
    out: dict[str, float] = defaultdict(float)
    for labels, v in smp.get(name, ()):
        out[labels.get(label, "")] += v
    return dict(out)


def histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> float | None:
    """Prometheus's ``histogram_quantile`` over cumulative ``(le, count)`` buckets: linear inside the
    bucket the rank falls in; the highest finite bound when it falls in ``+Inf``; None without samples."""
    buckets = sorted(buckets)
    if not buckets or buckets[-1][1] <= 0:
        return None
    rank = q * buckets[-1][1]
    lo_bound, lo_count = 0.0, 0.0
    for le, count in buckets:
        if count >= rank:
            if math.isinf(le):
                return lo_bound
            if count == lo_count:
                return le
            return lo_bound + (le - lo_bound) * (rank - lo_count) / (count - lo_count)
        lo_bound, lo_count = le, count
    return lo_bound


def quantiles(smp: Samples, histogram: str, model: str) -> dict[str, float | None]:
    """``{"p50": s, "p90": s, "p99": s}`` of one tier's histogram (seconds; None before a sample)."""
    buckets = [(float(lb["le"]), v) for lb, v in smp.get(histogram + "_bucket", ()) if lb.get("model") == model]
    return {f"p{round(q * 100)}": histogram_quantile(q, buckets) for q in QUANTILES}


def _per_segment(smp: Samples, name: str) -> dict[int, float]:
    return {int(s): v for s, v in by_label(smp, name, "segment").items() if s.isdigit()}


def _scalar(smp: Samples, name: str) -> float:
    return sum(v for _, v in smp.get(name, ()))


def _tier(i: int, name: str, model: str, smp: Samples) -> dict:
    """One tier's row; tier ``i`` decodes over KV segments 0..i, and its own segment is ``i``."""
    def at(metric: str, label: str, key: str) -> float:
        return by_label(smp, metric, label).get(key, 0.0)

    rate = {s: v for s, v in ((int(lb["segment"]), v) for lb, v in smp.get("mfs_prefix_cache_hit_rate", ()))}
    return {
        "tier": i, "name": name, "model": model,
        "running": at("mfs_scheduler_running", "tier", name),
        "waiting": at("mfs_scheduler_waiting", "tier", name),
        "requests": at("mfs_requests_total", "model", model),
        "prompt_tokens": at("mfs_prompt_tokens_total", "model", model),
        "completion_tokens": at("mfs_completion_tokens_total", "model", model),
        "ttft_s": quantiles(smp, "mfs_time_to_first_token_seconds", model),
        "tpot_s": quantiles(smp, "mfs_time_per_output_token_seconds", model),
        "kv_blocks_used": _per_segment(smp, "mfs_kv_blocks_used").get(i, 0.0),
        "kv_blocks_total": _per_segment(smp, "mfs_kv_blocks_total").get(i, 0.0),
        "prefix_cache_hit_rate": rate.get(i),
    }


def _speculation(smp: Samples) -> list[dict]:
    pairs: dict[tuple[str, str], dict] = {}
    for field, metric in (("rounds", "mfs_spec_rounds_total"), ("proposed", "mfs_spec_draft_tokens_total"),
                          ("accepted", "mfs_spec_accepted_tokens_total"),
                          ("acceptance_rate", "mfs_spec_acceptance_rate"),
                          ("tokens_per_verification", "mfs_spec_tokens_per_verification")):
        for lb, v in smp.get(metric, ()):
            pairs.setdefault((lb["draft"], lb["target"]), {"acceptance_rate": None,
                                                           "tokens_per_verification": None})[field] = v
    return [{"draft": d, "target": t, **v} for (d, t), v in sorted(pairs.items())]


def _workers(smp: Samples, workers, heartbeats: dict[str, float], tier_names: list[str], now: float) -> list[dict]:
    used: dict[str, dict[int, float]] = defaultdict(dict)
    total: dict[str, dict[int, float]] = defaultdict(dict)
    for into, metric in ((used, "mfs_kv_blocks_used"), (total, "mfs_kv_blocks_total")):
        for lb, v in smp.get(metric, ()):
            into[lb["worker"]][int(lb["segment"])] = v
    out = []
    for w in workers:
        beat = heartbeats.get(w.worker_id)
        segs = sorted(set(used[w.worker_id]) | set(total[w.worker_id]))
        out.append({"id": w.worker_id, "shard": w.shard,
                    "tiers": [tier_names[t] if t < len(tier_names) else str(t) for t in w.tiers],
                    "weights": w.weights, "choice": w.choice,
                    "heartbeat": beat, "age_s": None if beat is None else round(now - beat, 3),
                    "kv_blocks_used": [used[w.worker_id].get(s, 0.0) for s in segs],
                    "kv_blocks_total": [total[w.worker_id].get(s, 0.0) for s in segs]})
    return out


def _schedulers(shards: dict[str, dict], now: float) -> list[dict]:
    out = []
    for shard in sorted(shards):
        st = shards[shard]
        updated = st.get("updated")
        updated = float(updated) if isinstance(updated, (int, float)) else None
        out.append({"shard": shard, "leader": str(st.get("leader", "")), "epoch": st.get("epoch"),
                    "workers": st.get("workers"), "updated": updated,
                    "age_s": None if updated is None else round(now - updated, 3)})
    return out


def snapshot(registry: CollectorRegistry, *, tier_names: list[str], tier_ids: list[str], gateway_id: str,
             workers, heartbeats: dict[str, float], shards: dict[str, dict], now: float) -> dict:
    """The status document: per tier, speculation pairs, escalations, workers and leading schedulers.
    ``workers`` are ``gateway.backend.LiveWorker``s, ``shards`` the backend's ``shard_stats()``."""
    smp = samples(registry)
    tiers = [_tier(i, n, m, smp) for i, (n, m) in enumerate(zip(tier_names, tier_ids))]
    esc = [{"from": lb["from"], "to": lb["to"], "count": v}
           for lb, v in smp.get("mfs_cascade_escalations_total", ())]
    return {
        "time": now, "gateway": gateway_id,
        "redis_up": _scalar(smp, "mfs_redis_up") > 0,
        "inflight": _scalar(smp, "mfs_inflight_requests"),
        "requests": sum(t["requests"] for t in tiers),
        "completion_tokens": sum(t["completion_tokens"] for t in tiers),
        "tiers": tiers,
        "speculation": _speculation(smp),
        "escalations": {"total": _scalar(smp, "mfs_scheduler_escalations"), "pairs": esc},
        "preemptions": _scalar(smp, "mfs_scheduler_preemptions"),
        "workers": _workers(smp, workers, heartbeats, tier_names, now),
        "schedulers": _schedulers(shards, now),
        "admission": _admission(smp, tier_names),
    }


def _admission(smp: Samples, tier_names: list[str]) -> dict:
    """This gateway's queue (gateway.admission): requests waiting for their first token, the bounds,
    and the requests shed with 429 queue_full (cumulative; the page makes a rate of it)."""
    depth = by_label(smp, "mfs_gateway_queue_depth_by_tier", "tier")
    limit = by_label(smp, "mfs_gateway_queue_limit", "scope")
    shed = by_label(smp, "mfs_requests_shed_total", "tier")
    return {"queue_depth": _scalar(smp, "mfs_gateway_queue_depth"),
            "queue_depth_by_tier": {n: depth.get(n, 0.0) for n in tier_names},
            "max_waiting": limit.get("total"), "max_waiting_per_tier": limit.get("per_tier"),
            "max_queue_wait_s": limit.get("wait_s"), "start_rate": _scalar(smp, "mfs_gateway_start_rate"),
            "shed": sum(shed.values()), "shed_by_tier": {n: shed.get(n, 0.0) for n in ["all", *tier_names]}}
