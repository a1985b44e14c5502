"""Admission by policy: a bound on the requests waiting at this gateway, per tier and in total.

A request *waits* from the moment this gateway accepts it until its first token event arrives (it sits
in the scheduler's queue, or in its prefill); then it *runs* until it finishes, and no longer counts.
A request that would take the waiting count past ``max_waiting`` (all tiers) or ``max_waiting_per_tier``
(its own tier, known once the prompt is scored) is shed at once: 429 ``queue_full`` with a
``Retry-After`` of the time the present queue takes to drain at the rate requests have been starting.
Everything under the bound is submitted and served (the scheduler queues it; nothing here drops it).

The total is checked before the request is prepared (a shed request costs no Redis command), the
tier's bound after. The counts, the bounds and the sheds are Prometheus metrics (``gateway.metrics``)
and part of ``/status.json`` (``gateway.status``).
"""
from __future__ import annotations

import math
import os
import time
from collections import deque
from dataclasses import dataclass, field

from gateway.errors import APIError

RATE_WINDOW_S = 30.0          # starts counted for the drain-rate estimate
RETRY_AFTER_MIN_S, RETRY_AFTER_MAX_S = 1, 60
WAITING_PER_CORE = 64         # the default bound: a 2-core machine queues 128 requests


def default_max_waiting() -> int:
    """Sized for the machine: ``WAITING_PER_CORE`` per CPU this process may use."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return WAITING_PER_CORE * max(1, cores)


@dataclass(slots=True)
class Ticket:
    """One accepted request's place in the count: ``tier`` once known, ``waiting`` until it starts."""
    tier: int | None = None
    waiting: bool = True


@dataclass(slots=True)
class Admission:
    max_waiting: int
    max_waiting_per_tier: int          # 0: only the total bounds a tier
    tier_names: list[str]
    metrics: object | None = None      # gateway.metrics.Metrics
    waiting: int = 0
    waiting_by_tier: list[int] = field(default_factory=list)
    shed: int = 0
    _starts: deque = field(default_factory=deque)  # monotonic times of recent starts

    def __post_init__(self) -> None:
        for name, v in (("--max-waiting", self.max_waiting), ("--max-waiting-per-tier", self.max_waiting_per_tier)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {v!r}")
        if self.max_waiting < 1:
            raise ValueError("--max-waiting must be >= 1: a gateway that queues nothing serves nothing")
        self.waiting_by_tier = [0] * len(self.tier_names)
        if self.metrics is not None:
            self.metrics.set_admission_bounds(self.max_waiting, self.tier_limit, self.tier_names)
            self._publish()

    @property
    def tier_limit(self) -> int:
        return self.max_waiting_per_tier or self.max_waiting

    def enter(self) -> Ticket:
        """A new request, its tier not known yet: counted, or shed when the total is full."""
        if self.waiting >= self.max_waiting:
            raise self._shed(None, f"{self.waiting} requests are already waiting at this gateway, its "
                                   f"limit (--max-waiting {self.max_waiting})")
        self.waiting += 1
        self._publish()
        return Ticket()

    def place(self, t: Ticket, tier: int) -> None:
        """The ticket's tier, now known: counted there, or shed (and released) when that tier is full."""
        if self.waiting_by_tier[tier] >= self.tier_limit:
            self.leave(t)
            raise self._shed(tier, f"{self.waiting_by_tier[tier]} requests for tier '{self.tier_names[tier]}' "
                                   f"are already waiting at this gateway, its limit per tier "
                                   f"(--max-waiting-per-tier {self.tier_limit})")
        t.tier = tier
        self.waiting_by_tier[tier] += 1
        self._publish()

    def started(self, t: Ticket) -> None:
        """Its first token came: it runs now, and no longer waits."""
        if t.waiting:
            self._starts.append(time.monotonic())
            self._drop(t)

    def leave(self, t: Ticket) -> None:
        """Finished, failed or gone before it started: no longer waiting."""
        if t.waiting:
            self._drop(t)

    def _drop(self, t: Ticket) -> None:
        t.waiting = False
        self.waiting -= 1
        if t.tier is not None:
            self.waiting_by_tier[t.tier] -= 1
        self._publish()

    def start_rate(self) -> float:
        """Requests started per second over the last ``RATE_WINDOW_S`` (0 before any)."""
        now = time.monotonic()
        while self._starts and now - self._starts[0] > RATE_WINDOW_S:
            self._starts.popleft()
        if len(self._starts) < 2:
            return 0.0
        return len(self._starts) / max(now - self._starts[0], 1.0)

    def retry_after(self) -> int:
        """Seconds for the present queue to drain at the recent start rate (1..60; 2 before any start)."""
        rate = self.start_rate()
        if rate <= 0:
            return 2
        return int(min(RETRY_AFTER_MAX_S, max(RETRY_AFTER_MIN_S, math.ceil(self.waiting / rate))))

    def _shed(self, tier: int | None, why: str) -> APIError:
        self.shed += 1
        wait = self.retry_after()
        if self.metrics is not None:
            self.metrics.shed.labels("all" if tier is None else self.tier_names[tier],
                                     "total" if tier is None else "tier").inc()
        return APIError(429, f"This gateway's queue is full: {why}. The request was not queued; retry "
                             f"after {wait} s.", code="queue_full", headers={"Retry-After": str(wait)})

    def _publish(self) -> None:
        if self.metrics is not None:
            self.metrics.queue_depth.set(self.waiting)
            for name, n in zip(self.tier_names, self.waiting_by_tier):
                self.metrics.queue_depth_by_tier.labels(name).set(n)
