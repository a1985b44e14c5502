"""The commands a new user runs first, as subprocesses of the installed `mfs` script; the arguments they
refuse, in this process (`mfs.cli.run`: the same exit status and output, without a fresh interpreter)."""
import json

import pytest

from tests.support.procs import mfs_refuses as refuses, run_mfs as run


@pytest.mark.slow
def test_generate_default_family_top_tier_answers_paris():
    r = run("generate", "--model", "default", "--tier", "large", "--chat", "--max-tokens", "20",
            "What is the capital of France? Answer briefly.")
    assert r.returncode == 0, r.stderr
    assert "Paris" in r.stdout
    assert "loading" not in r.stdout  # stdout is the completion only


@pytest.mark.slow
def test_tiers_lists_layers_params_and_kv_bytes():
    r = run("tiers", "--model", "default", "--json")
    assert r.returncode == 0, r.stderr
    info = json.loads(r.stdout)
    tiers = info["tiers"]
    assert [t["layers"] for t in tiers] == [26, 28, 30]
    assert [t["tier"] for t in tiers] == ["small", "medium", "large"]
    # 2 (K,V) x KV layers x 3 KV heads x 64 dims x 4 bytes; a tier's KV layers are its segments' pools:
    # trunk layers plus the exit-block layers of every boundary up to it (blocks write KV for every
    # token crossing their boundary)
    blocks = [t["exit_block_layers"] for t in tiers]
    kv_layers = [sum(s + b for s, b in zip([26, 2, 2][:k + 1], blocks[:k + 1])) for k in range(3)]
    assert [t["kv_bytes_per_token"] for t in tiers] == [2 * n * 3 * 64 * 4 for n in kv_layers]
    assert tiers[0]["params"] < tiers[1]["params"] < tiers[2]["params"]
    assert 130e6 < tiers[2]["params"] < 140e6
    # the small tier misses the quality floor (mfs eval --record-quality measured it): named, never routed
    assert [t["routable"] for t in tiers] == [False, True, True] and "quality floor" in tiers[0]["note"]


def test_generate_rejects_unknown_tier_and_missing_model(llama_dir):
    r = refuses("generate", "--model", str(llama_dir), "--tier", "gigantic", "hi")
    assert r.returncode == 2 and "unknown tier" in r.stderr
    r = refuses("generate", "--model", "/nonexistent/model", "hi")
    assert r.returncode == 2 and ("does not exist" in r.stderr or "no such file" in r.stderr)


def test_bench_step_times_each_format_and_batch(llama_dir, tmp_path):
    out = tmp_path / "step.json"
    r = run("bench", "step", "--model", str(llama_dir), "--weights", "fp32,int8", "--batch", "1,3",
            "--steps", "6", "--threads", "1", "--exit-kv", "lazy,all", "--json", str(out))
    assert r.returncode == 0, r.stderr
    pts = json.loads(out.read_text())["points"]
    assert [(p["weights"], p["batch"], p["fused"], p["exit_kv"]) for p in pts] == [
        (w, b, w == "int8", m) for w in ("fp32", "int8") for b in (1, 3) for m in ("lazy", "all")]
    assert all(p["median_ms"] > 0 and p["p10_ms"] <= p["median_ms"] for p in pts)
    assert pts[4]["linear_mb_per_step"] < pts[0]["linear_mb_per_step"]  # int8 streams fewer bytes
    assert "no lower exit blocks" in r.stdout  # the tiny model has none: lazy and all run alike
    bad = refuses("bench", "step", "--model", str(llama_dir), "--weights", "int3")
    assert bad.returncode != 0 and "--weights" in bad.stderr
    bad = refuses("bench", "step", "--model", str(llama_dir), "--exit-kv", "some")
    assert bad.returncode != 0 and "--exit-kv" in bad.stderr


def test_bench_engine_reports_both_regimes(llama_dir, tmp_path):
    out = tmp_path / "engine.json"
    r = run("bench", "engine", "--model", str(llama_dir), "--tiers", "2,4,6", "--device", "cpu",
            "--num", "5", "--prompt-len", "6,12", "--output-len", "3,5", "--decode-num", "3",
            "--decode-prompt-len", "2,3", "--decode-output-len", "8,8", "--repeats", "1", "--skip-generate",
            "--threads", "1", "--num-blocks", "128", "--json", str(out), "--plot", str(tmp_path / "e.png"))
    assert r.returncode == 0, r.stderr
    res = json.loads(out.read_text())
    assert list(res["regimes"]) == ["compute", "decode"]
    dec = res["regimes"]["decode"]
    assert dec["workload"]["num"] == 3 and dec["workload"]["tokens"] == 24  # 3 requests x 8 tokens
    for reg in res["regimes"].values():
        assert reg["nested"]["tokens_per_s"] > 0 and reg["ratios"]["tokens_per_s"] > 0
        assert reg["ratios"]["weights"] < 1  # one nested copy of the weights, not three
        assert len(reg["ratios"]["tokens_per_s_per_repeat"]) == 1
    assert res["compiled"] is False and res["compile_warmup_s"] == []
    assert (tmp_path / "e.png").stat().st_size > 0
    bad = refuses("bench", "engine", "--model", str(llama_dir), "--json", str(out), "--regimes", "fast")
    assert bad.returncode != 0 and "--regimes" in bad.stderr


