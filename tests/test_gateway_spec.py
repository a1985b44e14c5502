"""Multi-level sampling in the API: the ``mfs`` body extension, the server defaults, the
response / usage extensions and the speculation / cascade metrics.

As in tests/test_gateway.py: a real redis-server and real gateways (one without defaults, one with a
default draft tier, one with a default draft tier and a default cascade), the test playing scheduler +
worker (it reads the Submit records on ``mfs:req`` and writes TokenEvents, and it writes ``mfs:stats``).
Clients are the official ``openai`` package (the extension goes in ``extra_body``) and ``httpx``.
"""
from __future__ import annotations

import json

import httpx2 as httpx
import msgpack
import openai
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from core import protocol as P
from core.sampling import SamplingParams
from gateway.app import init_app
from gateway.config import GatewayConfig
from tests.support.redis_server import redis_url  # noqa: F401 - the session fixture
from tests.support.gateway import PARIS, ServerThread, _err, backend, rds, register_worker  # noqa: F401

SMALL, MEDIUM, LARGE, FAMILY = ("smollm2-135m-small", "smollm2-135m-medium", "smollm2-135m-large",
                                "smollm2-135m")
# prompts the default complexity scorer routes to tier 0, 1 and 2 (see test_family_id_routes_by_complexity)
TO_TIER = ["What is the capital of France?", "Explain step by step why the sky is blue.",
           "Explain why this Python function has a bug and how to fix it:\n```python\ndef f(x):\n"
           "    return x +\n```"]


def _gateway(redis_url, frontend, gid, **kw):  # noqa: F811
    return ServerThread(GatewayConfig(redis_url=redis_url, gateway_id=gid, frontend=frontend, **kw))


@pytest.fixture(scope="module")
def gw_plain(redis_url, frontend, backend):  # noqa: F811
    with _gateway(redis_url, frontend, "gw-spec-plain") as s:
        yield s


@pytest.fixture(scope="module")
def gw_spec(redis_url, frontend, backend):  # noqa: F811
    with _gateway(redis_url, frontend, "gw-spec-draft", spec_draft_tier="small", spec_gamma=6) as s:
        yield s


@pytest.fixture(scope="module")
def gw_both(redis_url, frontend, backend):  # noqa: F811
    with _gateway(redis_url, frontend, "gw-spec-both", spec_draft_tier=0, cascade_threshold=0.6,
                  cascade_window=3) as s:
        yield s


@pytest.fixture(autouse=True)
def fresh(rds, backend):  # noqa: F811
    register_worker(rds)
    backend.script = backend.reply(PARIS)
    yield


def chat(gw, model: str, mfs=None, prompt: str = "hi", **kw):
    extra = {"mfs": mfs} if mfs is not None else None
    return gw.client().chat.completions.create(model=model, messages=[{"role": "user", "content": prompt}],
                                               max_tokens=20, extra_body=extra, **kw)


def multilevel(sub: P.Submit) -> tuple:
    p = sub.params
    return p.spec_draft_tier, p.spec_gamma, p.cascade_threshold, p.cascade_window


# ---- defaults and overrides reach the Submit ------------------------------------------------------
def test_no_defaults_no_multilevel(gw_plain, backend):
    for model in (SMALL, LARGE, FAMILY):
        r = chat(gw_plain, model)
        assert multilevel(backend.submits[r.id]) == (None, 4, None, 4)


def test_default_draft_applies_only_below_the_request_tier(gw_spec, backend):
    r = chat(gw_spec, LARGE)
    assert multilevel(backend.submits[r.id]) == (0, 6, None, 4)
    r = chat(gw_spec, MEDIUM)
    assert backend.submits[r.id].params.spec_draft_tier == 0
    r = chat(gw_spec, SMALL)  # the default draft is not below small: no speculation, no error
    assert backend.submits[r.id].params.spec_draft_tier is None
    r = chat(gw_spec, FAMILY, prompt=TO_TIER[2])  # no default cascade here: a family request speculates
    assert (backend.submits[r.id].tier, backend.submits[r.id].params.spec_draft_tier) == (2, 0)
    r = chat(gw_spec, FAMILY, prompt=TO_TIER[0])  # routed to small: nothing below it
    assert (backend.submits[r.id].tier, backend.submits[r.id].params.spec_draft_tier) == (0, None)
    r = gw_spec.client().completions.create(model=LARGE, prompt="Once", max_tokens=5)
    assert multilevel(backend.submits[r.id]) == (0, 6, None, 4)


