"""The whole service (`mfs up`'s processes) on the real default family, with the official `openai`
client: every tier and the family id, streamed and not, 32 concurrent streams equal to the offline
engine, a client that disconnects, and bad input."""
import asyncio
import json
import urllib.request

import aiohttp
import openai
import pytest

from engine.prompts import encode_prompt
from service.launch import Service
from tests.support.wait import wait_for
from engine import Engine
from worker.sampling import SamplingParams

pytestmark = pytest.mark.slow
TIERS = ["smollm2-135m-small", "smollm2-135m-medium", "smollm2-135m-large"]


@pytest.fixture(scope="module")
def service(tmp_path_factory):
    # the default family, every tier routable (the family id and the cascade reach the lower tiers)
    from tests.support.factories import default_family_every_tier_routable
    model = default_family_every_tier_routable(tmp_path_factory.mktemp("family"))
    with Service(str(model), workers=1, worker_args=["--threads", "1", "--num-blocks", "512"]) as svc:
        yield svc


@pytest.fixture(scope="module")
def client(service):
    return openai.OpenAI(base_url=service.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def metrics(service) -> str:
    with urllib.request.urlopen(service.url + "/metrics", timeout=10) as r:
        return r.read().decode()


def kv_used(service) -> float:
    return sum(float(line.rsplit(" ", 1)[1]) for line in metrics(service).splitlines()
               if line.startswith("mfs_kv_blocks_used{"))


def test_models_lists_every_tier_and_the_family(client):
    ids = [m.id for m in client.models.list().data]
    assert set(TIERS + ["smollm2-135m"]) <= set(ids)


@pytest.mark.parametrize("model", TIERS + ["smollm2-135m"])
def test_chat_and_completions_streamed_and_not(client, model):
    msg = [{"role": "user", "content": "What is the capital of France?"}]
    r = client.chat.completions.create(model=model, messages=msg, max_tokens=6, temperature=0)
    assert r.model in TIERS and (model == "smollm2-135m" or r.model == model)
    assert r.usage.completion_tokens >= 1 and r.choices[0].finish_reason in ("stop", "length")
    chunks = list(client.chat.completions.create(model=model, messages=msg, max_tokens=6, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == r.choices[0].message.content  # greedy: streamed equals non-streamed
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    c = client.completions.create(model=model, prompt="The capital of France is", max_tokens=5, temperature=0)
    s = "".join(x.choices[0].text for x in client.completions.create(
        model=model, prompt="The capital of France is", max_tokens=5, temperature=0, stream=True) if x.choices)
    assert c.choices[0].text == s and c.usage.completion_tokens == 5


def test_top_tier_answers_paris(client):
    r = client.chat.completions.create(model=TIERS[2], max_tokens=20, temperature=0,
                                       messages=[{"role": "user", "content": "What is the capital of France?"}])
    assert "Paris" in r.choices[0].message.content


def test_self_speculation_and_cascade_through_the_api(service, client):
    """The top tier with the small tier drafting answers exactly what it answers alone (greedy), and
    usage reports the drafts; a family request with a strict cascade says which tiers served it."""
    msg = [{"role": "user", "content": "Name three colours of the rainbow."}]
    plain = client.chat.completions.create(model=TIERS[2], messages=msg, max_tokens=24, temperature=0)
    spec = client.chat.completions.create(model=TIERS[2], messages=msg, max_tokens=24, temperature=0,
                                          extra_body={"mfs": {"speculative": {"draft": TIERS[0], "gamma": 3}}})
    assert spec.choices[0].message.content == plain.choices[0].message.content
    # it reused the plain request's blocks, filling the small exit's KV first: served by large alone
    assert spec.model == TIERS[2] and spec.model_extra["mfs"]["tiers"] == [TIERS[2]]
    d = spec.usage.completion_tokens_details
    assert d.accepted_prediction_tokens + d.rejected_prediction_tokens > 0
    assert spec.usage.model_extra["mfs_draft"]["draft_model"] == TIERS[0]
    sampled = client.chat.completions.create(model=TIERS[2], messages=msg, max_tokens=16, temperature=0.8,
                                             seed=1, extra_body={"mfs": {"speculative": {"draft": TIERS[1]}}})
    assert sampled.usage.completion_tokens >= 1
    # Window 1, threshold 0.999: the lower tiers (far less sure of themselves) escalate.
    casc = client.chat.completions.create(model="smollm2-135m", messages=msg, max_tokens=12, temperature=0,
                                          extra_body={"mfs": {"cascade": {"threshold": 0.999, "window": 1}}})
    tiers = casc.model_extra["mfs"]["tiers"]
    assert tiers and set(tiers) <= set(TIERS) and casc.model == tiers[-1]
    assert casc.model_extra["mfs"]["escalations"] == len(tiers) - 1
    text = metrics(service)
    assert "mfs_spec_draft_tokens_total{" in text
    escalated = sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                    if line.startswith("mfs_cascade_escalations_total{"))
    assert escalated >= 1


def test_32_concurrent_streams_equal_the_offline_engine(service, default_family):
    prompts = [f"Write one sentence about the number {i}." for i in range(32)]
    jobs = [(p, i % 3) for i, p in enumerate(prompts)]

    async def one(session, prompt, tier):
        body = {"model": TIERS[tier], "messages": [{"role": "user", "content": prompt}], "max_tokens": 8,
                "temperature": 0, "stream": True}
        text = ""
        async with session.post(service.url + "/v1/chat/completions", json=body) as resp:
            assert resp.status == 200, await resp.text()
            async for line in resp.content:
                line = line.decode().strip()
                if line.startswith("data: ") and line != "data: [DONE]":
                    ch = json.loads(line[6:])
                    text += "".join(c["delta"].get("content") or "" for c in ch["choices"])
        return text

    async def run_all():
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as s:
            return await asyncio.gather(*(one(s, p, t) for p, t in jobs))

    got = asyncio.run(run_all())
    tok = default_family.tokenizer
    eng = Engine(default_family.model, num_blocks=512)
    ids = [encode_prompt(tok, p, chat=True) for p, _ in jobs]
    outs = eng.generate(ids, [t for _, t in jobs], SamplingParams(max_tokens=8))
    want = [tok.decode([t for t in o if t not in default_family.model.cfg.eos_token_ids],
                       skip_special_tokens=True) for o in outs]
    assert got == want


def test_a_small_request_after_a_large_one_fills_the_exit_kv_it_skipped_and_answers_as_offline(
        service, client, default_family):
    """Lazy exits through the pipeline: the worker registers which segments have exit blocks, a large
    request writes none of their KV, and a small request of the same prompt reuses the large one's
    cached blocks after filling its exit block's KV (/metrics counts it), answering as a cold engine."""
    import redis

    from core import protocol as P
    from core.keyrecords import WorkerInfo
    r = redis.Redis.from_url(service.redis_url)
    assert WorkerInfo.from_hash(r.hgetall(P.worker_key("w0"))).exit_blocks == [0, 1]

    def filled() -> float:
        return sum(float(line.rsplit(" ", 1)[1]) for line in metrics(service).splitlines()
                   if line.startswith('mfs_exit_fill_tokens{segment="0"}'))
    # a plain completion (no chat template, whose first blocks other tests' small requests completed)
    prompt = ("Bees visit flowers, carry the nectar home in their honey stomachs, pass it from bee to bee "
              "and fan it with their wings until the water is gone; the result is")
    ask = dict(prompt=prompt, max_tokens=6, temperature=0)
    client.completions.create(model=TIERS[2], **ask)
    before = filled()
    small = client.completions.create(model=TIERS[0], **ask).choices[0].text
    # the stats hash is written every half second
    wait_for(lambda: filled() != before, 5, "the exit-block fill to be counted", poll=0.2)
    tok = default_family.tokenizer
    ids = encode_prompt(tok, prompt, chat=False)
    assert len(ids) > 32
    assert filled() - before == (len(ids) - 1) // 16 * 16  # every full prompt block the large request cached
    out = Engine(default_family.model, num_blocks=64).generate([ids], [0], SamplingParams(max_tokens=6))[0]
    assert small == tok.decode([t for t in out if t not in default_family.model.cfg.eos_token_ids],
                               skip_special_tokens=True)


def test_disconnect_mid_stream_stops_generation_and_frees_kv(service):
    async def go():
        body = {"model": TIERS[2], "prompt": "Count slowly: one, two, three,", "max_tokens": 400,
                "temperature": 0, "ignore_eos": True, "stream": True}
        async with aiohttp.ClientSession() as s:
            async with s.post(service.url + "/v1/completions", json=body) as resp:
                n = 0
                async for _ in resp.content:
                    n += 1
                    if n >= 6:
                        break  # leave mid-stream: the connection closes here
        return n

    assert asyncio.run(go()) >= 6
    wait_for(lambda: kv_used(service) == 0, 20, "every KV block free", poll=0.3)
    assert 'mfs_scheduler_running' in metrics(service)


@pytest.mark.parametrize("body,status,code", [
    ({"model": "nope", "messages": [{"role": "user", "content": "hi"}]}, 404, "model_not_found"),
    ({"model": TIERS[0], "messages": [{"role": "user", "content": "hi " * 5000}], "max_tokens": 5},
     400, "context_length_exceeded"),
    ({"model": TIERS[0], "messages": [{"role": "user", "content": "hi"}], "max_tokens": -1}, 400, None),
    ({"model": TIERS[0], "messages": "not a list"}, 400, None),
])
def test_bad_input_gets_openai_errors_and_service_keeps_serving(service, client, body, status, code):
    req = urllib.request.Request(service.url + "/v1/chat/completions", data=json.dumps(body).encode(),
                                 headers={"content-type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as e:
        urllib.request.urlopen(req, timeout=60)
    assert e.value.code == status
    err = json.loads(e.value.read())["error"]
    assert err["message"] and "type" in err
    if code:
        assert err["code"] == code
    r = client.completions.create(model=TIERS[0], prompt="Hello", max_tokens=2, temperature=0)
    assert r.usage.completion_tokens == 2
