"""Sampling parameters: logit_bias, repetition / frequency / presence penalties, min_p and
typical_p, against straightforward reference implementations of their definitions (vLLM's formulas, Hugging
Face's repetition penalty), on given logits and through the engine; self-speculation stays exact with
them; requests without them are untouched in mixed batches."""
from __future__ import annotations

import random

import pytest
import torch

from core.sampling import SamplingParams
from engine import Engine
from worker.sampling import probs_for, process_logits

V = 40  # vocabulary of the logits-only tests


def reference(logits: torch.Tensor, p: SamplingParams, prompt: list[int], output: list[int]) -> torch.Tensor:
    """The definitions, token by token: bias added; a token seen in prompt or output has its logit
    divided by the repetition penalty when positive, multiplied when not; then minus frequency x its
    count in the output, minus presence if it is in the output."""
    x = logits.clone()
    for t, b in p.logit_bias.items():
        x[t] += b
    for t in set(prompt) | set(output):
        x[t] = x[t] / p.repetition_penalty if x[t] > 0 else x[t] * p.repetition_penalty
    for t in set(output):
        x[t] -= p.frequency_penalty * output.count(t) + p.presence_penalty
    return x


def history(prompt, output):
    counts = torch.bincount(torch.tensor(output, dtype=torch.long), minlength=V).float()
    seen = torch.bincount(torch.tensor(prompt + output, dtype=torch.long), minlength=V) > 0
    return counts, seen


PARAMS = [
    SamplingParams(),
    SamplingParams(repetition_penalty=1.5),
    SamplingParams(repetition_penalty=0.7, presence_penalty=-0.5),
    SamplingParams(frequency_penalty=0.8),
    SamplingParams(presence_penalty=1.2, frequency_penalty=-0.3, logit_bias={3: 5.0, 7: -100.0}),
    SamplingParams(logit_bias={0: 2.5, 39: -1.0}),
]


def test_process_logits_matches_the_definitions_row_by_row():
    rng = random.Random(0)
    torch.manual_seed(0)
    logits = torch.randn(len(PARAMS), V, dtype=torch.float64) * 3
    hist = [([rng.randrange(V) for _ in range(8)], [rng.randrange(V) for _ in range(rng.randint(0, 12))])
            for _ in PARAMS]
    hs = [history(*h) if p.penalized else (None, None) for p, h in zip(PARAMS, hist)]
    got = process_logits(logits, PARAMS, [h[0] for h in hs], [h[1] for h in hs])
    for i, (p, (prompt, output)) in enumerate(zip(PARAMS, hist)):
        torch.testing.assert_close(got[i], reference(logits[i], p, prompt, output))
    assert torch.equal(got[0], logits[0])
    plain = logits[:3]
    assert process_logits(plain, [SamplingParams()] * 3, [None] * 3, [None] * 3) is plain  # no copy


def test_min_p_keeps_the_tokens_within_min_p_of_the_top():
    torch.manual_seed(1)
    logits = torch.randn(V) * 2
    for min_p in (0.0, 0.05, 0.3, 1.0):
        p = SamplingParams(temperature=0.7, min_p=min_p)
        probs = probs_for(logits, p)
        base = torch.softmax(logits.float() / 0.7, -1)
        keep = base >= min_p * base.max()
        assert torch.equal(probs > 0, keep)
        torch.testing.assert_close(probs[keep], base[keep] / base[keep].sum())


def test_typical_p_matches_hugging_faces_warper():
    from transformers.generation.logits_process import TemperatureLogitsWarper, TypicalLogitsWarper
    torch.manual_seed(2)
    for row in range(4):
        logits = torch.randn(V, dtype=torch.float64) * (1 + row)
        for mass in (0.2, 0.5, 0.9, 0.99):
            got = probs_for(logits, SamplingParams(temperature=0.8, typical_p=mass))
            ref = TypicalLogitsWarper(mass)(None, TemperatureLogitsWarper(0.8)(None, logits[None].clone()))[0]
            want = torch.softmax(ref, -1).float()
            assert torch.equal(got > 0, want > 0), (row, mass)
            torch.testing.assert_close(got, want)
    # 0 keeps one token (the one whose surprisal is closest to the entropy); 1 is off
    assert int((probs_for(logits, SamplingParams(temperature=1.0, typical_p=0.0)) > 0).sum()) == 1
    torch.testing.assert_close(probs_for(logits, SamplingParams(temperature=1.0, typical_p=1.0)),
                               torch.softmax(logits, -1).float())


def dense_decode(model, prompt: list[int], tier: int, p: SamplingParams, n: int) -> list[int]:
    """Greedy decoding by the definitions: a dense forward per token, the reference transforms, argmax."""
    out: list[int] = []
    for _ in range(n):
        with torch.no_grad():
            h = model.exit_hidden(torch.tensor([prompt + out]), upto_tier=tier)[tier]
            logits = model.logits(h)[0, -1].double()
        x = reference(logits, p, prompt, out)
        out.append(int(torch.argmax(x)))
    return out


PENALIZED = [
    SamplingParams(max_tokens=12, ignore_eos=True, repetition_penalty=1.8),
    SamplingParams(max_tokens=12, ignore_eos=True, frequency_penalty=1.5, presence_penalty=0.5),
    SamplingParams(max_tokens=12, ignore_eos=True, presence_penalty=2.0, logit_bias={17: 3.0}),
    SamplingParams(max_tokens=12, ignore_eos=True, logit_bias={5: 100.0}),
]


