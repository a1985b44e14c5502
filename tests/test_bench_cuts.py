"""``mfs bench cuts`` on a tiny random Llama (CPU, seconds): one cache for every cut, one trained exit
block and one result per cut, resume keeps what was measured, --measure picks cuts, and the table and
plot are written."""
from __future__ import annotations

import json

from mfs.cli import main as mfs_main
from tests.support.precipitate import tiny  # noqa: F401 - the module fixture


def _run(base, data, out, questions, *extra):
    argv = ["bench", "cuts", "--base", str(base), "--cuts", "1,2,3", "--data", str(data), "--out", str(out),
            "--json", str(out / "cuts.json"), "--seq-len", "32", "--cache-tokens", "1024",
            "--heldout-tokens", "256", "--heldout-answers", "skip", "--topk", "8", "--batch-size", "4",
            "--tokens-per-cut", "640", "--lr", "3e-3", "--questions", str(questions), "--answer-tokens", "4",
            "--decode-tokens", "3", "--decode-repeats", "1", "--capitals-items", "8", "--autocast", "none", *extra]
    return mfs_main(argv)


def test_bench_cuts_measures_every_cut_and_resumes(tiny, tmp_path, capsys):  # noqa: F811
    base, txt = tiny
    q = tmp_path / "q.jsonl"
    q.write_text("".join(json.dumps({"question": s, "keywords": ["a"]}) + "\n" for s in ("Say a.", "Name b.")))
    out = tmp_path / "cuts"
    assert _run(base, txt, out, q) == 0
    res = json.loads((out / "cuts.json").read_text())
    assert [r["cut"] for r in res["cuts"]] == [1, 2, 3]
    for r in res["cuts"]:
        assert r["train"]["tokens"] == 640  # an equal budget: 5 steps of 4 x 32
        assert r["ppl_vs_top"] > 0 and 0 <= r["agree_top"] <= 1 and 0 <= r["capitals_acc"] <= 1
        assert r["questions"]["of"] == 2 and r["ms_per_token"] > 0
        assert (out / f"cuts/{r['cut']}.safetensors").exists()
    assert res["top"]["layers"] == 4
    assert (out / "cuts.md").read_text().count("\n") == 6 and (out / "cuts.png").exists()
    # resume: the cache and every measured cut are kept; a lost cut is measured again
    (out / "cuts/2.json").unlink()
    capsys.readouterr()
    assert _run(base, txt, out, q, "--resume", "--measure", "2,3") == 0  # cut 1 is not asked for
    log = capsys.readouterr().out
    assert "feature cache complete" in log
    assert log.count("measured before, kept") == 1 and "cut 2: ppl" in log and "cut 1:" not in log
