"""Exit blocks (a private decoder layer between a tier's trunk boundary and its norm) everywhere the
nested model is served: the engine, chunked prefill, prefix caching across tiers, cross-tier catch-up,
self-speculation and the confidence cascade. Each check is an existing test of the plain nested model
run again on a family whose lower tiers have trained-looking (perturbed) exit blocks: the ``exit_family``
fixture (tests/conftest.py), a parameter of those tests in test_engine, test_prefix_cache,
test_speculative and test_cascade. This module holds the checks of the exit blocks themselves."""
import torch

from tests.support.engines import cold, greedy, make_engine


def test_the_block_has_its_own_kv_layer_in_its_boundary_segment(exit_family):
    from engine import Engine
    m = exit_family.model
    assert [m.segment_kv_layers(s) for s in range(3)] == [3, 3, 2]
    eng = Engine(m, block_size=4, num_blocks=16)
    assert [k.shape[0] for k in eng.runner.kv.k] == [3, 3, 2]
    # the block changes what the lower tiers say (the test below would pass trivially otherwise)
    ids = torch.tensor([[5, 9, 23, 71, 2]])
    with torch.no_grad():
        trunk = m.trunk_states(ids)
        plain = m.ops.rms_norm(trunk[0], m.exit_norms[0], m.cfg.rms_eps)
        assert not torch.allclose(m.exit_from_trunk(0, trunk[0]), plain)


def test_top_tier_rows_skip_lower_exit_kv_and_a_lower_tier_fills_it_when_it_reuses_their_blocks(exit_family):
    """Lazy exits: a top-tier request writes no lower exit block's KV (its blocks are cached as
    partial there); a lower-tier request reusing them fills its own exit's KV from the stored trunk
    state first, and answers as a cold run does. Without lazy exits every row writes every exit."""
    m = exit_family.model
    x = [7, 3, 99, 45, 12, 88, 23, 64, 5, 150, 33, 71, 2]   # 13 tokens, +3 answered: 3 full blocks
    answers = {}
    for lazy in (True, False):
        eng = make_engine(exit_family, lazy_exits=lazy)
        assert eng.scheduler.lazy_exits is lazy
        assert eng.generate([x], [2], greedy(3))[0] == cold(exit_family, x, 2, 3)
        block_kv = [eng.kv.k[s][len(m.segment_layers(s)):] for s in (0, 1)]  # the exit blocks' K
        assert [bool(k.any()) for k in block_kv] == [not lazy, not lazy]
        assert [len(p.partial) for p in eng.pools] == ([3, 3, 0] if lazy else [0, 0, 0])
        for tier, tail in ((0, [20, 21, 22, 23]), (1, [30, 31, 32])):
            p = x[:12] + tail
            before = (list(eng.stats.exit_filled), list(eng.stats.prefill_reused))
            out = eng.generate([p], [tier], greedy(5))[0]
            filled = [a - b for a, b in zip(eng.stats.exit_filled, before[0])]
            reused = [a - b for a, b in zip(eng.stats.prefill_reused, before[1])]
            assert filled == ([12 if s == tier else 0 for s in range(3)] if lazy else [0, 0, 0]), (lazy, tier)
            assert reused[:tier + 1] == [12] * (tier + 1), (lazy, tier)
            assert out == cold(exit_family, p, tier, 5), (lazy, tier)
            assert not eng.pools[tier].first_partial(eng.pools[tier].lookup(
                eng.scheduler.prefix_hashes(p, tier)[tier]))  # filled: complete now
            answers[lazy, tier] = out
    assert answers[True, 0] == answers[False, 0] and answers[True, 1] == answers[False, 1]


def test_a_fill_longer_than_the_budget_waits_for_a_step_alone_or_recomputes_beside_others():
    """The scheduler side of exit fills (driven directly, playing the worker): a fill that does not
    fit the step's budget beside other rows is dropped with the reuse from the first partial block;
    alone, it is planned whatever its length (like a cross-tier catch-up)."""
    from scheduler.core import SchedulerConfig, StepScheduler
    from worker.sampling import SamplingParams

    def make():
        return StepScheduler(SchedulerConfig(num_tiers=3, num_blocks=[32] * 3, block_size=4, max_model_len=128,
                                             vocab_size=1000, max_num_batched_tokens=8, exit_blocks=(0, 1)))

    def step(s):
        st = s.schedule()
        s.update(st, {r.request_id: 7 for r, n in st.rows if r.num_computed_tokens + n == r.num_tokens})
        return st

    prompt = list(range(100, 113))  # 13 tokens: 3 full blocks once computed
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    for beside in (False, True):
        s = make()
        s.add_request("top", prompt, 2, params)
        while s.has_unfinished():
            step(s)
        assert [len(p.partial) for p in s.pools] == [3, 3, 0]  # no exit KV written by the top tier
        if beside:
            s.add_request("busy", [1, 2, 3], 2, SamplingParams(max_tokens=20, ignore_eos=True))
            step(s)
        s.add_request("small", prompt[:12] + [5], 0, params)
        st = step(s)
        row = next(n for r, n in st.rows if r.request_id == "small")
        if beside:  # 12 fill tokens do not fit 8 - 1: computed from position 0 instead
            assert st.fills == [] and row == 7 and s.stats.prefill_reused[0] == 0
        else:
            assert [(r.request_id, seg, a, b) for r, seg, a, b in st.fills] == [("small", 0, 0, 12)]
            assert row == 1 and s.stats.prefill_reused[0] == 12 and s.stats.exit_filled == [12, 0, 0]
            assert len(s.pools[0].partial) == 0
