"""Every declared request parameter (core/params.py) at its boundary values through the HTTP API: a real
gateway over a real Redis, the test playing scheduler + worker (tests.support.gateway.FakeBackend). A
value the declaration refuses is a 400 naming the field where the body carries it (its name, or its path
in the ``mfs`` extension); any other value reaches the scheduler's Submit as it was sent. The parameters a
body spells its own way (max_tokens, logprobs, prompt_logprobs, the draft tier) have their own tests."""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import httpx2 as httpx
import pytest

from core.params import ENDPOINTS, PARAMS, Param, body_params, path_params
from gateway.config import GatewayConfig
from tests.support.gateway import PARIS, ServerThread, backend, rds, register_worker  # noqa: F401
from tests.support.params import coerced, probes
from tests.support.redis_server import redis_url  # noqa: F401 - the session fixture

SMALL, LARGE, FAMILY = "smollm2-135m-small", "smollm2-135m-large", "smollm2-135m"
ROUTE = {"chat": "/v1/chat/completions", "completions": "/v1/completions"}
# Where each path parameter's probes go: the model, and the rest of its mfs object (a draft below the
# large tier; a cascade needs the family id and, with no server default, a threshold)
MFS_CONTEXT = {"speculative": (LARGE, {"draft": "small"}), "cascade": (FAMILY, {"threshold": 0.5})}


@pytest.fixture(scope="module")
def gw(redis_url, frontend, backend):  # noqa: F811
    with ServerThread(GatewayConfig(redis_url=redis_url, gateway_id="gw-params", frontend=frontend)) as s:
        yield s


@pytest.fixture(autouse=True)
def fresh(rds, backend):  # noqa: F811
    register_worker(rds)
    backend.script = backend.reply(PARIS)


def post(gw, endpoint: str, model: str, fields: dict) -> httpx.Response:
    first = {"messages": [{"role": "user", "content": "hi"}]} if endpoint == "chat" else {"prompt": "hi"}
    return httpx.post(gw.url + ROUTE[endpoint], json={"model": model, **first, "max_tokens": 4, **fields},
                      timeout=30)


def sent_together(send, values: list) -> list[httpx.Response]:
    """One request per value, all in flight at once (each waits on the fake backend's answer)."""
    with ThreadPoolExecutor(8) as pool:
        return list(pool.map(send, values))


def answered_as_declared(r: httpx.Response, backend, p: Param, where: str, v) -> bool:  # noqa: F811
    """400 naming ``where`` exactly when the declaration refuses ``v``; else ``v`` reached the Submit.
    Returns whether it was accepted."""
    if p.problem(coerced(p, v)) is not None:
        assert r.status_code == 400, (where, v, r.text)
        err = r.json()["error"]
        assert err["param"] == where and err["message"] == f"'{where}' must be {p.expects()}, got {v!r}.", err
        return False
    assert r.status_code == 200, (where, v, r.text)
    got = getattr(backend.submits[r.json()["id"]].params, p.name)
    assert got == coerced(p, v) and type(got) is p.kind, (where, v, got)
    return True


def alternating(names: list[str]) -> list[tuple[str, str]]:
    """Each parameter on one endpoint, the two in turn (both read a parameter with the same code, which
    tests/test_params.py checks on both)."""
    return [(n, ENDPOINTS[i % len(ENDPOINTS)]) for i, n in enumerate(sorted(names))]


@pytest.mark.parametrize("name,endpoint", alternating([p.name for p in PARAMS.values() if p.endpoints]))
def test_a_body_parameter_at_its_bounds(gw, backend, name, endpoint):  # noqa: F811
    p = PARAMS[name]
    assert p in body_params(endpoint)
    values = probes(p)
    answers = sent_together(lambda v: post(gw, endpoint, SMALL, {name: v}), values)
    seen = {answered_as_declared(r, backend, p, name, v) for r, v in zip(answers, values)}
    assert seen == {True, False}  # both sides of the bounds were sent


@pytest.mark.parametrize("name,endpoint", alternating([p.name for p in path_params()]))
def test_an_mfs_parameter_at_its_bounds(gw, backend, name, endpoint):  # noqa: F811
    p = PARAMS[name]
    _, kind, key = p.path.split(".")
    model, rest = MFS_CONTEXT[kind]
    values = probes(p)
    answers = sent_together(lambda v: post(gw, endpoint, model, {"mfs": {kind: {**rest, key: v}}}), values)
    seen = {answered_as_declared(r, backend, p, p.path, v) for r, v in zip(answers, values)}
    assert seen == {True, False}


def test_every_parameter_a_body_carries_is_probed_here():
    """The parameters no test above reaches are exactly those the body spells its own way."""
    reached = {p.name for p in PARAMS.values() if p.endpoints or p.path}
    assert set(PARAMS) - reached == {"max_tokens", "logprobs", "prompt_logprobs", "spec_draft_tier"}
    assert PARAMS["cascade_threshold"].problem(0.0) is None and PARAMS["cascade_threshold"].problem(1.0) is None
