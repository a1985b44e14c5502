"""The local multiple-choice tasks (evals/, evaluation/mc_tasks.py): built from data the project ships,
never from a training source, at least 200 items each, and scored per tier the way lm-eval's ``acc`` is."""
from __future__ import annotations

import json

import torch
import torch.nn.functional as F

from evaluation import mc_tasks
from tests.support.precipitate import tiny  # noqa: F401 - the module fixture
from worker.family import load_family


def test_generated_tasks_are_shipped_true_and_disjoint_from_training():
    """Every shipped item is checked against its source (the module defines the function; the
    character has that Unicode name); no module of the stdlib task is a training source."""
    import importlib  # noqa: PLC0415
    import re  # noqa: PLC0415
    import unicodedata  # noqa: PLC0415

    from training.prompts import STDLIB_TRAIN  # noqa: PLC0415
    for name in ("stdlib_modules", "unicode_names"):
        items = mc_tasks.load_task(name)
        assert len(items) >= 200
        for it in items:
            assert it.source and len(it.choices) == 4 and len(set(it.choices)) == 4 and 0 <= it.answer < 4
            right = it.choices[it.answer].strip()
            if name == "stdlib_modules":
                func = re.search(r"function (\w+)\(\)", it.prompt).group(1)
                assert right not in STDLIB_TRAIN and callable(getattr(importlib.import_module(right), func))
            else:
                ch = re.search(r"character (.)\?", it.prompt).group(1)
                assert unicodedata.name(ch).lower() == right
    assert len(mc_tasks.load_task("capitals")) == 134
    assert len(mc_tasks.build_unicode_names()) == 300  # the builder still builds (deterministic seed)


def test_scores_are_choice_log_likelihoods_per_tier(tiny):  # noqa: F811
    base, _ = tiny
    fam = load_family(str(base), tiers="2,3,4", dtype="float64")
    items = mc_tasks.load_task("unicode_names")[:5]
    sc = mc_tasks.score_items(fam.model, fam.tokenizer, items, batch=3)
    assert len(sc) == 3 and all(len(t) == 5 for t in sc)
    it = items[0]  # one choice scored by hand, alone and unpadded
    tok = fam.tokenizer
    ctx = tok.encode(it.prompt, add_special_tokens=False)
    full = tok.encode(it.prompt + it.choices[1], add_special_tokens=False)
    with torch.no_grad():
        hs = fam.model.exit_hidden(torch.tensor([full]))
        for t in range(3):
            lp = F.log_softmax(fam.model.logits(hs[t][0, len(ctx) - 1:-1]).double(), -1)
            want = float(lp.gather(-1, torch.tensor(full[len(ctx):])[:, None]).sum())
            assert abs(sc[t][0][1] - want) < 1e-4  # fp32 log-softmax in the scorer
    acc = mc_tasks.accuracy(sc[-1], items)
    assert acc == sum(max(range(4), key=s.__getitem__) == i.answer for s, i in zip(sc[-1], items)) / 5
    res = mc_tasks.score_tasks(fam.model, tok, ["capitals"], limit=8)
    assert res["capitals"]["items"] == 8 and len(res["capitals"]["acc"]) == 3
    json.dumps(res)


def test_mfs_eval_tasks_without_answers(tiny, tmp_path, capsys):  # noqa: F811
    """`mfs eval --tasks ... --skip-answers`: the task accuracies per tier and for the original, the
    answers reported as not measured (None), never as zero."""
    from mfs.cli import main as mfs_main  # noqa: PLC0415
    base, _ = tiny
    out = tmp_path / "e.json"
    rc = mfs_main(["eval", "--model", str(base), "--seq-len", "32", "--heldout-tokens", "256",
                   "--tasks", "capitals,unicode_names", "--skip-answers", "--json", str(out),
                   "--heldout-chat", str(tmp_path / "h.jsonl")])
    assert rc == 0
    res = json.loads(out.read_text())
    assert set(res["tasks"]) == {"capitals", "unicode_names"}
    assert res["tasks"]["unicode_names"]["items"] == 300 and len(res["tasks"]["capitals"]["acc"]) == 3
    # no precipitated weights: the original is the top tier
    assert res["tasks"]["capitals"]["original"] == res["tasks"]["capitals"]["acc"][-1]
    assert all(t["fixed_correct"] is None for t in res["tiers"])
    assert "not measured" in capsys.readouterr().out and (tmp_path / "h.jsonl").exists()
    assert mfs_main(["eval", "--model", str(base), "--skip-answers", "--record-quality"]) == 2


def test_mfs_eval_questions_file_scores_keyword_answers_per_tier(tiny, tmp_path, capsys):  # noqa: F811
    """`mfs eval --questions FILE`: every tier's answers to the file, keyword-checked, next to
    perplexity and agreement; the share of the top tier's answered questions is None when it answers none."""
    from evaluation.eval_questions import answered_share, has_keyword  # noqa: PLC0415
    from mfs.cli import main as mfs_main  # noqa: PLC0415
    base, _ = tiny
    q = tmp_path / "q.jsonl"
    q.write_text("".join(json.dumps({"question": s, "keywords": ["zzz"]}) + "\n" for s in ("Say zzz.", "Hi.")))
    out = tmp_path / "e.json"
    assert mfs_main(["eval", "--model", str(base), "--seq-len", "32", "--heldout-tokens", "256",
                     "--skip-answers", "--questions", str(q), "--max-tokens", "4", "--json", str(out),
                     "--heldout-chat", str(tmp_path / "h.jsonl")]) == 0
    res = json.loads(out.read_text())
    assert res["questions_file"] == str(q)
    for t in res["tiers"] + [res["original"]]:
        assert len(t["answers_questions"]) == 2
        assert t["questions_correct"] == sum(has_keyword(a, ("zzz",)) for a in t["answers_questions"])
    assert "questions right" in capsys.readouterr().out
    assert has_keyword("The capital is Warsaw.", ("warsaw",)) and not has_keyword("Warsawa", ("warsaw",))
    assert answered_share([True, False, True], [True, True, False]) == 0.5
    assert answered_share([True], [False]) is None
