"""Request parameters are declared once (core/params.py): the gateway's parser, its OpenAPI request
schemas and ``SamplingParams.validate`` are derived from the declaration, so they agree on every bound
of every parameter (below, at and above each end, the wrong type), and a new parameter is one
declaration: it shows up in all three."""
from __future__ import annotations

import dataclasses
import re
from types import SimpleNamespace

import jsonschema
import pytest

from core.params import ENDPOINTS, PARAMS, Param, body_params, default, register
from core.sampling import SamplingParams
from gateway.errors import APIError
from gateway.openai_api import DEFAULT_LIMITS, parse_chat, parse_completion
from gateway.openapi.facts import Facts
from gateway.openapi.requests import request_schemas
from gateway.openapi.schema import param_schema
from tests.support.params import probes

NOT_DECLARED = {"stop_token_ids", "logit_bias", "grammar"}  # not scalars: checked on their own


def facts() -> Facts:
    svc = SimpleNamespace(tier_ids=["fam-s", "fam-l"], tier_names=["small", "large"],
                          frontend=SimpleNamespace(family_id="fam"), vocab_size=100, spec_draft_tier=None,
                          spec_gamma=4, cascade_threshold=None, cascade_window=4, max_prompt_tokens=0,
                          default_max_tokens=None)
    cfg = SimpleNamespace(limits=DEFAULT_LIMITS, max_body_bytes=1 << 20, request_timeout_s=60.0, max_inflight=8)
    return Facts(svc, cfg)


def body(endpoint: str, **fields) -> dict:
    first = {"messages": [{"role": "user", "content": "hi"}]} if endpoint == "chat" else {"prompt": "hi"}
    return {"model": "fam", **first, **fields}


def parse(endpoint: str, b: dict):
    return (parse_chat if endpoint == "chat" else parse_completion)(b)


def accepted_by_schema(p: Param, v) -> bool:
    try:
        jsonschema.Draft202012Validator(param_schema(p)).validate(v)
        return True
    except jsonschema.ValidationError:
        return False


def accepted_by_validate(p: Param, v) -> bool:
    try:
        SamplingParams(**{p.name: v}).validate()
        return True
    except ValueError:
        return False


def test_an_mfs_parameter_is_read_at_its_path_against_its_declaration():
    """spec_* and cascade_* come in the ``mfs`` extension; their bounds are their declarations' (the
    cascade threshold's [0, 1] included: 1 escalates at every window's end, 0 never)."""
    from gateway.multilevel import parse_multilevel
    paths = {p.name: p.path for p in PARAMS.values() if p.path}
    assert paths == {"spec_gamma": "mfs.speculative.gamma", "spec_stop_confidence": "mfs.speculative.stop_confidence",
                     "cascade_threshold": "mfs.cascade.threshold", "cascade_window": "mfs.cascade.window"}
    for t in (0, 0.0, 1, 1.0, 0.5):
        assert parse_multilevel({"mfs": {"cascade": {"threshold": t}}}).cascade.threshold == float(t)
    for t in (-1e-9, 1.000001, True, "0.5"):
        with pytest.raises(APIError) as e:
            parse_multilevel({"mfs": {"cascade": {"threshold": t}}})
        assert e.value.param == "mfs.cascade.threshold"
        assert e.value.message == f"'mfs.cascade.threshold' must be {PARAMS['cascade_threshold'].expects()}, got {t!r}."


def test_every_scalar_sampling_field_is_declared_with_its_default():
    by_name = {f.name: f for f in dataclasses.fields(SamplingParams)}
    assert set(by_name) - NOT_DECLARED == set(PARAMS)
    for p in PARAMS.values():
        assert SamplingParams().__getattribute__(p.name) == p.default, p.name
    SamplingParams().validate()


@pytest.mark.parametrize("name", sorted(PARAMS))
def test_validate_and_the_schema_agree_on_every_bound(name):
    p = PARAMS[name]
    for v in probes(p):
        assert accepted_by_validate(p, v) == accepted_by_schema(p, v), (name, v)
    for v in probes(p):
        if p.problem(v) is not None:
            with pytest.raises(ValueError, match="^" + re.escape(f"{name} must be {p.expects()}, got ")):
                SamplingParams(**{name: v}).validate()


