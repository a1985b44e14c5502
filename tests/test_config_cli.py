"""core/cli.py: flags generated from a config dataclass, and the dataclass built back from them."""
from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Literal

import pytest

from core.cli import add_args, from_args, opt
from tests.support.redis_server import redis_url  # noqa: F401 - the session fixture


def _pair(spec: str) -> tuple[int, int]:
    a, _, b = spec.partition("/")
    return int(a), int(b)


@dataclass(slots=True)
class Cfg:
    max_num_seqs: int = opt(64, "requests in a step")
    ratio: float = 1.5
    name: str = "x"
    tier: int | None = None
    draft: str | int | None = None
    verbose: bool = False
    prefix_caching: bool = opt(True, "reuse KV blocks")
    kind: Literal["a", "b"] | None = None
    timeout_s: float = opt(600.0, flag="--timeout")
    pair: tuple[int, int] = opt((1, 2), parse=_pair)
    tags: dict[str, int] = opt(default_factory=dict, parse=lambda s: {s: 1}, group="extra")
    internal: list[str] = opt(default_factory=list, cli=False)


def _parser(groups: bool = False) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="t", exit_on_error=False)
    add_args(p, Cfg, {"extra": p.add_argument_group("extra")} if groups else None)
    return p


def test_defaults_round_trip():
    assert from_args(Cfg, _parser().parse_args([])) == Cfg()


@pytest.mark.parametrize("argv, want", [
    (["--max-num-seqs", "8"], {"max_num_seqs": 8}),
    (["--ratio", "2.5", "--name", "y"], {"ratio": 2.5, "name": "y"}),
    (["--tier", "3"], {"tier": 3}),
    (["--draft", "small"], {"draft": "small"}),
    (["--verbose"], {"verbose": True}),
    (["--no-prefix-caching"], {"prefix_caching": False}),
    (["--kind", "b"], {"kind": "b"}),
    (["--timeout", "4"], {"timeout_s": 4.0}),
    (["--pair", "3/4"], {"pair": (3, 4)}),
    (["--tags", "k"], {"tags": {"k": 1}}),
])
def test_each_kind_of_field(argv, want):
    cfg = from_args(Cfg, _parser().parse_args(argv))
    assert {k: getattr(cfg, k) for k in want} == want
    assert all(getattr(cfg, k) == getattr(Cfg(), k) for k in Cfg.__slots__ if k not in want)


def test_flags_help_and_groups():
    p = _parser(groups=True)
    acts = {a.dest: a for a in p._actions}
    assert acts["max_num_seqs"].option_strings == ["--max-num-seqs"] and acts["max_num_seqs"].help == "requests in a step"
    assert acts["prefix_caching"].option_strings == ["--no-prefix-caching"]
    assert acts["kind"].choices == ["a", "b"]
    assert "internal" not in acts and "--timeout-s" not in p._option_string_actions
    extra = next(g for g in p._action_groups if g.title == "extra")
    assert [a.dest for a in extra._group_actions] == ["tags"]


def test_given_fields_and_fresh_factories():
    ns = _parser().parse_args([])
    a, b = from_args(Cfg, ns, internal=["k"]), from_args(Cfg, _parser().parse_args([]))
    assert a.internal == ["k"] and b.internal == []
    assert b.tags == {} and b.tags is not Cfg().tags


def test_parse_errors_name_the_flag_and_say_why(capsys):
    def positive(s: str) -> int:
        if int(s) <= 0:
            raise ValueError(f"{s} is not positive")
        return int(s)

    @dataclass
    class C:
        n: int = opt(1, parse=positive)

    p = argparse.ArgumentParser(prog="t")
    add_args(p, C)
    with pytest.raises(SystemExit):
        p.parse_args(["--n", "-2"])
    assert "argument --n: -2 is not positive" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        p.parse_args(["--n", "x"])  # int("x"): its ValueError says so
    assert "argument --n: invalid literal" in capsys.readouterr().err


def test_a_field_without_a_known_type_needs_a_parse():
    @dataclass
    class C:
        quota: dict[int, float] = field(default_factory=dict)

    with pytest.raises(TypeError, match="quota"):
        add_args(argparse.ArgumentParser(), C)


# ---- the processes' own configs ------------------------------------------------------------------
def _scheduler(argv: list[str]):
    from scheduler.config import SchedulerProcessConfig  # noqa: PLC0415
    p = argparse.ArgumentParser()
    add_args(p, SchedulerProcessConfig)
    return from_args(SchedulerProcessConfig, p.parse_args(argv))


def test_scheduler_flags_keep_their_names_and_defaults(capsys):
    from scheduler.config import SchedulerProcessConfig  # noqa: PLC0415
    assert _scheduler([]) == SchedulerProcessConfig()
    cfg = _scheduler(["--kv-quota", "0=0.6,1=0.3", "--no-prefix-caching", "--affinity-abs-threshold", "2",
                      "--affinity-rel-threshold", "3", "--lease-s", "1", "--housekeeping-s", "0.5",
                      "--shard", "b", "--max-num-seqs", "8"])
    assert (cfg.kv_quota, cfg.prefix_caching, cfg.affinity_abs_threshold, cfg.affinity_rel_threshold,
            cfg.lease_s, cfg.housekeeping_s, cfg.shard, cfg.max_num_seqs) == ({0: 0.6, 1: 0.3}, False, 2, 3.0,
                                                                                1.0, 0.5, "b", 8)
    with pytest.raises(SystemExit):
        _scheduler(["--shard", "a b"])
    assert "argument --shard: shard name 'a b'" in capsys.readouterr().err


