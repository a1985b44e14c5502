"""Fuzzing the completion endpoints with hypothesis: valid bodies, valid bodies with one field broken,
any JSON value and bytes that are no JSON at all against a real gateway on a real redis-server, a live worker
registered and the test's fake backend answering every Submit. No input may get a 5xx, and every
error must be in OpenAI's shape (also inside a stream).

Then against the gateway's own OpenAPI description (``GET /openapi.json``, ``gateway.openapi``): the
document is checked (OpenAPI-shaped, every ``$ref`` resolves, every schema valid JSON Schema 2020-12),
hypothesis-jsonschema generates request bodies valid by it (every one must be answered as documented:
no 5xx, a 200 validating against its response or stream-chunk schema, a 400 only for the rules JSON
Schema cannot express), and bodies with one documented field made invalid by it must get a 400 naming
that field.

Every simple field is also tried at and past each of its documented bounds (and with other types), and
``mfs`` around its rules for every model, on two gateways with different limits and ``mfs`` defaults.

Bounded: ~150 examples per endpoint for the hand-written strategies, 100 schema-valid and 50 invalid
bodies per endpoint from the description, ~600 edge bodies per endpoint and gateway; no per-example
deadline, about a minute in all on two cores.
"""
from __future__ import annotations

import copy
import json
import time
from types import SimpleNamespace

import httpx2 as httpx
import jsonschema
import hypothesis_jsonschema._canonicalise as _canon
import hypothesis_jsonschema._from_schema as _hjs
import pytest
import redis
from hypothesis import HealthCheck, assume, event, example, given, settings
from hypothesis import strategies as st
from hypothesis.internal.conjecture import utils as _cu
from hypothesis_jsonschema import from_schema
from hypothesis_jsonschema._encode import encode_canonical_json
from jsonschema import Draft202012Validator
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

from gateway.config import GatewayConfig
from gateway.openai_api import Limits
from gateway.structured import STRUCTURED
from tests.support.redis_server import redis_url  # noqa: F401 - the session fixture (this module's own server)
from tests.support.gateway import rds_worker, FakeBackend, ServerThread, register_worker

KEY = "sk-fuzz"
MODELS = ["smollm2-135m-small", "smollm2-135m-medium", "smollm2-135m-large", "smollm2-135m", "auto"]
# Examples per test sized for the suite on 2 cores (each run draws new ones: derandomize is off)
FUZZ = settings(max_examples=75, deadline=None, database=None, derandomize=False,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])

# any JSON value (NaN and infinities included: the gateway's json.loads accepts them); text with lone
# surrogates too (JSON can escape them, tokenizers choke on them)
chars = st.text(st.characters(exclude_categories=()), max_size=40)
scalars = st.none() | st.booleans() | st.integers(-(1 << 70), 1 << 70) | st.floats() | chars
anything = st.recursive(scalars, lambda c: st.lists(c, max_size=4) | st.dictionaries(chars, c, max_size=4),
                        max_leaves=10)
words = st.text(st.characters(exclude_categories=()), max_size=200)

# values a real client could send
VALID = {
    "max_tokens": st.integers(1, 64), "max_completion_tokens": st.integers(1, 64),
    "temperature": st.floats(0, 2), "top_p": st.floats(0, 1), "top_k": st.integers(-1, 50),
    "seed": st.integers(-(1 << 63), (1 << 63) - 1), "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "stop": st.text(min_size=1, max_size=5) | st.lists(st.text(min_size=1, max_size=5), max_size=4),
    "stop_token_ids": st.lists(st.integers(0, 49151), max_size=3), "ignore_eos": st.booleans(),
    "n": st.just(1), "user": st.text(max_size=20), "session_id": st.text(max_size=20),
    "frequency_penalty": st.floats(-2, 2), "logprobs": st.just(False), "echo": st.just(False),
    "presence_penalty": st.floats(-2, 2), "repetition_penalty": st.floats(0.5, 2), "min_p": st.floats(0, 1), "typical_p": st.floats(0, 1),
    "logit_bias": st.dictionaries(st.integers(0, 49151).map(str), st.floats(-100, 100), max_size=3),
}
EXTRA = ["best_of", "suffix", "tools", "functions", "presence_penalty", "response_format", "logit_bias"]
text_part = st.fixed_dictionaries({"type": st.just("text"), "text": words})
message = st.fixed_dictionaries({"role": st.sampled_from(["system", "user", "assistant"]),
                                 "content": words | st.lists(text_part, min_size=1, max_size=3)})