@pytest.mark.parametrize("endpoint", ENDPOINTS)
@pytest.mark.parametrize("name", sorted(PARAMS))
def test_the_parser_the_schema_and_validate_agree_on_every_bound(endpoint, name):
    p = PARAMS[name]
    if p not in body_params(endpoint):
        assert name not in parse(endpoint, body(endpoint)).params.sampling
        return
    seen = {True: 0, False: 0}
    for v in probes(p):
        try:
            got = parse(endpoint, body(endpoint, **{name: v})).params.sampling[name]
            ok = True
        except APIError as e:
            assert (e.status, e.param) == (400, name)
            assert e.message == f"'{name}' must be {p.expects()}, got {v!r}."
            ok = False
        assert ok == accepted_by_schema(p, v) == accepted_by_validate(p, v), (endpoint, name, v)
        if ok:
            assert got == v and type(got) is p.kind, (name, v, got)
        seen[ok] += 1
    assert seen[True] and seen[False]  # both sides of the bounds were probed
    assert parse(endpoint, body(endpoint)).params.sampling[name] == p.wire_default
    assert parse(endpoint, body(endpoint, **{name: None})).params.sampling[name] == p.wire_default


@pytest.mark.parametrize("endpoint,schema", [("chat", "ChatCompletionRequest"), ("completions", "CompletionRequest")])
def test_the_request_schemas_carry_each_declared_body_parameter_as_declared(endpoint, schema):
    props = request_schemas(facts())[schema]["properties"]
    for p in PARAMS.values():
        if endpoint in p.endpoints:
            assert props[p.name] == param_schema(p)
            assert props[p.name]["anyOf"][0]["description"] == p.doc


def test_the_declared_body_reaches_the_submitted_sampling_params():
    req = parse_chat(body("chat", temperature=0.3, min_p=0.2, top_k=-1, seed=9.0, ignore_eos=True))
    sp = SamplingParams(**req.params.sampling)
    sp.validate()
    assert (sp.temperature, sp.min_p, sp.top_k, sp.seed, sp.ignore_eos) == (0.3, 0.2, -1, 9, True)
    assert req.params.seed == 9 and req.params.ignore_eos is True


@pytest.fixture
def toy():
    """A parameter added for one test: a declaration, its SamplingParams field (a subclass here)."""
    p = register(Param("toy_p", float, 0.5, "A toy: completions only.", lo=0.0, hi=1.0, hi_open=True,
                       endpoints=("completions",)))

    @dataclasses.dataclass(slots=True)
    class ToyParams(SamplingParams):
        toy_p: float = default("toy_p")  # as SamplingParams' own fields read theirs
    try:
        yield p, ToyParams
    finally:
        del PARAMS["toy_p"]


def test_a_new_parameter_is_one_declaration_seen_by_the_parser_the_schema_and_validate(toy):
    p, ToyParams = toy
    assert parse_completion(body("completions", toy_p=0.25)).params.sampling["toy_p"] == 0.25
    assert parse_completion(body("completions")).params.sampling["toy_p"] == 0.5
    with pytest.raises(APIError, match=r"^'toy_p' must be a number >= 0 and < 1, got 1\.$"):
        parse_completion(body("completions", toy_p=1))
    assert "toy_p" not in parse_chat(body("chat", toy_p=1)).params.sampling  # chat does not read it
    schemas = request_schemas(facts())
    assert schemas["CompletionRequest"]["properties"]["toy_p"] == {
        "anyOf": [{"type": "number", "minimum": 0, "exclusiveMaximum": 1, "description": "A toy: completions only."},
                  {"type": "null"}]}
    assert "toy_p" not in schemas["ChatCompletionRequest"]["properties"]
    ToyParams(toy_p=0.0).validate()
    with pytest.raises(ValueError, match=r"^toy_p must be a number >= 0 and < 1, got 1\.0$"):
        ToyParams(toy_p=1.0).validate()


def test_a_declaration_is_checked_when_made():
    with pytest.raises(ValueError, match="declared twice"):
        register(Param("min_p", float, 0.0, "again", lo=0.0, hi=1.0))
    with pytest.raises(ValueError, match="out of its own bounds"):
        Param("bad", float, 2.0, "default above hi", lo=0.0, hi=1.0)
    with pytest.raises(TypeError, match="kind"):
        Param("bad", str, "x", "not a scalar kind")
