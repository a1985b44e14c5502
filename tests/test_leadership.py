"""The leadership lease as a fence, against a real Redis: a leader cut off long enough for its lease to
lapse (and a standby to take over) may come back holding entries it read before the cut; nothing it
prepares from them is written. And Redis fences a round that was already on its way: a round's writes
apply only while the epoch is the leader's (Lease.write)."""
import redis

from core import protocol as P
from scheduler.config import SchedulerProcessConfig
from scheduler.service import SchedulerService
from tests.support.redis_server import redis_url  # noqa: F401 - the session fixture


class Clock:
    """A clock the test steps (SchedulerService(clock=...)): A's own sense of time, apart from Redis's."""

    def __init__(self):
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def leader_a(redis_url, clock=None) -> tuple[redis.Redis, SchedulerService]:
    """A fresh Redis with scheduler A leading, its lease then expired in Redis (as if A were cut off)."""
    r = redis.Redis.from_url(redis_url)
    r.flushdb()
    a = SchedulerService(redis_url, SchedulerProcessConfig(lease_s=1.0), consumer="A", clock=clock or Clock())
    a.setup()
    assert a.try_lead()
    r.delete(P.LEADER_KEY)
    return r, a


def test_a_leader_whose_lease_lapsed_writes_nothing_of_its_round(redis_url):
    clock = Clock()
    r, a = leader_a(redis_url, clock)  # A is cut off: its lease expires in Redis...
    b = SchedulerService(redis_url, SchedulerProcessConfig(lease_s=1.0), consumer="B")
    assert b.try_lead() and b.lease.epoch == a.lease.epoch + 1  # ...and B leads
    clock.t += 0.99
    assert a.lease.held()  # by A's own clock, just under a lease since it renewed
    clock.t += 0.02  # and now over it
    assert not a.lease.held()
    r.xadd(P.REQ_STREAM, P.Cancel("x").encode())  # something A's round would acknowledge
    a.run_once()
    assert not a.leader  # A stepped down instead of writing
    pending = r.xpending_range(P.REQ_STREAM, P.SCHEDULER_GROUP, "-", "+", 10)
    assert [p["consumer"] for p in pending] == [b"A"]  # delivered to A, never acknowledged by it


def test_a_leader_whose_lease_lapsed_unnoticed_takes_it_back_and_writes(redis_url):
    """No one took over: renewing at write time succeeds (same epoch) and the round is written."""
    clock = Clock()
    r, a = leader_a(redis_url, clock)
    epoch = a.lease.epoch
    clock.t += 5.0
    r.xadd(P.REQ_STREAM, P.Cancel("x").encode())
    a.run_once()
    assert a.leader and a.lease.epoch == epoch and a.lease.held()
    assert r.xpending(P.REQ_STREAM, P.SCHEDULER_GROUP)["pending"] == 0  # the round was written


def test_a_worker_refuses_the_plans_of_a_former_leader(redis_url):
    """The workers' epoch fence (worker/loop.py): a plan of an older epoch than one the worker has seen
    is dropped whole (no token event, no step result); a newer epoch resets the requests it held."""
    from core.sampling import SamplingParams
    from worker.null import NullWorker
    r = redis.Redis.from_url(redis_url)
    r.flushdb()
    w = NullWorker("w-fence", r, step_s=0.0)

    def plan(step: int, epoch: int, rid: str) -> P.StepPlan:
        new = P.NewRequest(rid, "gw-fence", 0, 2, SamplingParams(max_tokens=5, ignore_eos=True), [])
        return P.StepPlan(step, new=[new], rows=[P.PlanRow(rid, 0, [5, 6], 0, [[0]], True, 0)],
                          worker_started=w.started, epoch=epoch)

    def delivered() -> tuple[list[str], list[int]]:
        events = [ev.request_id for _, f in r.xrange(P.out_stream("gw-fence")) for ev in P.token_events(f)]
        results = [P.decode(f).epoch for _, f in r.xrange(P.DONE_STREAM)]
        return events, results

    w.execute(plan(1, 2, "new-leader"))
    assert delivered() == (["new-leader"], [2]) and set(w.live) == {"new-leader"}
    w.execute(plan(2, 1, "old-leader"))  # the former leader, back from a cut, still planning
    assert delivered() == (["new-leader"], [2]) and set(w.live) == {"new-leader"}  # refused whole
    w.execute(plan(3, 3, "newer-leader"))  # a newer leader: what the worker held is forgotten
    assert delivered() == (["new-leader", "newer-leader"], [2, 3]) and set(w.live) == {"newer-leader"}


def test_redis_applies_a_round_only_while_the_epoch_is_the_leaders(redis_url):
    """A round sent under a valid lease but delivered after a takeover (delayed in flight) is refused
    whole by Redis; on time, every command of it applies, and one command's error does not stop the rest."""
    r, a = leader_a(redis_url)
    r.set("k", "not a stream")

    def a_round() -> redis.client.Pipeline:
        pipe = r.pipeline(transaction=False)
        pipe.xadd(P.plan_stream("w0"), {"t": "x", "d": b"\x00\xff"}, maxlen=100, approximate=True)
        pipe.xadd("k", {"t": "x"})  # WRONGTYPE: answers an error, the rest still applies
        pipe.append(P.progress_key("r1"), b"\x01\x00\x00\x00")
        return pipe

    assert a.lease.write(a_round())
    assert r.xlen(P.plan_stream("w0")) == 1 and r.get(P.progress_key("r1")) == b"\x01\x00\x00\x00"
    assert r.xrange(P.plan_stream("w0"))[0][1] == {b"t": b"x", b"d": b"\x00\xff"}  # bytes kept exactly
    late = a_round()  # prepared and sent by A while it led...
    b = SchedulerService(redis_url, SchedulerProcessConfig(lease_s=1.0), consumer="B")
    assert b.try_lead()  # ...but B took over before it arrived
    assert not a.lease.write(late)
    assert r.xlen(P.plan_stream("w0")) == 1 and r.get(P.progress_key("r1")) == b"\x01\x00\x00\x00"
    assert a.lease.write(r.pipeline(transaction=False))  # nothing to write: nothing refused
