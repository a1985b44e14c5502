"""Self-speculative decoding in the nested model: a lower tier drafts, the target tier verifies by
running only the segments above the draft tier, from the hidden state the drafts stored. Greedy
speculation equals plain greedy decoding token for token; with sampling, rejection sampling keeps the
target tier's distribution exactly (checked by chi-square tests against enumerated marginals)."""
import random

import pytest
import torch

from engine import Engine, InvalidRequest
from worker.sampling import SamplingParams, accept_greedy, accept_sampled, probs_for


def make_engine(fam, **kw):
    kw.setdefault("block_size", 4)
    kw.setdefault("num_blocks", 256)
    kw.setdefault("spec_min_acceptance", 0.0)  # these tests exercise rounds: no break-even gate
    return Engine(fam.model, **kw)


def plain(fam, prompt, tier, n):
    return make_engine(fam, prefix_caching=False).generate(
        [prompt], [tier], SamplingParams(max_tokens=n, ignore_eos=True))[0]


@pytest.mark.parametrize("draft,target", [(0, 1), (0, 2), (1, 2)])
@pytest.mark.parametrize("family,gamma", [("llama_family", 2), ("llama_family", 4), ("exit_family", 4)])
def test_greedy_speculation_equals_plain_decoding_in_mixed_batches(request, family, draft, target, gamma):
    fam = request.getfixturevalue(family)
    rng = random.Random(draft * 10 + target + gamma)
    spec = [[rng.randrange(3, 160) for _ in range(rng.randint(2, 12))] for _ in range(3)]
    others = [([rng.randrange(3, 160) for _ in range(rng.randint(2, 12))], t) for t in (0, 1, 2)]
    eng = make_engine(fam)
    sp = SamplingParams(max_tokens=17, ignore_eos=True, spec_draft_tier=draft, spec_gamma=gamma)
    outs = eng.generate(spec + [p for p, _ in others], [target] * 3 + [t for _, t in others],
                        [sp] * 3 + [SamplingParams(max_tokens=9, ignore_eos=True)] * 3)
    for p, o in zip(spec, outs[:3]):
        assert o == plain(fam, p, target, 17)
    for (p, t), o in zip(others, outs[3:]):
        assert o == plain(fam, p, t, 9)
    st = eng.stats
    assert st.spec_rounds > 0 and 0 <= st.spec_accepted <= st.spec_proposed
    assert all(p.num_free == p.num_blocks for p in eng.pools)  # freed (some still findable in cache)
    assert not eng.running


def test_many_rejections_leave_no_blocks_held(llama_family):
    # Random tiny tiers disagree often: most drafts are rejected and their KV positions rolled back.
    eng = make_engine(llama_family, prefix_caching=False)
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 160) for _ in range(6)] for _ in range(4)]
    sp = SamplingParams(max_tokens=60, ignore_eos=True, spec_draft_tier=0, spec_gamma=4)
    outs = eng.generate(prompts, [2] * 4, sp)
    assert [len(o) for o in outs] == [60] * 4
    assert eng.stats.spec_accepted < eng.stats.spec_proposed  # there were rejections
    assert all(p.num_free == p.num_blocks for p in eng.pools)
    assert outs == [plain(llama_family, p, 2, 60) for p in prompts]


@pytest.mark.parametrize("stop", [0.0, 1.0])
def test_early_stop_ends_rounds_when_the_drafter_is_unsure(llama_family, stop):
    """spec_stop_confidence 1.0: every draft is below it, so each round verifies a single draft;
    0.0: rounds run to gamma. Outputs equal plain decoding either way, every block comes back."""
    eng = make_engine(llama_family, prefix_caching=False)
    rng = random.Random(9)
    prompts = [[rng.randrange(3, 160) for _ in range(6)] for _ in range(3)]
    sp = SamplingParams(max_tokens=30, ignore_eos=True, spec_draft_tier=0, spec_gamma=4,
                        spec_stop_confidence=stop)
    outs = eng.generate(prompts, [2] * 3, sp)
    assert outs == [plain(llama_family, p, 2, 30) for p in prompts]
    st = eng.stats
    assert st.spec_rounds > 0
    if stop == 1.0:
        assert st.spec_proposed == st.spec_rounds
    else:
        assert st.spec_proposed >= 2 * st.spec_rounds
    assert all(p.num_free == p.num_blocks for p in eng.pools)


