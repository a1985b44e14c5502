"""The status page's charts: what the last minutes looked like, per tier.

The gateway samples its metrics registry every ``period_s`` seconds (a task of the app, so the history
exists before anybody opens the page) and keeps ``span_s`` seconds of samples. A chart point is the
difference of two consecutive samples: tokens/s and requests/s from the counters, TTFT and TPOT
percentiles from the histograms' bucket counts that arrived in between (so a point says what that
interval served, not the average since start), and the scheduler's gauges (waiting, KV blocks used)
as they stood. Tokens and latencies are this gateway's; gauges are the whole system's, as on the page.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from prometheus_client import CollectorRegistry

from gateway.status import Samples, by_label, histogram_quantile, samples

TTFT = "mfs_time_to_first_token_seconds"
TPOT = "mfs_time_per_output_token_seconds"


@dataclass(slots=True)
class TierSample:
    completion_tokens: float
    requests: float
    ttft_buckets: list[tuple[float, float]]  # (le, cumulative count)
    tpot_buckets: list[tuple[float, float]]
    waiting: float
    kv_blocks_used: float
    kv_blocks_total: float
    queue: float   # this gateway's requests of the tier waiting for their first token (gateway.admission)
    shed: float    # of the tier answered 429 queue_full (cumulative)


@dataclass(slots=True)
class Sample:
    time: float
    tiers: list[TierSample]
    queue: float   # the gateway's whole queue
    shed: float    # every 429 queue_full, those shed before a tier was chosen among them


def _buckets(smp: Samples, histogram: str, model: str) -> list[tuple[float, float]]:
    return sorted((float(lb["le"]), v) for lb, v in smp.get(histogram + "_bucket", ()) if lb.get("model") == model)


def _delta(new: list[tuple[float, float]], old: list[tuple[float, float]]) -> list[tuple[float, float]]:
    before = dict(old)
    return [(le, count - before.get(le, 0.0)) for le, count in new]


class History:
    """A ring of :class:`Sample`; ``series()`` is what ``/status.json`` sends as ``history``."""

    def __init__(self, tier_names: list[str], tier_ids: list[str], *, period_s: float = 2.0,
                 span_s: float = 300.0):
        if period_s <= 0 or span_s < period_s:
            raise ValueError(f"history: need 0 < period ({period_s}) <= span ({span_s})")
        self.tier_names, self.tier_ids = tier_names, tier_ids
        self.period_s = period_s
        self._ring: deque[Sample] = deque(maxlen=int(span_s / period_s) + 1)

    def record(self, registry: CollectorRegistry, now: float) -> None:
        smp = samples(registry)
        depth = by_label(smp, "mfs_gateway_queue_depth_by_tier", "tier")
        shed = by_label(smp, "mfs_requests_shed_total", "tier")
        tiers = []
        for i, (name, model) in enumerate(zip(self.tier_names, self.tier_ids)):
            tiers.append(TierSample(
                completion_tokens=by_label(smp, "mfs_completion_tokens_total", "model").get(model, 0.0),
                requests=by_label(smp, "mfs_requests_total", "model").get(model, 0.0),
                ttft_buckets=_buckets(smp, TTFT, model), tpot_buckets=_buckets(smp, TPOT, model),
                waiting=by_label(smp, "mfs_scheduler_waiting", "tier").get(name, 0.0),
                kv_blocks_used=by_label(smp, "mfs_kv_blocks_used", "segment").get(str(i), 0.0),
                kv_blocks_total=by_label(smp, "mfs_kv_blocks_total", "segment").get(str(i), 0.0),
                queue=depth.get(name, 0.0), shed=shed.get(name, 0.0)))
        self._ring.append(Sample(now, tiers, queue=sum(v for _, v in smp.get("mfs_gateway_queue_depth", ())),
                                 shed=sum(shed.values())))

    def series(self) -> dict:
        """``{"period_s", "tiers": [names], "points": [{"time", "tiers": [{tok_s, req_s, ttft_p50_s,
        ttft_p99_s, tpot_p50_s, tpot_p99_s, waiting, kv_used, kv_total, queue, shed_s}], "total": {queue,
        shed_s}}]}``; a latency is None for an interval that finished no request of that tier."""
        pts = []
        ring = list(self._ring)
        for a, b in zip(ring, ring[1:]):
            dt = b.time - a.time
            if dt <= 0:
                continue
            row = []
            for ta, tb in zip(a.tiers, b.tiers):
                ttft, tpot = _delta(tb.ttft_buckets, ta.ttft_buckets), _delta(tb.tpot_buckets, ta.tpot_buckets)
                row.append({"tok_s": max(0.0, tb.completion_tokens - ta.completion_tokens) / dt,
                            "req_s": max(0.0, tb.requests - ta.requests) / dt,
                            "ttft_p50_s": histogram_quantile(0.5, ttft), "ttft_p99_s": histogram_quantile(0.99, ttft),
                            "tpot_p50_s": histogram_quantile(0.5, tpot), "tpot_p99_s": histogram_quantile(0.99, tpot),
                            "waiting": tb.waiting, "kv_used": tb.kv_blocks_used, "kv_total": tb.kv_blocks_total,
                            "queue": tb.queue, "shed_s": max(0.0, tb.shed - ta.shed) / dt})
            pts.append({"time": b.time, "tiers": row,
                        "total": {"queue": b.queue, "shed_s": max(0.0, b.shed - a.shed) / dt}})
        return {"period_s": self.period_s, "tiers": list(self.tier_names), "points": pts}
