"""Loading base weights: the default GGUF's dequantized cache, and a HF directory after its first load,
are read without transformers (a worker's start), and what that reads equals what transformers reads
from the same folder; the tokenizer is read only when first asked for."""
import json
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from family.manifest import manifest_for, resolve_base
from family.source import locate, resolve_cached, split_source
from worker.config import ModelConfig
from tests.support.factories import tiny_llama, tiny_qwen2
from tests.support.wait import pace
from family.loader import _read_fast, load_base

PROBE = """
import json, sys
from family.loader import load_base
base = load_base(sys.argv[1])
before = {m: m in sys.modules for m in ("transformers", "torch._dynamo")}
tok = base.tokenizer
print(json.dumps({"before": before, "after": "transformers" in sys.modules,
                  "paris": tok.decode(tok.encode(" Paris")), "keys": len(base.state_dict)}))
"""


def _default_gguf() -> str:
    manifest, mdir = manifest_for("default")
    path = resolve_base(manifest.base, mdir)
    folder, _ = resolve_cached(path)
    if folder == split_source(path)[0]:  # no cache yet: the first load writes it
        load_base(path, with_tokenizer=False)
    return str(path)


def test_the_gguf_cache_loads_without_transformers_and_the_tokenizer_only_when_asked():
    path = _default_gguf()
    r = subprocess.run([sys.executable, "-c", PROBE, path], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["before"] == {"transformers": False, "torch._dynamo": False}, out
    assert out["after"] is True and out["paris"] == " Paris" and out["keys"] > 200, out


def _assert_same_as_transformers(folder, own, dtype=torch.float32):
    from transformers import AutoConfig, AutoModelForCausalLM
    own_cfg, own_sd = own
    hf_cfg = AutoConfig.from_pretrained(folder)
    hf_sd = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).state_dict()
    assert sorted(own_sd) == sorted(hf_sd)
    for k, v in hf_sd.items():
        assert own_sd[k].dtype == v.dtype and torch.equal(own_sd[k], v), k
    a, b = ModelConfig.from_hf(own_cfg, set(own_sd)), ModelConfig.from_hf(hf_cfg, set(hf_sd))
    for f in ModelConfig.__dataclass_fields__:
        x, y = getattr(a, f), getattr(b, f)
        assert torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y, (f, x, y)


def test_the_gguf_cache_read_without_transformers_equals_transformers_reading_it():
    folder, gguf = resolve_cached(_default_gguf())
    assert gguf is None
    own = _read_fast(folder, json.loads((folder / "config.json").read_text()), torch.float32)
    _assert_same_as_transformers(folder, own)


def test_a_hf_folder_is_read_without_transformers_from_its_second_load_on(tmp_path, monkeypatch):
    monkeypatch.setenv("MFS_CACHE", str(tmp_path / "cache"))
    makers = {"llama": tiny_llama, "llama-tied": lambda p: tiny_llama(p, tie=True), "qwen2": tiny_qwen2}
    for name, make in makers.items():
        folder = make(tmp_path / name)
        assert not locate(folder).config_cache.exists()
        first = load_base(folder, dtype=torch.float64, with_tokenizer=False)  # transformers, then cached
        assert locate(folder).config_cache.exists()
        own = _read_fast(folder, json.loads(locate(folder).config_cache.read_text())["config"], torch.float64)
        _assert_same_as_transformers(folder, own, torch.float64)
        second = load_base(folder, dtype=torch.float64, with_tokenizer=False)
        assert isinstance(second.hf_config, type(own[0]))  # the fast path: a namespace, not transformers'
        assert all(torch.equal(second.state_dict[k], v) for k, v in first.state_dict.items())
        (folder / "config.json").write_text((folder / "config.json").read_text() + "\n")  # a changed config
        assert not locate(folder).config_cache.exists()  # is read by transformers again
    entries = sorted((tmp_path / "cache" / "config").glob("*.json"))
    assert len(entries) == 3
    shutil.rmtree(tmp_path / "llama")  # a model that is gone: its entry goes with the next write
    load_base(tiny_llama(tmp_path / "another"), with_tokenizer=False)
    sources = {json.loads(e.read_text())["source"] for e in (tmp_path / "cache" / "config").glob("*.json")}
    assert sources == {str((tmp_path / n).resolve()) for n in ("llama-tied", "qwen2", "another")}