valid_chat = st.fixed_dictionaries({"model": st.sampled_from(MODELS),
                                    "messages": st.lists(message, min_size=1, max_size=4)}, optional=VALID)
prompt = words | st.lists(st.integers(0, 49151), min_size=1, max_size=8)
valid_completion = st.fixed_dictionaries({"model": st.sampled_from(MODELS), "prompt": prompt}, optional=VALID)


def mutated(valid, required: list[str]):
    """A valid body with one field set to any JSON value, or dropped."""
    names = st.sampled_from(required + sorted(VALID) + EXTRA)

    def mutate(args):
        body, name, value, drop = args
        body = dict(body)
        if drop:
            body.pop(name, None)
        else:
            body[name] = value
        return body
    return st.tuples(valid, names, anything, st.booleans()).map(mutate)


def raw(valid, required: list[str]):
    """Valid bodies, bodies with one field broken, any JSON value at all, and bytes."""
    dump = lambda b: json.dumps(b).encode()  # noqa: E731
    return st.one_of(valid.map(dump), mutated(valid, required).map(dump), anything.map(dump),
                     st.binary(max_size=64))


@pytest.fixture(scope="module")
def gw(redis_url, rds, frontend):  # noqa: F811
    fb = FakeBackend(redis_url, frontend.tokenizer)
    fb.start()
    cfg = GatewayConfig(redis_url=redis_url, gateway_id="gw-fuzz", frontend=frontend, api_keys=[KEY],
                        rpm=1_000_000, tpm=1 << 40, request_timeout_s=20)
    try:
        with ServerThread(cfg) as s, httpx.Client(base_url=s.url, timeout=20,
                                                  headers={"Authorization": f"Bearer {KEY}"}) as http:
            yield http
    finally:
        fb.halt.set()
        fb.join(5)
        fb.r.close()


@pytest.fixture(scope="module")
def rds(rds_worker):
    return rds_worker


def check_error(err) -> None:
    assert isinstance(err, dict) and set(err) == {"message", "type", "param", "code"}, err
    assert isinstance(err["message"], str) and err["message"] and isinstance(err["type"], str)
    assert err["param"] is None or isinstance(err["param"], str)
    assert err["code"] is None or isinstance(err["code"], str)


def check(r: httpx.Response, obj: str) -> None:
    event(f"status {r.status_code}")  # pytest --hypothesis-show-statistics shows the mix
    assert r.status_code < 500, r.text
    if r.status_code >= 400:
        check_error(r.json()["error"])
        return
    assert r.status_code == 200, r.text
    if not r.headers["Content-Type"].startswith("text/event-stream"):
        assert r.json()["object"] == obj
        return
    events = [e[6:] for e in r.text.split("\n\n") if e.startswith("data: ")]
    assert events and events[-1] == "[DONE]", r.text
    for e in map(json.loads, events[:-1]):
        if "error" in e:
            check_error(e["error"])
        else:
            assert e["object"] == obj + (".chunk" if obj == "chat.completion" else "")


@FUZZ
@given(body=raw(valid_chat, ["model", "messages"]))
@example(body=b'{"model": "auto", "messages": [{"role": "user", "content": "a\\ud800"}]}')
@example(body=b'{"model": "auto", "messages": [{"role": "user", "content": "hi"}], "user": "\\udfff"}')
# ^ a lone surrogate in `user` was a 500 (msgpack cannot encode it)
def test_fuzz_chat_completions(gw, body):
    check(gw.post("/v1/chat/completions", content=body, headers={"Content-Type": "application/json"}),
          "chat.completion")


@FUZZ
@given(body=raw(valid_completion, ["model", "prompt"]))
@example(body=b'{"model": "smollm2-135m-small", "prompt": "a\\ud800b"}')  # was a 500 (the tokenizer)
def test_fuzz_completions(gw, body):
    check(gw.post("/v1/completions", content=body, headers={"Content-Type": "application/json"}),
          "text_completion")


