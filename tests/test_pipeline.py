"""Scheduler and worker processes over a real redis-server, driven through the protocol itself
(the gateway's side of it): outputs equal the offline engine's, placement, cancellation, errors."""
import random

import pytest
import redis

from core import protocol as P
from core.keyrecords import decode_progress
from worker.family import load_family
from service.launch import Service
from engine import Engine
from tests.support.pipeline import Reader, serve_each_tier, submit, wait_kv_idle
from tests.support.wait import pace
from worker.sampling import SamplingParams


@pytest.fixture(scope="module")
def nested_service(llama_dir):
    # the speculation gate stays open (no pair's acceptance is below 0): every speculative request
    # drafts from its first round, whatever rate the pairs measured before it
    with Service(str(llama_dir), tiers="2,4,6", workers=2, gateway=False, dtype="float64",
                 worker_args=["--num-blocks", "64", "--block-size", "4", "--threads", "1"],
                 scheduler_args=["--spec-min-acceptance", "0"]) as svc:
        yield svc


def test_outputs_equal_the_offline_engine_across_two_workers(nested_service, llama_dir):
    r = redis.Redis.from_url(nested_service.redis_url)
    rng = random.Random(11)
    work = [(f"p{i}", [rng.randrange(3, 160) for _ in range(rng.randint(2, 30))], i % 3,
             rng.randint(3, 16)) for i in range(12)]
    for rid, prompt, tier, n in work:
        submit(r, rid, prompt, tier, max_tokens=n, ignore_eos=True)
    rd = Reader(r)
    rd.until(lambda: all(rd.finished(rid) for rid, *_ in work))
    fam = load_family(str(llama_dir), tiers="2,4,6", dtype="float64")
    eng = Engine(fam.model, block_size=4, num_blocks=64)
    for rid, prompt, tier, n in work:
        want = eng.generate([prompt], [tier], SamplingParams(max_tokens=n, ignore_eos=True))[0]
        assert rd.tokens(rid) == want, rid
    workers = {e.worker for evs in rd.events.values() for e in evs}
    assert len(workers) == 2, "placement by load should use both workers"
    wait_kv_idle(r)


def test_cancel_stops_generation_and_frees_blocks(nested_service):
    r = redis.Redis.from_url(nested_service.redis_url)
    submit(r, "long", [5, 6, 7, 8, 9], 2, max_tokens=200, ignore_eos=True)
    rd = Reader(r)
    rd.until(lambda: len(rd.events.get("long", [])) >= 3)
    # its progress (for a new leader to resume from) is there, with a TTL, so it can never leak
    rd.until(lambda: len(decode_progress(r.get(P.progress_key("long")))) >= 3)
    assert 0 < r.ttl(P.progress_key("long")) <= P.PROGRESS_TTL_S
    r.xadd(P.REQ_STREAM, P.Cancel("long", "client disconnected").encode())
    wait_kv_idle(r)
    n = len(rd.events["long"])
    pace(0.5)  # a window in which no more than the step in flight may arrive
    rd.read(block_ms=None)
    assert len(rd.events["long"]) <= n + 2  # at most the step in flight when the cancel landed
    assert not rd.finished("long")
    assert not r.exists(P.progress_key("long"))


@pytest.mark.parametrize("prompt,tier,kw,code,status", [
    (list(range(3, 140)) * 4, 0, {}, "context_length_exceeded", 400),
    ([5, 6], 7, {}, "model_not_found", 404),
    ([5, 6], 0, {"max_tokens": 0}, "invalid_request", 400),
    ([], 1, {}, "invalid_request", 400),
])
def test_bad_requests_get_an_error_event(nested_service, prompt, tier, kw, code, status):
    r = redis.Redis.from_url(nested_service.redis_url)
    rid = f"bad-{code}-{tier}-{len(prompt)}"
    submit(r, rid, prompt, tier, **kw)
    rd = Reader(r)
    rd.until(lambda: rd.finished(rid))
    ev = rd.events[rid][-1]
    assert ev.finish_reason == "error" and ev.error_code == code and ev.status == status, ev
    submit(r, rid + "-ok", [5, 6, 7], 1, max_tokens=2, ignore_eos=True)
    rd.until(lambda: rd.finished(rid + "-ok"))
    assert len(rd.tokens(rid + "-ok")) == 2


def test_independent_layout_serves_each_tier_from_its_own_copy(llama_dir):
    served = serve_each_tier(str(llama_dir), "2,4,6", "i", lambda t: [9, 8, 7, 6 + t], dtype="float64",
                             layout="independent")
    rd = served.reader
    fam = load_family(str(llama_dir), tiers="2,4,6", dtype="float64")
    eng = Engine(fam.model, block_size=4, num_blocks=64)
    for rid, (p, t) in served.prompts.items():
        assert rd.tokens(rid) == eng.generate([p], [t], SamplingParams(max_tokens=6, ignore_eos=True))[0]
    assert {e.worker for evs in rd.events.values() for e in evs} == {"w0-small", "w0-medium", "w0-large"}


