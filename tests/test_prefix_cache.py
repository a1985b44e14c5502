"""Prefix caching with delayed reclamation in the in-process engine: multi-turn reuse, LRU eviction
order under pressure, segment-0 blocks shared across tiers, TTL reclamation. Outputs always equal a
cold engine's (float64)."""

import pytest

from tests.support.engines import BS, cold, greedy, make_engine


def deltas(eng, before):
    s = eng.stats
    return {k: [a - b for a, b in zip(getattr(s, k), before[k])] for k in before}


def snapshot(eng):
    s = eng.stats
    return {k: list(getattr(s, k)) for k in ("prefill_computed", "prefill_reused", "cache_hits")}


def finish(eng, rid):
    """Steps the engine until request `rid` has finished; returns its tokens."""
    toks = []
    while True:
        outs = eng.step()
        for o in outs:
            if o.request_id == rid:
                toks += o.new_token_ids
                if o.finished:
                    return toks


def test_second_turn_computes_only_the_new_tokens(llama_family):
    eng = make_engine(llama_family)
    p1 = [5, 9, 14, 3, 77, 31, 8, 100, 42, 17]      # 10 tokens
    out1 = eng.generate([p1], [2], greedy(7))[0]      # KV of 10 + 7 - 1 = 16 tokens: 4 full blocks
    assert out1 == cold(llama_family, p1, 2, 7)
    p2 = p1 + out1 + [61, 62, 63, 64, 65]             # 22 tokens
    before = snapshot(eng)
    out2 = eng.generate([p2], [2], greedy(6))[0]
    d = deltas(eng, before)
    # the answer's last token (never fed back in turn 1) and the 5 new ones; the 16 others reused
    assert d["prefill_computed"] == [6, 6, 6]
    assert d["prefill_reused"] == [16, 16, 16]
    assert d["cache_hits"] == [4, 4, 4]
    assert out2 == cold(llama_family, p2, 2, 6)
    assert all(p.num_used == 0 for p in eng.pools) and eng.pools[0].num_cached > 0


def test_reuse_always_leaves_the_last_prompt_token_to_compute(llama_family):
    eng = make_engine(llama_family)
    p = list(range(10, 22))                            # 12 tokens: 3 full blocks
    first = eng.generate([p], [1], greedy(3))[0]
    before = snapshot(eng)
    again = eng.generate([p], [1], greedy(3))[0]
    d = deltas(eng, before)
    assert d["prefill_reused"][:2] == [8, 8] and d["prefill_computed"][:2] == [4, 4]
    assert again == first


def test_cached_blocks_are_evicted_in_lru_order_tail_first_and_in_use_blocks_never(llama_family):
    eng = make_engine(llama_family, num_blocks=8)
    pool = eng.pools[0]
    evicted = []
    note = pool.on_evict

    def spy(block, h):
        assert all(block not in r.block_tables[0] for r in eng.running), f"block {block} is in use"
        evicted.append(block)
        note(block, h)
    pool.on_evict = spy

    a = [11, 12, 13, 14, 15, 16, 17, 18, 19]
    b = [21, 22, 23, 24, 25, 26, 27, 28, 29]
    eng.generate([a], [0], greedy(4))                  # 12 tokens of KV: blocks 0 1 2, all cached
    eng.generate([b], [0], greedy(4))                  # never-cached blocks go first: 3 4 5
    assert list(pool.evictable) == [2, 1, 0, 5, 4, 3]  # least recently released first, tails first
    assert pool.num_free == 8 and pool.num_cached == 6

    eng.add_request("e", b[:8] + [7, 7], 0, greedy(6))  # reuses b's first two blocks
    eng.step()
    assert eng.scheduler.requests["e"].block_tables[0] == [3, 4, 6]
    assert list(pool.evictable) == [2, 1, 0, 5]
    eng.add_request("f", list(range(40, 53)), 0, greedy(1))  # 4 blocks: the free 7, then a's 2 1 0
    finish(eng, "f")
    assert evicted == [2, 1, 0]
    e = eng.scheduler.requests["e"]
    assert pool.ref[3] == pool.ref[4] == 1 and pool.lookup(e.block_hashes[0][:2]) == [3, 4]
    finish(eng, "e")
    assert eng.stats.evictions[0] == 3 and eng.stats.evictions[1] == 0


@pytest.mark.parametrize("family", ["llama_family", "exit_family"])
def test_lower_tiers_reuse_segment_blocks_of_a_higher_tier_request(request, family):
    fam = request.getfixturevalue(family)
    eng = make_engine(fam)
    x = [7, 3, 99, 45, 12, 88, 23, 64, 5, 150, 33, 71, 2]   # 13 tokens
    assert eng.generate([x], [2], greedy(3))[0] == cold(fam, x, 2, 3)  # 15 tokens: 3 blocks
    for tier, tail in ((0, [20, 21, 22, 23]), (1, [30, 31, 32])):
        p = x[:12] + tail
        before = snapshot(eng)
        out = eng.generate([p], [tier], greedy(5))[0]
        d = deltas(eng, before)
        assert d["prefill_reused"][:tier + 1] == [12] * (tier + 1), (tier, d)
        assert d["prefill_reused"][tier + 1:] == [0] * (2 - tier)
        assert out == cold(fam, p, tier, 5)
    # The other way round (cross-tier): a tier-0 history has KV only in segment 0. A top-tier request
    # of the same prompt reuses it there and computes segments 1 and 2 for those positions from the
    # hidden state stored at exit 0 — segment 0 computes only the last token.
    y = [40, 41, 42, 43, 44, 45, 46, 47, 48]
    eng.generate([y], [0], greedy(2))
    before = snapshot(eng)
    assert eng.generate([y], [2], greedy(4))[0] == cold(fam, y, 2, 4)
    d = deltas(eng, before)
    assert d["prefill_reused"] == [8, 0, 0]
    assert d["prefill_computed"] == [1, 9, 9]