def test_a_pair_below_break_even_is_gated_but_still_probed(llama_family):
    """Random tiny tiers rarely agree. A request's own pauses only start after its first poor rounds;
    once the pair's acceptance (over every request) is known to be below spec_min_acceptance, later
    requests start a round only every spec_probe_every-th chance. Outputs stay exact."""
    rng = random.Random(4)
    prompts = [[rng.randrange(3, 160) for _ in range(6)] for _ in range(8)]
    sp = SamplingParams(max_tokens=24, ignore_eos=True, spec_draft_tier=0, spec_gamma=4)
    free = make_engine(llama_family, prefix_caching=False)
    gated = make_engine(llama_family, prefix_caching=False, spec_min_acceptance=0.5, spec_probe_every=16)
    for p in prompts:  # one after another, as a server sees them
        want = plain(llama_family, p, 2, 24)
        assert free.generate([p], [2], sp)[0] == want
        assert gated.generate([p], [2], sp)[0] == want
    assert free.stats.spec_gated == 0
    assert gated.stats.spec_gated > 0 and 0 < gated.stats.spec_rounds < free.stats.spec_rounds / 2, \
        (gated.stats.spec_rounds, free.stats.spec_rounds)
    assert all(p.num_free == p.num_blocks for p in gated.pools)


def test_speculation_rejects_what_it_cannot_serve(llama_family):
    eng = make_engine(llama_family)
    with pytest.raises(InvalidRequest, match="draft tier"):
        eng.add_request("a", [5, 6], 1, SamplingParams(spec_draft_tier=1))
    with pytest.raises(InvalidRequest, match="cascades or speculates"):
        eng.add_request("b", [5, 6], 2, SamplingParams(spec_draft_tier=0, cascade_threshold=0.5))
    eng.add_request("c", [5, 6], 2, SamplingParams(spec_draft_tier=0, temperature=0.8, top_k=20))


# ---- speculation with sampling ---------------------------------------------------------------------
def chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's chi-square goodness of fit of `counts` to `probs` (categories expecting fewer than 5
    draws are pooled; a draw of a zero-probability category fails outright)."""
    counts, probs = counts.double(), probs.double() / probs.sum()
    n = float(counts.sum())
    if float(counts[probs == 0].sum()) > 0:
        return 0.0
    exp = probs * n
    small = (exp < 5) & (probs > 0)
    c = torch.cat([counts[exp >= 5], counts[small].sum().reshape(1)])
    e = torch.cat([exp[exp >= 5], exp[small].sum().reshape(1)])
    keep = e > 0
    c, e = c[keep], e[keep]
    stat = float(((c - e) ** 2 / e).sum())
    df = len(e) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


def test_greedy_acceptance_rule():
    assert accept_greedy([4, 5, 6], [4, 5, 6]) == ([4, 5, 6], 3)
    assert accept_greedy([4, 5, 6], [4, 9, 6]) == ([4, 9], 1)
    assert accept_greedy([4, 5, 6], [7, 5, 6]) == ([7], 0)


@pytest.mark.parametrize("support", ["full", "partial"])
def test_rejection_sampling_commits_tokens_distributed_as_the_target(support):
    """A round of two drafts x_i ~ q_i; the committed tokens must be distributed as p_i (here p_1 does
    not depend on the first token, so the second committed token, when the first was accepted, is
    p_1-distributed too). With `partial` support, p and q each put zero mass where the other does not."""
    V, N = 6, 20000
    g = torch.Generator().manual_seed(1234)
    p = torch.softmax(torch.randn(2, V, generator=g) * 1.5, -1)
    q = torch.softmax(torch.randn(2, V, generator=g) * 1.5, -1)
    if support == "partial":
        p[:, 0] = 0.0
        q[:, 1] = 0.0
        q[0, 2] = 0.0
        p, q = p / p.sum(-1, keepdim=True), q / q.sum(-1, keepdim=True)
    first, second, drafted = torch.zeros(V), torch.zeros(V), torch.zeros(V)
    accepted = 0
    for _ in range(N):
        x = [int(torch.multinomial(q[i], 1, generator=g)) for i in range(2)]
        committed, k = accept_sampled(p, [q[0], q[1]], x, g)
        assert len(committed) == (2 if k == 2 else k + 1) and committed[:k] == x[:k]
        first[committed[0]] += 1
        drafted[x[0]] += 1
        if len(committed) == 2:
            second[committed[1]] += 1
        accepted += k
    assert chi2_pvalue(first, p[0]) > 1e-3
    assert chi2_pvalue(second, p[1]) > 1e-3
    # The same test tells the draft distribution apart: without the correction it would fail.
    assert chi2_pvalue(first, q[0]) < 1e-6
    assert chi2_pvalue(drafted, p[0]) < 1e-6
    assert 0 < accepted < 2 * N


@pytest.fixture(scope="module")
def small_vocab_family(tmp_path_factory):
    """A tiny model over 12 tokens whose head is scaled up, so its tiers' distributions are peaked and
    differ from each other (a raw random head is nearly uniform)."""
    from worker.family import load_family
    from tests.support.factories import tiny_llama
    d = tiny_llama(tmp_path_factory.mktemp("llama_v12"), vocab=12, seed=3)
    fam = load_family(str(d), tiers="2,4,6", dtype="float64")
    with torch.no_grad():
        fam.model.lm_head.weight.mul_(15.0)
    return fam


@pytest.fixture(scope="module")
def small_vocab_exit_family(tmp_path_factory):
    """The same with an exit block under tiers 0 and 1, perturbed to look trained."""
    from worker.family import load_family
    from tests.support.factories import perturb_exits, tiny_llama
    d = tiny_llama(tmp_path_factory.mktemp("llama_v12_exit"), vocab=12, seed=3)
    fam = load_family(str(d), tiers="2+1,4+1,6", dtype="float64")
    perturb_exits(fam, 6)
    with torch.no_grad():
        fam.model.lm_head.weight.mul_(15.0)
    return fam


def exact_marginals(model, prompt, tier, params) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact distributions of output tokens #2 and #3 when `tier` samples 3 tokens with `params`:
    the tree of the first two tokens enumerated with a plain dense forward (no cache, no speculation)."""
    V = model.cfg.vocab_size

    def dist(seqs):
        with torch.no_grad():
            h = model.exit_hidden(torch.tensor(seqs), upto_tier=tier)[tier][:, -1]
            return torch.stack([probs_for(row, params) for row in model.logits(h)]).double()
    p1 = dist([prompt])[0]                                                  # [V]
    p2 = dist([prompt + [a] for a in range(V)])                             # [V(a), V]
    p3 = dist([prompt + [a, b] for a in range(V) for b in range(V)]).view(V, V, V)
    m2 = p1 @ p2
    m3 = torch.einsum("a,ab,abc->c", p1, p2, p3)
    return m2, m3


