"""`mfs bench peers` at scale: the synthetic GGUF writer, the bandwidth floor, the memory of `mfs up`'s
processes, the ratios and tables, and the flags' errors (no llama.cpp needed)."""
from __future__ import annotations

import argparse
import os
import subprocess
import sys

import gguf
import numpy as np
import pytest

from benches import peers, peers_synth
from benches.peers_api import tree_rss_bytes
from benches.peers_floor import bandwidth_gbs, bytes_per_token, floor_record
from benches.peers_report import markdown, ratios_vs_llama_cpp
from tests.support.wait import wait_for

TINY = peers_synth.Shape(layers=2, hidden=64, intermediate=128, heads=4, kv_heads=2, vocab=49152 + 40, tied=False)


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    return peers_synth.write_f16(TINY, tmp_path_factory.mktemp("synth") / "tiny.gguf", seed=3, say=lambda m: None)


def test_the_named_shapes_are_llama_3_2_sizes():
    assert 1.2e9 < peers_synth.SHAPES["llama-1b"].params() < 1.3e9      # Llama 3.2 1B: 1.24 B
    assert 3.1e9 < peers_synth.SHAPES["llama-3b"].params() < 3.3e9      # Llama 3.2 3B: 3.21 B


def test_the_synthetic_gguf_has_the_shape_in_f16_with_a_padded_smollm2_tokenizer(tiny_gguf):
    r = gguf.GGUFReader(str(tiny_gguf))
    got = {t.name: (tuple(int(x) for x in reversed(t.shape)), t.tensor_type.name) for t in r.tensors}
    want = {name: (s, "F32" if len(s) == 1 else "F16") for name, s in TINY.tensors()}
    assert got == want and ("output.weight" in got) is not TINY.tied
    tokens = r.fields["tokenizer.ggml.tokens"].contents()
    assert len(tokens) == TINY.vocab and tokens[-1] == "<|reserved_special_token_39|>"
    assert r.fields["llama.attention.head_count_kv"].contents() == 2
    up = next(t for t in r.tensors if t.name == "blk.1.ffn_up.weight").data.astype(np.float32)
    assert 0.018 < float(up.std()) < 0.022 and abs(float(up.mean())) < 2e-3
    norm = next(t for t in r.tensors if t.name == "blk.0.attn_norm.weight").data
    assert (norm == 1).all()


def test_transformers_reads_the_synthetic_gguf_as_that_llama(tiny_gguf):
    from transformers import AutoConfig
    c = AutoConfig.from_pretrained(tiny_gguf.parent, gguf_file=tiny_gguf.name)
    assert (c.model_type, c.num_hidden_layers, c.hidden_size, c.intermediate_size) == ("llama", 2, 64, 128)
    assert (c.num_attention_heads, c.num_key_value_heads, c.vocab_size) == (4, 2, TINY.vocab)


def test_the_same_seed_writes_the_same_file_and_another_seed_does_not(tiny_gguf, tmp_path):
    say = lambda m: None  # noqa: E731
    again = peers_synth.write_f16(TINY, tmp_path / "again.gguf", seed=3, say=say)
    other = peers_synth.write_f16(TINY, tmp_path / "other.gguf", seed=4, say=say)
    assert again.read_bytes() == tiny_gguf.read_bytes()
    assert other.read_bytes() != tiny_gguf.read_bytes()
    with pytest.raises(ValueError, match="at least that"):
        peers_synth.write_f16(peers_synth.Shape(1, 64, 128, 4, 2, vocab=1000, tied=True), tmp_path / "x.gguf")


def test_make_reuses_the_cache_and_quantizes_a_missing_file_once(tmp_path, monkeypatch):
    made = []

    def quantize(src, dst, threads, say):
        made.append((src.name, dst.name, threads))
        dst.write_bytes(b"q")
        return dst
    monkeypatch.setattr(peers_synth, "quantize", quantize)
    monkeypatch.setattr(peers_synth, "write_f16", lambda shape, path, seed, say: path.write_bytes(b"f") or path)
    first = peers_synth.make("llama-1b", threads=2, seed=7, cache=tmp_path)
    again = peers_synth.make("llama-1b", threads=2, seed=7, cache=tmp_path)
    assert first == again == tmp_path / "llama-1b-seed7.Q4_K_M.gguf"
    assert made == [("llama-1b-seed7.f16.gguf", "llama-1b-seed7.Q4_K_M.gguf", 2)]
    requantized = peers_synth.make("smollm2-q4km", cache=tmp_path)
    assert made[-1][0] == peers_synth.smollm2_gguf().name and requantized.name == "smollm2-q4km.Q4_K_M.gguf"
    with pytest.raises(ValueError, match="expected one of llama-1b"):
        peers_synth.make("llama-70b", cache=tmp_path)


def test_the_bandwidth_probe_and_the_floor(tiny_gguf):
    gbs = bandwidth_gbs(1, mib=64, repeats=2)
    assert gbs > 0.1
    with pytest.raises(ValueError, match="threads 0"):
        bandwidth_gbs(0)
    per_token = bytes_per_token(tiny_gguf)  # its own head: the embedding is one row a token
    embd = TINY.vocab * TINY.hidden * 2
    assert per_token == sum(int(np.prod(s)) * (4 if len(s) == 1 else 2) for _, s in TINY.tensors()) - embd
    f = floor_record(per_token, [gbs / 2, gbs])
    assert f["floor_tokens_per_s"] == pytest.approx(gbs * 1e9 / per_token) and f["bandwidth_gbs"] == gbs
    assert floor_record(None, [gbs]) is None


