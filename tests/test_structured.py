"""Structured output in the worker: a grammar masks every sampled row, through the
in-process engine over a tiny random model with the real SmolLM2 tokenizer (float64). Sampled at
temperature 1 from a random model, the output is what the grammar makes it: every document parses and
validates. The service's side (the OpenAI fields, 400s, the openai client's parse helper) is in
tests/test_api_e2e.py."""
from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from core.sampling import SamplingParams
from engine import Engine
from tests.support.factories import tiny_llama_with_tokenizer
from worker.family import load_family
from core.grammar import GrammarError, grammar_of

TIERS = "2,4,6"
# bounded (every string, number and array), so that a random model finishes well within max_tokens
SCHEMA = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 6},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "ok": {"type": "boolean"},
    "colour": {"enum": ["red", "green", "blue"]},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 3}, "maxItems": 2}},
    "required": ["name", "age", "ok", "colour", "tags"], "additionalProperties": False}


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One intra-op thread: on a shared 2-core machine two spinning threads make each step ~10x slower."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def fam(tmp_path_factory, frontend):
    d = tiny_llama_with_tokenizer(tmp_path_factory.mktemp("tinytok"), frontend.tokenizer)
    return load_family(str(d), tiers=TIERS, dtype="float64")


def engine(fam, **kw) -> Engine:
    return Engine(fam.model, block_size=16, num_blocks=1024, max_num_seqs=128, max_num_batched_tokens=4096,
                  tokenizer=fam.tokenizer, **kw)


def prompt(fam, text: str = "Give me a JSON document.") -> list[int]:
    return fam.tokenizer(text)["input_ids"]


def run(eng: Engine, fam, params: list[SamplingParams], tiers=None) -> list[tuple[str, str | None]]:
    """(text, finish reason) of each request, run together."""
    ids = [f"r{i}" for i in range(len(params))]
    tiers = tiers or [2] * len(params)
    for rid, p, t in zip(ids, params, tiers):
        eng.add_request(rid, prompt(fam), t, p)
    toks: dict[str, list[int]] = {rid: [] for rid in ids}
    reason: dict[str, str | None] = {}
    while eng.has_unfinished():
        for o in eng.step():
            toks[o.request_id] += o.new_token_ids
            if o.finished:
                reason[o.request_id] = o.finish_reason
    eos = set(fam.model.cfg.eos_token_ids)
    return [(fam.tokenizer.decode([t for t in toks[rid] if t not in eos]), reason.get(rid)) for rid in ids]


def test_100_seeded_sampled_requests_against_a_schema_all_parse_and_validate(fam):
    spec = ("json", json.dumps(SCHEMA))
    out = run(engine(fam), fam, [SamplingParams(max_tokens=200, temperature=1.0, seed=i, grammar=spec)
                                 for i in range(100)])
    docs = []
    for text, reason in out:
        assert reason == "stop", text  # ended by the grammar (EOS once complete), not by max_tokens
        doc = json.loads(text)
        jsonschema.validate(doc, SCHEMA)
        docs.append(doc)
    assert len({json.dumps(d) for d in docs}) > 50  # sampled: the seeds differ, so do the documents


def test_the_mask_changes_what_is_sampled_and_only_for_the_rows_that_ask(fam):
    eng = engine(fam)
    free, ruled = run(eng, fam, [SamplingParams(max_tokens=12, temperature=1.0, seed=3),
                                 SamplingParams(max_tokens=40, temperature=1.0, seed=3, grammar=("regex", "[a-c]{2,5}"))])
    # the unconstrained row, batched with a constrained one, samples what it samples alone
    assert free == run(engine(fam), fam, [SamplingParams(max_tokens=12, temperature=1.0, seed=3)])[0]
    assert re.fullmatch("[a-c]{2,5}", ruled[0]) and ruled[1] == "stop"


@pytest.mark.parametrize("greedy", [True, False])
def test_choice_regex_and_json_object(fam, greedy):
    t = 0.0 if greedy else 1.0
    choices = ["red", "green", "deep blue", 'say "hi"\n']
    out = run(engine(fam), fam, [
        SamplingParams(max_tokens=20, temperature=t, seed=1, grammar=("choice", json.dumps(choices))),
        SamplingParams(max_tokens=30, temperature=t, seed=2, grammar=("regex", r"\d{3}-[a-z]{2}")),
        SamplingParams(max_tokens=60, temperature=t, seed=3,
                       grammar=("json", json.dumps({"type": "object", "properties": {"a": {"type": "boolean"}},
                                                    "required": ["a"], "additionalProperties": False})))])
    assert out[0][0] in choices and out[0][1] == "stop"
    assert re.fullmatch(r"\d{3}-[a-z]{2}", out[1][0]) and out[1][1] == "stop"
    assert isinstance(json.loads(out[2][0])["a"], bool)