def test_session_escalating_to_the_top_tier_reuses_its_lower_segment_kv(nested_service, llama_dir):
    r = redis.Redis.from_url(nested_service.redis_url)
    turn1 = [11, 12, 13, 14, 15, 16, 17, 18, 19, 20, 21]
    submit(r, "esc-1", turn1, 0, max_tokens=6, ignore_eos=True, session_id="esc")
    rd = Reader(r)
    rd.until(lambda: rd.finished("esc-1"))
    turn2 = turn1 + rd.tokens("esc-1") + [30, 31, 32, 33, 34]
    submit(r, "esc-2", turn2, 2, max_tokens=6, ignore_eos=True, session_id="esc")
    rd.until(lambda: rd.finished("esc-2"))
    first = min(rd.events["esc-2"], key=lambda e: e.seq)
    assert first.cached_tokens == 16  # positions of turn 1 whose segment-0 KV was reused
    assert {e.worker for e in rd.events["esc-1"]} == {e.worker for e in rd.events["esc-2"]}
    fam = load_family(str(llama_dir), tiers="2,4,6", dtype="float64")
    cold = Engine(fam.model, block_size=4, num_blocks=64, prefix_caching=False)
    assert rd.tokens("esc-2") == cold.generate([turn2], [2], SamplingParams(max_tokens=6, ignore_eos=True))[0]


def test_speculation_and_cascade_over_the_protocol(nested_service, llama_dir):
    """Draft/verify rows and escalations travel the protocol: greedy self-speculation equals plain
    decoding for every draft/target pair (mixed with plain requests), a cascade escalates exactly where
    the offline engine does, sampled speculation completes; draft counts reach the token events and the
    scheduler's per-pair gauges; drafts and escalated tokens are never streamed."""
    from tests.support.cascade import WINDOW, find_case
    fam = load_family(str(llama_dir), tiers="2,4,6", dtype="float64")
    r = redis.Redis.from_url(nested_service.redis_url)
    rng = random.Random(5)
    spec = [(f"s{d}{t}-{i}", [rng.randrange(3, 160) for _ in range(rng.randint(3, 12))], d, t)
            for i in range(2) for d, t in ((0, 1), (0, 2), (1, 2))]
    for rid, prompt, d, t in spec:
        submit(r, rid, prompt, t, max_tokens=24, ignore_eos=True, spec_draft_tier=d, spec_gamma=4)
    plain = [(f"q{i}", [rng.randrange(3, 160) for _ in range(5)], i % 3) for i in range(3)]
    for rid, prompt, t in plain:
        submit(r, rid, prompt, t, max_tokens=24, ignore_eos=True)
    case = find_case(fam)
    submit(r, "cascade", case["prompt"], 0, max_tokens=16, ignore_eos=True,
           cascade_threshold=case["threshold"], cascade_window=WINDOW)
    submit(r, "sampled-spec", [7, 8, 9], 2, max_tokens=40, ignore_eos=True, temperature=0.9, seed=3,
           spec_draft_tier=0)
    rd = Reader(r)
    every = [x[0] for x in spec + plain] + ["cascade", "sampled-spec"]
    rd.until(lambda: all(rd.finished(rid) for rid in every))
    eng = Engine(fam.model, block_size=4, num_blocks=64)
    for rid, prompt, d, t in spec:
        assert rd.tokens(rid) == eng.generate([prompt], [t], SamplingParams(max_tokens=24, ignore_eos=True))[0]
        last = rd.events[rid][-1]
        assert 0 <= last.draft_accepted <= last.draft_proposed and last.draft_proposed > 0, last
        assert {e.tier for e in rd.events[rid]} == {t}
    for rid, prompt, t in plain:
        assert rd.tokens(rid) == eng.generate([prompt], [t], SamplingParams(max_tokens=24, ignore_eos=True))[0]
    k = case["k"]
    assert rd.tokens("cascade") == case["low"][:k] + case["cont"], "cascade != tier 0 then tier 1"
    tiers = [e.tier for e in rd.events["cascade"]]
    assert tiers == [0] * k + [1] * (16 - k), tiers
    assert len(rd.tokens("sampled-spec")) == 40
    s = wait_kv_idle(r)
    assert {"0>1", "0>2", "1>2"} <= set(s.spec) and s.escalations_by_pair.get("0>1", 0) >= 1, s
    for pair in s.spec.values():
        assert pair["accepted"] <= pair["proposed"] and pair["rounds"] <= pair["committed"]
