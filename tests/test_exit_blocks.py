"""Exit blocks (a private decoder layer between a tier's trunk boundary and its norm) everywhere the
nested model is served: the engine, chunked prefill, prefix caching across tiers, cross-tier catch-up,
self-speculation and the confidence cascade. Each check is an existing test of the plain nested model
run again on a family whose lower tiers have trained-looking (perturbed) exit blocks."""
import pytest
import torch

from tests import test_cascade, test_engine, test_prefix_cache, test_speculative


def perturb_exits(fam, seed: int) -> None:
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in fam.model.exit_blocks.parameters():
            p.add_(torch.randn_like(p) * 0.05)
        for t in fam.model.tiers[:-1]:
            fam.model.exit_norms[t.index].uniform_(0.5, 1.5)


@pytest.fixture(scope="module")
def exit_family(llama_dir):
    from worker.family import load_family
    fam = load_family(str(llama_dir), tiers="2+1,4+1,6", dtype="float64")
    perturb_exits(fam, 5)
    return fam


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


def test_mixed_batch_equals_each_request_alone(exit_family):
    test_engine.test_mixed_batch_equals_each_request_alone(exit_family)


def test_lower_tiers_reuse_segment_blocks_of_a_higher_tier_request(exit_family):
    """A top-tier request's cached segment blocks carry the exit block's KV too: a lower-tier request
    reusing them equals a cold run."""
    test_prefix_cache.test_lower_tiers_reuse_segment_blocks_of_a_higher_tier_request(exit_family)


@pytest.mark.parametrize("draft,target", [(0, 1), (0, 2), (1, 2)])
def test_greedy_speculation_equals_plain_decoding(exit_family, draft, target):
    test_speculative.test_greedy_speculation_equals_plain_decoding_in_mixed_batches(
        exit_family, draft, target, 4)


def test_sampled_speculation_returns_every_block(exit_family):
    test_speculative.test_sampled_speculation_with_many_rejections_returns_every_block(exit_family, 24)


def test_speculative_sampling_keeps_the_target_distribution(tmp_path_factory):
    from worker.family import load_family
    from tests.factories import tiny_llama
    d = tiny_llama(tmp_path_factory.mktemp("llama_v12_exit"), vocab=12, seed=3)
    fam = load_family(str(d), tiers="2+1,4+1,6", dtype="float64")
    perturb_exits(fam, 6)
    with torch.no_grad():
        fam.model.lm_head.weight.mul_(15.0)
    test_speculative.test_speculative_sampling_keeps_the_target_distribution(fam, dict(temperature=1.0))


def test_cascade_with_speculation_in_a_mixed_batch_equals_solo_runs(exit_family):
    """Escalation enters the next segment from the trunk's stored state (never the block's output)."""
    case = test_cascade.find_case(exit_family)
    test_cascade.test_escalation_happens_exactly_where_the_window_mean_first_drops(exit_family, case)
    test_cascade.test_mixed_batch_with_cascade_and_speculation_equals_solo_runs(
        exit_family, case, 8, [20, 20, 10])


def test_top_tier_rows_skip_lower_exit_kv_and_a_lower_tier_fills_it_when_it_reuses_their_blocks(exit_family):
    """Lazy exits: a top-tier request writes no lower exit block's KV (its blocks are cached as
    partial there); a lower-tier request reusing them fills its own exit's KV from the stored trunk
    state first, and answers as a cold run does. Without lazy exits every row writes every exit."""
    from tests.test_prefix_cache import cold, greedy, make_engine
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
