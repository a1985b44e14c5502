"""`mfs bench control-plane` at its smallest: null workers (worker/null.py) speak the real worker
protocol to the real scheduler and Redis, and the report's figures are consistent with each other."""
import json
import os

import pytest

from mfs.cli import main
from worker.null import EOS, VOCAB, null_token

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def test_null_tokens_depend_only_on_request_and_position_and_are_never_eos():
    toks = [null_token("r1", k) for k in range(2000)]
    assert toks == [null_token("r1", k) for k in range(2000)]
    assert toks != [null_token("r2", k) for k in range(2000)]
    assert all(1 <= t < VOCAB and t not in EOS for t in toks)


def test_bench_control_plane_two_null_workers(tmp_path):
    out = tmp_path / "cp.json"
    rc = main(["bench", "control-plane", "--workers", "2", "--shards", "1,2", "--step-ms", "20", "--rows", "4",
               "--max-tokens", "16", "--warmup", "2", "--seconds", "3", "--log-dir", str(tmp_path / "logs"),
               "--json", str(out), "--plot", str(tmp_path / "cp.png")])
    assert rc == 0
    p, p2 = json.loads(out.read_text())["points"]
    assert (p["shards"], p2["shards"]) == (1, 2)
    # two shards: each leader drives its own worker, the client's submits spread over both
    assert p2["client_errors"] == 0 and all(v > 0 for v in p2["steps_per_s_by_shard"].values())
    assert sorted(p2["steps_per_s_by_shard"]) == ["0", "1"] and 0 < p2["steps_per_s"] <= 105
    assert p["client_errors"] == 0
    assert p["workers"] == 2 and p["ideal_steps_per_s"] == 100.0
    # every step of a saturated worker samples one token per row (4 rows), and no worker steps faster
    # than its simulated step time
    assert 0 < p["steps_per_s"] <= p["ideal_steps_per_s"] * 1.05
    assert p["tokens_per_s"] == pytest.approx(p["steps_per_s"] * 4, rel=0.35)
    assert p["gap_samples"] > 0 and 0 < p["gap_ms_p50"] <= p["gap_ms_p99"]
    assert p["leader_cpu_ms_per_step"] > 0 and p["redis_commands_per_token"] > 0
    assert 0 < p["machine_cpus_busy"] <= (os.cpu_count() or 1) * 1.1
    assert (tmp_path / "cp.png").stat().st_size > 0
