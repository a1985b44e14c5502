"""Blocks behind every layer's attention window go back to the pool while a request runs
(scheduler/window.py): the tokens and logits stay those of the run that holds every block (and
transformers'), a stream holds a bounded number of blocks, released blocks serve other requests, shared
and cached blocks keep their references, and a model with a global layer (or a cascade request) keeps
everything."""
import pytest
import torch

from engine import Engine, InvalidRequest
from scheduler.window import RELEASED, held
from tests.support.factories import tiny_arch, tiny_mistral
from worker.family import load_family
from worker.sampling import SamplingParams

PROMPT = [1, 17, 33, 90, 5, 61, 7, 120, 44, 3, 19]
BS = 4


@pytest.fixture(scope="module")
def mistral(tmp_path_factory):
    """A tiny Mistral with a 16-token window on every layer, cut into tiers of 2, 4 and 6 layers."""
    path = tiny_mistral(tmp_path_factory.mktemp("mistral") / "m", window=16)
    fam = load_family(str(path), tiers="2,4,6", dtype="float32")
    assert fam.model.kv_window == 16
    return fam.model, path


def check_refs(eng: Engine) -> None:
    """Each pool's references are exactly the blocks its running requests hold, none released."""
    for s, pool in enumerate(eng.pools):
        refs = [0] * pool.num_blocks
        for req in eng.running:
            if s < len(req.block_tables):
                for b in held(req, s):
                    assert b != RELEASED
                    refs[b] += 1
        assert refs == pool.ref, f"segment {s}: references differ from the blocks held"


def run(eng: Engine, requests: dict, watch=None, later: dict | None = None, after: int = 0):
    """Steps ``eng`` until every request finishes; `later` is added once `after` steps ran. Returns
    {request: (tokens, logits)}; ``watch(eng)`` runs after every step."""
    got = {rid: ([], []) for rid in [*requests, *(later or {})]}
    for rid, (prompt, tier, params) in requests.items():
        eng.add_request(rid, prompt, tier, params)
    steps = 0
    while eng.has_unfinished() or later:
        if later and steps == after:
            for rid, (prompt, tier, params) in later.items():
                eng.add_request(rid, prompt, tier, params)
            later = None
        for o in eng.step():
            got[o.request_id][0].extend(o.new_token_ids)
            got[o.request_id][1].append(o.logits)
        steps += 1
        check_refs(eng)
        if watch is not None:
            watch(eng)
    assert all(eng.pools[s].num_used == 0 for s in range(len(eng.pools)))
    return {rid: (toks, torch.stack(lg) if lg[0] is not None else None) for rid, (toks, lg) in got.items()}


def bounded(window: int, most: list[int]):
    """A watch: every running request holds at most window / BS + 2 blocks in each segment."""
    def watch(eng):
        for req in eng.running:
            n = max(len(held(req, s)) for s in range(len(req.block_tables)))
            most.append(n)
            assert n <= window // BS + 2, f"{req.request_id} holds {n} blocks"
    return watch


@pytest.mark.parametrize("tiers,prefix_caching", [("2,4,6", True), ("2,4,6", False), ("2+1,4+1,6", True)])
def test_a_long_stream_gives_the_same_tokens_and_logits_and_holds_a_window(mistral, tiers, prefix_caching):
    """120 greedy tokens of every tier past a 16-token window (lower tiers with exit blocks too, whose
    layers are windowed as well): bit-identical to the run that holds every block, the top tier's equal
    to transformers' over the whole sequence, and each request holding at most window / block_size + 2
    blocks per segment throughout."""
    model, path = mistral
    if tiers != "2,4,6":
        model = load_family(str(path), tiers=tiers, dtype="float32").model
        assert model.exit_block_segments == (0, 1) and model.kv_window == 16
    reqs = {f"t{t}": (PROMPT, t, SamplingParams(max_tokens=120, ignore_eos=True)) for t in range(3)}
    most: list[int] = []
    kw = dict(block_size=BS, num_blocks=128, keep_logits=True, prefix_caching=prefix_caching)
    eng = Engine(model, **kw)
    got = run(eng, reqs, bounded(16, most))
    ref = run(Engine(model, release_outside_window=False, **kw), reqs)  # room for all: no preemption
    assert eng.stats.preemptions == 0 and max(most) >= 16 // BS and len(most) > 100
    for rid in reqs:
        assert got[rid][0] == ref[rid][0] and len(got[rid][0]) == 120
        assert torch.equal(got[rid][1], ref[rid][1])
    from transformers import AutoModelForCausalLM
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    toks, logits = got["t2"]
    with torch.no_grad():
        hf_logits = hf(torch.tensor([PROMPT + toks[:-1]])).logits[0, len(PROMPT) - 1:]
    torch.testing.assert_close(logits, hf_logits, rtol=0, atol=1e-4)
    assert hf_logits.argmax(-1).tolist() == toks