# ---- against the OpenAPI description ----------------------------------------------------------
if not hasattr(_cu.many, "more"):
    class _Many(_cu.many):
        """hypothesis-jsonschema 0.23.1 (its latest release) drives Hypothesis' private ``many`` with the
        old protocol (``while elements.more(): ... elements.reject()``); this Hypothesis only has
        ``with many(...) as elements: for _ in elements:``. The old protocol on the new class."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.__enter__()

        def more(self) -> bool:
            self._finish_element()
            if not self._decide():
                self._closed = True
                return False
            self.count += 1
            self._in_element, self._rejected = True, False
            return True

    _hjs.cu = SimpleNamespace(many=_Many)  # its only use of the module

if hasattr(_hjs, "__from_schema"):
    _uncached = getattr(_hjs, "__from_schema")
    _STRATEGIES: dict = {}

    def _cached_from_schema(schema, *, alphabet, custom_formats):
        """hypothesis-jsonschema builds the strategy of each object field anew on every draw (canonicalising
        and merging its schema each time): a memo, by the schema's canonical JSON, makes drawing a chat
        body about three times faster. A schema's strategy depends on nothing else."""
        key = (encode_canonical_json(schema), id(alphabet), id(custom_formats))
        if key not in _STRATEGIES:  # (alphabet, custom_formats) kept: their ids stay theirs
            _STRATEGIES[key] = (_uncached(schema, alphabet=alphabet, custom_formats=custom_formats),
                                alphabet, custom_formats)
        return _STRATEGIES[key][0]

    setattr(_hjs, "__from_schema", _cached_from_schema)  # its recursive calls go through the module global

if hasattr(_canon, "_get_validator_class"):
    _canonical = _canon.canonicalish
    _CANONICAL: dict = {}

    def _validator_class(schema):
        """hypothesis-jsonschema checks each schema it canonicalises or merges against the metaschema,
        behind a memo of 128 entries that these bodies overflow: ~250 checks of whole merged body schemas
        at ~75 ms each. The description's schemas are checked against the metaschema once
        (test_openapi_document) and every body drawn is validated against the description itself, so
        the draws stay checked; here the validator class alone."""
        return jsonschema.validators.validator_for(schema, default=Draft202012Validator)

    def _canonicalish(schema):
        """canonicalish, a pure function of the schema's JSON, memoised by it (a copy out, as callers
        edit what it returns): merging a body's per-model alternatives canonicalised the same ~30 field
        schemas ~150,000 times. With the validator above, a body's strategy builds ~10 times faster."""
        key = encode_canonical_json(schema)
        if key not in _CANONICAL:
            _CANONICAL[key] = _canonical(schema)
        return copy.deepcopy(_CANONICAL[key])

    _canon._get_validator_class = _validator_class   # the module's only entry to its checks
    _canon.canonicalish = _hjs.canonicalish = _canonicalish  # its recursive calls and from_schema's

DOC: dict = {}   # the gateway's /openapi.json, fetched by the `doc` fixture (the strategies read it lazily)
DOC_URI = "urn:mfs:gateway:openapi"
POSTS = {"/v1/chat/completions": "chat.completion", "/v1/completions": "text_completion"}
SCHEMA_FUZZ = settings(FUZZ, max_examples=50,
                       suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                              HealthCheck.filter_too_much, HealthCheck.large_base_example])
# Fields the validator reads leniently, so that some values invalid by the (stricter) description are
# still accepted: `stop_token_ids` is read with `or []` (any falsy value is "none"), and `user` /
# `session_id` are ignored unless a string (only one of the two is read). Not mutated below.
LENIENT = {"stop_token_ids", "user", "session_id"}
# the `param` the gateway names for a bad field, where it is not the field's own name
PARAM_ALIASES = {"functions": ("tools",), "stream_options": ("include_usage",),
                 # cross-field rules: the error names the field that needs the other one
                 "logprobs": ("top_logprobs",),                          # top_logprobs needs logprobs true
                 "echo": ("max_tokens", "max_completion_tokens")}       # max_tokens 0 needs echo
json_values = st.recursive(st.none() | st.booleans() | st.integers(-(1 << 70), 1 << 70)
                           | st.floats(allow_nan=False, allow_infinity=False) | chars,
                           lambda c: st.lists(c, max_size=4) | st.dictionaries(chars, c, max_size=4),
                           max_leaves=10)


_WORKER: dict = {}


@pytest.fixture(scope="module", autouse=True)
def _worker(rds):
    _WORKER.update(r=rds, t=time.monotonic())


def keep_worker() -> None:
    """Re-registers the live worker (its key has a 120 s TTL) when a run is long: shrinking can be."""
    if time.monotonic() - _WORKER["t"] > 30:
        register_worker(_WORKER["r"])
        _WORKER["t"] = time.monotonic()