def test_the_generic_tokenizer_class_read_directly_equals_autotokenizers_choice():
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    from family.tokenizer import load_tokenizer
    folder, _ = resolve_cached(_default_gguf())
    ours, auto = load_tokenizer(folder, None), AutoTokenizer.from_pretrained(folder)
    assert type(ours) is type(auto) and isinstance(ours, PreTrainedTokenizerFast)
    assert ours.get_vocab() == auto.get_vocab() and ours.chat_template == auto.chat_template
    assert ours.all_special_tokens == auto.all_special_tokens
    assert (ours.eos_token_id, ours.bos_token_id, ours.pad_token_id) == (auto.eos_token_id, auto.bos_token_id,
                                                                        auto.pad_token_id)
    texts = ["The capital of France is", " héllo\tworld\n\n<|im_start|>x", "def f(x):\n    return x ** 2", "日本語"]
    for t in texts:
        assert ours.encode(t) == auto.encode(t) and ours.decode(ours.encode(t)) == auto.decode(auto.encode(t))
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 2?"}]
    assert (ours.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
            == auto.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True))


def test_a_ggufs_cache_is_named_by_its_content_so_copies_share_it(tmp_path, monkeypatch):
    from family.source import gguf_cache_dir
    monkeypatch.setenv("MFS_CACHE", str(tmp_path / "cache"))
    a, b, c = (tmp_path / d for d in ("venv-a", "venv-b", "venv-c"))
    for d in (a, b, c):
        d.mkdir()
    (a / "m.gguf").write_bytes(b"GGUF" + bytes(range(256)) * 64)
    (b / "m.gguf").write_bytes((a / "m.gguf").read_bytes())  # the same file installed elsewhere
    (c / "m.gguf").write_bytes((a / "m.gguf").read_bytes()[:-1] + b"x")  # the same size, other bytes
    first = gguf_cache_dir(a, "m.gguf")
    assert gguf_cache_dir(b, "m.gguf") == first != gguf_cache_dir(c, "m.gguf")
    assert gguf_cache_dir(a, "m.gguf") == first  # the remembered hash
    memos = list((tmp_path / "cache" / "gguf" / "by-path").iterdir())
    assert len(memos) == 3
    for memo in memos:  # a memo read while another process wrote it (empty) once named the cache "gguf/"
        memo.write_text("")
    assert gguf_cache_dir(a, "m.gguf") == first and gguf_cache_dir(c, "m.gguf") != first