@pytest.mark.parametrize("mfs,expect", [
    ({"speculative": {"draft": "medium", "gamma": 3}}, (1, 3)),
    ({"speculative": {"draft": MEDIUM}}, (1, 6)),          # a model id; the server's gamma
    ({"speculative": {"draft": 1}}, (1, 6)),               # an index
    ({"speculative": {"draft": "1", "gamma": 16}}, (1, 16)),
    ({"speculative": {"gamma": 2}}, (0, 2)),               # the server's draft tier
    ({"speculative": True}, (0, 6)),
    ({"speculative": False}, (None, 6)),                   # turns the server default off
    ({"speculative": None}, (0, 6)),
    ({}, (0, 6)),
    ({"cascade": False}, (0, 6)),                          # a no-op on a tier model
])
def test_per_request_speculation(gw_spec, backend, mfs, expect):
    r = chat(gw_spec, LARGE, mfs)
    sub = backend.submits[r.id]
    assert (sub.params.spec_draft_tier, sub.params.spec_gamma) == expect and sub.params.cascade_threshold is None


def test_per_request_speculation_without_server_default(gw_plain, backend):
    r = chat(gw_plain, MEDIUM, {"speculative": {"draft": "small", "gamma": 5}})
    assert multilevel(backend.submits[r.id]) == (0, 5, None, 4)
    r = gw_plain.client().completions.create(model=LARGE, prompt="Once", max_tokens=5,
                                             extra_body={"mfs": {"speculative": {"draft": 1}}})
    assert multilevel(backend.submits[r.id]) == (1, 4, None, 4)
    # temperature does not matter
    r = chat(gw_plain, LARGE, {"speculative": {"draft": 0}}, temperature=1.3, top_p=0.8)
    assert backend.submits[r.id].params.spec_draft_tier == 0 and backend.submits[r.id].params.temperature == 1.3


def test_speculation_stop_confidence_reaches_the_submit(gw_plain, backend):
    """mfs.speculative.stop_confidence sets SamplingParams.spec_stop_confidence; unset, its default."""
    r = chat(gw_plain, LARGE, {"speculative": {"draft": "small", "stop_confidence": 0.2}})
    assert backend.submits[r.id].params.spec_stop_confidence == 0.2
    r = chat(gw_plain, LARGE, {"speculative": {"draft": "small", "stop_confidence": 0}})
    assert backend.submits[r.id].params.spec_stop_confidence == 0.0  # always draft gamma
    r = chat(gw_plain, LARGE, {"speculative": {"draft": "small"}})
    assert backend.submits[r.id].params.spec_stop_confidence == SamplingParams().spec_stop_confidence


def test_cascade_defaults_and_overrides(gw_both, gw_plain, backend):
    # a family request: the default cascade from the scored tier; cascade wins over the default draft
    r = chat(gw_both, FAMILY, prompt=TO_TIER[0])
    assert (backend.submits[r.id].tier, *multilevel(backend.submits[r.id])) == (0, None, 4, 0.6, 3)
    r = chat(gw_both, "auto", prompt=TO_TIER[1])
    assert (backend.submits[r.id].tier, *multilevel(backend.submits[r.id])) == (1, None, 4, 0.6, 3)
    # a tier model id: no cascade; the default draft applies
    r = chat(gw_both, LARGE)
    assert multilevel(backend.submits[r.id]) == (0, 4, None, 3)
    # routed to the top tier: nowhere to escalate, so the default draft applies
    r = chat(gw_both, FAMILY, prompt=TO_TIER[2])
    assert (backend.submits[r.id].tier, *multilevel(backend.submits[r.id])) == (2, 0, 4, None, 3)
    # cascade off for this request: the default draft (below the scored tier 1) applies
    r = chat(gw_both, FAMILY, {"cascade": False}, prompt=TO_TIER[1])
    assert multilevel(backend.submits[r.id]) == (0, 4, None, 3)
    # both off
    r = chat(gw_both, FAMILY, {"cascade": False, "speculative": False}, prompt=TO_TIER[1])
    assert multilevel(backend.submits[r.id]) == (None, 4, None, 3)
    # an explicit speculation beats the default cascade
    r = chat(gw_both, FAMILY, {"speculative": {"draft": "small", "gamma": 2}}, prompt=TO_TIER[1])
    assert multilevel(backend.submits[r.id]) == (0, 2, None, 3)
    # an explicit cascade beats (silently) the default draft, with its own threshold / window
    r = chat(gw_both, FAMILY, {"cascade": {"threshold": 0.25}}, prompt=TO_TIER[0])
    assert multilevel(backend.submits[r.id]) == (None, 4, 0.25, 3)
    r = chat(gw_both, FAMILY, {"cascade": {"window": 8}}, prompt=TO_TIER[0])
    assert multilevel(backend.submits[r.id]) == (None, 4, 0.6, 8)
    # no server default: a request asks for its own
    r = chat(gw_plain, FAMILY, {"cascade": {"threshold": 0.3, "window": 5}}, prompt=TO_TIER[0])
    assert multilevel(backend.submits[r.id]) == (None, 4, 0.3, 5)
    r = gw_plain.client().completions.create(model="auto", prompt=TO_TIER[0], max_tokens=5,
                                             extra_body={"mfs": {"cascade": {"threshold": 0.5}}})
    assert multilevel(backend.submits[r.id]) == (None, 4, 0.5, 4)


