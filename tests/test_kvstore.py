"""The KV block directory (kvstore/) against a real Redis, and cache-aware placement through the
scheduler and two worker processes: a session follows its KV, yields to load, survives a restart."""
import pytest
import redis

from core import protocol as P
from kvstore.directory import BlockDirectory, common_blocks
from service.launch import Service
from tests.support.redis_server import redis_url  # noqa: F401 - the session fixture
from tests.support.pipeline import Reader, submit, wait_idle
from tests.support.wait import wait_for
from engine import Engine
from worker.sampling import SamplingParams


def chain(seed, n=4):
    return [bytes([seed + i]) * 16 for i in range(n)]


def test_directory_lists_blocks_per_worker_with_the_last_word_winning(redis_url):  # noqa: F811
    d = BlockDirectory(redis.Redis.from_url(redis_url), ttl_s=30)
    s0, s1 = chain(0), chain(100)
    d.record("dA", [(h, True) for h in s0 + s1])
    d.record("dB", [(h, True) for h in s0[:2]])
    assert d.held_blocks([s0], ["dA", "dB", "dC"]) == {"dA": 4, "dB": 2, "dC": 0}
    assert d.held_blocks([s0, s1[:3]], ["dA", "dB"]) == {"dA": 3, "dB": 0}  # every segment counts
    d.record("dA", [(s0[2], False), (s1[0], False), (s1[0], True)])
    assert d.held_blocks([s0, s1], ["dA"]) == {"dA": 2}
    assert d.num_held("dA") == 7
    assert 0 < d.r.ttl(P.kv_held_key("dA")) <= 30
    assert d.r.sismember(P.kv_held_key("dA"), s0[0]) and not d.r.sismember(P.kv_held_key("dA"), s0[2])
    assert not d.r.keys("mfs:kv:block:*")  # one set per worker, no key per block


def test_directory_sessions_and_dropping_a_worker(redis_url):  # noqa: F811
    d = BlockDirectory(redis.Redis.from_url(redis_url), ttl_s=30)
    s0, s1 = chain(50), chain(150)
    d.record("eA", [(h, True) for h in s0 + s1])
    d.record("eB", [(h, True) for h in s0])
    d.touch_session("sess-e", "eA", "life-1", 2, [s0, s1])
    e = d.session("sess-e")
    assert (e.worker, e.started, e.tier, e.chains) == ("eA", "life-1", 2, [s0, s1])
    assert 0 < d.r.ttl(P.kv_session_key("sess-e")) <= 30
    assert common_blocks([s0[:3], s1[:3]], e.chains) == 3 and common_blocks([s0, chain(7)], e.chains) == 0
    assert common_blocks([s0, s1, chain(9)], e.chains) == 0  # a segment the session never had
    assert d.drop_worker("eA") == 8
    assert d.session("sess-e") is None and d.num_held("eA") == 0
    assert d.held_blocks([s0], ["eA", "eB"]) == {"eA": 0, "eB": 4}
    assert d.session("nobody") is None


# ---- placement through the service ------------------------------------------------------------
@pytest.fixture(scope="module")
def service(llama_dir):
    # Affinity yields as soon as the preferred worker has more requests than the other one.
    with Service(str(llama_dir), tiers="2,4,6", workers=2, gateway=False, dtype="float64",
                 worker_args=["--num-blocks", "64", "--block-size", "4", "--threads", "1"],
                 scheduler_args=["--affinity-abs-threshold", "0", "--affinity-rel-threshold", "1.0"]) as svc:
        yield svc


@pytest.fixture(scope="module")
def cold(llama_family):
    def run(prompt, tier, n):
        eng = Engine(llama_family.model, block_size=4, num_blocks=64)
        return eng.generate([prompt], [tier], SamplingParams(max_tokens=n, ignore_eos=True))[0]
    return run


def turn(r, rd, rid, prompt, tier, n, session):
    submit(r, rid, prompt, tier, max_tokens=n, ignore_eos=True, session_id=session)
    rd.until(lambda: rd.finished(rid))
    first = min(rd.events[rid], key=lambda e: e.seq)
    return rd.tokens(rid), first.worker, first.cached_tokens