def test_mfs_up_memory_is_found_by_parent_and_named_by_role():
    """`mfs up`'s children start in sessions of their own: they are found below it by parent."""
    child = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()", "-m", "worker"],
                             stdin=subprocess.PIPE, start_new_session=True)
    try:
        got = wait_for(lambda: tree_rss_bytes(os.getpid()).get("worker"), timeout=30, what="the child's memory")
        assert got > 0 and tree_rss_bytes(os.getpid())["other"] > 0  # this process itself
    finally:
        child.stdin.close()
        child.wait(30)


def _rec(name, single, conc=None, ttft=None, rss=100, worker=None):
    r = {"name": name, "single": {"tokens_per_s": single, "tpot_ms": 1.0}, "rss_bytes": rss, "ppl_top": 1.0}
    if conc:
        r["concurrent"] = {"tokens_per_s": conc, "tpot_ms": 1.0}
    if ttft:
        r["long_prompt"] = {"prompt_tokens": 1024, "ttft_ms": ttft}
    if worker:
        r["worker_rss_bytes"] = worker
    return r


def test_ratios_and_the_markdown_table_against_llama_cpps_single_stream():
    mfs = _rec("mfs api (mfs up defaults)", 12.0, conc=60.0, ttft=500.0, rss=900 * 2**20, worker=300 * 2**20)
    llama = _rec("llama.cpp (GGUF as shipped)", 10.0, ttft=1000.0, rss=550 * 2**20)
    llama["model_rss_bytes"] = 250 * 2**20  # less the bench's interpreter and torch
    q = ratios_vs_llama_cpp([[mfs, llama]])["mfs api (mfs up defaults)"]
    assert (q["single_median"], q["concurrent_median"], q["ttft_long_median"], q["memory_median"]) == (1.2, 6.0, 0.5, 1.2)
    out = {"model": "m.gguf", "concurrency": 16, "long_prompt": 1024, "date": "d", "notes": ["a note"],
           "machine": {"cpu": "Some CPU", "cpu_capability": "AVX2", "threads": 2, "load_start": [1.0, 1, 1],
                       "load_end": [2.0, 1, 1]},
           "floor": {"bandwidth_gbs": 8.0, "bandwidth_probes_gbs": [7.5, 8.0], "bytes_per_token": 400e6,
                     "floor_tokens_per_s": 20.0},
           "results": [mfs, llama], "vs_llama_cpp": {"mfs api (mfs up defaults)": q}}
    md = markdown(out).splitlines()
    row = next(ln for ln in md if ln.startswith("| mfs api"))
    assert row.split(" | ")[1:10] == ["12.0", "0.60", "1.20", "60.0", "6.00", "500", "0.50", "300", "1.20"]
    assert next(ln for ln in md if ln.startswith("| llama.cpp")).split(" | ")[4] == "-"  # no concurrent run
    assert any("20.0 tok/s" in ln for ln in md) and "Some CPU" in md[0] and "- a note" in md



def test_the_printed_table_keeps_a_large_perplexity_apart_from_the_weights_column(capsys):
    """A random-weight 128k-vocabulary model's perplexity (~2e5) once ran into the "-" of the api row's
    weights column and read as a negative number."""
    from benches.peers_report import print_table
    mfs = _rec("mfs api (mfs up defaults)", 12.0, conc=60.0, ttft=500.0, rss=900 * 2**20, worker=300 * 2**20)
    mfs["ppl_top"] = 197550.744
    print_table({"concurrency": 16, "results": [mfs], "machine": {"cpu": "Some CPU", "threads": 2}, "notes": []})
    row = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("mfs api"))
    assert row.split()[-2:] == ["-", "197550.744"]

def _args(*argv):
    p = argparse.ArgumentParser()
    peers.add_parser(p.add_subparsers())
    return p.parse_args(["peers", *argv])


@pytest.mark.parametrize("argv,message", [
    (["--make-synthetic", "llama-9b"], "expected one of llama-1b, llama-3b, smollm2-q4km"),
    (["--make-synthetic", "llama-1b", "--model", "x.gguf"], "give it or --model, not both"),
    ([], "--json is required"),
    (["--long-prompt", "-5", "--json", "x"], "--long-prompt -5"),
    (["--modes", "fp32", "--up-args", "--threads 2", "--json", "x"], "only --modes api starts"),
    (["--threads", "0", "--json", "x"], "--threads 0"),
])
def test_the_flags_errors_say_what_is_wrong(argv, message):
    assert message in peers._arg_error(_args(*argv))


def test_making_a_file_without_llama_cpp_says_how_to_build_it(monkeypatch, capsys):
    from benches import llama_build
    monkeypatch.setattr(llama_build, "installed", lambda: False)
    monkeypatch.setattr(llama_build, "build", lambda say: pytest.fail("built without --build-llama-cpp"))
    assert peers.run(_args("--make-synthetic", "llama-1b")) == 2
    assert "--build-llama-cpp" in capsys.readouterr().err