# ---- validation ------------------------------------------------------------------------------------
BAD = [
    (LARGE, "yes", "mfs"),
    (LARGE, [1], "mfs"),
    (LARGE, {"speculate": {}}, "mfs"),
    (LARGE, {"speculative": "small"}, "mfs.speculative"),
    (LARGE, {"speculative": 1}, "mfs.speculative"),
    (LARGE, {"speculative": {"draft": "small", "gama": 3}}, "mfs.speculative"),
    (LARGE, {"speculative": {"draft": "tiny"}}, "mfs.speculative.draft"),
    (LARGE, {"speculative": {"draft": FAMILY}}, "mfs.speculative.draft"),
    (LARGE, {"speculative": {"draft": 3}}, "mfs.speculative.draft"),
    (LARGE, {"speculative": {"draft": -1}}, "mfs.speculative.draft"),
    (LARGE, {"speculative": {"draft": 2 ** 70}}, "mfs.speculative.draft"),
    (LARGE, {"speculative": {"draft": True}}, "mfs.speculative.draft"),
    (LARGE, {"speculative": {"draft": ""}}, "mfs.speculative.draft"),
    (LARGE, {"speculative": {"draft": 0.5}}, "mfs.speculative.draft"),
    (LARGE, {"speculative": {"draft": ["small"]}}, "mfs.speculative.draft"),
    (LARGE, {"speculative": {"draft": "large"}}, "mfs.speculative.draft"),    # not below the request
    (MEDIUM, {"speculative": {"draft": "large"}}, "mfs.speculative.draft"),
    (SMALL, {"speculative": {"draft": 0}}, "mfs.speculative.draft"),
    (FAMILY, {"speculative": {"draft": "small"}}, "mfs.speculative.draft"),   # scored: tier 0 ("hi")
    (LARGE, {"speculative": {"draft": "small", "gamma": 0}}, "mfs.speculative.gamma"),
    (LARGE, {"speculative": {"draft": "small", "gamma": 17}}, "mfs.speculative.gamma"),
    (LARGE, {"speculative": {"draft": "small", "gamma": "4"}}, "mfs.speculative.gamma"),
    (LARGE, {"speculative": {"draft": "small", "gamma": 2.5}}, "mfs.speculative.gamma"),
    (LARGE, {"speculative": {"draft": "small", "gamma": True}}, "mfs.speculative.gamma"),
    (LARGE, {"speculative": {"draft": "small", "stop_confidence": 1.5}}, "mfs.speculative.stop_confidence"),
    (LARGE, {"speculative": {"draft": "small", "stop_confidence": -0.1}}, "mfs.speculative.stop_confidence"),
    (LARGE, {"speculative": {"draft": "small", "stop_confidence": "0.5"}}, "mfs.speculative.stop_confidence"),
    (LARGE, {"speculative": {"draft": "small", "stop_confidence": True}}, "mfs.speculative.stop_confidence"),
    (LARGE, {"speculative": True}, "mfs.speculative.draft"),                 # no server default draft
    (LARGE, {"speculative": {"gamma": 4}}, "mfs.speculative.draft"),
    (FAMILY, {"cascade": "on"}, "mfs.cascade"),
    (FAMILY, {"cascade": {"threshold": 0.5, "patience": 2}}, "mfs.cascade"),
    (FAMILY, {"cascade": {"threshold": -1e-06}}, "mfs.cascade.threshold"),  # [0, 1], as declared
    (FAMILY, {"cascade": {"threshold": 1.000001}}, "mfs.cascade.threshold"),
    (FAMILY, {"cascade": {"threshold": 1.5}}, "mfs.cascade.threshold"),
    (FAMILY, {"cascade": {"threshold": -0.2}}, "mfs.cascade.threshold"),
    (FAMILY, {"cascade": {"threshold": "0.5"}}, "mfs.cascade.threshold"),
    (FAMILY, {"cascade": {"threshold": True}}, "mfs.cascade.threshold"),
    (FAMILY, {"cascade": {"window": 4}}, "mfs.cascade.threshold"),           # no server default threshold
    (FAMILY, {"cascade": True}, "mfs.cascade.threshold"),
    (FAMILY, {"cascade": {"threshold": 0.5, "window": 0}}, "mfs.cascade.window"),
    (FAMILY, {"cascade": {"threshold": 0.5, "window": 65}}, "mfs.cascade.window"),
    (FAMILY, {"cascade": {"threshold": 0.5, "window": "4"}}, "mfs.cascade.window"),
    (LARGE, {"cascade": {"threshold": 0.5}}, "mfs.cascade"),                  # a cascade on a tier model
    (SMALL, {"cascade": {"threshold": 0.5, "window": 4}}, "mfs.cascade"),
    (FAMILY, {"cascade": {"threshold": 0.5}, "speculative": {"draft": "small"}}, "mfs"),  # both
    (LARGE, {"cascade": True, "speculative": True}, "mfs"),
]


