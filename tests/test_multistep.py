"""Multi-step decoding (scheduler/core.py: ``extend_decode``; worker/loop.py): while a worker's requests
all decode plainly, one plan runs several forward steps, each row fed its own sampled token. The outputs,
the KV blocks left cached and the blocks left free are those of planning every step; a sampling request's
tokens reach its client only with the plan's result, a greedy request's every ``stream_every`` steps of the
plan (its first and last token at once)."""
import threading
from types import SimpleNamespace

import pytest
import redis

from core import protocol as P
from core.sampling import SamplingParams, finish_reason
from scheduler.config import SchedulerProcessConfig
from scheduler.core import SchedulerConfig, StepScheduler
from scheduler.service import SchedulerService
from tests.support.pipeline import GW, Reader, stats_after, submit
from tests.support.redis_server import redis_url  # noqa: F401 - the session fixture
from tests.support.wait import wait_for
from worker.loop import pending_merge
from worker.null import NullRunner, NullWorker, null_token

EOS = 7


def fake_token(rid: str, pos: int) -> int:
    """What the fake model samples at a position: request c meets its EOS at position 9 (its fourth output token)."""
    return EOS if (rid, pos) == ("c", 9) else 10 + (hash((rid, pos)) % 50)


def run_worker(core: StepScheduler, step, steps: int) -> dict[str, list[int]]:
    """The worker's side of a plan (worker/loop.py): `steps` forward steps, each row fed its token, a
    row stopping at its end or where its block tables end."""
    got: dict[str, list[int]] = {}
    rows = [(req, req.num_computed_tokens + n, len(req.output_ids)) for req, n in step.rows if n >= 1]
    for _ in range(steps):
        nxt = []
        for req, pos, done in rows:
            if pos != req.num_tokens and req.request_id not in got:  # a prefill chunk: no token
                continue
            tok = fake_token(req.request_id, pos)
            got.setdefault(req.request_id, []).append(tok)
            n = done + 1
            ended = finish_reason(tok, n, len(req.prompt_ids) + n, req.params.max_tokens, req.stop_ids,
                                  core.cfg.max_model_len)
            if not ended and pos + 1 < len(req.block_tables[0]) * core.cfg.block_size:
                nxt.append((req, pos + 1, n))
        rows = nxt
    return got


def serve(k: int):
    core = StepScheduler(SchedulerConfig(num_tiers=2, num_blocks=[40, 40], block_size=4, eos_token_ids=(EOS,)))
    core.add_request("a", [1, 2, 3, 4, 5], 1, SamplingParams(max_tokens=11))
    core.add_request("b", [1, 2, 3], 0, SamplingParams(max_tokens=5))
    core.add_request("c", [9, 8, 7, 6, 5, 4], 1, SamplingParams(max_tokens=30))
    outputs: dict[str, list[int]] = {}
    plans = forwards = 0
    while core.has_unfinished():
        step = core.schedule()
        steps = core.extend_decode(step, k)
        got = run_worker(core, step, steps)
        decoded = got if steps > 1 else None
        tokens = {} if decoded else {rid: t[0] for rid, t in got.items()}
        for o in core.update(step, tokens, decoded=decoded):
            outputs.setdefault(o.request_id, []).extend(o.new_token_ids)
        plans += 1
        forwards += max(map(len, got.values()), default=1)
    cached = [sorted(p.cached) for p in core.pools]  # the hashes findable (the block ids may differ)
    return outputs, [p.num_free for p in core.pools], cached, plans, forwards


def test_a_multi_step_plan_leaves_what_planning_every_step_leaves():
    one, free1, cached1, plans1, fwd1 = serve(1)
    four, free4, cached4, plans4, fwd4 = serve(4)
    assert four == one
    assert len(one["a"]) == 11 and len(one["b"]) == 5 and one["c"][-1] == EOS and len(one["c"]) == 4
    assert free4 == free1 and cached4 == cached1 and cached1[0]  # full blocks were cached alike
    assert plans1 == fwd1 and plans4 < fwd4 and plans4 < plans1


def test_a_plan_is_one_step_unless_every_request_decodes_plainly_and_none_waits():
    core = StepScheduler(SchedulerConfig(num_tiers=1, num_blocks=[16], block_size=4, max_num_seqs=1))
    core.add_request("a", [1, 2, 3], 0, SamplingParams(max_tokens=20))
    step = core.schedule()
    assert core.extend_decode(step, 4) == 1  # a prefill
    core.update(step, {"a": 11})
    step = core.schedule()
    assert core.extend_decode(step, 4) == 4
    assert len(step.rows[0][0].block_tables[0]) == 2  # positions 3..6 held: blocks for 7 tokens
    core.update(step, {}, decoded={"a": [12, 13, 14, 15]})
    core.add_request("b", [1, 2], 0, SamplingParams(max_tokens=3))  # waits: max_num_seqs is 1
    assert core.extend_decode(core.schedule(), 4) == 1
    casc = StepScheduler(SchedulerConfig(num_tiers=2, num_blocks=[16, 16], block_size=4))
    casc.add_request("c", [1, 2], 1, SamplingParams(max_tokens=9, cascade_threshold=0.5))
    casc.update(casc.schedule(), {"c": 5})
    assert casc.extend_decode(casc.schedule(), 4) == 1  # an escalation needs the scheduler each step


