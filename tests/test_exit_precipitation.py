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
from tests.test_precipitate import tiny  # noqa: F401 - the module fixture


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
    rc = mfs_main(["gpu-precipitate", "--dry-run", "--out", str(out), "--base", str(base),
                   "--tiers", "2,3,4", "--data", str(txt), "--threads", "1"])
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
