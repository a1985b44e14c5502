"""The confidence cascade: a request starts at a low tier and moves up one tier when the mean max
softmax probability of its last `cascade_window` tokens falls below `cascade_threshold`. The runner
decides (so an escalated token is never emitted); the scheduler moves the request up and computes the
new segment for its history from the hidden state stored at the old tier's exit (float64 model)."""
import random

import pytest

from engine import InvalidRequest
from worker.sampling import SamplingParams
from tests.support.cascade import BS, N, WINDOW, find_case, greedy, make_engine


def run(eng, rid):
    toks, last = [], None
    while eng.has_unfinished():
        for o in eng.step():
            if o.request_id == rid:
                toks += o.new_token_ids
                last = o
    return toks, last


@pytest.fixture(scope="module")
def case(llama_family):
    return find_case(llama_family)


@pytest.fixture(scope="module")
def exit_case(exit_family):
    return find_case(exit_family)


@pytest.mark.parametrize("family,found", [("llama_family", "case"), ("exit_family", "exit_case")])
def test_escalation_happens_exactly_where_the_window_mean_first_drops(request, family, found):
    fam, case = request.getfixturevalue(family), request.getfixturevalue(found)
    eng = make_engine(fam)
    eng.add_request("c", case["prompt"], 0, greedy(N, cascade_threshold=case["threshold"],
                                                   cascade_window=WINDOW))
    toks, last = run(eng, "c")
    k = case["k"]
    assert last.finished and last.tiers == [0, 1] and last.escalated_at == [k]
    assert last.tier == 1
    assert eng.stats.escalations == {"0>1": 1}
    # the output: tier 0's tokens up to k, then tier 1's greedy continuation of prompt + those
    assert toks == case["low"][:k] + case["cont"]
    assert len(toks) == N
    assert all(p.num_free == p.num_blocks for p in eng.pools)
    assert not eng.runner.requests


def test_escalated_history_is_findable_in_the_upper_segment_cache(llama_family, case):
    """The new segment's blocks computed by the catch-up are registered like any others: a follow-up
    tier-1 turn reuses them in segments 0 and 1."""
    eng = make_engine(llama_family)
    out = eng.generate([case["prompt"]], [0], greedy(N, cascade_threshold=case["threshold"],
                                                     cascade_window=WINDOW))[0]
    follow = case["prompt"] + out + [11, 12, 13]
    before = list(eng.stats.prefill_reused)
    again = eng.generate([follow], [1], greedy(5))[0]
    reused = [a - b for a, b in zip(eng.stats.prefill_reused, before)]
    full = (len(case["prompt"]) + N - 1) // BS * BS  # the cascade's computed full blocks
    assert reused[:2] == [full, full], reused
    assert again == make_engine(llama_family).generate([follow], [1], greedy(5))[0]


def test_threshold_zero_never_escalates(llama_family, case):
    eng = make_engine(llama_family)
    eng.add_request("c", case["prompt"], 0, greedy(N, cascade_threshold=0.0, cascade_window=1))
    toks, last = run(eng, "c")
    assert toks == case["low"] and last.tiers == [0] and last.escalated_at == []
    assert eng.stats.escalations == {}


def test_threshold_one_climbs_to_the_top_before_the_first_token(llama_family, case):
    """Every window of one falls below 1: the first token escalates tier 0 -> 1 -> 2 (the prefill's
    last row each time), then the top tier, having no tier above, samples every token."""
    eng = make_engine(llama_family)
    eng.add_request("c", case["prompt"], 0, greedy(N, cascade_threshold=1.0, cascade_window=1))
    toks, last = run(eng, "c")
    assert last.tiers == [0, 1, 2] and last.escalated_at == [0, 0]
    assert toks == make_engine(llama_family).generate([case["prompt"]], [2], greedy(N))[0]
    assert eng.stats.escalations == {"0>1": 1, "1>2": 1}
    assert all(p.num_free == p.num_blocks for p in eng.pools)


def test_cascade_requests_are_validated(llama_family):
    eng = make_engine(llama_family)
    with pytest.raises(InvalidRequest, match="cascades or speculates"):
        eng.add_request("a", [5, 6], 1, greedy(4, cascade_threshold=0.3, spec_draft_tier=0))
    with pytest.raises(InvalidRequest, match="cascade_threshold"):
        eng.add_request("b", [5, 6], 0, greedy(4, cascade_threshold=1.5))
    with pytest.raises(InvalidRequest, match="cascade_window"):
        eng.add_request("c", [5, 6], 0, greedy(4, cascade_threshold=0.3, cascade_window=0))
    # the blocks it may need are checked against every tier it may climb to
    small = make_engine(llama_family, num_blocks=[64, 64, 2])
    small.add_request("d", [5, 6], 0, greedy(12))
    with pytest.raises(InvalidRequest, match="KV blocks"):
        small.add_request("e", [5, 6], 0, greedy(12, cascade_threshold=0.3))


