"""What a child process of the service is: its role, shard and id, and how to start it again. The
launcher (service/launch.py) builds these; the supervisor (service/supervise.py) reads them."""
from __future__ import annotations

import sys
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path

from core.protocol import DEFAULT_SHARD


class Role(StrEnum):
    """The value is the module a child runs (``python -m <role>``); Redis is a ``redis-server``."""
    REDIS = "redis"
    SCHEDULER = "scheduler"
    WORKER = "worker"
    GATEWAY = "gateway"


@dataclass(slots=True, frozen=True)
class ChildSpec:
    name: str  # unique within a Service: worker-w0, scheduler-s1-2, gateway, redis, ...
    role: Role
    log: Path  # where its stdout and stderr go
    args: tuple[str, ...] = ()  # after ``python -m <role>``
    shard: str = DEFAULT_SHARD  # the control-plane shard a scheduler leads or a worker joins
    id: str = ""  # a worker's --worker-id

    def argv(self) -> list[str]:
        assert self.role is not Role.REDIS, "the embedded Redis is started by EmbeddedRedis"
        return [sys.executable, "-m", self.role.value, *self.args]