def test_processes_loading_one_uncached_gguf_together_dequantize_it_once(tmp_path, monkeypatch):
    """The workers of a cold `mfs up` start together: one dequantizes the GGUF (transformers, here a stand-in
    that takes a while and writes the cache's marker), the others wait on its lock, then read its cache.
    Each load opens the lock file itself, so threads contend as processes do (flock)."""
    import threading

    from family import loader
    monkeypatch.setenv("MFS_CACHE", str(tmp_path / "cache"))
    (tmp_path / "m.gguf").write_bytes(b"GGUF" + bytes(range(256)))
    converted, inside, overlap = [], [0], []

    def convert(src, dtype):
        inside[0] += 1
        overlap.append(inside[0])
        pace(0.5)  # a slow conversion: a second caller arrives while it runs
        src.cache_dir.mkdir(parents=True)
        (src.cache_dir / ".complete").write_text("x")
        converted.append(src.original)
        inside[0] -= 1
        return SimpleNamespace(model_type="llama"), {"w": torch.zeros(1)}

    def read_cached(src, dtype):
        return (SimpleNamespace(model_type="llama"), {"w": torch.ones(1)}) if src.cached else None

    monkeypatch.setattr(loader, "_read_transformers", convert)
    monkeypatch.setattr(loader, "_read_cached", read_cached)
    got = []
    threads = [threading.Thread(target=lambda: got.append(load_base(tmp_path / "m.gguf", with_tokenizer=False)))
               for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert len(converted) == 1 and overlap == [1]  # one conversion, never two at once
    assert sorted(float(b.state_dict["w"]) for b in got) == [0.0, 1.0, 1.0]  # the others read its cache


@pytest.mark.parametrize("written", [True, False])
def test_a_ggufs_first_load_reads_its_tokenizer_from_the_cache_it_wrote(tmp_path, monkeypatch, written):
    """The first load of a GGUF converts its tokenizer into the cache beside the weights; the loaded
    base reads it from there, not from the GGUF's metadata again. A cache that was not written (a failed
    write costs only speed) leaves the tokenizer to the GGUF."""
    from family import loader
    monkeypatch.setenv("MFS_CACHE", str(tmp_path / "cache"))
    (tmp_path / "m.gguf").write_bytes(b"GGUF" + bytes(range(256)))

    def convert(src, dtype):
        if written:
            src.cache_dir.mkdir(parents=True)
            (src.cache_dir / ".complete").write_text("x")
        return SimpleNamespace(model_type="llama"), {"w": torch.zeros(1)}

    monkeypatch.setattr(loader, "_read_transformers", convert)
    base = load_base(tmp_path / "m.gguf")
    src = locate(tmp_path / "m.gguf")
    assert base.tokenizer_from == ((src.cache_dir, None) if written else (tmp_path, "m.gguf"))
    if not written:  # converted again (no cache), and no tokenizer wanted: none read
        assert load_base(tmp_path / "m.gguf", with_tokenizer=False).tokenizer_from is None


def test_a_path_without_a_tokenizer_starts_without_transformers(tmp_path, monkeypatch):
    """A HF folder given as --model: its layer count is read from config.json and, with no tokenizer
    files in it, no tokenizer is looked for; so a worker and a gateway on it (from its second load on)
    never import transformers (~2 s of CPU each on 2 cores). A config that names its layers otherwise
    still goes through transformers' AutoConfig."""
    from transformers import GPT2Config
    monkeypatch.setenv("MFS_CACHE", str(tmp_path / "cache"))
    folder = tiny_llama(tmp_path / "llama", layers=5)
    load_base(folder, with_tokenizer=False)  # the first load writes the config cache
    probe = ("import json, sys\n"
             "from family.manifest import load_frontend, manifest_for\n"
             "from worker.family import load_family\n"
             "fe = load_frontend(sys.argv[1])\n"
             "fam = load_family(sys.argv[1], tiers='2,5')\n"
             "print(json.dumps([manifest_for(sys.argv[1])[0].tiers[-1].layers, fe.tokenizer is None,\n"
             "                  len(fam.model.layers), 'transformers' in sys.modules]))\n")
    r = subprocess.run([sys.executable, "-c", probe, str(folder)], capture_output=True, text=True, timeout=120,
                       cwd=Path(__file__).resolve().parents[1])
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout.splitlines()[-1]) == [5, True, 5, False]
    gpt2 = tmp_path / "gpt2"
    GPT2Config(n_layer=3, n_embd=32, n_head=2).save_pretrained(gpt2)
    assert "num_hidden_layers" not in json.loads((gpt2 / "config.json").read_text())
    assert manifest_for(str(gpt2))[0].tiers[-1].layers == 3


@pytest.mark.parametrize("files", [["tokenizer.json"], ["tokenizer_config.json"], ["vocab.json", "merges.txt"],
                                   ["vocab.txt"], ["spiece.model"], ["tokenizer.model"], ["source.spm"],
                                   ["qwen.tiktoken"], ["tekken.json"], ["prophetnet.tokenizer"], []])
def test_a_folder_is_searched_for_a_tokenizer_where_one_may_be(tmp_path, files):
    """The files AutoTokenizer reads make a folder worth searching; a folder with none is not searched,
    unless its config.json names a tokenizer class (byte-level ones read no file)."""
    from family.tokenizer import _has_tokenizer_files
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    for f in files:
        (tmp_path / f).write_text("{}")
    assert _has_tokenizer_files(tmp_path) == bool(files)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "t5", "tokenizer_class": "ByT5Tokenizer"}))
    assert _has_tokenizer_files(tmp_path)