@pytest.mark.parametrize("model,mfs,param", BAD)
def test_bad_mfs_is_400(gw_plain, backend, model, mfs, param):
    n = len(backend.submits)
    r = httpx.post(gw_plain.url + "/v1/chat/completions",
                   json={"model": model, "messages": [{"role": "user", "content": "hi"}], "mfs": mfs})
    err = _err(r, 400, param=param)
    assert err["type"] == "invalid_request_error"
    assert len(backend.submits) == n  # nothing reached the scheduler


@pytest.mark.parametrize("model,mfs,param", [BAD[i] for i in (0, 6, 15, 20, 29, 36, 39, 41)])
def test_bad_mfs_is_400_on_completions(gw_plain, model, mfs, param):
    _err(httpx.post(gw_plain.url + "/v1/completions", json={"model": model, "prompt": "hi", "mfs": mfs}),
         400, param=param)


def test_bad_mfs_with_openai_client_and_nan(gw_both):
    with pytest.raises(openai.BadRequestError) as e:
        chat(gw_both, SMALL, {"cascade": {"threshold": 0.5}})
    assert e.value.status_code == 400 and e.value.param == "mfs.cascade"
    assert "family model id" in e.value.message
    body = (b'{"model": "auto", "messages": [{"role": "user", "content": "hi"}], '
            b'"mfs": {"cascade": {"threshold": NaN}}}')
    _err(httpx.post(gw_both.url + "/v1/chat/completions", content=body,
                    headers={"Content-Type": "application/json"}), 400, param="mfs.cascade.threshold")


def test_bad_server_defaults_stop_the_gateway(frontend, redis_url):  # noqa: F811
    for kw in ({"spec_draft_tier": "tiny"}, {"spec_draft_tier": 5}, {"spec_gamma": 0},
               {"spec_gamma": 17}, {"cascade_threshold": 1.5}, {"cascade_threshold": -0.1},
               {"cascade_window": 0}):
        with pytest.raises(ValueError):
            init_app(GatewayConfig(redis_url=redis_url, frontend=frontend, **kw))
    for ref in ("medium", MEDIUM, 1, "1"):
        init_app(GatewayConfig(redis_url=redis_url, frontend=frontend, spec_draft_tier=ref))


ml_values = st.recursive(st.none() | st.booleans() | st.integers(-3, 70) | st.floats() |
                         st.sampled_from(["small", "medium", "large", SMALL, FAMILY, "", "0", "x"]),
                         lambda c: st.lists(c, max_size=3) | st.dictionaries(
                             st.sampled_from(["draft", "gamma", "stop_confidence", "threshold", "window", "x"]), c,
                             max_size=3),
                         max_leaves=6)
mfs_bodies = st.dictionaries(st.sampled_from(["speculative", "cascade", "other"]), ml_values, max_size=2)


