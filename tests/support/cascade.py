"""A confidence-cascade case on a family: a prompt and threshold whose tier-0 window first drops below
the threshold at a known output index (used by the cascade, logprobs and pipeline tests)."""
import random

import pytest

from engine import Engine
from worker.sampling import SamplingParams, confidences

BS = 4
WINDOW = 3
N = 16


def make_engine(fam, **kw):
    kw.setdefault("block_size", BS)
    kw.setdefault("num_blocks", 128)
    return Engine(fam.model, **kw)


def greedy(n, **kw):
    return SamplingParams(max_tokens=n, ignore_eos=True, **kw)


def greedy_with_confidence(fam, prompt, tier, n):
    """Plain greedy decoding at one tier: the tokens and each step's max softmax probability."""
    eng = make_engine(fam, keep_logits=True)
    eng.add_request("x", prompt, tier, greedy(n))
    toks, confs = [], []
    while eng.has_unfinished():
        for o in eng.step():
            toks += o.new_token_ids
            confs += confidences(o.logits[None])
    return toks, confs


def window_means(confs, w):
    """means[j]: the mean of the window ending at output j (None before the window is full)."""
    return [None if j < w - 1 else sum(confs[j - w + 1:j + 1]) / w for j in range(len(confs))]


def find_case(fam):
    """A prompt and threshold whose tier-0 confidence window first averages below the threshold at a
    known output index k (found offline with plain tier-0 greedy decoding), and whose tier-1
    continuation never does (so the cascade is exactly tier 0 then tier 1)."""
    rng = random.Random(0)
    for _ in range(40):
        prompt = [rng.randrange(3, 160) for _ in range(rng.randint(5, 11))]
        low, confs = greedy_with_confidence(fam, prompt, 0, N)
        means = window_means(confs, WINDOW)
        # k: a new strict minimum of the window mean, past the first full window, leaving a tail
        for k in range(N - 4, WINDOW - 1, -1):
            before = min(means[WINDOW - 1:k])
            if means[k] < before - 1e-6:
                break
        else:
            continue
        threshold = (means[k] + before) / 2
        cont, cconfs = greedy_with_confidence(fam, prompt + low[:k], 1, N - k)
        if all(m is None or m >= threshold + 1e-9 for m in window_means(cconfs, WINDOW)):
            return dict(prompt=prompt, k=k, threshold=threshold, low=low, cont=cont)
    pytest.fail("no prompt with a clean single escalation found")
