"""The worker loop's acknowledgements (worker/loop.py): an executed plan is acknowledged in the round
trip that delivers its result, not in one of its own; a plan refused unexecuted (a former leader's) is
still acknowledged, on its own. Nothing stays pending either way."""
import threading

import redis

from core import protocol as P
from core.sampling import SamplingParams
from tests.support.redis_server import redis_url  # noqa: F401 - the session fixture
from tests.support.wait import wait_for
from worker.null import NullWorker


def test_executed_plans_are_acknowledged_with_their_result_and_refused_ones_alone(redis_url):
    r = redis.Redis.from_url(redis_url)
    r.flushdb()
    w = NullWorker("w-acks", r, step_s=0.0)
    standalone = []
    xack = w.r.xack
    w.r.xack = lambda *a, **kw: (standalone.append(a[-1]), xack(*a, **kw))[1]
    runner = threading.Thread(target=w.run, daemon=True)
    runner.start()
    try:
        wait_for(lambda: r.sismember(P.WORKERS_SET, "w-acks"), 10, "the worker to register")

        def plan(step: int, epoch: int) -> P.StepPlan:
            rid = f"r{step}"
            new = P.NewRequest(rid, "gw-acks", 0, 2, SamplingParams(max_tokens=1, ignore_eos=True), [])
            return P.StepPlan(step, new=[new], rows=[P.PlanRow(rid, 0, [5, 6], 0, [[0]], True, 0)],
                              worker_started=w.started, epoch=epoch)

        stream = P.plan_stream("w-acks")
        for step in (1, 2, 3):
            r.xadd(stream, plan(step, 2).encode())
        wait_for(lambda: len(r.xrange(P.DONE_STREAM)) == 3, 10, "three results")
        wait_for(lambda: r.xpending(stream, P.WORKER_GROUP)["pending"] == 0, 5, "the plans acknowledged")
        assert standalone == []  # each went with its result
        refused = r.xadd(stream, plan(4, 1).encode())  # a former leader's: dropped unexecuted
        wait_for(lambda: r.xpending(stream, P.WORKER_GROUP)["pending"] == 0 and standalone, 5,
                 "the refused plan acknowledged")
        assert standalone == [refused] and len(r.xrange(P.DONE_STREAM)) == 3
    finally:
        w.stop.set()
        runner.join(5)
