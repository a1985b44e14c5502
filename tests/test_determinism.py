"""Same request, same tokens: on the served CPU format (w4a8, fp32 activations) a request's tokens and
every step's logits, bit for bit, are those of the same request served alone, whatever its batch, its
arrival, its prefill chunks, its prefix-cache hits, the path (eager or compiled) of its steps, and
whether self-speculation or the cascade touched it. A tiny random Llama with the default format's
operators; the default weights in one slow check."""
from __future__ import annotations

import random

import pytest
import torch

from engine import Engine
from tests.support.cascade import WINDOW, find_case
from worker.execution import compile_decode
from worker.family import load_family
from worker.sampling import SamplingParams

N = 10  # tokens a request generates


@pytest.fixture(scope="module")
def fam(llama_dir):
    return load_family(str(llama_dir), tiers="2+1,4,6", dtype="float32", weights="w4a8")


def serve(model, reqs, *, chunk: int = 512, warm=(), arrivals=None, keep_logits: bool = True):
    """reqs: (id, prompt, tier, params). ``warm`` prompts run first in the same engine (their blocks stay
    cached); ``arrivals[i]``: the step at which request i is added (all at once by default). Returns
    {id: (tokens, [each step's logits])}."""
    eng = Engine(model, block_size=4, num_blocks=256, max_num_batched_tokens=chunk, keep_logits=keep_logits)
    if warm:
        eng.generate(list(warm), [2] * len(warm), SamplingParams(max_tokens=2, ignore_eos=True))
    arrivals = arrivals or [0] * len(reqs)
    out: dict[str, tuple[list[int], list]] = {r[0]: ([], []) for r in reqs}
    step = 0
    while step <= max(arrivals) or eng.has_unfinished():
        for (rid, prompt, tier, sp), at in zip(reqs, arrivals):
            if at == step:
                eng.add_request(rid, prompt, tier, sp)
        for o in eng.step():
            out[o.request_id][0].extend(o.new_token_ids)
            if o.new_token_ids and o.logits is not None:
                out[o.request_id][1].append(o.logits)
        step += 1
    return out


def alone(model, req):
    return serve(model, [req])[req[0]]


def assert_same(got, want, what):
    toks, logits = got
    assert toks == want[0], what
    assert len(logits) == len(want[1]) and all(torch.equal(a, b) for a, b in zip(logits, want[1])), what


def workload(rng: random.Random, n: int, prefix: list[int]):
    reqs = []
    for i in range(n):
        own = [rng.randrange(3, 160) for _ in range(rng.randint(1, 30))]
        prompt = (prefix + own) if rng.random() < 0.5 else own
        sp = SamplingParams(max_tokens=N, ignore_eos=True)
        if rng.random() < 0.4:  # seeded sampling is in the contract too
            sp = SamplingParams(max_tokens=N, ignore_eos=True, temperature=0.9, seed=rng.randrange(1000))
        reqs.append((f"r{i}", prompt, rng.randrange(3), sp))
    return reqs


@pytest.mark.parametrize("seed", range(3))
def test_a_request_in_any_batch_chunking_arrival_and_cache_state_equals_it_alone(fam, seed):
    rng = random.Random(seed)
    prefix = [rng.randrange(3, 160) for _ in range(13)]
    reqs = workload(rng, 7, prefix)
    want = {r[0]: alone(fam.model, r) for r in reqs}
    chunk = rng.choice([3, 8, 17, 64])
    arrivals = [rng.randrange(6) for _ in reqs]
    got = serve(fam.model, reqs, chunk=chunk, warm=[prefix + [7, 7, 7]], arrivals=arrivals)
    for r in reqs:
        assert_same(got[r[0]], want[r[0]], f"{r[0]} (chunk {chunk}, arrivals {arrivals})")


def test_self_speculation_and_the_cascade_equal_plain_decoding(fam):
    """Greedy self-speculation (every draft > target pair) is plain decoding at the target tier, token for
    token, on the served format; a cascade is tier 0's tokens until it escalates, then tier 1's
    continuation of them, as plain decoding of each gives."""
    rng = random.Random(7)
    reqs = []
    for i, (d, t) in enumerate([(0, 1), (0, 2), (1, 2), (0, 2)]):
        prompt = [rng.randrange(3, 160) for _ in range(rng.randint(3, 12))]
        reqs.append((f"s{i}", prompt, t, SamplingParams(max_tokens=24, ignore_eos=True, spec_draft_tier=d,
                                                         spec_gamma=4)))
    got = serve(fam.model, reqs, keep_logits=False)
    for rid, prompt, t, _ in reqs:
        assert got[rid][0] == alone(fam.model, (rid, prompt, t, SamplingParams(max_tokens=24, ignore_eos=True)))[0]
    case = find_case(fam)
    sp = SamplingParams(max_tokens=16, ignore_eos=True, cascade_threshold=case["threshold"], cascade_window=WINDOW)
    out = serve(fam.model, [("c", case["prompt"], 0, sp)], keep_logits=False)["c"][0]
    assert out == case["low"][:case["k"]] + case["cont"]


