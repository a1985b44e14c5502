"""Which tiers one step may mix: at most ``max_tiers_per_step`` (the policy's order decides which), and a
path-switch budget, a token bucket of ``path_switches_per_s`` (capacity: one second's worth, at least one
switch): a step whose mix differs from the last one spends a token, and with none left the current mix
runs on. Time comes from an injectable clock (tests step it instead of sleeping)."""
from __future__ import annotations

import time
from collections.abc import Callable, Iterable

Clock = Callable[[], float]


class TierMix:
    def __init__(self, max_tiers_per_step: int, path_switches_per_s: float, clock: Clock = time.monotonic):
        self.max_tiers = max_tiers_per_step
        self.rate = path_switches_per_s
        self.clock = clock
        self.capacity = max(1.0, path_switches_per_s)
        self.tokens = self.capacity
        self._t = clock()
        self.last: frozenset[int] = frozenset()

    @property
    def limited(self) -> bool:
        return bool(self.max_tiers or self.rate)

    def allowed(self, tiers_in_order: Iterable[int]) -> set[int] | None:
        """The tiers this step may run, given every unfinished request's tier in the policy's order
        (None: no limit)."""
        if not self.limited:
            return None
        order: list[int] = []
        for t in tiers_in_order:
            if t not in order:
                order.append(t)
        if self.rate:
            now = self.clock()
            self.tokens = min(self.capacity, self.tokens + (now - self._t) * self.rate)
            self._t = now
            keep = [t for t in order if t in self.last]
            if keep and self.tokens < 1.0:
                return set(keep)  # no budget to change the mix: run the current one
        return set(order[:self.max_tiers] if self.max_tiers else order)

    def ran(self, mix: frozenset[int]) -> bool:
        """Records the mix a step ran; True when it switched paths (it then spent a token)."""
        switched = bool(mix and self.last and mix != self.last)
        if switched:
            self.tokens -= 1.0
        if mix:
            self.last = mix
        return switched
