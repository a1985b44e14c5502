"""The one polling wait of the test suite."""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

import redis

T = TypeVar("T")

# A predicate that cannot reach Redis yet (starting, failing over, restarting) is "not yet", not an error.
NOT_YET = (redis.ConnectionError, redis.TimeoutError, redis.ResponseError)


def wait_for(pred: Callable[[], T], timeout: float, what: str, poll: float = 0.05) -> T:
    """Calls ``pred`` every ``poll`` seconds until it returns something truthy, and returns that; fails
    the test with ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            got = pred()
            if got:
                return got
        except NOT_YET:
            pass
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}"
        time.sleep(poll)
