"""Admission by policy: a bound on the requests waiting at this gateway, per tier and in total.

A request *waits* from the moment this gateway accepts it until its first token event arrives (it sits
in the scheduler's queue, or in its prefill); then it *runs* until it finishes, and no longer counts.
A request that would take the waiting count past ``max_waiting`` (all tiers) or ``max_waiting_per_tier``
(its own tier, known once the prompt is scored), or whose expected wait, the requests ahead of it at
the rate requests start, passes ``max_queue_wait_s``, is shed at once: 429 ``queue_full`` with a
``Retry-After`` of the time the present queue takes to drain at that rate. Everything under the bounds
is submitted and served (the scheduler queues it; nothing here drops it).

The start rate is the service's capacity as this gateway sees it: a moving average of the time between
two starts, counted only while requests kept waiting in between (a start with nobody queued behind it
measures the arrivals, not the capacity). It is kept over idle spells, so a burst after a pause is
bounded by the last rate seen; before any, only the counts bound the queue.

The total is checked before the request is prepared (a shed request costs no Redis command), the
tier's bound after. The counts, the bounds and the sheds are Prometheus metrics (``gateway.metrics``)
and part of ``/status.json`` (``gateway.status``).
"""
from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass, field

from gateway.errors import APIError

RATE_ALPHA = 0.02             # the start-interval average's weight of a new interval (~50 starts of memory)
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
    max_queue_wait_s: float = 0.0      # 0: no bound on the expected wait
    waiting: int = 0
    waiting_by_tier: list[int] = field(default_factory=list)
    shed: int = 0
    _interval_s: float | None = None   # moving average of the time between two starts under backlog
    _last_start: float | None = None
    _intervals: int = 0
    _emptied: bool = True              # the queue was empty since the last start

    def __post_init__(self) -> None:
        for name, v in (("--max-waiting", self.max_waiting), ("--max-waiting-per-tier", self.max_waiting_per_tier)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {v!r}")
        if isinstance(self.max_queue_wait_s, bool) or not isinstance(self.max_queue_wait_s, (int, float)) \
                or not 0 <= self.max_queue_wait_s < float("inf"):
            raise ValueError(f"--max-queue-wait must be a number of seconds >= 0, got {self.max_queue_wait_s!r}")
        if self.max_waiting < 1:
            raise ValueError("--max-waiting must be >= 1: a gateway that queues nothing serves nothing")
        self.waiting_by_tier = [0] * len(self.tier_names)
        if self.metrics is not None:
            self.metrics.set_admission_bounds(self.max_waiting, self.tier_limit, self.max_queue_wait_s,
                                              self.tier_names)
            self._publish()

    @property
    def tier_limit(self) -> int:
        return self.max_waiting_per_tier or self.max_waiting

    def enter(self) -> Ticket:
        """A new request, its tier not known yet: counted, or shed when the total is full or its
        expected wait too long."""
        if self.waiting >= self.max_waiting:
            raise self._shed(None, f"{self.waiting} requests are already waiting at this gateway, its "
                                   f"limit (--max-waiting {self.max_waiting})")
        rate = self.start_rate()
        if self.max_queue_wait_s and rate > 0 and (self.waiting + 1) / rate > self.max_queue_wait_s:
            raise self._shed(None, f"the {self.waiting} requests waiting at this gateway take about "
                                   f"{self.waiting / rate:.0f} s to start at the present rate ({rate:.2f}/s), "
                                   f"its limit (--max-queue-wait {self.max_queue_wait_s:g})", bound="wait")
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
        if not t.waiting:
            return
        now = time.monotonic()
        if not self._emptied and self._last_start is not None:
            dt, self._intervals = now - self._last_start, self._intervals + 1
            alpha = max(RATE_ALPHA, 1.0 / self._intervals)  # the plain mean until there are enough
            self._interval_s = dt if self._interval_s is None else self._interval_s + alpha * (dt - self._interval_s)
        self._last_start = now
        self._drop(t)
        self._emptied = self.waiting == 0

    def leave(self, t: Ticket) -> None:
        """Finished, failed or gone before it started: no longer waiting."""
        if t.waiting:
            self._drop(t)

    def _drop(self, t: Ticket) -> None:
        t.waiting = False
        self.waiting -= 1
        self._emptied = self._emptied or self.waiting == 0
        if t.tier is not None:
            self.waiting_by_tier[t.tier] -= 1
        self._publish()

    def start_rate(self) -> float:
        """Requests started per second while a queue lasted (see the module docstring; 0 before any)."""
        if not self._interval_s:
            return 0.0
        return 1.0 / self._interval_s

    def retry_after(self) -> int:
        """Seconds for the present queue to drain at the recent start rate (1..60; 2 before any start)."""
        rate = self.start_rate()
        if rate <= 0:
            return 2
        return int(min(RETRY_AFTER_MAX_S, max(RETRY_AFTER_MIN_S, math.ceil(self.waiting / rate))))

    def _shed(self, tier: int | None, why: str, bound: str | None = None) -> APIError:
        self.shed += 1
        wait = self.retry_after()
        if self.metrics is not None:
            self.metrics.shed.labels("all" if tier is None else self.tier_names[tier],
                                     bound or ("total" if tier is None else "tier")).inc()
            self.metrics.start_rate.set(self.start_rate())
        return APIError(429, f"This gateway's queue is full: {why}. The request was not queued; retry "
                             f"after {wait} s.", code="queue_full", headers={"Retry-After": str(wait)})

    def _publish(self) -> None:
        if self.metrics is not None:
            self.metrics.queue_depth.set(self.waiting)
            self.metrics.start_rate.set(self.start_rate())
            for name, n in zip(self.tier_names, self.waiting_by_tier):
                self.metrics.queue_depth_by_tier.labels(name).set(n)