def fetch_doc(client: httpx.Client) -> dict:
    r = httpx.get(str(client.base_url.join("/openapi.json")), timeout=20)  # no key: the description is open
    assert r.status_code == 200 and r.headers["Content-Type"].startswith("application/json"), r.text
    return r.json()


@pytest.fixture(scope="module")
def doc(gw):
    DOC.clear()
    DOC.update(fetch_doc(gw))
    return DOC


@pytest.fixture(scope="module")
def gw_open(gw, redis_url, frontend):  # noqa: F811 - gw: its fake backend answers this one too
    """A second gateway with no keys, other limits, and server defaults for both kinds of `mfs`."""
    cfg = GatewayConfig(redis_url=redis_url, gateway_id="gw-fuzz-open", frontend=frontend,
                        limits=Limits(max_prompt_chars=1000, max_messages=3, max_stop=4, max_stop_chars=8,
                                      max_stop_token_ids=5, max_tokens_cap=64, max_session_chars=10),
                        max_prompt_tokens=100, spec_draft_tier="small", cascade_threshold=0.5,
                        request_timeout_s=20)
    with ServerThread(cfg) as s, httpx.Client(base_url=s.url, timeout=20) as http:
        yield http


def gateway(request, which: str) -> tuple[httpx.Client, dict]:
    """("keys": the module's gateway, "open": gw_open) and its description."""
    if which == "keys":
        return request.getfixturevalue("gw"), request.getfixturevalue("doc")
    client = request.getfixturevalue("gw_open")
    return client, fetch_doc(client)


def pointer(path: str, *parts: str) -> str:
    """A JSON pointer into the document: ``path`` is one, ``parts`` are escaped and appended."""
    return path + "".join("/" + p.replace("~", "~0").replace("/", "~1") for p in parts)


def at(doc: dict, ref: str):
    """What a local ``$ref`` ('#/a/b') points at; KeyError if nothing."""
    node = doc
    for part in ref.removeprefix("#").split("/")[1:]:
        part = part.replace("~1", "/").replace("~0", "~")
        node = node[int(part)] if isinstance(node, list) else node[part]
    return node


def inlined(doc: dict, node):
    """``node`` with every ``$ref`` replaced by its target (the description has no recursive schema)."""
    if isinstance(node, dict):
        if "$ref" in node:
            return inlined(doc, at(doc, node["$ref"]))
        return {k: inlined(doc, v) for k, v in node.items()}
    if isinstance(node, list):
        return [inlined(doc, v) for v in node]
    return node


def validator(doc: dict, ref: str) -> Draft202012Validator:
    """A validator for the schema at ``ref`` ('#/...'), its own ``$ref``s resolved in the document."""
    registry = Registry().with_resource(DOC_URI, Resource(contents=doc, specification=DRAFT202012))
    return Draft202012Validator({"$ref": DOC_URI + ref}, registry=registry)


def response(doc: dict, path: str, method: str, status: int | str) -> dict:
    r = doc["paths"][path][method]["responses"][str(status)]
    return at(doc, r["$ref"]) if "$ref" in r else r


