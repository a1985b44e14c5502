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
    from mfs.engine import Engine
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
