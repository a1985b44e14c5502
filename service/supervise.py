"""`mfs up`'s supervisor: restarts the children of a started Service that exit (RestartPolicy), and gives
back at once what an exited one held in Redis -- a worker's registration, a scheduler's lease, a gateway's
heartbeat -- so the others act now rather than when its TTL runs out (core.keyrecords)."""
from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from service.children import ChildSpec, Role

AFTER_GIVING_BACK = {"registration": "the scheduler moves its requests now",
                     "leadership": "a standby takes over now",
                     "heartbeat": "the scheduler cancels its requests now"}


def exit_text(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"was killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"was killed by signal {-returncode}"
    return f"exited with status {returncode}"


@dataclass
class RestartPolicy:
    """A child that exits is started again after `backoff_s`, doubled for each restart of the same
    child within `window_s` (at most `max_backoff_s`); a child that would need more than `limit`
    restarts within `window_s` is crash-looping, and the supervisor gives up. limit=0: never restart."""
    limit: int = 5
    window_s: float = 120.0
    backoff_s: float = 1.0
    max_backoff_s: float = 30.0

    def __post_init__(self) -> None:
        if self.limit < 0 or self.window_s <= 0 or self.backoff_s < 0 or self.max_backoff_s < self.backoff_s:
            raise ValueError(f"bad restart policy {self}: limit >= 0, window > 0, 0 <= backoff <= max backoff")

    def delay(self, recent: int) -> float:
        return min(self.max_backoff_s, self.backoff_s * 2 ** recent)


class Supervised(Protocol):
    """What the supervisor reads of a started Service (service.launch)."""
    redis_url: str
    specs: dict[str, ChildSpec]  # name -> its role, shard, id, log and how to start it again

    def children(self) -> dict[str, subprocess.Popen]: ...
    def restart(self, name: str) -> subprocess.Popen: ...


@dataclass
class Supervisor:
    """Watches a started Service's children and restarts the ones that exit (see RestartPolicy).
    `poll()` is called from one loop; it never blocks on a backoff."""
    svc: Supervised
    policy: RestartPolicy = field(default_factory=RestartPolicy)
    say: Callable[[str], None] = print
    clock: Callable[[], float] = time.monotonic
    restarts: dict[str, list[float]] = field(default_factory=dict)  # name -> when it was restarted
    due: dict[str, float] = field(default_factory=dict)             # name -> when to restart it

    def give_back(self, spec: ChildSpec, pid: int) -> str | None:
        """What the exited child ``spec`` (process ``pid``) held in Redis, given back now if it is still
        that process's: a worker's registration (the scheduler moves its requests at its next refresh,
        not when the 5 s TTL ends), a scheduler's lease (a standby takes over at its next poll, not when
        the 3 s lease expires), a gateway's heartbeat (the scheduler cancels its requests, whose client
        went with it, at its next housekeeping). Returns what was given back; None where nothing was (a
        clean stop gives back its own; Redis down too: the TTLs end them). Waits on Redis half a second
        at most (a Sentinel target: its own second)."""
        import redis  # noqa: PLC0415

        from core import keyrecords as K  # noqa: PLC0415
        from core.redisconn import connect  # noqa: PLC0415
        if spec.role is Role.WORKER:
            what, act = "registration", lambda r: K.withdraw_registration(r, spec.id, pid)
        elif spec.role is Role.SCHEDULER:
            what, act = "leadership", lambda r: K.release_leadership(r, spec.shard, pid)
        elif spec.role is Role.GATEWAY:
            what, act = "heartbeat", lambda r: K.forget_gateway(r, pid)
        else:
            return None
        # a client of its own each time: Redis may have been restarted since the last child exited
        r = connect(self.svc.redis_url, socket_timeout=0.5, socket_connect_timeout=0.5)
        try:
            return what if act(r) else None
        except (redis.RedisError, OSError):
            return None
        finally:
            r.close()

    def poll(self) -> str | None:
        """Restarts what is due; returns why to stop everything (a crash loop), else None."""
        now = self.clock()
        for name, p in self.svc.children().items():
            if name in self.due or p.poll() is None:
                continue
            spec = self.svc.specs[name]
            given = self.give_back(spec, p.pid)
            if given:
                self.say(f"mfs up: {name}'s {given} given back: {AFTER_GIVING_BACK[given]}")
            recent = [t for t in self.restarts.get(name, []) if now - t < self.policy.window_s]
            self.restarts[name] = recent
            log_file = spec.log
            if len(recent) >= self.policy.limit:
                return (f"{name} {exit_text(p.returncode)} after {len(recent)} restart(s) within "
                        f"{self.policy.window_s:.0f}s: crash loop, giving up (see {log_file})")
            delay = self.policy.delay(len(recent))
            self.due[name] = now + delay
            self.say(f"mfs up: {name} {exit_text(p.returncode)}; restarting it in {delay:.0f}s "
                     f"(restart {len(recent) + 1} of at most {self.policy.limit} within "
                     f"{self.policy.window_s:.0f}s; log: {log_file})")
        for name, when in list(self.due.items()):
            if now < when:
                continue
            del self.due[name]
            self.restarts.setdefault(name, []).append(now)
            try:
                proc = self.svc.restart(name)
            except (OSError, RuntimeError) as e:  # e.g. Redis could not bind its port yet
                recent = len(self.restarts[name])
                if recent >= self.policy.limit:
                    return f"{name} could not be restarted ({e}): giving up"
                self.due[name] = now + self.policy.delay(recent)
                self.say(f"mfs up: restarting {name} failed ({e}); trying again in "
                         f"{self.policy.delay(recent):.0f}s")
                continue
            self.say(f"mfs up: {name} restarted (pid {proc.pid})")
        return None