def body_ref(path: str, doc: dict = DOC) -> str:
    return doc["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]


_VALIDATORS: dict = {}


def valid_body(doc: dict, path: str, body) -> bool:
    """Whether ``body`` is valid by the description of ``path``'s request body."""
    key = (id(doc), path)
    if key not in _VALIDATORS:
        _VALIDATORS[key] = (validator(doc, body_ref(path, doc)), doc)
    return _VALIDATORS[key][0].is_valid(body)


_BODIES: dict[str, st.SearchStrategy] = {}
# fields that take only the values meaning "off": drawn often enough by the plain and dense strategies
UNSUPPORTED = {"best_of", "suffix", "tools", "functions"}


def non_null(schema: dict) -> dict:
    alts = schema.get("anyOf")
    if alts and {"type": "null"} in alts:
        rest = [a for a in alts if a != {"type": "null"}]
        others = {k: v for k, v in schema.items() if k != "anyOf"}
        return others | (rest[0] if len(rest) == 1 else {"anyOf": rest})
    return schema


def _paired(body: dict) -> dict:
    """The cross-field rules fields drawn alone can break: chat's top_logprobs needs logprobs true,
    completions' max_tokens 0 needs echo."""
    if "messages" in body and body.get("top_logprobs") is not None:
        body["logprobs"] = True
    read = body.get("max_completion_tokens")
    if "prompt" in body and (read if read is not None else body.get("max_tokens")) == 0:
        body["echo"] = True  # max_tokens 0 needs echo
    return body


def one_constraint(body: dict) -> dict:
    """``body`` held to the cross-field rule on structured output the description cannot express (see
    gateway.structured): at most one of its fields (the first kept), and not with ignore_eos."""
    present = [f for f in STRUCTURED if body.get(f) is not None
               and not (f == "response_format" and isinstance(body[f], dict) and body[f].get("type") == "text")]
    body = {k: v for k, v in body.items() if k not in present[1:]}
    if present and body.get("ignore_eos") is True:
        body["ignore_eos"] = False
    return body


def bodies(path: str) -> st.SearchStrategy:
    """Request bodies valid by the description (built lazily: the document comes from the gateway).

    hypothesis-jsonschema draws only a few of the ~25 optional fields of a body (and some unknown ones),
    and often repeats a value: besides bodies as the schema has them, a quarter has every documented
    field present (the schema with all of them required), and half has up to 8 fields drawn from their
    own schemas, not null (``mfs`` from the alternative for the body's model); and about half of all
    streams (few would, else), so that each field's range, each ``mfs`` rule and streams are exercised
    within 100 examples. (``test_schema_edges`` below tries every bound.)"""
    def build():
        if path not in _BODIES:
            schema = inlined(DOC, at(DOC, body_ref(path)))
            plain = from_schema(schema)
            dense = from_schema({**schema, "required": sorted(schema["properties"])})
            names = sorted(set(schema["properties"]) - UNSUPPORTED - {"model"})
            fields = {n: from_schema(non_null(schema["properties"][n])) for n in names if n != "mfs"}
            mfs = [(Draft202012Validator(alt["properties"]["model"]),
                    from_schema(non_null(alt["properties"]["mfs"]))) for alt in schema["anyOf"]]

            def with_fields(args):
                body, chosen = args
                strategies = {n: fields[n] if n != "mfs" else next(s for v, s in mfs if v.is_valid(body["model"]))
                              for n in chosen}
                return st.fixed_dictionaries(strategies).map(lambda values: _paired({**body, **values}))
            focused = st.tuples(plain, st.lists(st.sampled_from(names), min_size=1, max_size=8,
                                                unique=True)).flatmap(with_fields)
            _BODIES[path] = st.tuples(st.one_of(plain, dense, focused, focused), st.booleans()).map(
                lambda body_stream: {**body_stream[0], "stream": True} if body_stream[1] else body_stream[0])
        return _BODIES[path]
    return st.deferred(build)


def check_error_doc(doc: dict, r: httpx.Response) -> dict:
    validator(doc, "#/components/schemas/ErrorResponse").validate(r.json())
    return r.json()["error"]


def allowed_400(doc: dict, body: dict, err: dict) -> bool:
    """The rules the description cannot express (see gateway.openapi): the context and the prompt
    bounds counted in tokens or across messages, a draft checked against the scored tier, whether a
    structured-output schema or regex compiles, and two structured-output fields at once (or one with
    ignore_eos)."""
    family = [m for m in at(doc, "#/components/schemas/ModelId")["enum"]
              if m not in at(doc, "#/components/schemas/TierModelId")["enum"]]
    return (err["code"] in ("context_length_exceeded", "prompt_too_long")
            or (err["param"] == "mfs.speculative.draft" and body["model"] in family)
            or err["code"] in ("invalid_grammar", "conflicting_parameters"))


def conforms(doc: dict, path: str, body: dict, r: httpx.Response) -> None:
    """``r`` is what the description says ``path`` answers ``body`` (valid by it) with."""
    event(f"status {r.status_code}")
    assert r.status_code < 500, r.text
    if r.status_code >= 400:
        err = check_error_doc(doc, r)
        event(f"status {r.status_code}: {err['code'] or err['param']}")
        assert r.status_code == 400 and allowed_400(doc, body, err), (body, r.text)
        return
    assert r.status_code == 200, r.text
    ok = pointer("#/paths", path, "post", "responses", "200", "content")
    event("stream" if body.get("stream") else "json")
    if r.headers["Content-Type"].startswith("application/json"):
        assert not body.get("stream")
        validator(doc, pointer(ok, "application/json", "schema")).validate(r.json())
        return
    assert r.headers["Content-Type"].startswith("text/event-stream") and body.get("stream") is True
    events = [e[6:] for e in r.text.split("\n\n") if e.startswith("data: ")]
    assert events and events[-1] == "[DONE]", r.text
    chunk = validator(doc, pointer(ok, "text/event-stream", "x-event-data"))
    for e in events[:-1]:
        chunk.validate(json.loads(e))


def names_field(param: str | None, field: str) -> bool:
    """Whether an error's ``param`` is ``field`` or inside it ('mfs.cascade', 'messages[0].role')."""
    return param is not None and any(param == n or param.startswith((n + ".", n + "["))
                                     for n in (field, *PARAM_ALIASES.get(field, ())))


def post(gw, path: str, body) -> httpx.Response:
    keep_worker()
    return gw.post(path, content=json.dumps(body).encode(), headers={"Content-Type": "application/json"})


@pytest.mark.parametrize("which", ["keys", "open"])
def test_openapi_document(request, which):
    """OpenAPI 3.1-shaped, every $ref resolves, every schema is valid JSON Schema 2020-12, and it
    describes this gateway: its models, its routes, its security."""
    gw, doc = gateway(request, which)
    assert doc["openapi"].startswith("3.1.")
    assert doc["jsonSchemaDialect"] == "https://json-schema.org/draft/2020-12/schema"
    assert doc["info"]["title"] and doc["info"]["version"]
    refs = []

    def walk(node):
        if isinstance(node, dict):
            if isinstance(node.get("$ref"), str):
                refs.append(node["$ref"])
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)
    walk(doc)
    assert refs
    for ref in refs:
        assert ref.startswith("#/"), ref
        at(doc, ref)  # resolves

    schemas = dict(doc["components"]["schemas"])
    for name, h in doc["components"]["headers"].items():
        schemas[f"header {name}"] = h["schema"]
    op_ids, schemes = set(), set(doc["components"]["securitySchemes"])
    bearer = doc["components"]["securitySchemes"]["bearerAuth"]
    assert (bearer["type"], bearer["scheme"]) == ("http", "bearer")
    assert doc["security"] == ([{"bearerAuth": []}] if which == "keys" else [{}])  # [{}]: none needed
    for path, item in doc["paths"].items():
        assert path.startswith("/")
        for method, op in item.items():
            assert method in ("get", "post", "put", "delete", "patch"), method
            assert op["operationId"] not in op_ids
            op_ids.add(op["operationId"])
            for req in op.get("security", []):
                assert set(req) <= schemes
            names = {p["name"] for p in op.get("parameters", []) if p["in"] == "path"}
            assert names == {seg[1:-1] for seg in path.split("/") if seg.startswith("{")}, path
            for p in op.get("parameters", []):
                schemas[f"{method} {path} {p['name']}"] = p["schema"]
            for ctype, media in op.get("requestBody", {}).get("content", {}).items():
                schemas[f"{method} {path} body {ctype}"] = media["schema"]
            assert op["responses"]
            for status in op["responses"]:
                assert status == "default" or (len(status) == 3 and status.isdigit()), status
                for ctype, media in response(doc, path, method, status).get("content", {}).items():
                    schemas[f"{method} {path} {status} {ctype}"] = media["schema"]
                    if "x-event-data" in media:
                        schemas[f"{method} {path} {status} {ctype} events"] = media["x-event-data"]
    for name, schema in schemas.items():
        try:
            Draft202012Validator.check_schema(schema)
        except Exception as e:  # noqa: BLE001 - say which
            raise AssertionError(f"{name}: {e}") from e
    # the routes: the POSTs answer every documented error in OpenAI's shape, and two paths are open
    for path in POSTS:
        for status in ("400", "401", "404", "413", "429", "503", "504"):
            content = response(doc, path, "post", status)["content"]
            assert content["application/json"]["schema"] == {"$ref": "#/components/schemas/ErrorResponse"}
    assert {p for p, item in doc["paths"].items() if item["get" if "get" in item else "post"].get("security")
            == []} == {"/health", "/openapi.json"}
    assert set(doc["paths"]) == {"/v1/models", "/v1/models/{model}", "/v1/chat/completions",
                                 "/v1/completions", "/health", "/metrics", "/openapi.json"}
    # the models: what /v1/models lists, plus "auto"
    ids = [m["id"] for m in gw.get("/v1/models").json()["data"]]
    assert doc["components"]["schemas"]["ModelId"]["enum"] == ids + ["auto"]
    assert doc["components"]["schemas"]["TierModelId"]["enum"] == ids[:-1]


