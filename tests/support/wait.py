"""The one polling wait of the test suite, and the one deliberate pause.

Every test that waits for something waits with ``wait_for`` on that something: a condition it can read
(a key, a metric, a log line, a process's state), with a deadline. ``pace`` is the only other way a
test lets time pass, and only where the passing time is the scenario rather than a stand-in for a
condition: a client or a fake peer keeping its own rhythm (a heartbeat, a scripted token stream, the
gap between a client's requests), a fault held for a set time (an outage, a partition), or a window in
which something must *not* happen. ``tests/test_structure.py`` checks that no test module calls
``time.sleep`` itself.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

import redis

T = TypeVar("T")

# A predicate that cannot reach Redis yet (starting, failing over, restarting) is "not yet", not an error.
NOT_YET = (redis.ConnectionError, redis.TimeoutError, redis.ResponseError)


def wait_for(pred: Callable[[], T], timeout: float, what: str | Callable[[], str], poll: float = 0.05,
             not_yet: tuple[type[BaseException], ...] = NOT_YET) -> T:
    """Calls ``pred`` every ``poll`` seconds until it returns something truthy, and returns that; fails
    the test with ``what`` (a string, or a function that describes the state at the deadline) after
    ``timeout`` seconds. An exception in ``not_yet`` counts as "not yet" (and the next call comes at
    least 50 ms later: an unreachable server is not hammered); any other one, an AssertionError
    included, ends the wait at once."""
    deadline = time.monotonic() + timeout
    while True:
        pause = poll
        try:
            got = pred()
            if got:
                return got
        except not_yet:
            pause = max(poll, 0.05)
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {what() if callable(what) else what}")
        time.sleep(pause)


def pace(seconds: float) -> None:
    """Lets ``seconds`` pass on purpose (see the module docstring for when that is right). Never a wait
    for a condition: that is ``wait_for``."""
    if seconds > 0:
        time.sleep(seconds)
