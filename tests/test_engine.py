"""Continuous batching of every tier in one forward: equality with solo runs, KV accounting,
preemption, sampling, and bad requests."""
import random

import pytest

from engine import Engine, InvalidRequest
from worker.sampling import SamplingParams


def make_engine(fam, **kw):
    kw.setdefault("block_size", 4)
    kw.setdefault("num_blocks", 128)
    return Engine(fam.model, **kw)


def workload(n=9, seed=3):
    rng = random.Random(seed)
    out = []
    for i in range(n):
        prompt = [rng.randrange(3, 160) for _ in range(rng.randint(1, 40))]
        out.append((f"r{i}", prompt, i % 3, SamplingParams(max_tokens=rng.randint(1, 24), ignore_eos=True)))
    return out


def solo(fam, prompt, tier, params):
    eng = make_engine(fam)
    return eng.generate([prompt], [tier], params)[0]


def all_blocks_free(eng):
    return all(p.num_free == p.num_blocks for p in eng.pools)


@pytest.mark.parametrize("family", ["llama_family", "exit_family"])
def test_mixed_batch_equals_each_request_alone(request, family):
    """All tiers, prompts of different lengths, prefill chunked across steps (budget 16 tokens),
    requests joining while others run and leaving at different times."""
    fam = request.getfixturevalue(family)
    work = workload()
    expected = {rid: solo(fam, p, t, sp) for rid, p, t, sp in work}
    eng = make_engine(fam, max_num_batched_tokens=16)
    got = {rid: [] for rid, *_ in work}
    pending = list(work)
    steps = 0
    mixed_steps = 0
    while pending or eng.has_unfinished():
        if pending and steps % 2 == 0:  # one newcomer every other step
            rid, p, t, sp = pending.pop(0)
            eng.add_request(rid, p, t, sp)
        outs = eng.step()
        if len({r.tier for r in eng.running}) > 1:
            mixed_steps += 1
        for o in outs:
            got[o.request_id].extend(o.new_token_ids)
        steps += 1
    assert got == expected
    assert mixed_steps > 0, "the workload never mixed tiers in one step"
    assert all_blocks_free(eng)


def test_long_prompt_is_chunked_and_never_starves_decode(llama_family):
    eng = make_engine(llama_family, max_num_batched_tokens=8)
    eng.add_request("short", [5, 6], 0, SamplingParams(max_tokens=12, ignore_eos=True))
    eng.step()  # "short" is decoding from now on
    eng.add_request("long", list(range(3, 43)), 2, SamplingParams(max_tokens=2, ignore_eos=True))
    per_step = []
    first_long = None
    while eng.has_unfinished():
        before = eng.stats.forward_tokens
        outs = eng.step()
        per_step.append(eng.stats.forward_tokens - before)
        ids = {o.request_id for o in outs}
        if "long" in ids and first_long is None:
            first_long = len(per_step)
        if first_long is None:
            assert "short" in ids, "a decode row was starved by the long prefill"
    assert max(per_step) <= 8
    assert first_long >= 40 // 7  # 40 prompt tokens through 7 free token slots a step


def test_undersized_pool_preempts_and_still_completes(llama_family):
    rng = random.Random(5)
    work = [(f"r{i}", [rng.randrange(3, 160) for _ in range(rng.randint(3, 8))], i % 3,
             SamplingParams(max_tokens=30, ignore_eos=True)) for i in range(6)]
    expected = {rid: solo(llama_family, p, t, sp) for rid, p, t, sp in work}
    eng = make_engine(llama_family, num_blocks=14)  # far fewer blocks than the work needs at once
    for rid, p, t, sp in work:
        eng.add_request(rid, p, t, sp)
    got = {rid: [] for rid, *_ in work}
    while eng.has_unfinished():
        for o in eng.step():
            got[o.request_id].extend(o.new_token_ids)
    assert eng.stats.preemptions > 0, "the pool was not small enough to force a preemption"
    assert got == expected
    assert all_blocks_free(eng)


def test_lower_tiers_hold_blocks_only_in_their_segments(llama_family):
    eng = make_engine(llama_family)
    eng.add_request("small", list(range(3, 12)), 0, SamplingParams(max_tokens=4))
    eng.step()
    used = [p.num_used for p in eng.pools]
    assert used[0] == 3 and used[1] == 0 and used[2] == 0  # 9 tokens, block size 4
    eng.add_request("large", list(range(3, 8)), 2, SamplingParams(max_tokens=4))
    eng.step()
    used = [p.num_used for p in eng.pools]
    assert used[1] == 2 and used[2] == 2