@pytest.mark.parametrize("family,sampling", [("small_vocab_family", dict(temperature=1.0)),
                                             ("small_vocab_family", dict(temperature=0.8, top_k=8, top_p=0.95)),
                                             ("small_vocab_exit_family", dict(temperature=1.0))])
def test_speculative_sampling_keeps_the_target_distribution(request, family, sampling):
    """Many seeded requests of one prompt, three tokens each: the empirical distributions of output
    tokens #2 and #3 under speculation (draft tier 0, target tier 2) match the target tier's exact
    marginals, as plain sampling's do; the draft tier's marginals are told apart by the same test."""
    fam, N, prompt = request.getfixturevalue(family), 2000, [3, 7, 1, 4, 9]
    m_target = exact_marginals(fam.model, prompt, 2, SamplingParams(**sampling))
    m_draft = exact_marginals(fam.model, prompt, 0, SamplingParams(**sampling))
    V = fam.model.cfg.vocab_size
    got = {}
    for mode in ("spec", "plain"):
        eng = Engine(fam.model, block_size=4, num_blocks=2048, max_num_seqs=512,
                     max_num_batched_tokens=4096, spec_min_acceptance=0.0)
        extra = dict(spec_draft_tier=0, spec_gamma=2) if mode == "spec" else {}
        params = [SamplingParams(max_tokens=3, ignore_eos=True, seed=1000 * (mode == "spec") + i,
                                 **sampling, **extra) for i in range(N)]
        outs = eng.generate([prompt] * N, [2] * N, params)
        assert all(len(o) == 3 for o in outs)
        assert all(p.num_free == p.num_blocks for p in eng.pools) and not eng.runner.requests
        got[mode] = [torch.bincount(torch.tensor([o[j] for o in outs]), minlength=V) for j in (1, 2)]
        if mode == "spec":
            st = eng.stats
            assert st.spec_rounds > N // 2 and 0 < st.spec_accepted < st.spec_proposed, st
    for mode in ("spec", "plain"):
        for j in range(2):
            assert chi2_pvalue(got[mode][j], m_target[j]) > 1e-3, (mode, j)
    assert chi2_pvalue(got["spec"][0], m_draft[0]) < 1e-3  # the test has the power to fail


