"""The sharded control plane: one scheduler leader per shard of workers, each shard
its own request stream, lease and epoch; the gateway picks the shard of each request (session
affinity, then load); a shard's leader failing moves only that shard. Unit checks of the key names and
the choice, then the real service: 2 shards x (leader + standby) x 1 worker behind one gateway, a tiny
float64 model with a real tokenizer, the `openai` client."""
from __future__ import annotations

import concurrent.futures as cf
import shutil
import signal

import openai
import pytest
import redis

from core import protocol as P
from core.keyrecords import StatsSnapshot
from gateway.backend import LiveWorker, choose_shard, merge_stats
from engine import Engine
from service.children import Role
from service.launch import Service
from tests.support.factories import tiny_llama_with_tokenizer
from tests.support.wait import wait_for
from worker.family import load_family
from worker.sampling import SamplingParams

TIERS = "2,4,6"
N = 160  # tokens per stream in the service test


# ---- names and the choice ----------------------------------------------------------------------
def test_the_default_shard_keeps_the_unsharded_names_and_others_suffix_theirs():
    d, s = P.Shard(), P.Shard("eu-1")
    assert (d.req_stream, d.done_stream, d.workers_set, d.leader_key, d.epoch_key, d.stats_field) == (
        P.REQ_STREAM, P.DONE_STREAM, P.WORKERS_SET, P.LEADER_KEY, P.EPOCH_KEY, "scheduler")
    assert (s.req_stream, s.done_stream, s.workers_set, s.leader_key, s.epoch_key, s.stats_field) == (
        "mfs:req:eu-1", "mfs:done:eu-1", "mfs:workers:eu-1", "mfs:scheduler:leader:eu-1",
        "mfs:scheduler:epoch:eu-1", "scheduler:eu-1")
    assert P.shard_of_stats_field("scheduler") == "0" and P.shard_of_stats_field("scheduler:eu-1") == "eu-1"
    assert P.shard_of_stats_field("other") is None
    for bad in ("", "a b", "x" * 33, "a:b"):
        with pytest.raises(ValueError, match="shard name"):
            P.Shard(bad)


def test_choose_shard_serving_tier_then_session_then_least_loaded():
    ws = [LiveWorker("a", 64, "0", (0, 1, 2)), LiveWorker("b", 64, "1", (0, 1, 2)),
          LiveWorker("c", 64, "2", (2,))]
    load = {"0": 5, "1": 2, "2": 0}
    assert choose_shard(0, ws, load, ["0", "1", "2"]) == "1"            # least loaded serving tier 0
    assert choose_shard(2, ws, load, ["0", "1", "2"]) == "2"            # shard 2 serves tier 2
    assert choose_shard(0, ws, load, ["0", "1", "2"], session_shard="0") == "0"  # the session's shard
    assert choose_shard(0, ws, load, ["0", "1", "2"], session_shard="2") == "1"  # ...unless it lacks the tier
    assert choose_shard(7, ws, {}, ["0", "1", "2"]) == "0"              # nobody serves 7: any live, by name
    assert choose_shard(0, [], {"1": 0, "0": 3}, ["0", "1"]) == "1"     # no worker known: the known shards
    assert choose_shard(0, [], {}, []) == "0"


def test_merge_stats_sums_numbers_and_merges_maps():
    a = {"leader": "s0", "workers": 1, "waiting": {0: 2}, "kv_blocks_used": {"w0": [1, 2]},
         "spec": {"0>2": {"rounds": 1}}, "step_roundtrip_s": 0.5}
    b = {"leader": "s1", "workers": 2, "waiting": {0: 1, 1: 4}, "kv_blocks_used": {"w1": [3, 4]},
         "spec": {"0>2": {"rounds": 2}}, "step_roundtrip_s": 0.25}
    m = merge_stats([a, b])
    assert m == {"leader": "s0", "workers": 3, "waiting": {0: 3, 1: 4},
                 "kv_blocks_used": {"w0": [1, 2], "w1": [3, 4]}, "spec": {"0>2": {"rounds": 3}},
                 "step_roundtrip_s": 0.75}
    assert merge_stats([a]) == a and merge_stats([]) == {}


def test_service_plans_shards_and_workers():
    """Each child's spec names its role, shard and worker id, and its args say the same to the process."""
    url = "redis://127.0.0.1:1/0"
    svc = Service("default", workers=4, shards=2, schedulers=2, gateway=False, redis_url=url)

    def shard_arg(spec) -> str | None:
        return spec.args[spec.args.index("--shard") + 1] if "--shard" in spec.args else None

    plan = svc.plan()
    assert [(s.name, s.role, s.shard, shard_arg(s)) for s in plan if s.role is Role.SCHEDULER] == [
        ("scheduler", Role.SCHEDULER, "0", "0"), ("scheduler-2", Role.SCHEDULER, "0", "0"),
        ("scheduler-s1", Role.SCHEDULER, "1", "1"), ("scheduler-s1-2", Role.SCHEDULER, "1", "1")]
    workers = [s for s in plan if s.role is Role.WORKER]
    assert [(s.name, s.id, s.shard, shard_arg(s)) for s in workers] == [
        ("worker-w0", "w0", "0", "0"), ("worker-w1", "w1", "1", "1"),
        ("worker-w2", "w2", "0", "0"), ("worker-w3", "w3", "1", "1")]
    assert all(s.args[s.args.index("--worker-id") + 1] == s.id for s in workers)
    one = Service("default", workers=2, gateway=False, redis_url=url).plan()
    assert [(s.name, s.shard, shard_arg(s)) for s in one] == [
        ("scheduler", "0", None), ("worker-w0", "0", None), ("worker-w1", "0", None)]
    assert Service("default", redis_url=url).plan()[-1].role is Role.GATEWAY
    with pytest.raises(ValueError):
        Service("default", shards=0)


