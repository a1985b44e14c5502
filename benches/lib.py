"""What the benches share: percentiles and a summary of a sample, and the served model ids."""
from __future__ import annotations

import json
import statistics


def pct(xs: list[float], p: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    k = (len(xs) - 1) * p / 100
    lo, hi = int(k), min(int(k) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def summarize(xs: list[float]) -> dict:
    return {"mean": statistics.mean(xs) if xs else float("nan"), "p50": pct(xs, 50),
            "p90": pct(xs, 90), "p99": pct(xs, 99)}


def model_ids(url: str) -> list[str]:
    import urllib.request  # noqa: PLC0415
    with urllib.request.urlopen(url + "/v1/models", timeout=10) as r:
        ids = [m["id"] for m in json.loads(r.read())["data"]]
    return ids[:-1]  # the last entry is the family id