def test_a_session_escalating_from_small_to_large_computes_only_upper_segments_for_its_history(
        llama_family):
    eng = make_engine(llama_family)
    turn1 = [9, 8, 7, 6, 5, 4, 3, 12, 13, 14, 15]  # 11 tokens
    a1 = eng.generate([turn1], [0], greedy(6))[0]
    turn2 = turn1 + a1 + [101, 102, 103, 104, 105]  # 22 tokens; 16 of them were seen at tier 0
    before = snapshot(eng)
    out = eng.generate([turn2], [2], greedy(6))[0]
    d = deltas(eng, before)
    assert out == cold(llama_family, turn2, 2, 6)
    reused = 16  # full blocks of turn 1's prompt and answer (its last answer token was never fed)
    assert d["prefill_reused"] == [reused, 0, 0]
    assert d["prefill_computed"] == [len(turn2) - reused, len(turn2), len(turn2)]


def test_cached_blocks_expire_after_the_ttl(llama_family):
    now = [0.0]  # the scheduler's clock, stepped by the test
    eng = make_engine(llama_family, cache_ttl_s=60.0, clock=lambda: now[0])
    p = list(range(60, 73))
    eng.generate([p], [0], greedy(2))
    assert eng.pools[0].num_cached == 3
    now[0] += 59.0  # within the TTL: the next turn reuses them
    before = snapshot(eng)
    eng.generate([p], [0], greedy(2))
    assert deltas(eng, before)["prefill_reused"][0] == 12 and eng.stats.evictions[0] == 0
    now[0] += 60.5  # released at 59 s (the second turn's end), 119.5 s now: past the TTL
    before = snapshot(eng)
    eng.generate([p], [0], greedy(2))
    assert deltas(eng, before)["prefill_reused"][0] == 0
    assert eng.stats.evictions[0] == 3


def test_prefix_caching_can_be_switched_off(llama_family):
    eng = make_engine(llama_family, prefix_caching=False)
    p = list(range(60, 73))
    first = eng.generate([p], [2], greedy(3))[0]
    assert eng.generate([p], [2], greedy(3))[0] == first
    assert eng.stats.prefill_reused == [0, 0, 0] and eng.pools[0].num_cached == 0


def test_shared_prefixes_under_pressure_with_preemption_still_equal_cold_runs(llama_family):
    import random
    rng = random.Random(7)
    system = [rng.randrange(3, 160) for _ in range(10)]
    work = [(f"r{i}", system + [rng.randrange(3, 160) for _ in range(rng.randint(1, 9))], i % 3,
             rng.randint(4, 20)) for i in range(9)]
    eng = make_engine(llama_family, num_blocks=16, max_num_batched_tokens=24)
    got = {rid: [] for rid, *_ in work}
    for k, (rid, p, t, n) in enumerate(work):
        eng.add_request(rid, p, t, greedy(n))
        if k % 3 == 2:  # arrivals in waves, so later ones find earlier ones' blocks
            for _ in range(6):
                for o in eng.step():
                    got[o.request_id].extend(o.new_token_ids)
    while eng.has_unfinished():
        for o in eng.step():
            got[o.request_id].extend(o.new_token_ids)
    s = eng.stats
    assert s.preemptions > 0 and sum(s.evictions) > 0 and s.prefill_reused[0] > 0, s
    for rid, p, t, n in work:
        assert got[rid] == cold(llama_family, p, t, n), rid
    assert all(p.num_used == 0 for p in eng.pools)


def test_a_history_longer_than_the_step_budget_catches_up_in_a_step_of_its_own(llama_family):
    eng = make_engine(llama_family, max_num_batched_tokens=8)
    turn1 = list(range(50, 71))  # 21 tokens: more than one step's budget
    a1 = eng.generate([turn1], [0], greedy(4))[0]
    turn2 = turn1 + a1 + [7, 8, 9]
    before = snapshot(eng)
    out = eng.generate([turn2], [2], greedy(5))[0]
    d = deltas(eng, before)
    assert out == cold(llama_family, turn2, 2, 5)
    assert d["prefill_reused"] == [24, 0, 0]  # 6 full blocks of turn 1 + its answer
    assert d["prefill_computed"] == [len(turn2) - 24, len(turn2), len(turn2)]


def test_followers_wait_for_the_first_choices_prompt_then_reuse_it(llama_family):
    """The n > 1 choices of one request: the followers are admitted once the first choice's prompt is
    computed and start from its cached blocks (one prefill); their outputs are a cold engine's."""
    eng = make_engine(llama_family)
    prompt = list(range(20, 43))  # 23 tokens: 5 full blocks
    eng.add_request("c0", prompt, 2, greedy(4))
    for i in (1, 2, 3):
        eng.add_request(f"c{i}", prompt, 2, greedy(4), follow="c0")
    out: dict[str, list[int]] = {f"c{i}": [] for i in range(4)}
    while eng.has_unfinished():
        for o in eng.step():
            out[o.request_id] += o.new_token_ids
    want = cold(llama_family, prompt, 2, 4)
    assert all(v == want for v in out.values())
    assert eng.stats.prefill_computed[0] == len(prompt) + 3 * (len(prompt) - 5 * BS)
    assert eng.stats.prefill_reused[0] == 3 * 5 * BS
