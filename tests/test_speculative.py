"""Self-speculative decoding in the nested model: a lower tier drafts, the target tier verifies by
running only the segments above the draft tier, from the hidden state the drafts stored."""
import random

import pytest

from worker.engine import Engine, InvalidRequest
from worker.sampling import SamplingParams


def make_engine(fam, **kw):
    kw.setdefault("block_size", 4)
    kw.setdefault("num_blocks", 256)
    return Engine(fam.model, **kw)


def plain(fam, prompt, tier, n):
    return make_engine(fam, enable_prefix_caching=False).generate(
        [prompt], [tier], SamplingParams(max_tokens=n, ignore_eos=True))[0]


@pytest.mark.parametrize("draft,target", [(0, 1), (0, 2), (1, 2)])
@pytest.mark.parametrize("gamma", [2, 4])
def test_greedy_speculation_equals_plain_decoding_in_mixed_batches(llama_family, draft, target, gamma):
    rng = random.Random(draft * 10 + target + gamma)
    spec = [[rng.randrange(3, 160) for _ in range(rng.randint(2, 12))] for _ in range(3)]
    others = [([rng.randrange(3, 160) for _ in range(rng.randint(2, 12))], t) for t in (0, 1, 2)]
    eng = make_engine(llama_family)
    sp = SamplingParams(max_tokens=17, ignore_eos=True, spec_draft_tier=draft, spec_gamma=gamma)
    outs = eng.generate(spec + [p for p, _ in others], [target] * 3 + [t for _, t in others],
                        [sp] * 3 + [SamplingParams(max_tokens=9, ignore_eos=True)] * 3)
    for p, o in zip(spec, outs[:3]):
        assert o == plain(llama_family, p, target, 17)
    for (p, t), o in zip(others, outs[3:]):
        assert o == plain(llama_family, p, t, 9)
    st = eng.stats
    assert st.spec_rounds > 0 and 0 <= st.spec_accepted <= st.spec_proposed
    assert all(p.num_free == p.num_blocks for p in eng.pools)  # freed (some still findable in cache)
    assert not eng.running


def test_many_rejections_leave_no_blocks_held(llama_family):
    # Random tiny tiers disagree often: most drafts are rejected and their KV positions rolled back.
    eng = make_engine(llama_family, enable_prefix_caching=False)
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 160) for _ in range(6)] for _ in range(4)]
    sp = SamplingParams(max_tokens=60, ignore_eos=True, spec_draft_tier=0, spec_gamma=4)
    outs = eng.generate(prompts, [2] * 4, sp)
    assert [len(o) for o in outs] == [60] * 4
    assert eng.stats.spec_accepted < eng.stats.spec_proposed  # there were rejections
    assert all(p.num_free == p.num_blocks for p in eng.pools)
    assert outs == [plain(llama_family, p, 2, 60) for p in prompts]


def test_speculation_rejects_what_it_cannot_serve(llama_family):
    eng = make_engine(llama_family)
    with pytest.raises(InvalidRequest, match="draft tier"):
        eng.add_request("a", [5, 6], 1, SamplingParams(spec_draft_tier=1))
    with pytest.raises(InvalidRequest, match="greedy"):
        eng.add_request("b", [5, 6], 2, SamplingParams(spec_draft_tier=0, temperature=0.8))