@settings(max_examples=60, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(model=st.sampled_from([SMALL, MEDIUM, LARGE, FAMILY, "auto"]), mfs=mfs_bodies | ml_values)
@example(model="smollm2-135m-small", mfs={"speculative": float("inf")})  # once broke the test's own encoder
@example(model="smollm2-135m", mfs={"cascade": {"threshold": float("nan")}})
def test_fuzz_mfs_never_5xx(gw_both, model, mfs):
    # json.dumps writes NaN/Infinity (which the gateway's parser reads); httpx's json= refuses them
    body = json.dumps({"model": model, "messages": [{"role": "user", "content": "hi"}], "mfs": mfs,
                       "max_tokens": 4})
    r = httpx.post(gw_both.url + "/v1/chat/completions", timeout=20, content=body,
                   headers={"content-type": "application/json"})
    assert r.status_code in (200, 400), r.text
    if r.status_code == 400:
        err = r.json()["error"]
        assert err["param"] is not None and err["param"].startswith("mfs"), err


# ---- which tiers served a request --------------------------------------------------------------
def escalating(tok, text: str = " one two three four", draft: tuple[int, int] | None = None):
    """Tokens from tier 0, then tier 1 (a cascade escalation), with a redelivered tier-0 event in
    between; ``draft``: cumulative (proposed, accepted) on the events, growing to these values."""
    ids = tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]

    def script(sub: P.Submit):
        def ev(seq, toks, tier, fin=False, frac=1.0):
            p, a = (int(draft[0] * frac), int(draft[1] * frac)) if draft else (0, 0)
            return 0.0, P.TokenEvent(sub.request_id, seq, toks, fin, "stop" if fin else None, tier=tier,
                                     prompt_tokens=len(sub.prompt_ids), draft_proposed=p, draft_accepted=a)
        return [ev(0, ids[:2], 0, frac=0.5), ev(2, ids[2:3], 1, frac=0.5), ev(0, ids[:2], 0, frac=0.5),
                ev(3, ids[3:], 1, fin=True)]
    return script


def test_tiers_non_stream(gw_both, backend, frontend):
    backend.script = escalating(frontend.tokenizer)
    r = chat(gw_both, FAMILY, prompt=TO_TIER[0])
    assert r.choices[0].message.content == " one two three four"
    assert r.model == MEDIUM  # the tier of the last token
    assert r.model_extra["mfs"] == {"tiers": [SMALL, MEDIUM], "escalations": 1}
    assert r.usage.completion_tokens_details is None and "mfs_draft" not in (r.usage.model_extra or {})
    r = gw_both.client().completions.create(model="auto", prompt=TO_TIER[0], max_tokens=20)
    assert r.model == MEDIUM and r.model_extra["mfs"]["tiers"] == [SMALL, MEDIUM]
    backend.script = backend.reply(PARIS)  # one tier
    r = chat(gw_both, LARGE)
    assert r.model == LARGE and r.model_extra["mfs"] == {"tiers": [LARGE], "escalations": 0}


@pytest.mark.parametrize("include_usage", [False, True])
def test_tiers_stream(gw_both, backend, frontend, include_usage):
    backend.script = escalating(frontend.tokenizer)
    opts = {"stream_options": {"include_usage": True}} if include_usage else {}
    chunks = list(chat(gw_both, FAMILY, prompt=TO_TIER[0], stream=True, **opts))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == " one two three four"
    models = [c.model for c in chunks]
    assert models[0] == SMALL and models[-1] == MEDIUM and set(models) == {SMALL, MEDIUM}
    assert models == sorted(models, key=[SMALL, MEDIUM].index)  # never back to small
    final = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(final) == 1 and final[0].model_extra["mfs"] == {"tiers": [SMALL, MEDIUM], "escalations": 1}
    assert all("mfs" not in (c.model_extra or {}) for c in chunks
               if c.choices and not c.choices[0].finish_reason)
    if include_usage:
        assert chunks[-1].choices == [] and chunks[-1].model_extra["mfs"]["tiers"] == [SMALL, MEDIUM]
        assert chunks[-1].usage.completion_tokens_details is None
    # completions stream, raw SSE
    r = httpx.post(gw_both.url + "/v1/completions", json={"model": "auto", "prompt": TO_TIER[0],
                                                          "stream": True, **opts})
    events = [json.loads(e[6:]) for e in r.text.split("\n\n") if e.startswith("data: {")]
    assert events[-1]["mfs"] == {"tiers": [SMALL, MEDIUM], "escalations": 1}