@pytest.mark.parametrize("family,found,budget,num_blocks", [("llama_family", "case", 512, 256),
                                                          ("llama_family", "case", 8, [20, 20, 10]),
                                                          ("exit_family", "exit_case", 8, [20, 20, 10])])
def test_mixed_batch_with_cascade_and_speculation_equals_solo_runs(request, family, found, budget, num_blocks):
    """Cascade requests (greedy and seeded sampling), speculating requests and plain ones of every tier
    in one engine; a small step budget chunks the catch-ups and a small pool preempts. Every request
    equals its run alone, and every block comes back."""
    fam, case = request.getfixturevalue(family), request.getfixturevalue(found)
    rng = random.Random(4)
    thr = case["threshold"]
    work = [("casc", case["prompt"], 0, greedy(N, cascade_threshold=thr, cascade_window=WINDOW)),
            ("casc-top", case["prompt"][:5] + [9, 9, 9, 9, 9, 9, 9, 9], 0,
             greedy(10, cascade_threshold=1.0, cascade_window=2)),
            ("casc-sampled", [rng.randrange(3, 160) for _ in range(9)], 0,
             SamplingParams(max_tokens=14, ignore_eos=True, temperature=1.0, seed=5,
                            cascade_threshold=0.05, cascade_window=2)),
            ("casc-1", [rng.randrange(3, 160) for _ in range(12)], 1,
             greedy(12, cascade_threshold=1.0, cascade_window=3))]
    work += [(f"spec{t}", [rng.randrange(3, 160) for _ in range(rng.randint(3, 10))], 2,
              greedy(15, spec_draft_tier=t, spec_gamma=3)) for t in (0, 1)]
    work += [(f"plain{t}", [rng.randrange(3, 160) for _ in range(rng.randint(3, 14))], t,
              greedy(rng.randint(5, 15))) for t in (0, 1, 2)]
    solo = {rid: make_engine(fam, num_blocks=256).generate([p], [t], sp)[0]
            for rid, p, t, sp in work}
    eng = make_engine(fam, max_num_batched_tokens=budget, num_blocks=num_blocks)
    got = {rid: [] for rid, *_ in work}
    last = {}
    for i, (rid, p, t, sp) in enumerate(work):
        eng.add_request(rid, p, t, sp)
        if i % 2:
            for o in eng.step():
                got[o.request_id] += o.new_token_ids
                last[o.request_id] = o
    while eng.has_unfinished():
        for o in eng.step():
            got[o.request_id] += o.new_token_ids
            last[o.request_id] = o
    assert got == solo
    assert last["casc"].tiers == [0, 1] and last["casc-top"].tiers == [0, 1, 2]
    assert last["casc-1"].tiers == [1, 2] and last["plain1"].tiers == [1]
    st = eng.stats
    assert st.escalations.get("0>1", 0) >= 2 and st.escalations.get("1>2", 0) >= 2, st.escalations
    assert st.spec_rounds > 0
    if budget == 8:
        assert st.preemptions > 0
    assert all(p.num_free == p.num_blocks for p in eng.pools)
    assert not eng.running and not eng.runner.requests


@pytest.mark.parametrize("cascade_first", [True, False])
def test_an_escalation_into_a_full_pool_preempts(llama_family, cascade_first):
    """The top segment's pool is too small for both: when the cascade request climbs into it, the later
    arrival is preempted (the other request, or the climber itself) and recomputed later."""
    rng = random.Random(9)
    casc = ("casc", [rng.randrange(3, 160) for _ in range(8)], 0,
            greedy(20, cascade_threshold=1.0, cascade_window=4))
    plain = ("plain", [rng.randrange(3, 160) for _ in range(8)], 2, greedy(20))
    work = [casc, plain] if cascade_first else [plain, casc]
    solo = {rid: make_engine(llama_family).generate([p], [t], sp)[0] for rid, p, t, sp in work}
    eng = make_engine(llama_family, num_blocks=[32, 32, 7])
    got = {rid: [] for rid, *_ in work}
    last = {}
    for rid, p, t, sp in work:
        eng.add_request(rid, p, t, sp)
    while eng.has_unfinished():
        for o in eng.step():
            got[o.request_id] += o.new_token_ids
            last[o.request_id] = o
    assert got == solo
    assert last["casc"].tiers == [0, 1, 2] and last["casc"].escalated_at == [3, 6]
    assert eng.stats.preemptions > 0
    assert all(p.num_free == p.num_blocks for p in eng.pools)