def test_released_blocks_serve_another_request_and_a_stream_outgrows_the_pool(mistral):
    """A 16-block pool: a 111-token stream (28 blocks' worth, refused when blocks are held to the end)
    runs through every block of the pool; a second request admitted later takes blocks the first gave
    back. Neither's tokens or logits change against the same two requests with every block held."""
    model, _ = mistral
    a = {"a": (PROMPT, 2, SamplingParams(max_tokens=100, ignore_eos=True))}
    b = {"b": ([3, 9, 27, 81, 4, 16], 1, SamplingParams(max_tokens=40, ignore_eos=True))}
    kw = dict(block_size=BS, keep_logits=True, max_num_batched_tokens=16)
    with pytest.raises(InvalidRequest, match="KV blocks"):
        Engine(model, num_blocks=16, release_outside_window=False, **kw).add_request("a", *a["a"])
    seen: dict[str, set] = {"a": set(), "b": set(), "a_before_b": set()}

    def watch(eng):
        for req in eng.running:
            seen[req.request_id].update(held(req, 0))
        if "b" not in eng.scheduler.requests and not seen["b"]:
            seen["a_before_b"] |= seen["a"]
    got = run(Engine(model, num_blocks=16, **kw), a, watch, later=b, after=70)
    assert seen["a_before_b"] == set(range(16))  # a had used every block before b came
    assert seen["b"] and seen["b"] <= seen["a_before_b"]
    ref = run(Engine(model, num_blocks=64, release_outside_window=False, **kw), a, later=b, after=70)
    for rid in ("a", "b"):
        assert got[rid][0] == ref[rid][0]
        assert torch.equal(got[rid][1], ref[rid][1])


def test_shared_prefix_blocks_keep_their_references(mistral):
    """Two requests of one 40-token prompt (past the window), the second admitted while the first
    decodes: it reuses the cached prompt blocks, among them blocks the first already gave back (found
    in the cache) and blocks both hold; every pool reference stays the blocks held (checked each
    step), and both outputs equal their runs with every block held."""
    model, _ = mistral
    prompt = [(7 * i + 3) % 150 + 3 for i in range(40)]
    a = {"a": (prompt, 2, SamplingParams(max_tokens=30, ignore_eos=True))}
    b = {"b": (prompt, 2, SamplingParams(max_tokens=30, ignore_eos=True, temperature=1.0, seed=5))}
    shared: list[int] = []

    def watch(eng):
        refs = eng.pools[0].ref
        shared.append(sum(1 for b in range(len(refs)) if refs[b] == 2))
    eng = Engine(model, block_size=BS, num_blocks=64, keep_logits=True)
    got = run(eng, a, watch, later=b, after=3)
    assert eng.stats.cache_hits[0] == (len(prompt) - 1) // BS  # every full prompt block found
    assert max(shared) > 0
    ref = run(Engine(model, block_size=BS, num_blocks=64, keep_logits=True, release_outside_window=False),
              a, later=b, after=3)
    for rid in ("a", "b"):
        assert got[rid][0] == ref[rid][0]
        assert torch.equal(got[rid][1], ref[rid][1])


def test_speculation_past_the_window_is_unchanged(mistral):
    """Self-speculation (tier 0 drafts for tier 2) over 100 tokens: the same tokens as with every block
    held, and the request's blocks stay bounded."""
    model, _ = mistral
    params = SamplingParams(max_tokens=100, ignore_eos=True, spec_draft_tier=0, spec_gamma=4)
    reqs = {"s": (PROMPT, 2, params)}
    most: list[int] = []
    eng = Engine(model, block_size=BS, num_blocks=64)
    got = run(eng, reqs, bounded(16, most))
    assert eng.stats.spec_rounds > 0
    ref = run(Engine(model, block_size=BS, num_blocks=64, release_outside_window=False), reqs)
    assert got["s"][0] == ref["s"][0]


def test_a_cascade_request_keeps_its_blocks_through_an_escalation_past_the_window(mistral):
    """A cascade request escalates after 30 tokens (position 41, past the 16-token window): the catch-up
    reads the trunk state of its whole history, so it releases nothing; its tokens equal the run with
    release off."""
    model, _ = mistral
    params = SamplingParams(max_tokens=50, ignore_eos=True, cascade_threshold=1.0, cascade_window=30)
    reqs = {"c": (PROMPT, 0, params)}
    def watch(eng):
        for req in eng.running:
            assert req.num_released_blocks == 0
            assert len(held(req, 0)) >= req.num_computed_tokens // BS
    eng = Engine(model, block_size=BS, num_blocks=64)
    got = run(eng, reqs, watch)
    assert eng.stats.escalations.get("0>1", 0) == 1
    ref = run(Engine(model, block_size=BS, num_blocks=64, release_outside_window=False), reqs)
    assert got["c"][0] == ref["c"][0]


def test_a_model_with_a_global_layer_releases_nothing(tmp_path):
    """Gemma 3's global layers read every position: no window, every block held to the end."""
    fam = load_family(str(tiny_arch(tmp_path / "g", "gemma3")), tiers="3,6", dtype="float32")
    assert fam.model.kv_window == 0
    eng = Engine(fam.model, block_size=BS, num_blocks=64)
    assert eng.scheduler.cfg.kv_window == 0

    def watch(eng):
        for req in eng.running:
            assert req.num_released_blocks == 0 and RELEASED not in req.block_tables[0]
            assert len(held(req, 0)) >= req.num_computed_tokens // BS
    run(eng, {"g": (PROMPT, 1, SamplingParams(max_tokens=30, ignore_eos=True))}, watch)
