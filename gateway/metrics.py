"""Prometheus metrics of one gateway app (its own CollectorRegistry, so tests can run many apps).

Request metrics are labelled by the tier's model id; scheduler gauges are read from the Redis hash
``mfs:stats`` field ``scheduler`` at scrape time (``refresh_scheduler``), so ``/metrics`` of any
gateway shows the whole system.
"""
from __future__ import annotations

import re

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_TPOT = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.16, 0.32, 0.64, 1.28, 2.56)


class Metrics:
    """The gateway's metrics, declared by concern: its requests, the scheduler's gauges, prefix reuse,
    resilience, admission and multi-level sampling."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        for declare in (self._requests, self._scheduler, self._prefix_reuse, self._resilience, self._admission,
                        self._multilevel):
            declare(self.registry)

    def _requests(self, r: CollectorRegistry) -> None:
        """This gateway's requests, labelled by the tier's model id."""
        self.requests = Counter("mfs_requests", "Finished requests by tier model id and finish reason",
                                ["model", "finish_reason"], registry=r)
        self.errors = Counter("mfs_request_errors", "Requests answered with an error, by HTTP status",
                              ["status"], registry=r)
        self.prompt_tokens = Counter("mfs_prompt_tokens", "Prompt tokens submitted", ["model"], registry=r)
        self.completion_tokens = Counter("mfs_completion_tokens", "Completion tokens received",
                                         ["model"], registry=r)
        self.cached_tokens = Counter("mfs_cached_prompt_tokens", "Prompt tokens reported as cached "
                                     "(usage.prompt_tokens_details.cached_tokens)", ["model"], registry=r)
        self.ttft = Histogram("mfs_time_to_first_token_seconds", "Time to first token", ["model"],
                              buckets=_LATENCY, registry=r)
        self.tpot = Histogram("mfs_time_per_output_token_seconds", "Mean time per output token after "
                              "the first", ["model"], buckets=_TPOT, registry=r)
        self.e2e = Histogram("mfs_e2e_request_latency_seconds", "End-to-end request latency", ["model"],
                             buckets=_LATENCY, registry=r)
        self.inflight = Gauge("mfs_inflight_requests", "Requests this gateway is serving now",
                              registry=r)
        self.routing = Counter("mfs_tier_routed", "Requests routed per tier (by name or by the "
                               "complexity scorer)", ["model", "how"], registry=r)

    def _scheduler(self, r: CollectorRegistry) -> None:
        """The scheduler's gauges, read from mfs:stats at scrape time."""
        self.live_workers = Gauge("mfs_live_workers", "Workers with a live registration", registry=r)
        self.waiting = Gauge("mfs_scheduler_waiting", "Requests waiting in the scheduler", ["tier"],
                             registry=r)
        self.running = Gauge("mfs_scheduler_running", "Requests running", ["tier"], registry=r)
        self.kv_used = Gauge("mfs_kv_blocks_used", "KV blocks in use", ["worker", "segment"], registry=r)
        self.kv_total = Gauge("mfs_kv_blocks_total", "KV blocks in the pool", ["worker", "segment"],
                              registry=r)
        self.path_switches = Gauge("mfs_scheduler_path_switches", "Tier-mix changes of worker "
                                   "batches (cumulative, as the scheduler reports it)", registry=r)
        self.escalations = Gauge("mfs_scheduler_escalations", "Tier escalations (cumulative)", registry=r)
        self.preemptions = Gauge("mfs_scheduler_preemptions", "Preemptions (cumulative)", registry=r)
        self.plans = Gauge("mfs_scheduler_plans", "Step plans whose result the scheduler handled "
                           "(cumulative)", registry=r)
        self.forward_steps = Gauge("mfs_scheduler_forward_steps", "Forward steps those plans ran: more than "
                                   "the plans when multi-step decoding (--decode-steps) runs several a plan "
                                   "(cumulative)", registry=r)

    def _prefix_reuse(self, r: CollectorRegistry) -> None:
        """Prefix reuse, per KV segment, cumulative as the scheduler reports it. A request of tier k
        counts in segments 0..k; tokens are prompt tokens, blocks are full prompt blocks."""
        seg = ["segment"]
        self.prefill_computed = Gauge("mfs_prefill_tokens_computed", "Prompt tokens whose KV was "
                                      "computed, per segment (cumulative)", seg, registry=r)
        self.prefill_reused = Gauge("mfs_prefill_tokens_reused", "Prompt tokens whose KV came from the "
                                    "prefix cache, per segment (cumulative)", seg, registry=r)
        self.cache_queries = Gauge("mfs_prefix_cache_queries", "Full prompt blocks looked up in the "
                                   "prefix cache at admission, per segment (cumulative)", seg, registry=r)
        self.exit_filled = Gauge("mfs_exit_fill_tokens", "Cached positions whose exit-block KV a lower-tier "
                                 "request filled before reusing them (lazy exits), per segment (cumulative)",
                                 seg, registry=r)
        self.cache_hits = Gauge("mfs_prefix_cache_hits", "Prompt blocks found in the prefix cache at "
                                "admission, per segment (cumulative)", seg, registry=r)
        self.cache_hit_rate = Gauge("mfs_prefix_cache_hit_rate", "Prefix-cache hits / queries per "
                                    "segment (blocks; absent before the first query)", seg, registry=r)
        self.evictions = Gauge("mfs_kv_evictions", "Cached KV blocks reclaimed, per segment "
                               "(cumulative)", seg, registry=r)
        self.directory_blocks = Gauge("mfs_kv_directory_blocks", "Prefix blocks the KV directory lists "
                                      "per worker", ["worker"], registry=r)
        self.affinity_preferred = Gauge("mfs_scheduler_affinity_preferred", "Requests with a worker "
                                        "listed as holding their prefix (cumulative)", registry=r)
        self.affinity_yielded = Gauge("mfs_scheduler_affinity_yielded", "...of which placed on a less "
                                      "loaded worker instead (cumulative)", registry=r)

    def _resilience(self, r: CollectorRegistry) -> None:
        """Redis outages as this gateway saw them, and requests failed with a retryable 503 because
        their token stream broke (reason "gap": tokens lost, seq skipped; "redis": no event within
        --stall-timeout after a Redis outage or restart)."""
        self.redis_up = Gauge("mfs_redis_up", "1 while this gateway reaches Redis, 0 during an outage",
                              registry=r)
        self.redis_outages = Counter("mfs_redis_outages", "Redis outages (connection lost) and restarts "
                                     "this gateway saw", registry=r)
        self.interrupted = Counter("mfs_requests_interrupted", "Requests failed with a retryable 503 "
                                   "because their token stream broke, by reason (gap | redis)", ["reason"],
                                   registry=r)
        for reason in ("gap", "redis"):
            self.interrupted.labels(reason)  # present (at 0) before the first one

    def _admission(self, r: CollectorRegistry) -> None:
        """Admission (gateway.admission): requests accepted and waiting for their first token, the
        bounds, and the requests shed with 429 queue_full by the bound that was full."""
        self.queue_depth = Gauge("mfs_gateway_queue_depth", "Requests this gateway accepted that wait for "
                                 "their first token (all tiers)", registry=r)
        self.queue_depth_by_tier = Gauge("mfs_gateway_queue_depth_by_tier", "...of which per tier (a request "
                                         "counts in its tier once its prompt is scored)", ["tier"], registry=r)
        self.queue_limit = Gauge("mfs_gateway_queue_limit", "The waiting bounds: scope total "
                                 "(--max-waiting), per_tier (--max-waiting-per-tier) or wait_s "
                                 "(--max-queue-wait, seconds; 0: none)", ["scope"], registry=r)
        self.start_rate = Gauge("mfs_gateway_start_rate", "Requests starting per second while a queue lasts, "
                                "as this gateway measures it (what its expected wait divides by)", registry=r)
        self.shed = Counter("mfs_requests_shed", "Requests answered 429 queue_full, by tier ('all' before "
                            "the tier is known) and the bound that was reached (total | tier | wait)",
                            ["tier", "bound"], registry=r)

    def _multilevel(self, r: CollectorRegistry) -> None:
        """Multi-level sampling: this gateway's requests submitted with self-speculation (per
        draft/target tier name) or with a confidence cascade (per starting tier)..."""
        self.spec_requests = Counter("mfs_spec_requests", "Requests this gateway submitted with "
                                     "self-speculative decoding, by draft and target tier",
                                     ["draft", "target"], registry=r)
        self.cascade_requests = Counter("mfs_cascade_requests", "Requests this gateway submitted with a "
                                        "confidence cascade, by starting tier", ["start"], registry=r)
        # ...and the scheduler's cumulative per-pair counters from mfs:stats (see MultiLevelCollector).
        self.multilevel = MultiLevelCollector()
        r.register(self.multilevel)

    def set_admission_bounds(self, total: int, per_tier: int, wait_s: float, tier_names: list[str]) -> None:
        self.queue_limit.labels("total").set(total)
        self.queue_limit.labels("per_tier").set(per_tier)
        self.queue_limit.labels("wait_s").set(wait_s)
        self.shed.labels("all", "total")  # present (at 0) before the first shed
        self.shed.labels("all", "wait")
        for name in tier_names:
            self.shed.labels(name, "tier")
            self.queue_depth_by_tier.labels(name).set(0)

    def observe_request(self, model: str, finish: str, prompt_tokens: int, completion_tokens: int,
                        ttft: float | None, tpot: float | None, e2e: float, cached_tokens: int = 0) -> None:
        self.requests.labels(model, finish).inc()
        self.prompt_tokens.labels(model).inc(prompt_tokens)
        self.cached_tokens.labels(model).inc(max(0, cached_tokens or 0))
        self.completion_tokens.labels(model).inc(completion_tokens)
        if ttft is not None:
            self.ttft.labels(model).observe(ttft)
        if tpot is not None:
            self.tpot.labels(model).observe(tpot)
        self.e2e.labels(model).observe(e2e)

    def refresh_scheduler(self, stats: dict, tier_names: list[str]) -> None:
        """Sets the scheduler gauges from its msgpack dict; missing keys leave their gauges empty."""
        def tier_label(k) -> str:
            try:
                return tier_names[int(k)]
            except (ValueError, TypeError, IndexError):
                return str(k)

        for gauge, key in ((self.waiting, "waiting"), (self.running, "running")):
            gauge.clear()
            for k, v in _items(stats.get(key)):
                gauge.labels(tier_label(k)).set(_num(v))
        for gauge, key in ((self.kv_used, "kv_blocks_used"), (self.kv_total, "kv_blocks_total")):
            gauge.clear()
            for worker, segs in _items(stats.get(key)):
                for s, v in enumerate(segs if isinstance(segs, (list, tuple)) else [segs]):
                    gauge.labels(str(worker), str(s)).set(_num(v))
        for gauge, key in ((self.path_switches, "path_switches"), (self.escalations, "escalations"),
                           (self.preemptions, "preemptions"), (self.plans, "steps"),
                           (self.forward_steps, "forward_steps")):
            gauge.set(_num(stats.get(key, 0)))
        self._refresh_reuse(stats)
        self.multilevel.update(stats, tier_names)

    def _refresh_reuse(self, stats: dict) -> None:
        per_seg = {}
        for gauge, key in ((self.prefill_computed, "prefill_computed"), (self.prefill_reused, "prefill_reused"),
                           (self.cache_queries, "cache_queries"), (self.cache_hits, "cache_hits"),
                           (self.evictions, "evictions"), (self.exit_filled, "exit_filled")):
            gauge.clear()
            per_seg[key] = {str(s): _num(v) for s, v in _seq_items(stats.get(key))}
            for s, v in per_seg[key].items():
                gauge.labels(s).set(v)
        self.cache_hit_rate.clear()
        for s, q in per_seg["cache_queries"].items():
            if q > 0:
                self.cache_hit_rate.labels(s).set(per_seg["cache_hits"].get(s, 0.0) / q)
        self.directory_blocks.clear()
        for worker, v in _items(stats.get("directory_blocks")):
            self.directory_blocks.labels(str(worker)).set(_num(v))
        self.affinity_preferred.set(_num(stats.get("affinity_preferred", 0)))
        self.affinity_yielded.set(_num(stats.get("affinity_yielded", 0)))

    def render(self) -> bytes:
        return generate_latest(self.registry)