@pytest.mark.parametrize("family,num_blocks", [("llama_family", 256), ("llama_family", 24), ("exit_family", 24)])
def test_sampled_speculation_with_many_rejections_returns_every_block(request, family, num_blocks):
    """Raw random tiers disagree often: many rejections, rolled-back draft positions, and (small pool)
    preemptions mid-round. Every request ends with its length and every block comes back."""
    fam = request.getfixturevalue(family)
    eng = make_engine(fam, num_blocks=num_blocks)
    rng = random.Random(11)
    prompts = [[rng.randrange(3, 160) for _ in range(6)] for _ in range(4)]
    sps = [SamplingParams(max_tokens=60, ignore_eos=True, spec_draft_tier=0, spec_gamma=4,
                          temperature=(1.0, 0.3, 0.1, 0.3)[i], seed=i, top_k=40 * (i % 2),
                          top_p=0.9 if i == 3 else 1.0)
           for i in range(4)]
    outs = eng.generate(prompts, [2] * 4, sps)
    assert [len(o) for o in outs] == [60] * 4
    st = eng.stats
    assert 0 < st.spec_accepted < 0.8 * st.spec_proposed  # many rejections
    assert (st.preemptions > 0) == (num_blocks == 24)
    assert all(p.num_free == p.num_blocks for p in eng.pools)
    assert not eng.running and not eng.runner.requests


def test_sampled_speculation_is_reproducible_from_its_seed_in_any_batch(llama_family):
    rng = random.Random(2)
    prompt = [rng.randrange(3, 160) for _ in range(7)]
    sp = SamplingParams(max_tokens=20, ignore_eos=True, spec_draft_tier=1, spec_gamma=3,
                        temperature=0.9, seed=77)
    alone = make_engine(llama_family).generate([prompt], [2], sp)[0]
    others = [[rng.randrange(3, 160) for _ in range(5)] for _ in range(3)]
    mixed = make_engine(llama_family).generate(
        [prompt] + others, [2, 0, 1, 2],
        [sp] + [SamplingParams(max_tokens=12, ignore_eos=True, temperature=1.0, seed=i) for i in range(3)])
    assert mixed[0] == alone



def _play(s, n_steps=None):
    """Drives a StepScheduler as its worker would, every draft accepted (drafts 41, 42, ...; plain
    tokens 10): what the scheduler decides is under test here, not the model. Yields each step before
    its update."""
    t, k = 40, 0
    while s.has_unfinished() and (n_steps is None or k < n_steps):
        st = s.schedule()
        yield st
        tokens = {r.request_id: 10 for r, n in st.rows if r.num_computed_tokens + n == r.num_tokens}
        drafts = {}
        for r, _, _ in st.drafts:
            t += 1
            drafts[r.request_id] = t
        ver = {r.request_id: list(r.drafts[:len(toks)]) for r, toks, _ in st.verifies}
        s.update(st, tokens, ver, {rid: len(v) for rid, v in ver.items()}, None, drafts)
        k += 1


def test_blocks_a_verification_completes_are_hashed_from_their_real_tokens():
    """A verification computes positions whose tokens the request only gets when they are emitted:
    their blocks are registered once the tokens are known (hashing them at once memoized the hash of
    a truncated block for good, and cached the KV under it)."""
    from scheduler.blocks import block_hash
    from scheduler.core import SchedulerConfig, StepScheduler
    s = StepScheduler(SchedulerConfig(num_tiers=2, num_blocks=[32, 32], block_size=2, max_model_len=64,
                                      vocab_size=100, max_num_batched_tokens=16))
    s.add_request("a", [1, 2, 3, 4, 5], 1, SamplingParams(max_tokens=12, ignore_eos=True, spec_draft_tier=0,
                                                          spec_gamma=3))
    req = s.requests["a"]
    for _ in _play(s, 6):
        pass
    assert s.stats.spec_accepted >= 3
    for seg, memo in enumerate(req.block_hashes):
        chain, parent = [], None
        for i in range(len(memo)):
            parent = block_hash(parent, seg, req.token_slice(2 * i, 2 * i + 2))
            chain.append(parent)
        assert memo == chain, seg
        # every registered block is found by the real tokens (the newest may wait for the next update)
        assert len(s.pools[seg].lookup(chain)) == req.num_cached_blocks >= 3


def test_a_round_longer_than_the_step_budget_is_verified_in_part_never_left_pending():
    """Four drafts against a 3-token budget: the verification takes the three that fit; the request
    never gets a plain row while drafts wait (their stored hidden states would go stale)."""
    from scheduler.core import SchedulerConfig, StepScheduler
    s = StepScheduler(SchedulerConfig(num_tiers=3, num_blocks=[64] * 3, block_size=4, max_model_len=128,
                                      vocab_size=1000, max_num_batched_tokens=3))
    s.add_request("s", [5, 6, 7, 8, 9], 2, SamplingParams(max_tokens=16, ignore_eos=True, spec_draft_tier=0,
                                                          spec_gamma=4))
    verified = []
    for st in _play(s):
        assert not [r for r, _ in st.rows if r.output_ids and r.drafts], "a plain row beside pending drafts"
        verified += [len(toks) for _, toks, _ in st.verifies]
    assert verified and max(verified) == 3