@pytest.mark.parametrize("params", PENALIZED)
def test_greedy_with_penalties_equals_the_reference_in_a_mixed_batch(llama_family, params):
    """The engine's tokens are the reference decode's; a plain request batched alongside is unchanged,
    and the penalties do change the output."""
    model = llama_family.model
    prompt = [9, 9, 14, 30, 9, 14, 52]
    plain = SamplingParams(max_tokens=12, ignore_eos=True)
    eng = Engine(model, block_size=4, num_blocks=64)
    got, other = eng.generate([prompt, prompt[::-1]], [1, 1], [params, plain])
    assert got == dense_decode(model, prompt, 1, params, 12)
    assert other == Engine(model, block_size=4, num_blocks=64).generate([prompt[::-1]], [1], plain)[0]
    assert got != Engine(model, block_size=4, num_blocks=64).generate([prompt], [1], plain)[0]
    if params.logit_bias == {5: 100.0}:
        assert got == [5] * 12


@pytest.mark.parametrize("params", PENALIZED[:3])
def test_greedy_speculation_with_penalties_equals_plain_decoding(llama_family, params):
    """The verifying tier applies at each position the transforms plain decoding applies there (the
    history includes the drafts before it), so greedy speculation commits exactly the plain tokens."""
    prompt = [9, 9, 14, 30, 9, 14, 52]
    want = Engine(llama_family.model, block_size=4, num_blocks=64).generate([prompt], [2], params)[0]
    spec = SamplingParams(**{**{f: getattr(params, f) for f in params.__slots__},
                             "spec_draft_tier": 0, "spec_gamma": 3})
    eng = Engine(llama_family.model, block_size=4, num_blocks=64)
    assert eng.generate([prompt], [2], spec)[0] == want
    assert eng.stats.spec_rounds > 0


def test_sampled_penalties_are_reproducible_and_spec_completes(llama_family):
    prompt = [9, 9, 14, 30]
    p = SamplingParams(max_tokens=16, ignore_eos=True, temperature=0.9, seed=5, min_p=0.05,
                       repetition_penalty=1.3, frequency_penalty=0.4)
    a = Engine(llama_family.model, block_size=4, num_blocks=64).generate([prompt], [2], p)[0]
    b = Engine(llama_family.model, block_size=4, num_blocks=64).generate([prompt, [3, 4]], [2, 0],
                                                                          [p, SamplingParams(max_tokens=3)])[0]
    assert a == b
    s = SamplingParams(**{**{f: getattr(p, f) for f in p.__slots__}, "spec_draft_tier": 1})
    assert len(Engine(llama_family.model, block_size=4, num_blocks=64).generate([prompt], [2], s)[0]) == 16


@pytest.mark.parametrize("kw", [{"min_p": -0.1}, {"min_p": 1.5}, {"typical_p": -0.1}, {"typical_p": 1.5},
                                {"top_p": 1.01}, {"presence_penalty": 2.5},
                                {"frequency_penalty": -3}, {"repetition_penalty": 0}, {"repetition_penalty": -1},
                                {"logit_bias": {1: 101}}, {"logit_bias": {-1: 1}}])
def test_bad_sampling_parameters_are_refused(llama_family, kw):
    with pytest.raises(ValueError):
        SamplingParams(**kw).validate()
    from scheduler.core import InvalidRequest
    with pytest.raises(InvalidRequest):
        Engine(llama_family.model, block_size=4, num_blocks=64).add_request("x", [5, 6], 0, SamplingParams(**kw))


def test_logit_bias_beyond_the_vocabulary_is_refused(llama_family):
    from scheduler.core import InvalidRequest
    with pytest.raises(InvalidRequest, match="logit_bias"):
        Engine(llama_family.model, block_size=4, num_blocks=64).add_request(
            "x", [5, 6], 0, SamplingParams(logit_bias={160: 1.0}))


def test_extreme_but_valid_parameters_sample_a_real_token_instead_of_crashing():
    """Found by schemathesis against the service: a tiny temperature, or a repetition penalty near 0,
    overflowed to inf - inf = nan and torch.multinomial raised, killing the worker with every request
    on it. Each still samples, from the distribution its definition gives in the limit."""
    import torch

    from worker.sampling import make_generator, process_logits, sample
    logits = torch.tensor([[2.0, 5.0, -1.0, 4.0, 0.5]])
    seen = torch.tensor([True, True, False, False, False])
    for params in (SamplingParams(temperature=1e-300, seed=1),
                   SamplingParams(temperature=1.0, repetition_penalty=2.2250738585e-313, seed=1),
                   SamplingParams(temperature=1e-30, min_p=0.35, repetition_penalty=1e-300, seed=1)):
        x = process_logits(logits, [params], [torch.zeros(5)], [seen])
        assert not torch.isnan(x).any()
        tok = sample(x, [params], [make_generator(params)])[0]
        # the limit of each: the top logit after the penalty (token 1 when it is unpenalized, and the
        # penalty near 0 blows seen positive logits up)
        assert tok == int(torch.argmax(x[0]))