def test_the_compiled_path_computes_what_the_eager_path_computes(fam):
    """The compiled decode graph calls the eager layers' operators: alone or batched, each step's logits
    equal the eager path's, bit for bit (and so a background swap changes no token). (The family of
    test_execution.py: the same graphs, from the inductor cache when that file ran first.)"""
    model = fam.model
    rng = random.Random(3)
    reqs = workload(rng, 5, [])
    want = {r[0]: alone(model, r) for r in reqs}
    compile_decode(model)
    try:
        got = serve(model, reqs, arrivals=[0, 0, 1, 2, 2])
        for r in reqs:
            assert_same(got[r[0]], want[r[0]], r[0])
            assert_same(alone(model, r), want[r[0]], r[0] + " alone")
    finally:
        compile_decode(model, enable=False)


@pytest.mark.slow
def test_the_default_weights_answer_alone_as_in_a_batch():
    """The default family on its default format: four chat-sized prompts, each alone and all together
    with prefill chunks of 16 tokens, at the top and the lowest tier."""
    from kernels import cpu_rows
    if not cpu_rows.rows_kernel():
        pytest.skip("the per-row operators do not build here")
    fam = load_family("default", weights="w4a8")
    rng = random.Random(1)
    reqs = [(f"d{i}", [rng.randrange(100, 40000) for _ in range(rng.randint(20, 60))], i % 2 * 2,
             SamplingParams(max_tokens=12, ignore_eos=True)) for i in range(4)]
    want = {r[0]: alone(fam.model, r) for r in reqs}
    got = serve(fam.model, reqs, chunk=16)
    for r in reqs:
        assert_same(got[r[0]], want[r[0]], r[0])


def test_a_seeded_request_resumed_with_its_tokens_so_far_samples_on_as_its_fault_free_run(fam):
    """What a worker does with a request another worker started (``ModelRunner.add(..., num_output=k)``):
    its generator skips the k draws made, so its next tokens are the fault-free run's."""
    sp = SamplingParams(max_tokens=N, ignore_eos=True, temperature=1.0, seed=11)
    prompt = [5, 9, 33, 7, 2]
    want = alone(fam.model, ("a", prompt, 2, sp))[0]
    for k in (1, 4):
        eng = Engine(fam.model, block_size=4, num_blocks=64)
        rest = SamplingParams(max_tokens=N - k, ignore_eos=True, temperature=1.0, seed=11)
        eng.scheduler.add_request("b", prompt + want[:k], 2, rest, meta={})
        eng.runner.add("b", rest, prompt + want[:k], num_output=k)
        got = []
        while eng.has_unfinished():
            got += [t for o in eng.step() for t in o.new_token_ids]
        assert want[:k] + got == want, k


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sixteen_streams_after_a_worker_sigkill_equal_their_fault_free_run(llama_dir):
    """The service (two workers, w4a8 in fp32, compiled decode swapped in when built) with one worker
    SIGKILLed mid-generation: every stream equals the request served alone, greedy or seeded, token for
    token and in each token's log-probability, bit for bit."""
    import signal

    import redis

    from service.launch import Service
    from tests.support.faults import assert_complete_and_equal
    from tests.support.pipeline import Reader, submit
    rng = random.Random(4)
    work = [(f"k{i}", [rng.randrange(3, 160) for _ in range(rng.randint(3, 20))], i % 3, 40) for i in range(16)]
    seeds = {rid: 100 + i for i, (rid, *_) in enumerate(work) if i % 4 == 3}
    with Service(str(llama_dir), tiers="2+1,4,6", workers=2, gateway=False, dtype="float32",
                 worker_args=["--num-blocks", "256", "--block-size", "4", "--threads", "1",
                              "--weights", "w4a8"]) as svc:
        r = redis.Redis.from_url(svc.redis_url)
        for rid, prompt, tier, n in work:
            kw = dict(temperature=0.9, seed=seeds[rid]) if rid in seeds else {}
            submit(r, rid, prompt, tier, max_tokens=n, ignore_eos=True, logprobs=0, **kw)
        rd = Reader(r)
        rd.until(lambda: sum(len(v) for v in rd.events.values() if any(e.worker == "w1" for e in v)) >= 40)
        svc.procs["worker-w1"].send_signal(signal.SIGKILL)
        rd.until(lambda: all(rd.finished(rid) for rid, *_ in work), timeout=240)
        moved = [rid for rid, evs in rd.events.items() if {e.worker for e in evs} == {"w0", "w1"}]
        assert moved, "no request was in flight on the killed worker"
    fam = load_family(str(llama_dir), tiers="2+1,4,6", dtype="float32", weights="w4a8")
    want, want_lp = {}, {}
    for rid, prompt, tier, n in work:
        sp = SamplingParams(max_tokens=n, ignore_eos=True, logprobs=0,
                            **(dict(temperature=0.9, seed=seeds[rid]) if rid in seeds else {}))
        eng = Engine(fam.model, block_size=4, num_blocks=64)
        eng.add_request(rid, prompt, tier, sp)
        want[rid], want_lp[rid] = [], []
        while eng.has_unfinished():
            for o in eng.step():
                want[rid] += o.new_token_ids
                want_lp[rid] += [lp.logprob for lp in o.logprobs]
    assert_complete_and_equal(rd, work, want)
    for rid, *_ in work:
        got = {e.seq + i: lp.logprob for e in rd.events[rid] for i, lp in enumerate(e.logprobs)}
        assert [got[i] for i in range(len(want_lp[rid]))] == want_lp[rid], rid
