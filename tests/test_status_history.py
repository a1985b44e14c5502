"""The status page's charts' data (gateway.history): each point is one sampling interval, computed from
the same metrics registry ``/metrics`` renders."""
from __future__ import annotations

import pytest

from gateway.history import History
from gateway.metrics import Metrics

NAMES, IDS = ["small", "large"], ["fam-small", "fam-large"]


def test_points_are_per_interval_rates_and_latencies():
    m = Metrics()
    h = History(NAMES, IDS, period_s=1.0, span_s=10.0)
    h.record(m.registry, 100.0)
    m.completion_tokens.labels("fam-small").inc(40)
    m.requests.labels("fam-small", "length").inc(2)
    for v in (0.05, 0.05):
        m.ttft.labels("fam-small").observe(v)
    m.refresh_scheduler({"waiting": {"0": 3}, "kv_blocks_used": {"w1": [7, 2]}, "kv_blocks_total": {"w1": [64, 64]}},
                        NAMES)
    h.record(m.registry, 102.0)
    m.completion_tokens.labels("fam-small").inc(10)
    for v in (2.0, 2.0):  # slow first tokens in the second interval only
        m.ttft.labels("fam-small").observe(v)
    h.record(m.registry, 104.0)
    s = h.series()
    assert s["tiers"] == NAMES and s["period_s"] == 1.0
    first, second = (p["tiers"][0] for p in s["points"])
    assert first["tok_s"] == pytest.approx(20.0) and second["tok_s"] == pytest.approx(5.0)
    assert first["req_s"] == pytest.approx(1.0) and second["req_s"] == 0.0
    # the second interval's TTFT is its own requests' (2 s), not the cumulative median
    assert first["ttft_p50_s"] < 0.1 and 1.0 < second["ttft_p50_s"] <= 2.5
    assert first["waiting"] == 3 and first["kv_used"] == 7 and first["kv_total"] == 64
    large = s["points"][0]["tiers"][1]
    assert large["tok_s"] == 0.0 and large["ttft_p50_s"] is None  # nothing finished: a gap, not a zero


def test_the_ring_keeps_its_span():
    m = Metrics()
    h = History(NAMES, IDS, period_s=1.0, span_s=5.0)
    for t in range(20):
        h.record(m.registry, float(t))
    times = [p["time"] for p in h.series()["points"]]
    assert times == [15.0, 16.0, 17.0, 18.0, 19.0]


@pytest.mark.parametrize("period,span", [(0.0, 10.0), (5.0, 1.0), (-1.0, 5.0)])
def test_bad_periods_are_refused(period, span):
    with pytest.raises(ValueError, match="history"):
        History(NAMES, IDS, period_s=period, span_s=span)


def test_queue_and_shed_rate_per_tier_and_in_total():
    m = Metrics()
    h = History(NAMES, IDS, period_s=1.0, span_s=10.0)
    h.record(m.registry, 10.0)
    m.shed.labels("small", "tier").inc(4)
    m.shed.labels("all", "total").inc(6)  # family-id requests, shed before a tier was chosen
    m.queue_depth.set(9)
    m.queue_depth_by_tier.labels("large").set(5)
    h.record(m.registry, 12.0)
    (p,) = h.series()["points"]
    small, large = p["tiers"]
    assert small["shed_s"] == pytest.approx(2.0) and large["shed_s"] == 0.0 and large["queue"] == 5
    assert p["total"] == {"queue": 9, "shed_s": pytest.approx(5.0)}
