"""``mfs precipitate --method exit-blocks`` and ``mfs gpu-precipitate --dry-run`` on a tiny random
Llama with a char tokenizer (CPU, seconds): the trunk stays the original, the lower tiers' held-out
loss falls, the run resumes where it stopped, and options of the other method are refused."""
from __future__ import annotations

import json

import pytest
import torch

from mfs.cli import main as mfs_main
from family.manifest import Manifest
from worker.family import load_family
from tests.support.precipitate import tiny  # noqa: F401 - the module fixture


def _run(base, data, out, *extra):
    argv = ["precipitate", "--method", "exit-blocks", "--base", str(base), "--tiers", "2,3,4",
            "--data", str(data), "--out", str(out), "--seq-len", "32", "--cache-tokens", "1024",
            "--heldout-tokens", "256", "--batch-size", "4", "--topk", "8", "--lr", "3e-3",
            "--save-every-min", "0", "--threads", "1", "--autocast", "none", *extra]
    return mfs_main(argv)


def test_exit_blocks_train_on_a_frozen_trunk_and_resume(tiny, tmp_path, capsys):  # noqa: F811
    base, txt = tiny
    out = tmp_path / "eb"
    assert _run(base, txt, out, "--steps", "20", "--eval-every", "10", "--patience", "0") == 0
    evals = [json.loads(x) for x in (out / "eval_log.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evals] == [0, 10, 20]
    for name in ("small", "medium"):  # held-out perplexity of the lower tiers falls
        assert evals[-1][f"{name}_ppl"] < evals[0][f"{name}_ppl"]
    m = Manifest.read(out)
    assert m.weights == {"kind": "exit", "file": "exit-blocks.safetensors"}
    assert [t.block_layers for t in m.tiers] == [1, 1, 0]
    assert set(m.quality) == {"floor", "small", "medium"}
    fam = load_family(str(out))
    orig = load_family(str(base), tiers="2,3,4")
    ids = torch.tensor([[5, 9, 23, 71, 2, 40, 41]])
    with torch.no_grad():
        new, old = fam.model.exit_hidden(ids), orig.model.exit_hidden(ids)
        assert torch.equal(fam.model.logits(new[-1]), orig.model.logits(old[-1]))  # top tier: the original
        assert not torch.allclose(new[0], old[0])
    # resume: the cache is reused and training continues from step 20
    assert _run(base, txt, out, "--steps", "30", "--eval-every", "10", "--patience", "0", "--resume",
                "--max-minutes", "10", "--decay-minutes", "5") == 0
    assert "feature cache complete" in capsys.readouterr().out
    evals = [json.loads(x) for x in (out / "eval_log.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evals] == [0, 10, 20, 30]


def test_each_method_refuses_the_others_options(tiny, tmp_path, capsys):  # noqa: F811
    base, txt = tiny
    assert _run(base, txt, tmp_path / "x", "--lora-rank", "8") == 2
    assert "--lora-rank is not an option of --method exit-blocks" in capsys.readouterr().err
    argv = ["precipitate", "--base", str(base), "--data", str(txt), "--out", str(tmp_path / "y"),
            "--topk", "16"]
    assert mfs_main(argv) == 2
    assert "--topk is not an option of --method lora" in capsys.readouterr().err


def test_gpu_precipitate_fails_fast_without_cuda_and_dry_runs_on_cpu(tiny, tmp_path, capsys):  # noqa: F811
    base, txt = tiny
    if not torch.cuda.is_available():
        assert mfs_main(["gpu-precipitate", "--out", str(tmp_path / "g"), "--base", str(base)]) == 2
        assert "no CUDA device" in capsys.readouterr().err
        assert not (tmp_path / "g").exists()
    out = tmp_path / "dry"
    rc = mfs_main(["gpu-precipitate", "--dry-run", "--method", "exit-blocks", "--out", str(out),
                   "--base", str(base), "--tiers", "2,3,4", "--data", str(txt), "--threads", "1"])
    assert rc == 0
    res = json.loads((out / "eval.json").read_text())
    assert res["gpu_precipitate"]["device"] == "cpu (dry run)"
    assert [t["name"] for t in res["tiers"]] == ["small", "medium", "large"]
    assert res["ratios"]["top_vs_original"] == pytest.approx(1.0)


def test_bench_route_measures_every_policy(tiny, tmp_path):  # noqa: F811
    base, _ = tiny
    out = tmp_path / "route.json"
    rc = mfs_main(["bench", "route", "--model", str(base), "--num-prompts", "3", "--max-tokens", "4",
                   "--threads", "1", "--json", str(out), "--plot", str(tmp_path / "route.png")])
    assert rc == 0
    res = json.loads(out.read_text())
    by = {p["policy"]: p for p in res["points"]}
    assert {"always-top", "always-small", "keyword", "confidence@0.5",
            "confidence@0.5+cascade@0.4"} <= set(by)
    # a 4-layer model cut in thirds (rounded): tiers of 1, 3 and 4 layers, no quality record
    assert res["usable_tiers"] == ["small", "medium", "large"]
    assert by["always-small"]["cost_vs_top"] == pytest.approx(1 / 4)
    assert by["always-top"]["cost_vs_top"] == 1.0
    assert all(0 <= p["agreement"] <= 1 for p in res["points"])
    assert (tmp_path / "route.png").stat().st_size > 0
    assert by["always-top"]["below_top"] == 0 and by["always-small"]["below_top"] == 1
    # a keyword-checked workload: each policy counts its answers with a keyword, always-top's is the unit
    qfile = tmp_path / "q.jsonl"
    qfile.write_text("".join(json.dumps({"question": q, "keywords": k}) + "\n" for q, k in
                             [("Name a colour.", ["red", "blue"]), ("Say hi.", ["hi"]), ("Count to two.", ["two"])]))
    assert mfs_main(["bench", "route", "--model", str(base), "--questions", str(qfile), "--max-tokens", "4",
                     "--threads", "1", "--json", str(out)]) == 0
    res = json.loads(out.read_text())
    assert res["prompts"] == 3 and res["questions_file"] == str(qfile)
    assert all(0 <= p["answered"] <= 3 and "answered_vs_top" in p for p in res["points"])


def test_a_warm_start_with_an_added_layer_begins_where_the_artifact_ended(tiny, tmp_path, capsys):  # noqa: F811
    """--init-from an earlier artifact, --block-layers 2,1: the small tier gets a second block layer that
    starts as the identity, so the first evaluation equals the artifact's; the medium tier is loaded as is."""
    base, txt = tiny
    first, second = tmp_path / "first", tmp_path / "second"
    assert _run(base, txt, first, "--steps", "10", "--eval-every", "10", "--patience", "0") == 0
    art = [json.loads(x) for x in (first / "eval_log.jsonl").read_text().splitlines()][-1]
    assert _run(base, txt, second, "--steps", "10", "--eval-every", "10", "--patience", "0", "--block-layers",
                "2,1", "--init-from", str(first / "exit-blocks.safetensors")) == 0
    start = [json.loads(x) for x in (second / "eval_log.jsonl").read_text().splitlines()][0]
    assert start["step"] == 0
    for k in ("small_ppl", "medium_ppl", "small_agree_top", "medium_agree_top"):  # fp16 export rounding
        assert start[k] == pytest.approx(art[k], rel=2e-3), k
    assert [t.block_layers for t in Manifest.read(second).tiers] == [2, 1, 0]
    fam = load_family(str(second))
    assert [len(fam.model.exit_block(t)) for t in (0, 1)] == [2, 1]
    capsys.readouterr()
    # fewer layers than the artifact has, or a count per tier that does not fit: refused, said why
    assert _run(base, txt, tmp_path / "third", "--steps", "1", "--block-layers", "1,1", "--init-from",
                str(second / "exit-blocks.safetensors")) == 2
    assert "--block-layers may only add layers" in capsys.readouterr().err
    assert _run(base, txt, tmp_path / "fourth", "--steps", "1", "--block-layers", "2,1,1") == 2
    assert "one count >= 1, or one per lower tier" in capsys.readouterr().err


def test_answer_sources_take_what_they_have_and_text_sources_share_the_rest():
    from training.exit_features import training_windows  # noqa: PLC0415

    class Tok:  # encode_docs needs only encode for plain texts
        def encode(self, text, add_special_tokens=False):
            return [int(w) for w in text.split()]

    def docs(start, n):  # one document of n tokens, values marking the source
        return [" ".join(str(start + i % 100) for i in range(n))]

    seq = 8
    src = [("stdlib", docs(1000, 400)), ("self", docs(0, 60)), ("chat", docs(200, 30)),
           ("packages", docs(2000, 400))]
    w, mix = training_windows(src, Tok(), 9999, seq, 40 * seq, seed=3)
    # encode_docs appends EOS per document: 61 and 31 tokens -> 7 and 3 whole windows
    assert mix == {"self": 7 * seq, "chat": 3 * seq, "packages": 15 * seq, "stdlib": 15 * seq}
    assert w.shape == (40, seq)
    first = w[:, 0]
    assert int(((first >= 200) & (first < 300)).sum()) == 3  # every chat window is in
    # the order of --data does not matter; without 'chat' the text sources share what it left
    assert torch.equal(w, training_windows(src[::-1], Tok(), 9999, seq, 40 * seq, seed=3)[0])
    _, mix2 = training_windows([s for s in src if s[0] != "chat"], Tok(), 9999, seq, 40 * seq, seed=3)
    assert mix2 == {"self": 7 * seq, "packages": 16 * seq, "stdlib": 17 * seq}


def test_the_feature_cache_key_follows_the_answer_prompt_lists(monkeypatch):
    from training import data as D  # noqa: PLC0415
    assert D.answer_prompts_digest("stdlib,/some/file.txt") == ""
    a = D.answer_prompts_digest("self,chat,stdlib")
    assert a == D.answer_prompts_digest("chat, self") and a != D.answer_prompts_digest("self")
    monkeypatch.setattr(D, "CHAT_PROMPTS", D.CHAT_PROMPTS + ["What is a new prompt?"])
    assert D.answer_prompts_digest("self,chat,stdlib") != a


def test_vocab_prompts_are_seeded_distinct_and_avoid_the_evaluation_words(frontend):
    import re  # noqa: PLC0415

    from training import data as D  # noqa: PLC0415
    tok = frontend.tokenizer
    ps = D.vocab_prompts(tok, 300)
    assert len(ps) == len(set(ps)) == 300 and ps == D.vocab_prompts(tok, 300)
    assert ps != D.vocab_prompts(tok, 300, seed=1)
    banned = D._eval_words()
    assert {"paris", "honey", "france", "capital", "dogs", "mona"} <= banned
    evals = set(D.EVAL_QUESTIONS) | set(D.EVAL_QUESTIONS_LARGE) | set(D.HELDOUT_PROMPTS)
    for p in ps:
        assert p not in evals
        word = next(g for g in re.search(r'"([a-z]+)"|about ([a-z]+)\.', p).groups() if g)
        assert word not in banned and all(word[:4] != b[:4] for b in banned if len(b) >= 4), p
    with pytest.raises(ValueError, match="positive"):
        D.answer_prompts_digest("vocab:0", tok)
    with pytest.raises(ValueError, match="eligible words"):
        D.vocab_prompts(tok, 10**6)
    # the count is part of the feature cache's key; the vocab source needs the tokenizer
    assert D.answer_prompts_digest("vocab:100", tok) != D.answer_prompts_digest("vocab:101", tok)
    with pytest.raises(ValueError, match="tokenizer"):
        D.answer_prompts_digest("self,vocab")


def test_names_prompts_ask_about_proper_names_never_evaluation_words(frontend):
    import re  # noqa: PLC0415

    from training import data as D  # noqa: PLC0415
    tok = frontend.tokenizer
    ps = D.names_prompts(tok, 300)
    assert len(ps) == len(set(ps)) == 300 and ps == D.names_prompts(tok, 300)
    assert ps != D.names_prompts(tok, 300, seed=1)
    spaced = {t[1:] for t in tok.get_vocab() if t.startswith("\u0120")}
    banned = D._eval_words()
    evals = set(D.EVAL_QUESTIONS) | set(D.EVAL_QUESTIONS_LARGE) | set(D.HELDOUT_PROMPTS)
    words = []
    for p in ps:
        assert p not in evals
        word = re.fullmatch(r"(?:Tell me about|What is|Give me one fact about) ([A-Za-z]+)(?: known for\?|\.)",
                            p).group(1)
        # a capitalised vocabulary word without a lowercase twin, never an evaluation word or its stem
        assert word[0].isupper() and word[1:].islower() and word in spaced and word.lower() not in spaced, p
        low = word.lower()
        assert low not in banned and all(low[:4] != b[:4] for b in banned if len(b) >= 4), p
        words.append(word)
    assert len(set(words)) == 300
    with pytest.raises(ValueError, match="positive"):
        D.answer_prompts_digest("names:x", tok)
    with pytest.raises(ValueError, match="eligible words"):
        D.names_prompts(tok, 10**6)
    assert D.answer_prompts_digest("names:100", tok) != D.answer_prompts_digest("vocab:100", tok)
    assert D.answer_prompts_digest("vocab:50,names:50", tok) != D.answer_prompts_digest("vocab:50", tok)


def test_answers_are_saved_batch_by_batch_and_a_stopped_run_resumes(tiny, tmp_path, monkeypatch):  # noqa: F811
    from training import data as D  # noqa: PLC0415
    base, _ = tiny
    fam = load_family(str(base), tiers="2,3,4", dtype="float64")  # batch-invariant greedy answers
    prompts = [f"say {c}" for c in "abcdefg"]
    full = D.self_records(fam.model, fam.tokenizer, prompts, tmp_path / "full.jsonl", max_tokens=6)
    assert [r["prompt"] for r in full] == prompts
    # a run stopped after three answers, killed in the middle of writing the fourth
    part = tmp_path / "part.jsonl"
    lines = (tmp_path / "full.jsonl").read_text().splitlines(keepends=True)
    part.write_text("".join(lines[:3]) + lines[3][:9])
    asked: list[list[str]] = []
    real = D.generate_answers

    def spy(model, tokenizer, ps, *a, **kw):
        asked.append(list(ps))
        return real(model, tokenizer, ps, *a, **kw)

    monkeypatch.setattr(D, "generate_answers", spy)
    resumed = D.self_records(fam.model, fam.tokenizer, prompts, part, max_tokens=6)
    assert asked == [prompts[3:]]  # only what was missing is generated again
    assert resumed == full and part.read_text() == (tmp_path / "full.jsonl").read_text()
    # a complete cache is read, not regenerated; another prompt list starts over
    assert D.self_records(fam.model, fam.tokenizer, prompts, part, max_tokens=6) == full and len(asked) == 1
    other = D.self_records(fam.model, fam.tokenizer, ["say z"] + prompts[1:], part, max_tokens=6)
    assert asked[-1] == ["say z"] + prompts[1:] and other[1:] == full[1:]
