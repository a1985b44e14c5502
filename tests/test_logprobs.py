"""Log-probabilities in the in-process engine: each token's entry is the log-softmax of the
raw logits of the tier that produced it (plain rows, a cascade's tiers, a verification's target), and
prompt log-probabilities equal a dense teacher-forced forward, with or without a warm prefix cache."""
from __future__ import annotations

import pytest
import torch

from engine import Engine
from worker.sampling import SamplingParams

PROMPTS = [[5, 9, 23, 77, 101, 3, 44], [11, 12, 13], list(range(20, 58))]


def dense_logprobs(model, ids: list[int], tier: int) -> torch.Tensor:
    """[len(ids), V]: log-softmax of tier `tier`'s logits at every position, one dense causal forward."""
    with torch.no_grad():
        h = model.exit_hidden(torch.tensor([ids]), upto_tier=tier)[tier]
        return torch.log_softmax(model.logits(h)[0].double(), dim=-1)


def run(eng: Engine, prompt, tier, params):
    rid = f"r{len(eng.scheduler.requests)}-{eng.stats.steps}"
    eng.add_request(rid, prompt, tier, params)
    outs = []
    while eng.has_unfinished():
        outs += [o for o in eng.step() if o.request_id == rid]
    return outs


@pytest.mark.parametrize("tier", [0, 2])
@pytest.mark.parametrize("temperature", [0.0, 0.9])
def test_token_logprobs_are_the_log_softmax_of_the_tiers_logits(llama_family, tier, temperature):
    eng = Engine(llama_family.model, block_size=4, num_blocks=64, keep_logits=True)
    outs = run(eng, PROMPTS[0], tier, SamplingParams(max_tokens=6, ignore_eos=True, logprobs=5,
                                                      temperature=temperature, seed=3))
    assert sum(len(o.new_token_ids) for o in outs) == 6
    for o in outs:
        (tok,), (lp,) = o.new_token_ids, o.logprobs
        want = torch.log_softmax(o.logits.double(), -1)
        assert lp.token == tok and abs(lp.logprob - float(want[tok])) < 1e-4
        top = torch.topk(want, 5)
        assert lp.top_ids == top.indices.tolist()
        assert max(abs(a - b) for a, b in zip(lp.top_logprobs, top.values.tolist())) < 1e-4


def test_no_logprobs_unless_asked_and_zero_means_the_chosen_token_only(llama_family):
    eng = Engine(llama_family.model, block_size=4, num_blocks=64)
    assert all(o.logprobs == [] and o.prompt_logprobs == []
               for o in run(eng, PROMPTS[1], 1, SamplingParams(max_tokens=3, ignore_eos=True)))
    outs = run(eng, PROMPTS[1], 1, SamplingParams(max_tokens=3, ignore_eos=True, logprobs=0))
    assert all(len(o.logprobs) == 1 and o.logprobs[0].top_ids == [] for o in outs)


@pytest.mark.parametrize("tier", [0, 1, 2])
def test_prompt_logprobs_equal_a_dense_teacher_forced_forward(llama_family, tier):
    model = llama_family.model
    # a small budget chunks the long prompt: positions are scored across steps
    eng = Engine(model, block_size=4, num_blocks=64, max_num_batched_tokens=16)
    for prompt in PROMPTS:
        outs = run(eng, prompt, tier, SamplingParams(max_tokens=2, ignore_eos=True, prompt_logprobs=3,
                                                     logprobs=1))
        plp = outs[0].prompt_logprobs
        assert [x.token for x in plp] == prompt[1:]
        ref = dense_logprobs(model, prompt + outs[0].new_token_ids, tier)
        for p, x in enumerate(plp):
            assert abs(x.logprob - float(ref[p, prompt[p + 1]])) < 1e-4
            assert x.top_ids == torch.topk(ref[p], 3).indices.tolist()
        first = outs[0].logprobs[0]  # the first output token: scored at the last prompt position
        assert abs(first.logprob - float(ref[len(prompt) - 1, first.token])) < 1e-4
        assert all(o.prompt_logprobs == [] for o in outs[1:])


def test_prompt_logprobs_compute_every_position_even_when_the_prefix_is_cached(llama_family):
    model = llama_family.model
    eng = Engine(model, block_size=4, num_blocks=64)
    prompt = PROMPTS[2]
    run(eng, prompt, 2, SamplingParams(max_tokens=1))  # warms the prefix cache
    reused = eng.stats.prefill_reused[0]
    outs = run(eng, prompt, 2, SamplingParams(max_tokens=1, prompt_logprobs=0))
    assert eng.stats.prefill_reused[0] == reused  # nothing read from the cache...
    ref = dense_logprobs(model, prompt, 2)
    got = [x.logprob for x in outs[0].prompt_logprobs]
    assert max(abs(g - float(ref[p, prompt[p + 1]])) for p, g in enumerate(got)) < 1e-4
    run(eng, prompt, 2, SamplingParams(max_tokens=1))
    assert eng.stats.prefill_reused[0] > reused  # ...and the cache still serves the others


def test_speculation_reports_the_target_tiers_logprobs(llama_family):
    """Greedy self-speculation commits the target's tokens: their logprobs are the target tier's, as
    plain decoding at that tier gives them."""
    prompt = PROMPTS[0]
    plain = run(Engine(llama_family.model, block_size=4, num_blocks=64), prompt, 2,
                SamplingParams(max_tokens=12, ignore_eos=True, logprobs=2))
    spec = run(Engine(llama_family.model, block_size=4, num_blocks=64), prompt, 2,
               SamplingParams(max_tokens=12, ignore_eos=True, logprobs=2, spec_draft_tier=0, spec_gamma=3))
    a = [lp for o in plain for lp in o.logprobs]
    b = [lp for o in spec for lp in o.logprobs]
    assert [x.token for x in a] == [x.token for x in b] and len(b) == 12
    assert max(abs(x.logprob - y.logprob) for x, y in zip(a, b)) < 1e-4
    assert all(x.top_ids == y.top_ids for x, y in zip(a, b))


def test_a_cascades_tokens_carry_their_own_tiers_logprobs(llama_family):
    from tests.support.cascade import WINDOW, find_case
    case = find_case(llama_family)
    model = llama_family.model
    outs = run(Engine(model, block_size=4, num_blocks=64), case["prompt"], 0,
               SamplingParams(max_tokens=16, ignore_eos=True, logprobs=0, cascade_threshold=case["threshold"],
                              cascade_window=WINDOW))
    toks = [t for o in outs for t in o.new_token_ids]
    lps = [lp for o in outs for lp in o.logprobs]
    tiers = [o.tier for o in outs for _ in o.new_token_ids]
    assert len(lps) == len(toks) == 16 and set(tiers) == {0, 1}
    ids = case["prompt"] + toks
    refs = {t: dense_logprobs(model, ids, t) for t in set(tiers)}
    for i, (tok, lp, t) in enumerate(zip(toks, lps, tiers)):
        assert lp.token == tok
        assert abs(lp.logprob - float(refs[t][len(case["prompt"]) - 1 + i, tok])) < 1e-4


def test_logprobs_bounds_are_validated():
    for bad in (-1, 21, True, 1.5):
        with pytest.raises(ValueError):
            SamplingParams(logprobs=bad).validate()
        with pytest.raises(ValueError):
            SamplingParams(prompt_logprobs=bad).validate()
    SamplingParams(logprobs=20, prompt_logprobs=0).validate()
