"""Who goes first and who yields: the step scheduler's policy seam (as vLLM's ``SchedulingPolicy``).
FCFS is the default and the only policy so far: running requests are served in arrival order and
the latest arrival is preempted when a pool is full."""
from __future__ import annotations

from scheduler.request import Request


class SchedulingPolicy:
    """Order and preemption victim among a worker's running requests."""
    name = ""

    def order(self, running: list[Request]) -> list[Request]:
        """The order running requests get their next tokens in (and the tier mix is chosen in)."""
        raise NotImplementedError

    def victim(self, running: list[Request]) -> Request:
        """The request that gives its blocks back when a pool is full."""
        raise NotImplementedError


class FCFS(SchedulingPolicy):
    name = "fcfs"

    def order(self, running: list[Request]) -> list[Request]:
        return sorted(running, key=lambda r: r.arrival)

    def victim(self, running: list[Request]) -> Request:
        return max(running, key=lambda r: r.arrival)