def test_bench_engine_compile_compiles_both_layouts_before_timing(llama_dir, tmp_path, monkeypatch):
    """--compile: the nested model and each standalone tier get compiled decode graphs, built by a
    warm-up before any timed run (compile_decode and warm_up are recorded, not run: the real
    compilation is covered in tests/test_compiled_step.py and costs minutes per model)."""
    import argparse

    from benches import engine as bench_engine
    from worker.runner import ModelRunner
    calls = []
    monkeypatch.setattr(bench_engine, "compile_decode", lambda m, enable=True: calls.append(("compile", id(m))))
    monkeypatch.setattr(ModelRunner, "warm_up", lambda self, steps=2: calls.append(("warm", id(self.model))) or 1.5)
    p = argparse.ArgumentParser()
    bench_engine.add_parser(p.add_subparsers())
    out = tmp_path / "engine.json"
    args = p.parse_args(["engine", "--model", str(llama_dir), "--tiers", "2,4,6", "--device", "cpu",
                         "--regimes", "decode", "--decode-num", "3", "--decode-prompt-len", "2,3",
                         "--decode-output-len", "4,4", "--repeats", "1", "--skip-generate", "--threads", "1",
                         "--num-blocks", "128", "--compile", "--json", str(out)])
    import torch
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)  # --threads 1 must not slow later tests
    assert args.func(args) == 0
    models = [m for kind, m in calls if kind == "compile"]
    assert len(models) == 4 and len(set(models)) == 4  # nested + three standalone tiers
    assert calls == [x for m in models for x in (("compile", m), ("warm", m))]  # each warmed right after
    res = json.loads(out.read_text())
    assert res["compiled"] is True and res["compile_warmup_s"] == [1.5] * 4


def test_bench_peers_runs_each_contender_side_by_side(tmp_path, frontend):
    """A tiny model over the real tokenizer (an HF folder: llama.cpp is skipped with the reason):
    every MFS mode and transformers answer the same prompts, with perplexities that agree in fp32."""
    from tests.support.factories import tiny_llama_with_tokenizer
    from family.manifest import manifest_for
    family = tiny_llama_with_tokenizer(tmp_path / "fam", frontend.tokenizer)
    tiers = len(manifest_for(str(family))[0].tiers)
    out = tmp_path / "peers.json"
    mix = ",".join(["1"] * tiers)
    r = run("bench", "peers", "--model", str(family), "--modes", "fp32,int4", "--prompt-len", "4",
            "--new-tokens", "3", "--concurrency", str(tiers), "--mix", mix, "--heldout-tokens", "64",
            "--seq-len", "32", "--threads", "1", "--json", str(out), env={"TMPDIR": str(tmp_path)})
    assert r.returncode == 0, r.stderr[-3000:]
    assert not list(tmp_path.glob("mfs-peers-*"))  # the contenders' logs go after a clean run
    res = json.loads(out.read_text())
    assert [x["name"] for x in res["results"]] == ["mfs fp32", "mfs int4", "transformers generate fp32"]
    assert res["machine"]["device"] == "cpu"
    assert any("llama.cpp" in n for n in res["notes"])
    for x in res["results"]:
        assert x["single"]["tokens"] == 3 and x["concurrent"]["tokens"] == 3 * tiers
        assert x["single"]["tokens_per_s"] > 0 and x["rss_bytes"] > 0
    fp32, int4, hf = res["results"]
    assert fp32["ppl_top"] == pytest.approx(hf["ppl_top"], rel=1e-4)
    assert int4["weights_bytes"] < fp32["weights_bytes"]