def test_a_service_removes_the_log_folder_it_made_after_a_clean_with_block_only(tmp_path):
    made = Service("default", gateway=False)  # nothing started: stop() has nothing to stop
    assert made._log_dir is None  # no folder until one is needed
    folder = made.log_dir
    assert folder.is_dir()
    made.__exit__(None, None, None)
    assert not folder.exists()
    failed = Service("default", gateway=False)  # an exception: its logs explain it, so they stay
    failed.__exit__(RuntimeError, RuntimeError("boom"), None)
    assert failed.log_dir.is_dir()
    shutil.rmtree(failed.log_dir)
    given = Service("default", gateway=False, log_dir=str(tmp_path / "logs"))  # the caller's folder stays
    (given.log_dir / "worker-w0.log").write_text("kept")
    given.__exit__(None, None, None)
    assert (given.log_dir / "worker-w0.log").read_text() == "kept"


# ---- the real service --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def family_dir(tmp_path_factory, frontend):
    return tiny_llama_with_tokenizer(tmp_path_factory.mktemp("tinytok-shards"), frontend.tokenizer)


def shard_stats(r: redis.Redis) -> dict[str, StatsSnapshot]:
    return {P.shard_of_stats_field(k.decode()): StatsSnapshot.decode(v)
            for k, v in r.hgetall(P.STATS_KEY).items() if P.shard_of_stats_field(k.decode()) is not None}


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_two_shards_serve_together_and_a_shard_leader_loss_moves_only_its_shard(family_dir):
    fam = load_family(str(family_dir), tiers=TIERS, dtype="float64")
    eos = fam.tokenizer.eos_token_id
    prompts = [fam.tokenizer(f"Say something about {i}.")["input_ids"] for i in range(16)]
    # the in-process engine's greedy text (top tier), the reference for every stream (float64: a batch
    # equals solo runs). N tokens: long enough that a stream outlasts a few stats snapshots (every 0.5 s);
    # with 24 a whole pass could end between two, and the leader was killed after the work was done.
    eng = Engine(fam.model, block_size=4, num_blocks=1024)
    want = [fam.tokenizer.decode([t for t in toks if t != eos])
            for toks in eng.generate(prompts, [2] * len(prompts), SamplingParams(max_tokens=N))]
    with Service(str(family_dir), tiers=TIERS, workers=2, shards=2, schedulers=2, dtype="float64",
                 scheduler_args=["--lease-s", "1.5"],
                 worker_args=["--num-blocks", "1024", "--block-size", "4", "--threads", "1"]) as svc:
        r = redis.Redis.from_url(svc.redis_url)
        client = openai.OpenAI(base_url=svc.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        large = next(m.id for m in client.models.list().data if m.id.endswith("-large"))
        assert {m.decode() for m in r.smembers(P.SHARDS_SET)} == {"0", "1"}
        assert {m.decode() for m in r.smembers(P.Shard("1").workers_set)} == {"w1"}

        def run(ids: list[int]) -> str:
            stream = client.completions.create(model=large, prompt=ids, max_tokens=N, temperature=0,
                                               stream=True)
            return "".join(chunk.choices[0].text for chunk in stream if chunk.choices)

        def pass_(kill: bool) -> tuple[list[str], dict]:
            before = shard_stats(r)
            with cf.ThreadPoolExecutor(16) as ex:
                futs = [ex.submit(run, p) for p in prompts]
                killed = None
                if kill:  # shard 1's leader, once both shards are busy
                    wait_for(lambda: all((s := shard_stats(r).get(k)) and sum(s.running.values())
                                         for k in ("0", "1")), 60, "both shards running requests")
                    # the shard's leader, whichever of its two schedulers won the lease (its consumer
                    # name ends with its pid)
                    leader = shard_stats(r)["1"].leader
                    killed = next(p for n, p in svc.procs.items()
                                  if n.startswith("scheduler-s1") and leader.endswith(f"-{p.pid}"))
                    killed.send_signal(signal.SIGKILL)
                    killed.wait(10)
                got = [f.result(timeout=300) for f in futs]
            if kill:  # the standby's first snapshot (written every 0.5 s) after its takeover
                wait_for(lambda: shard_stats(r)["1"].epoch > before["1"].epoch, 30, "shard 1's standby to lead")
            return got, {"before": before, "after": shard_stats(r), "killed": killed}

        got, st = pass_(kill=False)
        assert got == want
        steps = {k: s.steps for k, s in st["after"].items()}
        assert steps["0"] > 0 and steps["1"] > 0, f"one shard did all the work: {steps}"

        got, st = pass_(kill=True)
        assert got == want
        b, a = st["before"], st["after"]
        assert a["0"].leader == b["0"].leader and a["0"].epoch == b["0"].epoch  # shard 0 never noticed
        assert a["1"].leader != b["1"].leader and a["1"].epoch > b["1"].epoch   # shard 1's standby took over
        print(f"\nshard steps {steps}; shard 1 epoch {b['1'].epoch} -> {a['1'].epoch}, "
              f"leader {b['1'].leader} -> {a['1'].leader}; 16/16 equal in both passes")