# ---- usage: draft tokens -----------------------------------------------------------------------
def test_usage_reports_draft_tokens(gw_spec, backend, frontend):
    backend.script = escalating(frontend.tokenizer, draft=(12, 9))
    r = chat(gw_spec, LARGE, {"speculative": {"draft": "medium"}})
    d = r.usage.completion_tokens_details
    assert (d.accepted_prediction_tokens, d.rejected_prediction_tokens) == (9, 3)
    assert r.usage.model_extra["mfs_draft"] == {"draft_model": MEDIUM, "proposed": 12, "accepted": 9}
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    chunks = list(chat(gw_spec, LARGE, stream=True, stream_options={"include_usage": True}))
    u = chunks[-1].usage
    assert (u.completion_tokens_details.accepted_prediction_tokens,
            u.completion_tokens_details.rejected_prediction_tokens) == (9, 3)
    assert u.model_extra["mfs_draft"] == {"draft_model": SMALL, "proposed": 12, "accepted": 9}
    # no draft counts on the events: no draft fields
    backend.script = backend.reply(PARIS)
    r = chat(gw_spec, LARGE)
    assert backend.submits[r.id].params.spec_draft_tier == 0
    assert r.usage.completion_tokens_details is None and "mfs_draft" not in (r.usage.model_extra or {})
    raw = httpx.post(gw_spec.url + "/v1/completions", json={"model": LARGE, "prompt": "x"}).json()
    assert set(raw["usage"]) == {"prompt_tokens", "completion_tokens", "total_tokens"}


# ---- metrics -----------------------------------------------------------------------------------
def series(text: str, name: str) -> float:
    return sum(float(ln.rsplit(" ", 1)[1]) for ln in text.splitlines() if ln.startswith(name + " "))


def test_spec_and_cascade_metrics(gw_both, backend, rds):  # noqa: F811
    spec_req, casc_req = ('mfs_spec_requests_total{draft="small",target="large"}',
                          'mfs_cascade_requests_total{start="small"}')
    before = httpx.get(gw_both.url + "/metrics").text
    chat(gw_both, LARGE)                       # speculation small > large
    chat(gw_both, FAMILY, prompt=TO_TIER[0])   # a cascade from small
    stats = {"spec": {"0>2": {"rounds": 10, "proposed": 40, "accepted": 30, "committed": 38},
                      "1>2": {"rounds": 0, "proposed": 0, "accepted": 0, "committed": 0},
                      "0>1": {"rounds": 2},             # partial: the rest count 0
                      "junk": {"rounds": 1}, "2>": 5, "0>2x": {}},
             "escalations_by_pair": {"0>1": 3, "1>2": 1, "bad": 9},
             "escalations": 4}
    rds.hset(P.STATS_KEY, "scheduler", msgpack.packb(stats))
    try:
        text = httpx.get(gw_both.url + "/metrics").text
    finally:
        rds.delete(P.STATS_KEY)
    for line in ('mfs_spec_rounds_total{draft="small",target="large"} 10.0',
                 'mfs_spec_draft_tokens_total{draft="small",target="large"} 40.0',
                 'mfs_spec_accepted_tokens_total{draft="small",target="large"} 30.0',
                 'mfs_spec_acceptance_rate{draft="small",target="large"} 0.75',
                 'mfs_spec_tokens_per_verification{draft="small",target="large"} 3.8',
                 'mfs_spec_rounds_total{draft="medium",target="large"} 0.0',
                 'mfs_spec_rounds_total{draft="small",target="medium"} 2.0',
                 'mfs_spec_draft_tokens_total{draft="small",target="medium"} 0.0',
                 'mfs_cascade_escalations_total{from="small",to="medium"} 3.0',
                 'mfs_cascade_escalations_total{from="medium",to="large"} 1.0',
                 "mfs_scheduler_escalations 4.0",
                 "# TYPE mfs_spec_acceptance_rate gauge"):
        assert line in text, line
    assert any(ln.startswith("# TYPE mfs_spec_rounds") and ln.endswith(" counter") for ln in text.splitlines())
    assert series(text, spec_req) == series(before, spec_req) + 1
    assert series(text, casc_req) == series(before, casc_req) + 1
    assert 'mfs_spec_acceptance_rate{draft="medium"' not in text  # nothing proposed: no rate
    assert 'mfs_spec_tokens_per_verification{draft="medium"' not in text
    assert "junk" not in text and "bad" not in text
    # the hash gone (or an older scheduler): no pair series, the scrape still works
    r = httpx.get(gw_both.url + "/metrics")
    assert r.status_code == 200
    assert "mfs_spec_rounds_total{" not in r.text and "mfs_cascade_escalations_total{" not in r.text