def test_openapi_gets(gw, doc):
    """The GET endpoints answer as documented, and the guarded ones want the key."""
    v = lambda name: validator(doc, f"#/components/schemas/{name}")  # noqa: E731
    models = gw.get("/v1/models")
    v("ModelList").validate(models.json())
    for m in models.json()["data"]:
        v("Model").validate(gw.get(f"/v1/models/{m['id']}").json())
    r = gw.get("/v1/models/no-such-model")
    assert r.status_code == 404 and check_error_doc(doc, r)["code"] == "model_not_found"
    r = gw.get("/health")
    assert r.status_code in (200, 503)
    v("Health").validate(r.json())
    r = gw.get("/metrics")
    assert r.status_code == 200 and r.headers["Content-Type"].startswith("text/plain")
    with httpx.Client(base_url=gw.base_url, timeout=20) as anonymous:  # no key
        for path in ("/v1/models", "/metrics"):
            r = anonymous.get(path)
            assert r.status_code == 401 and check_error_doc(doc, r)["code"] == "invalid_api_key"
        assert anonymous.get("/health").status_code in (200, 503)
        assert anonymous.get("/openapi.json").json() == doc
    r = gw.get("/v1/nowhere")
    assert r.status_code == 404
    check_error_doc(doc, r)


@pytest.mark.usefixtures("doc")  # DOC: not an argument, or a failure would print all of it
@SCHEMA_FUZZ
@given(body=bodies("/v1/chat/completions"))
def test_schema_valid_chat_bodies(gw, body):
    assert valid_body(DOC, "/v1/chat/completions", body)
    conforms(DOC, "/v1/chat/completions", body, post(gw, "/v1/chat/completions", body))