def test_worker_flags_keep_their_names_and_defaults():
    from worker.service import WorkerConfig  # noqa: PLC0415
    p = argparse.ArgumentParser()
    add_args(p, WorkerConfig)
    d = from_args(WorkerConfig, p.parse_args([]))
    assert (d.model, d.tiers, d.dtype, d.kernels, d.weights, d.num_blocks, d.kv_cache_mb, d.block_size,
            d.max_model_len, d.shard, d.standalone_tier) == ("default", None, None, None, "fp32", None, 256, 16, 4096,
                                                             "0", None)
    assert d.worker_id.startswith("w-") and d.threads >= 1
    cfg = from_args(WorkerConfig, p.parse_args(["--standalone-tier", "1", "--num-blocks", "256", "--dtype",
                                                "float64", "--worker-id", "w7", "--threads", "1"]))
    assert (cfg.standalone_tier, cfg.num_blocks, cfg.dtype, cfg.worker_id, cfg.threads) == (1, 256, "float64",
                                                                                           "w7", 1)


def test_gateway_flags_fill_its_config_and_nested_limits():
    from gateway.__main__ import parse_args  # noqa: PLC0415
    from gateway.config import GatewayConfig  # noqa: PLC0415
    d, c = GatewayConfig(), parse_args(["--request-timeout", "5", "--max-stop", "2", "--spec-draft-tier", "1",
                                        "--complexity-config", '{"w_length": 2.0}', "--gateway-id", "g1"])
    assert parse_args([]).limits == d.limits and parse_args([]).complexity == d.complexity
    assert (c.request_timeout_s, c.limits.max_stop, c.spec_draft_tier, c.complexity.w_length, c.gateway_id) == (
        5.0, 2, "1", 2.0, "g1")


PROCESS_ONLY = {"directory_ttl_s", "affinity_abs_threshold", "affinity_rel_threshold", "lease_s", "housekeeping_s",
                "shard", "decode_steps", "stream_interval"}  # decode_steps: the service asks extend_decode for
#   it; stream_interval: each plan carries it to its worker


def test_every_scheduler_knob_reaches_the_workers_step_scheduler_or_is_the_process_own(redis_url):  # noqa: F811
    """The step-scheduler knobs are said once (SchedulerConfig's fields and defaults) and passed by name:
    a new scheduler flag is either one of them or named here as the process's own."""
    import dataclasses  # noqa: PLC0415

    import redis  # noqa: PLC0415

    from core.keyrecords import WorkerInfo  # noqa: PLC0415
    from scheduler.config import STEP_LIMITS, SchedulerProcessConfig  # noqa: PLC0415
    from scheduler.registry import WorkerRegistry  # noqa: PLC0415
    from scheduler.request import SchedulerConfig  # noqa: PLC0415
    names = {f.name for f in dataclasses.fields(SchedulerProcessConfig)}
    assert names == set(STEP_LIMITS) | PROCESS_ONLY and not set(STEP_LIMITS) & PROCESS_ONLY
    for name in STEP_LIMITS:  # the process's defaults are the step scheduler's
        assert getattr(SchedulerProcessConfig(), name) == getattr(SchedulerConfig(1, [1]), name), name
    cfg = _scheduler(["--max-num-batched-tokens", "96", "--max-num-seqs", "5", "--max-tiers-per-step", "2",
                      "--path-switches-per-s", "3", "--kv-quota", "0=0.5", "--no-prefix-caching",
                      "--cache-ttl-s", "7", "--spec-min-acceptance", "0.4", "--spec-probe-every", "9",
                      "--no-lazy-exits"])
    reg = WorkerRegistry(redis.Redis.from_url(redis_url), cfg)
    info = WorkerInfo(tiers=[0, 1, 2], num_tiers=3, num_blocks=[32, 32, 32], block_size=4, max_model_len=256,
                      vocab_size=100, eos=[2], started="t0", exit_blocks=[0, 1])
    step = reg._new_worker("w-knobs", info).core.cfg
    assert step.exit_blocks == (0, 1)  # what the worker's model has, not a knob
    assert {n: getattr(step, n) for n in STEP_LIMITS} == {
        "max_num_batched_tokens": 96, "max_num_seqs": 5, "max_tiers_per_step": 2, "path_switches_per_s": 3.0,
        "kv_quota": {0: 0.5}, "prefix_caching": False, "cache_ttl_s": 7.0, "spec_min_acceptance": 0.4,
        "spec_probe_every": 9, "lazy_exits": False}
    assert (step.num_blocks, step.block_size, step.max_model_len, step.eos_token_ids) == ([32] * 3, 4, 256, (2,))


def test_null_worker_flags_come_from_its_config(capsys):
    from worker.null import NullConfig, main  # noqa: PLC0415
    p = argparse.ArgumentParser()
    add_args(p, NullConfig)
    cfg = from_args(NullConfig, p.parse_args(["--workers", "3", "--shards", "a, b", "--step-ms", "5"]))
    assert (cfg.workers, cfg.shards, cfg.step_ms, cfg.num_tiers, cfg.stats_file) == (3, ["a", "b"], 5.0, 3, None)
    assert cfg.prefix.startswith("null-")
    for bad, says in ((["--shards", "a b"], "argument --shards: shard name 'a b'"),
                      (["--workers", "0"], "--workers and --num-tiers must be >= 1")):
        with pytest.raises(SystemExit):
            main(bad)
        assert says in capsys.readouterr().err