_PAIR = re.compile(r"^\s*(\d{1,4})\s*>\s*(\d{1,4})\s*$")


def tier_pair(key, tier_names: list[str]) -> tuple[str, str] | None:
    """``"0>2"`` -> (tier name, tier name); None for a key of another shape."""
    m = _PAIR.match(key) if isinstance(key, str) else None
    if m is None:
        return None
    return tuple(tier_names[i] if i < len(tier_names) else str(i) for i in map(int, m.groups()))


class MultiLevelCollector:
    """Speculation and cascade series from the scheduler's ``mfs:stats`` gauges, per tier pair.

    Reads ``spec: {"<draft>><target>": {rounds, proposed, accepted, committed}}`` and
    ``escalations_by_pair: {"<from>><to>": n}``, as of
    the last scrape's refresh. The counters are cumulative as the scheduler reports them (a scheduler
    restart resets them, which Prometheus reads as a counter reset). Missing keys: no series.
    """

    def __init__(self) -> None:
        self.spec: dict[tuple[str, str], dict[str, float]] = {}
        self.escalations: dict[tuple[str, str], float] = {}

    def update(self, stats: dict, tier_names: list[str]) -> None:
        spec, esc = {}, {}
        for k, v in _items(stats.get("spec")):
            pair = tier_pair(k, tier_names)
            if pair is not None and isinstance(v, dict):
                spec[pair] = {f: _num(v.get(f, 0)) for f in ("rounds", "proposed", "accepted", "committed")}
        for k, v in _items(stats.get("escalations_by_pair")):
            pair = tier_pair(k, tier_names)
            if pair is not None:
                esc[pair] = _num(v)
        self.spec, self.escalations = spec, esc

    def describe(self):
        return []  # collected fresh each scrape; nothing to check for name clashes

    def collect(self):
        lbl = ["draft", "target"]
        rounds = CounterMetricFamily("mfs_spec_rounds", "Self-speculation rounds (draft gamma tokens, "
                                     "verify once), per draft/target tier", labels=lbl)
        proposed = CounterMetricFamily("mfs_spec_draft_tokens", "Draft tokens proposed", labels=lbl)
        accepted = CounterMetricFamily("mfs_spec_accepted_tokens", "Draft tokens accepted by the target "
                                       "tier", labels=lbl)
        rate = GaugeMetricFamily("mfs_spec_acceptance_rate", "Accepted / proposed draft tokens "
                                 "(absent before the first proposal)", labels=lbl)
        per_verify = GaugeMetricFamily("mfs_spec_tokens_per_verification", "Tokens committed per "
                                       "verification round (absent before the first round)", labels=lbl)
        for (d, t), v in sorted(self.spec.items()):
            rounds.add_metric([d, t], v["rounds"])
            proposed.add_metric([d, t], v["proposed"])
            accepted.add_metric([d, t], v["accepted"])
            if v["proposed"] > 0:
                rate.add_metric([d, t], v["accepted"] / v["proposed"])
            if v["rounds"] > 0:
                per_verify.add_metric([d, t], v["committed"] / v["rounds"])
        esc = CounterMetricFamily("mfs_cascade_escalations", "Requests escalated one tier up by the "
                                  "confidence cascade (or any escalation), per tier pair",
                                  labels=["from", "to"])
        for (a, b), v in sorted(self.escalations.items()):
            esc.add_metric([a, b], v)
        return [rounds, proposed, accepted, rate, per_verify, esc]


def _items(v):
    return v.items() if isinstance(v, dict) else ()


def _seq_items(v):
    """Per-segment values: a dict {segment: value} (what the scheduler writes) or a list."""
    if isinstance(v, dict):
        return v.items()
    if isinstance(v, (list, tuple)):
        return enumerate(v)
    return ()


def _num(v) -> float:
    try:
        return float(v)
    except (TypeError, ValueError):
        return 0.0
