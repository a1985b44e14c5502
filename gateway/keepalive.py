"""The gateway's heartbeat key kept from lapsing while its event loop is busy.

The heartbeat (``Backend.run_heartbeat``) runs on the event loop. Taking in a burst of a thousand
requests (parsing, chat templates, tokenizing) can hold that loop for seconds on a loaded machine, longer
than the key's TTL (5 s): the scheduler then takes the gateway for gone and cancels every request in
flight (``gateway_lost``), the worst answer to a burst. A thread with a synchronous client renews the
key's TTL (``EXPIRE``: it never recreates a key that has lapsed) every beat, for as long as the loop's own
last beat is at most ``grace_s`` old; a loop stuck for longer lets the key lapse as before.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable

import redis
import structlog

log = structlog.get_logger("gateway.keepalive")


class Keepalive(threading.Thread):
    def __init__(self, client: redis.Redis, key: str, ttl_s: int, period_s: float,
                 last_beat: Callable[[], float | None], grace_s: float = 30.0):
        super().__init__(daemon=True, name="mfs-gateway-keepalive")
        self.r, self.key, self.ttl_s, self.period_s = client, key, ttl_s, period_s
        self.last_beat, self.grace_s = last_beat, grace_s
        self.halt = threading.Event()
        self.renewed = 0

    def run(self) -> None:
        while not self.halt.wait(self.period_s):
            beat = self.last_beat()
            if beat is None or time.monotonic() - beat > self.grace_s:
                continue  # no beat yet, or the loop is stuck: not this thread's to hide
            try:
                self.renewed += int(bool(self.r.expire(self.key, self.ttl_s)))
            except (redis.RedisError, OSError) as e:  # the loop's heartbeat reports outages
                log.debug("keepalive.failed", error=str(e))

    def stop(self) -> None:
        self.halt.set()
        self.join(2 * self.period_s + 1)
