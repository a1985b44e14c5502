"""The wire records round-trip through their msgpack encoding as the same typed records."""
import msgpack

from core import protocol as P
from core.sampling import SamplingParams


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


def test_a_reader_ignores_fields_it_does_not_know():
    body = msgpack.packb({"request_id": "r", "reason": "deadline", "added_later": 1})
    assert P.decode({b"t": b"cancel", b"d": body}) == P.Cancel("r", "deadline")