@pytest.mark.timeout(120)
def test_through_redis_greedy_tokens_stream_each_step_and_sampled_ones_with_the_result(redis_url):
    r = redis.Redis.from_url(redis_url)
    r.flushdb()
    worker = NullWorker("w-ms", r, step_s=0.002, num_tiers=1)
    svc = SchedulerService(redis_url, SchedulerProcessConfig(decode_steps=4, stream_interval=1), consumer="ms")
    threads = [threading.Thread(target=worker.run, daemon=True), threading.Thread(target=svc.run, daemon=True)]
    for t in threads:
        t.start()
    try:
        wait_for(lambda: r.sismember(P.WORKERS_SET, "w-ms"), 10, "the worker to register")
        submit(r, "greedy", [3, 4, 5], 0, max_tokens=13, ignore_eos=True)
        submit(r, "sampled", [3, 4, 5, 6], 0, max_tokens=13, ignore_eos=True, temperature=0.8, seed=1)
        rd = Reader(r)
        rd.until(lambda: rd.finished("greedy") and rd.finished("sampled"), 30)
        assert rd.tokens("greedy") == [null_token("greedy", 3 + i) for i in range(13)]
        assert rd.tokens("sampled") == [null_token("sampled", 4 + i) for i in range(13)]
        per_entry = [[ev.request_id for ev in P.token_events(f)] for _, f in r.xrange(P.out_stream(GW))]
        assert max(e.count("greedy") for e in per_entry) == 1  # one event a step
        assert max(e.count("sampled") for e in per_entry) > 1  # a plan's steps, with its result
        s = stats_after(r, lambda s: s.steps > 0 and not any(s.running.values()), 10, "the stats")
        assert s.forward_steps > s.steps
    finally:
        svc.running = False
        worker.stop.set()
        for t in threads:
            t.join(5)


class PathRunner(NullRunner):
    """A null runner whose steps name an execution path: "eager" for its first `switch_after` steps, then
    "inductor" (a worker swapping in its compiled graphs while it serves)."""

    def __init__(self, step_s: float, switch_after: int):
        super().__init__(step_s)
        self.calls, self.switch_after = 0, switch_after

    def execute(self, rows):
        out = super().execute(rows)
        self.calls += 1
        fields = {k: getattr(out, k) for k in out.__slots__}
        return SimpleNamespace(**fields, path="eager" if self.calls <= self.switch_after else "inductor")


def run_pipeline(redis_url, cfg: SchedulerProcessConfig, runner=None, **params) -> list[P.TokenEvent]:
    """One greedy request "g" of a 3-token prompt through a scheduler and a null worker: its token events,
    in the order they were written."""
    r = redis.Redis.from_url(redis_url)
    r.flushdb()
    worker = NullWorker("w-si", r, step_s=0.002, num_tiers=1)
    if runner is not None:
        worker.runner = runner
    svc = SchedulerService(redis_url, cfg, consumer="si")
    threads = [threading.Thread(target=worker.run, daemon=True), threading.Thread(target=svc.run, daemon=True)]
    for t in threads:
        t.start()
    try:
        wait_for(lambda: r.sismember(P.WORKERS_SET, "w-si"), 10, "the worker to register")
        submit(r, "g", [3, 4, 5], 0, ignore_eos=True, **params)
        rd = Reader(r)
        rd.until(lambda: rd.finished("g"), 30)
        assert rd.tokens("g") == [null_token("g", 3 + i) for i in range(params["max_tokens"])]
        return rd.events["g"]
    finally:
        svc.running = False
        worker.stop.set()
        for t in threads:
            t.join(5)


@pytest.mark.timeout(120)
def test_greedy_tokens_go_in_groups_of_the_stream_interval_the_first_alone(redis_url):
    evs = run_pipeline(redis_url, SchedulerProcessConfig(decode_steps=4, stream_interval=2), max_tokens=12)
    sizes = [len(e.token_ids) for e in evs]
    assert sizes[0] == 1 and evs[0].seq == 0  # the first token does not wait for a second
    assert max(sizes) == 2 and sizes.count(2) >= 4, sizes  # then two tokens an event
    assert evs[-1].finished and not any(e.finished for e in evs[:-1])
    every = run_pipeline(redis_url, SchedulerProcessConfig(decode_steps=4, stream_interval=1), max_tokens=12)
    assert [len(e.token_ids) for e in every] == [1] * 12