def test_sampling_is_reproducible_with_a_seed_and_top_k_1_is_greedy(llama_family):
    prompt = [4, 8, 15, 16, 23, 42]
    sp = SamplingParams(max_tokens=16, temperature=1.3, top_p=0.9, seed=1234, ignore_eos=True)
    a = solo(llama_family, prompt, 2, sp)
    b = make_engine(llama_family).generate([prompt, [9, 9, 9]], [2, 0], [sp, SamplingParams(max_tokens=5)])[0]
    assert a == b
    c = solo(llama_family, prompt, 2, SamplingParams(max_tokens=16, temperature=1.3, seed=99, ignore_eos=True))
    assert c != a
    greedy = solo(llama_family, prompt, 2, SamplingParams(max_tokens=16, ignore_eos=True))
    topk1 = solo(llama_family, prompt, 2, SamplingParams(max_tokens=16, temperature=0.7, top_k=1, seed=5,
                                                        ignore_eos=True))
    assert topk1 == greedy


def test_stop_tokens_and_max_tokens_finish_requests(llama_family):
    prompt = [4, 8, 15, 16, 23, 42]
    free = solo(llama_family, prompt, 1, SamplingParams(max_tokens=10, ignore_eos=True))
    stop_at = free[3]
    eng = make_engine(llama_family)
    eng.add_request("s", prompt, 1, SamplingParams(max_tokens=10, stop_token_ids=(stop_at,), ignore_eos=True))
    outs = []
    while eng.has_unfinished():
        outs += eng.step()
    toks = [o.new_token_ids[0] for o in outs]
    assert toks == free[:free.index(stop_at) + 1]
    assert outs[-1].finished and outs[-1].finish_reason == "stop"
    eng.add_request("l", prompt, 1, SamplingParams(max_tokens=3, ignore_eos=True))
    outs = []
    while eng.has_unfinished():
        outs += eng.step()
    assert len(outs) == 3 and outs[-1].finish_reason == "length"


@pytest.mark.parametrize("kwargs,message", [
    (dict(prompt=[5, 6], tier="huge"), "unknown tier"),
    (dict(prompt=[], tier=0), "prompt is empty"),
    (dict(prompt=list(range(3, 100)) * 6, tier=0), "context limit"),
    (dict(prompt=[5, 6], tier=0, params=SamplingParams(max_tokens=0)), "max_tokens"),
    (dict(prompt=[5, 6], tier=0, params=SamplingParams(max_tokens=-3)), "max_tokens"),
    (dict(prompt=[5, 999999], tier=0), "token ids"),
    (dict(prompt=[5, 6], tier=0, params=SamplingParams(top_p=1.5)), "top_p"),
])
def test_bad_requests_get_a_clear_error_and_others_keep_running(llama_family, kwargs, message):
    eng = make_engine(llama_family, max_model_len=256)
    eng.add_request("good", [7, 8, 9], 2, SamplingParams(max_tokens=6, ignore_eos=True))
    eng.step()
    with pytest.raises(InvalidRequest, match=message):
        eng.add_request("bad", kwargs["prompt"], kwargs["tier"], kwargs.get("params"))
    toks = []
    while eng.has_unfinished():
        toks += [t for o in eng.step() for t in o.new_token_ids]
    assert len(toks) == 5  # the good request's remaining tokens
    assert all_blocks_free(eng)


def test_abort_frees_blocks(llama_family):
    eng = make_engine(llama_family)
    eng.add_request("a", list(range(3, 30)), 2, SamplingParams(max_tokens=50, ignore_eos=True))
    eng.add_request("b", list(range(3, 10)), 0, SamplingParams(max_tokens=50, ignore_eos=True))
    eng.step()
    eng.step()
    assert eng.abort_request("a") and eng.abort_request("b")
    assert not eng.abort_request("a")
    assert not eng.has_unfinished() and all_blocks_free(eng)


def test_giving_the_heap_back_after_long_steps_leaves_every_token_as_it_was(llama_family, monkeypatch):
    """A runner that returns its freed heap after every step (worker/memory.py) answers as one that never does."""
    from worker import runner as runner_module
    calls = []
    monkeypatch.setattr(runner_module, "release_memory", lambda collect=True: calls.append(collect))
    work = workload(6, seed=5)
    answers = []
    for after in (1, 0):
        eng = make_engine(llama_family)
        eng.runner.release_after_tokens = after
        answers.append(eng.generate([w[1] for w in work], [w[2] for w in work], [w[3] for w in work]))
        if after:
            steps, calls[:] = len(calls), []
    assert answers[0] == answers[1] and steps > 0 and calls == []  # released after each step; never, with 0


def test_release_memory_returns_quietly_with_or_without_a_collection():
    from worker.memory import release_memory
    release_memory()  # glibc: malloc_trim; elsewhere a no-op
    release_memory(collect=False)