@pytest.mark.usefixtures("doc")
@SCHEMA_FUZZ
@given(body=bodies("/v1/completions"))
def test_schema_valid_completion_bodies(gw, body):
    assert valid_body(DOC, "/v1/completions", body)
    conforms(DOC, "/v1/completions", body, post(gw, "/v1/completions", body))


@pytest.mark.usefixtures("doc")
@pytest.mark.parametrize("path", list(POSTS))
@settings(SCHEMA_FUZZ, max_examples=25)
@given(data=st.data())
def test_schema_invalid_bodies_get_400(gw, path, data):
    """A valid body with one documented field set to a value the description rejects: a 400 that names
    the field (a 404 for a model that is a string but not one of the enum)."""
    doc = DOC
    body = one_constraint(data.draw(bodies(path), "body"))  # else the conflict may be the error named
    schema = at(doc, body_ref(path))
    field = data.draw(st.sampled_from(sorted(set(schema["properties"]) - LENIENT)), "field")
    value = data.draw(json_values, "value")
    body = {**body, field: value}
    if field == "max_tokens":
        body.pop("max_completion_tokens", None)  # it wins over max_tokens, which is then not read
    if field == "stream_options":
        body["stream"] = True                    # stream_options is read only when streaming
    assume(not valid_body(doc, path, body))
    r = post(gw, path, body)
    event(f"status {r.status_code}")
    err = check_error_doc(doc, r)
    if field == "model" and isinstance(value, str) and value:
        assert r.status_code == 404 and err["code"] == "model_not_found", r.text
        return
    assert r.status_code == 400, (body, r.text)
    assert names_field(err["param"], field), (field, value, r.text)


def sample(schema: dict):
    """Some value valid by a (simple) schema."""
    if "anyOf" in schema:
        return sample(next(a for a in schema["anyOf"] if a != {"type": "null"}))
    if "enum" in schema:
        return schema["enum"][0]
    return {"integer": schema.get("minimum", 0), "number": schema.get("minimum", 0),
            "string": "a" * max(1, schema.get("minLength", 0)), "boolean": True}.get(schema.get("type"), [])


def edges(schema: dict) -> list:
    """Values at and just past every bound a schema states, its enum values, and values of other types:
    where the description's verdict on a field and the gateway's must agree."""
    out: list = [None, True, 0, -1, 1.5, "x", "", [], {}, [1], ["x"]]

    def walk(s: dict) -> None:
        for alt in s.get("anyOf", []):
            walk(alt)
        out.extend(s.get("enum", []))
        t, step = s.get("type"), (1 if s.get("type") == "integer" else 0.5)
        for k in ("minimum", "maximum"):
            if k in s and t in ("integer", "number"):
                out.extend([s[k] - step, s[k], s[k] + step])
        for k in ("minLength", "maxLength"):
            if k in s:
                out.extend("a" * n for n in (s[k] - 1, s[k], s[k] + 1) if n >= 0)
        if t == "array" and "items" in s:
            item = sample(s["items"])
            for k in ("minItems", "maxItems"):
                if k in s:
                    out.extend([item] * n for n in (s[k] - 1, s[k], s[k] + 1) if n >= 0)
            out.extend([v] for v in edges(s["items"]))
    walk(schema)
    return list({json.dumps(v): v for v in out}.values())