@pytest.mark.timeout(120)
def test_a_merged_event_never_spans_a_path_swap(redis_url):
    # 4 steps a plan, sent every 4: without the swap's flush, tokens 1-4 (runner calls 2-5: eager,
    # then inductor) would go as one event naming one path
    evs = run_pipeline(redis_url, SchedulerProcessConfig(decode_steps=4, stream_interval=4),
                       PathRunner(0.002, switch_after=3), max_tokens=10)
    assert {e.path for e in evs} == {"eager", "inductor"}
    for e in evs:  # token k came from the runner's call k + 1
        assert {"eager" if e.seq + j < 3 else "inductor" for j in range(len(e.token_ids))} == {e.path}, \
            [(x.seq, len(x.token_ids), x.path) for x in evs]
    assert max(len(e.token_ids) for e in evs) > 1


def test_a_request_that_ends_inside_a_plan_is_sent_at_once(redis_url):
    # one 8-step plan sent every 8 steps: "h" ends at its third step (max_tokens 4, one token already
    # out); its last event, and "g"'s tokens so far, must not wait for the plan's end
    r = redis.Redis.from_url(redis_url)
    r.flushdb()
    worker = NullWorker("w-end", r, step_s=0.0, num_tiers=1)
    worker.register()
    new = [P.NewRequest(rid, GW, 0, 3, SamplingParams(max_tokens=m, ignore_eos=True), [])
           for rid, m in (("g", 20), ("h", 4))]
    rows = [P.PlanRow(rid, 0, [null_token(rid, 3)], 3, [[i]], True, 1) for i, rid in enumerate(("g", "h"))]
    worker.execute(P.StepPlan(1, new=new, rows=rows, worker_started=worker.started, steps=8, stream_every=8))
    entries = [P.token_events(f) for _, f in r.xrange(P.out_stream(GW))]
    assert [[(e.request_id, len(e.token_ids), e.finished) for e in evs] for evs in entries] == \
        [[("g", 3, False), ("h", 3, True)], [("g", 5, False)]]
    worker.deregister()


def test_a_first_token_inside_a_plan_is_sent_at_once(redis_url):
    # one 8-step plan sent every 8 steps: "f"'s row is its prompt's last chunk, so its first token comes
    # at the plan's first step; that event, and "g"'s token beside it, must not wait for the plan's end
    r = redis.Redis.from_url(redis_url)
    r.flushdb()
    worker = NullWorker("w-first", r, step_s=0.0, num_tiers=1)
    worker.register()
    new = [P.NewRequest(rid, GW, 0, 3, SamplingParams(max_tokens=20, ignore_eos=True), [])
           for rid in ("g", "f")]
    rows = [P.PlanRow("g", 0, [null_token("g", 3)], 3, [[0]], True, 1),
            P.PlanRow("f", 0, [null_token("f", 3)], 3, [[1]], True, 0)]
    worker.execute(P.StepPlan(1, new=new, rows=rows, worker_started=worker.started, steps=8, stream_every=8))
    entries = [P.token_events(f) for _, f in r.xrange(P.out_stream(GW))]
    assert [[(e.request_id, e.seq, len(e.token_ids)) for e in evs] for evs in entries] == \
        [[("g", 1, 1), ("f", 0, 1)], [("g", 2, 7), ("f", 1, 7)]]
    worker.deregister()


def test_pending_merge_extends_a_requests_event_and_keeps_its_start():
    a1 = P.TokenEvent("a", 5, [11], tier=0, prompt_tokens=3, cached_tokens=2,
                      logprobs=[P.TokenLogprob(11, -0.5)])
    a2 = P.TokenEvent("a", 6, [12], finished=True, finish_reason="length", tier=1, draft_proposed=4,
                      draft_accepted=3, logprobs=[P.TokenLogprob(12, -0.25)])
    b1 = P.TokenEvent("b", 0, [40])
    pending: dict = {}
    pending_merge(pending, [("gw1", a1), ("gw2", b1)])
    pending_merge(pending, [("gw1", a2)])
    gw, a = pending["a"]
    assert gw == "gw1" and (a.seq, a.token_ids, a.prompt_tokens, a.cached_tokens) == (5, [11, 12], 3, 2)
    assert [lp.token for lp in a.logprobs] == [11, 12]
    assert (a.finished, a.finish_reason, a.tier, a.draft_proposed, a.draft_accepted) == (True, "length", 1, 4, 3)
    assert pending["b"] == ("gw2", b1) and b1.token_ids == [40]


def test_the_flag_is_checked_and_reaches_the_scheduler_config():
    import argparse

    from core.cli import add_args, from_args
    p = argparse.ArgumentParser()
    add_args(p, SchedulerProcessConfig)
    assert from_args(SchedulerProcessConfig, p.parse_args(["--decode-steps", "3"])).decode_steps == 3
    assert SchedulerProcessConfig().decode_steps == 8
    assert from_args(SchedulerProcessConfig, p.parse_args(["--stream-interval", "2"])).stream_interval == 2
    assert SchedulerProcessConfig().stream_interval == 4
    with pytest.raises(SystemExit):
        p.parse_args(["--stream-interval", "0"])
    with pytest.raises(SystemExit):
        p.parse_args(["--decode-steps", "0"])
