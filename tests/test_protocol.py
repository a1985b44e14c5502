"""The wire records round-trip through their msgpack encoding as the same typed records."""
import msgpack
import redis

from core import protocol as P
from core.keyrecords import StatsSnapshot, WorkerInfo, decode_progress, encode_progress
from core.sampling import SamplingParams
from tests.support.redis_server import redis_url  # noqa: F401 - the session fixture


def roundtrip(rec):
    fields = {k.encode(): (v.encode() if isinstance(v, str) else v) for k, v in rec.encode().items()}
    return P.decode(fields)  # what XREAD hands a reader: bytes keys and values


def test_submit_carries_one_sampling_params():
    params = SamplingParams(max_tokens=7, temperature=0.5, top_k=3, top_p=0.9, seed=11, stop_token_ids=(2, 9),
                            ignore_eos=True, spec_draft_tier=0, spec_gamma=3, spec_stop_confidence=0.25)
    sub = P.Submit("r1", "gw", [5, 6], 2, params, model_id="m", arrival=1.5, session_id="s")
    back = roundtrip(sub)
    assert isinstance(back, P.Submit) and isinstance(back.params, SamplingParams)
    assert back == sub
    assert back.params.stop_token_ids == (2, 9)  # a tuple again, as the scheduler hashes it


def test_step_plan_rows_and_new_requests_are_records():
    new = P.NewRequest("r1", "gw", 1, 4, SamplingParams(max_tokens=3, cascade_threshold=0.4), [0, 2],
                       cached_tokens=4, seq_offset=2)
    rows = [P.PlanRow("r1", 1, [5, 6], 0, [[3], [4]], True, 0),
            P.PlanRow("r2", 2, [7, 8], 9, [[1], [2], [3]], False, 5, enter=1, sample_all=True, drafts=[7, 8])]
    plan = P.StepPlan(4, new=[new], rows=rows, drop=["old"], worker_started="t-1", epoch=3)
    back = roundtrip(plan)
    assert back == plan
    assert all(isinstance(r, P.PlanRow) for r in back.rows) and isinstance(back.new[0], P.NewRequest)
    assert isinstance(back.new[0].params, SamplingParams)


def test_a_step_s_token_events_for_one_gateway_travel_as_one_entry():
    a = P.TokenEvent("r1", 0, [5], logprobs=[P.TokenLogprob(5, -0.5, [5, 6], [-0.5, -1.0])])
    b = P.TokenEvent("r2", 3, [7, 8], True, "stop", tier=2, worker="w0")
    assert P.batch_entry([a]) == a.encode()  # one event: itself, as a reader of single events expects
    fields = {k.encode(): (v.encode() if isinstance(v, str) else v) for k, v in P.batch_entry([a, b]).items()}
    assert P.decode(fields) == P.TokenBatch([a, b])
    assert P.token_events(fields) == [a, b]
    assert P.token_events({b"t": b"tokens", b"d": a.encode()["d"]}) == [a]
    try:
        P.token_events(P.Cancel("r").encode())
    except ValueError as e:
        assert "not a token event" in str(e)
    else:
        raise AssertionError("a Cancel is not a token event")


def test_a_reader_ignores_fields_it_does_not_know():
    body = msgpack.packb({"request_id": "r", "reason": "deadline", "added_later": 1})
    assert P.decode({b"t": b"cancel", b"d": body}) == P.Cancel("r", "deadline")


def test_worker_registration_through_a_real_hash(redis_url):
    r = redis.Redis.from_url(redis_url)
    info = WorkerInfo([0, 1, 2], 3, [64, 64, 64], 4, 512, 1000, [2], "1.5-42", device="cpu", kernels="torch",
                        pid=42, epoch=3, heartbeat=2.5, exit_blocks=[0, 1], kv_window=16)
    r.hset(P.worker_key("w-proto"), mapping=info.to_hash())
    assert WorkerInfo.from_hash(r.hgetall(P.worker_key("w-proto"))) == info
    from scheduler.config import SchedulerProcessConfig
    from scheduler.registry import WorkerRegistry
    assert WorkerRegistry(r, SchedulerProcessConfig())._new_worker("w-proto", info).core.cfg.kv_window == 16
    assert int(r.hget(P.worker_key("w-proto"), "max_model_len")) == 512  # a scalar reads with one HGET
    r.delete(P.worker_key("w-proto"))
    r.hset(P.worker_key("w-proto"), mapping={"heartbeat": 1.0, "epoch": 3})  # only a heartbeat's fields
    assert WorkerInfo.from_hash(r.hgetall(P.worker_key("w-proto"))) is None
    r.delete(P.worker_key("w-proto"))


def test_progress_appends_decode_to_the_tokens(redis_url):
    r = redis.Redis.from_url(redis_url)
    key = P.progress_key("r-proto")
    r.delete(key)
    for toks in ([5, 70000], [], [-1, 2**31 - 1]):
        r.append(key, encode_progress(toks))
    assert decode_progress(r.get(key)) == [5, 70000, -1, 2**31 - 1]
    assert decode_progress(r.get(key) + b"\x01\x02") == [5, 70000, -1, 2**31 - 1]  # a torn tail
    assert decode_progress(None) == []
    r.delete(key)


def test_stats_snapshot_decodes_typed():
    snap = StatsSnapshot(leader="s1", epoch=2, workers=1, waiting={0: 1}, kv_blocks_used={"w0": [3, 1]},
                           prefill_reused={0: 40}, spec={"0>2": {"rounds": 1, "proposed": 4, "accepted": 3,
                                                                 "committed": 4}})
    assert StatsSnapshot.decode(snap.encode()) == snap
    assert StatsSnapshot.decode(None) is None


def test_to_wire_is_asdict_without_the_deep_copy():
    """The shallow encoder packs exactly what dataclasses.asdict would (nested records included)."""
    from dataclasses import asdict

    from core import protocol as P
    from core.sampling import SamplingParams
    rows = [P.PlanRow(f"r{i}", 2, [5, 6], 100, [[1, 2, 3]] * 3, True, 10, enter=1, drafts=[7]) for i in range(3)]
    new = [P.NewRequest("a", "g", 1, 5, SamplingParams(max_tokens=3, stop_token_ids=[1, 2]), [0])]
    records = [P.StepPlan(1, new, rows, ["x"], "s", 3), P.Submit("r", "g", [1, 2], 0, SamplingParams(seed=4)),
               P.StepResult("w", 2, {"r": 3}, verified={"r": [1, 2]}), P.TokenEvent("r", 0, [1], True, "stop"),
               P.TokenEvent("r", 1, [4], logprobs=[P.TokenLogprob(4, -0.5, [4, 9], [-0.5, -1.5])],
                            prompt_logprobs=[P.TokenLogprob(7, -2.0)]),
               P.Cancel("r")]
    for rec in records:
        assert P.to_wire(rec) == asdict(rec)
        assert P.decode(rec.encode()) == rec