def test_a_session_follows_its_kv_until_that_worker_is_overloaded(service, cold):
    r = redis.Redis.from_url(service.redis_url)
    rd = Reader(r)
    p1 = [5, 9, 14, 3, 77, 31, 8, 100, 42, 17]
    out1, home, cached = turn(r, rd, "s1-t1", p1, 2, 7, "s1")
    assert cached == 0 and out1 == cold(p1, 2, 7)
    wait_idle(r)
    p2 = p1 + out1 + [61, 62, 63, 64, 65]
    out2, w2, cached = turn(r, rd, "s1-t2", p2, 2, 6, "s1")
    assert w2 == home and cached == 16 and out2 == cold(p2, 2, 6)  # 10 + 7 - 1 tokens of KV: 4 blocks
    wait_idle(r)
    p3 = p2 + out2 + [70, 71]
    out3, w3, cached = turn(r, rd, "s1-t3", p3, 2, 4, "s1")
    assert w3 == home and cached == 24 and out3 == cold(p3, 2, 4)
    s = wait_idle(r)
    assert s.prefill_reused[0] >= 40 and s.directory_blocks[home] > 0
    assert s.affinity_preferred >= 2 and s.affinity_yielded == 0

    # A long request sharing the session's prefix lands on `home` too; the session's next turn then
    # finds it busier than the other worker and goes there, computing from scratch.
    hog = p3 + out3 + [90]
    submit(r, "hog", hog, 2, max_tokens=120, ignore_eos=True)
    p4 = p3 + out3 + [80, 81, 82]
    out4, w4, cached = turn(r, rd, "s1-t4", p4, 2, 5, "s1")
    assert w4 != home and cached == 0 and out4 == cold(p4, 2, 5)
    rd.until(lambda: len(rd.events.get("hog", [])) > 0)
    assert rd.events["hog"][0].worker == home
    r.xadd(P.REQ_STREAM, P.Cancel("hog").encode())
    s = wait_idle(r)
    assert s.affinity_yielded >= 1


def test_a_restarted_worker_loses_its_directory_entries_and_sessions_still_work(service, cold):
    r = redis.Redis.from_url(service.redis_url)
    rd = Reader(r)
    p1 = [33, 34, 35, 36, 37, 38, 39, 40, 41]
    out1, home, _ = turn(r, rd, "s2-t1", p1, 1, 8, "s2")
    wait_idle(r)
    d = BlockDirectory(r)
    assert d.num_held(home) > 0 and d.session("s2").worker == home
    name = f"worker-{home}"
    service.procs[name].send_signal(2)  # SIGINT: the worker deregisters and exits
    service.procs[name].wait(30)  # ~1 s; the worker handles SIGINT even if started with it ignored
    service.restart(name)
    wait_for(lambda: d.session("s2") is None and d.num_held(home) == 0, 60,  # dropped when the worker left
             "the directory to drop the restarted worker", poll=0.2)
    service.wait_workers(60, 2)
    p2 = p1 + out1 + [50, 51]
    out2, _, cached = turn(r, rd, "s2-t2", p2, 1, 5, "s2")
    assert cached == 0 and out2 == cold(p2, 1, 5)


# ---- the gateway's side: the session header in, cached tokens out ---------------------------------
@pytest.fixture(scope="module")
def gateway(tmp_path_factory):
    from gateway.config import GatewayConfig
    from family.manifest import load_frontend
    from tests.support.redis_server import redis_server
    from tests.support.gateway import FakeBackend, ServerThread, register_worker
    frontend = load_frontend("default")
    frontend.manifest.quality = None  # every tier routable, as in the other gateway tests
    with redis_server(tmp_path_factory.mktemp("redis-gw")) as url:
        fb = FakeBackend(url, frontend.tokenizer)
        fb.start()
        register_worker(fb.r)
        cfg = GatewayConfig(redis_url=url, gateway_id="gw-kv", frontend=frontend, max_body_bytes=1 << 20)
        try:
            with ServerThread(cfg) as gw:
                yield gw, fb
        finally:
            fb.halt.set()
            fb.join(5)


def test_gateway_forwards_the_session_and_reports_cached_tokens(gateway):
    gw, fb = gateway
    plain = fb.reply("Paris.")

    def script(sub):
        out = plain(sub)
        out[0][1].cached_tokens = 7  # what a worker says on a request's first token event
        return out
    fb.script = script
    client = gw.client()
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    r = client.chat.completions.create(model="smollm2-135m-small", messages=msgs, max_tokens=20,
                                       extra_headers={"X-Session-ID": "sess-h"})
    assert fb.last_submit().session_id == "sess-h"
    assert r.usage.prompt_tokens_details.cached_tokens == 7
    chunks = list(client.chat.completions.create(model="smollm2-135m-small", messages=msgs, max_tokens=20,
                                                 stream=True, stream_options={"include_usage": True},
                                                 extra_body={"session_id": "sess-b"}))
    assert fb.last_submit().session_id == "sess-b"
    assert chunks[-1].usage.prompt_tokens_details.cached_tokens == 7