def mfs_edges(doc: dict) -> list:
    """``mfs`` values around what the description allows: every way to name a tier and a few that name
    none, gamma / stop_confidence / threshold / window at and past their bounds, both at once, unknown
    fields."""
    names = at(doc, "#/components/schemas/TierModelId")["enum"]
    family = [m for m in at(doc, "#/components/schemas/ModelId")["enum"] if m not in names and m != "auto"]
    tiers = [n.removeprefix(family[0] + "-") for n in names]  # family/manifest.py: "<family>-<tier name>"
    refs = [*tiers, *names, *range(-1, len(names) + 1), *(str(i) for i in range(len(names) + 1)), "00", "01",
            "000001", "0x1", "", None, 1.0, True, [0]]
    spec = [None, True, False, 1, "x", {}, {"x": 1}, *({"draft": r} for r in refs),
            *({"draft": 0, "gamma": g} for g in (0, 1, 16, 17, 1.5, 2.0, "4", None)),
            *({"draft": 0, "stop_confidence": c} for c in (0, 0.5, 1, -0.1, 1.1, "0.5", True, None))]
    casc = [None, True, False, 1, {}, {"x": 1},
            *({"threshold": t} for t in (0, 1e-9, 0.5, 1 - 1e-9, 1, -0.1, "0.5", None)),
            *({"threshold": 0.5, "window": w} for w in (0, 1, 64, 65, 2.0, None))]
    return [None, {}, "x", [], {"x": 1}, *({"speculative": v} for v in spec), *({"cascade": v} for v in casc),
            {"speculative": True, "cascade": True}, {"speculative": {"draft": 0}, "cascade": {"threshold": 0.5}},
            {"speculative": False, "cascade": {"threshold": 0.5}}, {"speculative": {"draft": 0}, "cascade": False}]


@pytest.mark.parametrize("which", ["keys", "open"])
@pytest.mark.parametrize("path", list(POSTS))
def test_schema_edges(request, path, which):
    """Every simple field of a request body at and past its documented bounds (and of other types), and
    `mfs` around its rules for every model: what the description accepts the gateway accepts, what it
    rejects gets a 400 naming the field. On both gateways (their limits and `mfs` defaults differ).
    (The structured fields model, messages and prompt are left to the fuzz tests above.)"""
    gw, doc = gateway(request, which)
    ref = body_ref(path, doc)
    schema, valid = at(doc, ref), validator(doc, ref).is_valid
    base = {"model": at(doc, "#/components/schemas/TierModelId")["enum"][0], "max_tokens": 1,
            **({"messages": [{"role": "user", "content": "Hi"}]} if path.endswith("chat/completions")
               else {"prompt": "Hi"})}
    wrong, n = [], 0
    cases = [(field, value, {**base, field: value})
             for field in sorted(set(schema["properties"]) - {"model", "messages", "prompt", "mfs"})
             for value in edges(non_null(schema["properties"][field]))]
    cases += [("mfs", value, {**base, "model": model, "mfs": value})
              for model in at(doc, "#/components/schemas/ModelId")["enum"] for value in mfs_edges(doc)]
    for field, value, body in cases:
        if field == "stream_options":
            body["stream"] = True  # read only when streaming
        ok = valid(body)
        if not ok and field in LENIENT:
            continue  # the gateway may accept it (see LENIENT)
        r, n = post(gw, path, body), n + 1
        err = check_error_doc(doc, r) if r.status_code >= 400 else None
        if ok and not (r.status_code == 200 or (r.status_code == 400 and allowed_400(doc, body, err))):
            wrong.append(f"{field}={value!r:.60}: valid by the description, got {r.status_code} "
                         f"{r.text:.200}")
        if not ok and not (r.status_code == 400 and names_field(err["param"], field)):
            wrong.append(f"{field}={value!r:.60}: invalid by the description, got {r.status_code} "
                         f"{r.text:.200}")
    assert n > 500 and not wrong, "\n".join(wrong)