def test_bench_startup_times_each_stage_in_fresh_processes(tmp_path, frontend):
    from tests.support.factories import tiny_llama_with_tokenizer
    family = tiny_llama_with_tokenizer(tmp_path / "fam", frontend.tokenizer)
    out = tmp_path / "startup.json"
    r = run("bench", "startup", "--model", str(family), "--weights", "fp32", "--runs", "1", "--tokens", "2",
            "--json", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    assert set(res["seconds"]) == {"load_family", "load_frontend", "generate"}
    assert all(len(v) == 1 and v[0] > 0 for v in res["seconds"].values())
    assert res["machine"]["cpu"] and "median" in r.stdout
    bad = refuses("bench", "startup", "--runs", "0")
    assert bad.returncode == 2 and "--runs and --tokens must be at least 1" in bad.stderr
    missing = refuses("bench", "startup", "--model", str(tmp_path / "nowhere"), "--runs", "1")
    assert missing.returncode == 1 and "mfs bench startup: load_family failed (exit 1): " in missing.stderr
    assert "no such file or directory" in missing.stderr

def test_bench_peers_rounds_give_medians_and_ratios_within_each_round(tmp_path):
    """--repeats: each figure is the median over rounds, and a ratio to llama.cpp pairs the runs of one
    round (neighbours in time), then takes the median."""
    from benches.peers_report import merge_rounds, ratios_vs_llama_cpp

    def rec(name, tps, mix=None, rss=100):
        run_ = {"tokens_per_s": tps, "tpot_ms": 1e3 / tps, "ttft_ms": 5.0, "wall_s": 64 / tps}
        r = {"name": name, "single": dict(run_), "concurrent": dict(run_), "rss_bytes": rss, "ppl_top": 9.5}
        if mix:
            r["family_mix"] = dict(run_, tokens_per_s=mix)
        return r
    llama = "llama.cpp (GGUF as shipped)"
    rounds = [[rec("mfs int4", 100, 300, rss=120), rec(llama, 80)], [rec("mfs int4", 90, 280), rec(llama, 100)],
              [rec("mfs int4", 110, 290), rec(llama, 90)]]
    m = merge_rounds([r[0] for r in rounds])
    assert m["single"]["tokens_per_s"] == 100 and m["family_mix"]["tokens_per_s"] == 290
    assert m["rss_bytes"] == 120 and [x["single"]["tokens_per_s"] for x in m["rounds"]] == [100, 90, 110]
    ratio = ratios_vs_llama_cpp(rounds)["mfs int4"]
    assert ratio["single"] == [1.25, 0.9, 1.222] and ratio["single_median"] == 1.222
    assert ratio["family_mix_median"] == 3.222  # 290 / 90 in the third round
    assert ratios_vs_llama_cpp([[rec("mfs int4", 100)]]) == {}  # no llama.cpp, no ratio
    r = refuses("bench", "peers", "--repeats", "0", "--json", str(tmp_path / "p.json"))
    assert r.returncode == 2 and "--repeats" in r.stderr


def test_up_refuses_compile_with_the_wrong_kernels_before_starting_anything():
    r = refuses("up", "--compile", "--device", "cuda", "--kernels", "torch", "--port", "0")
    assert r.returncode == 2 and "--compile on CUDA records CUDA graphs of the Triton ops" in r.stderr
    assert "starting" not in r.stdout
    r = refuses("up", "--compile", "--device", "cpu", "--kernels", "triton", "--port", "0")
    assert r.returncode == 2 and "--compile on CPU compiles the torch ops" in r.stderr
    r = refuses("up", "--compile", "--weights", "w8a8", "--device", "cpu", "--port", "0")
    assert r.returncode == 2 and "--compile does not serve --weights w8a8" in r.stderr
    assert "starting" not in r.stdout


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the message without CUDA")
def test_bench_peers_on_cuda_without_one_fails_fast(tmp_path):
    r = refuses("bench", "peers", "--device", "cuda", "--json", str(tmp_path / "p.json"))
    assert r.returncode == 2 and "CUDA is not available" in r.stderr
    assert not (tmp_path / "p.json").exists()
    r = refuses("bench", "peers", "--modes", "int4,int3+compile", "--json", str(tmp_path / "p.json"))
    assert r.returncode == 2 and "unknown int3+compile" in r.stderr
    r = refuses("bench", "peers", "--modes", "w8a8+compile", "--json", str(tmp_path / "p.json"))
    assert r.returncode == 2 and "unknown w8a8+compile" in r.stderr


def test_a_command_imports_only_its_own_module_and_the_table_names_what_each_registers(monkeypatch):
    import subprocess
    import sys

    script = ("import sys; from mfs.cli import build_parser; build_parser(sys.argv[1:]).parse_args(sys.argv[1:]); "
              "print(sorted(m for m in ('benches.engine', 'benches.peers', 'training.precipitate', "
              "'evaluation.evaluate') if m in sys.modules))")
    got = {argv[0] + (" " + argv[1] if len(argv) > 1 else ""): subprocess.run(
        [sys.executable, "-c", script, *argv], capture_output=True, text=True, check=True).stdout.strip()
        for argv in (["tiers"], ["bench", "engine", "--json", "x.json"])}
    assert got == {"tiers": "[]", "bench engine": "['benches.engine']"}
    from mfs import cli
    parser = cli.build_parser()  # every command: the names checked against what each module registers
    assert set(parser._subparsers._group_actions[0].choices) == {n for n, _, _ in cli.COMMANDS} | {"bench"}
    monkeypatch.setattr(cli, "COMMANDS", [("generat", "mfs.commands", "add_generate")])
    with pytest.raises(RuntimeError, match="names 'generat' for mfs.commands.add_generate"):
        cli.build_parser()