def test_a_replanned_request_rebuilds_its_matcher_and_samples_the_same(fam):
    """A request resumed elsewhere (prompt + the outputs so far, seq_offset) continues its grammar: the
    runner feeds the outputs to a fresh matcher. Greedy, so the resumed tail equals the original's."""
    spec = ("json", json.dumps(SCHEMA))
    p = SamplingParams(max_tokens=200, temperature=0.0, grammar=spec)
    eng = engine(fam)
    eng.add_request("a", prompt(fam), 2, p)
    toks = []
    while eng.has_unfinished():
        for o in eng.step():
            toks += o.new_token_ids
    k = 7
    eng2 = engine(fam)
    eng2.runner.add("b", p.resumed(k), prompt(fam) + toks[:k], num_output=k)
    assert eng2.runner.requests["b"].matcher is not None
    # the rebuilt matcher allows exactly the original's next token among the grammar's options
    allowed = eng2.runner.grammars().allowed([eng2.runner.requests["b"].matcher])[0]
    assert bool(allowed[toks[k]])
    eng2.runner.drop(["b"])
    # through the engine: a fresh request with that prefix as its prompt tail produces the same tail
    eng3 = engine(fam)
    eng3.scheduler.add_request("c", prompt(fam) + toks[:k], 2, p.resumed(k))
    eng3.runner.add("c", p.resumed(k), prompt(fam) + toks[:k], num_output=k)
    tail = []
    while eng3.has_unfinished():
        for o in eng3.step():
            tail += o.new_token_ids
    assert tail == toks[k:]


def test_bad_specs_are_refused():
    for spec in [("json", '{"type": "nope"}'), ("json", "not json"), ("regex", "(ab"),
                 ("json", '{"$ref": "#/defs/x"}')]:
        with pytest.raises(GrammarError):
            grammar_of(spec)
    with pytest.raises(ValueError, match="ignore_eos"):
        SamplingParams(grammar=("regex", "a"), ignore_eos=True).validate()
    with pytest.raises(ValueError, match="kind"):
        SamplingParams(grammar=("lark", "a")).validate()


def test_compiled_grammars_are_cached_by_spec(fam):
    eng = engine(fam)
    spec = ("json", json.dumps(SCHEMA))
    run(eng, fam, [SamplingParams(max_tokens=200, seed=i, temperature=1.0, grammar=spec) for i in range(3)])
    assert list(eng.runner.grammars().compiled) == [spec]


def test_logprobs_under_a_grammar_are_the_raw_models(fam):
    """Log-probabilities stay the raw logits' (as with logit_bias and penalties): the mask shapes the
    sampling, not what the model thought."""
    eng = engine(fam, keep_logits=True)
    eng.add_request("a", prompt(fam), 2, SamplingParams(max_tokens=5, grammar=("regex", "[a-z]{5}"), logprobs=0))
    while eng.has_unfinished():
        for o in eng.step():
            if o.new_token_ids and o.logprobs:
                ref = torch.log_softmax(o.logits.double(), -1)[o.new_token_ids[0]]
                assert abs(o.logprobs[0].logprob - float(ref)) < 1e-6


def spec_engine(fam) -> Engine:
    return engine(fam, spec_min_acceptance=0.0)  # rounds every time: no break-even gate


def test_greedy_speculation_under_a_grammar_commits_exactly_the_plain_tokens(fam):
    """Drafts are checked against the mask: at each verified position the target's logits are masked as
    plain decoding would mask them there (the matcher advanced through the earlier drafts), so greedy
    speculation commits exactly what plain greedy decoding under the grammar does."""
    specs = [("json", json.dumps(SCHEMA)), ("regex", r"[a-f]{3,9}\.[0-9]{2}"), ("choice", json.dumps(["ab", "abc", "x"]))]
    plain = run(engine(fam), fam, [SamplingParams(max_tokens=120, grammar=g) for g in specs])
    eng = spec_engine(fam)
    spec = run(eng, fam, [SamplingParams(max_tokens=120, grammar=g, spec_draft_tier=0, spec_gamma=4) for g in specs])
    assert spec == plain and all(r == "stop" for _, r in spec)
    assert eng.stats.spec_accepted > 0  # drafts the grammar allows are kept


def test_sampled_speculation_under_a_grammar_keeps_every_document_valid(fam):
    spec = ("json", json.dumps(SCHEMA))
    eng = spec_engine(fam)
    out = run(eng, fam, [SamplingParams(max_tokens=200, temperature=1.0, seed=i, grammar=spec, spec_draft_tier=0,
                                        spec_gamma=3) for i in range(30)])
    for text, reason in out:
        assert reason == "stop", text
        jsonschema.validate(json.loads(text), SCHEMA)
    assert eng.stats.spec_proposed > 0
