"""``mfs precipitate --method joint`` on a tiny random Llama (CPU, seconds): every tier's held-out loss
is scored, the artifact is a delta with exit blocks that the loader merges, the top tier's drift is
reported, a run resumes, an artifact written in parts is assembled, and options are checked."""
from __future__ import annotations

import json

import pytest
import torch

from family.manifest import Manifest
from mfs.cli import main as mfs_main
from tests.support.precipitate import tiny  # noqa: F401 - the module fixture
from worker.family import load_family


def _run(base, data, out, *extra):
    argv = ["precipitate", "--method", "joint", "--base", str(base), "--tiers", "2,3,4",
            "--data", str(data), "--out", str(out), "--seq-len", "32", "--cache-tokens", "1024",
            "--heldout-tokens", "256", "--batch-size", "4", "--topk", "8", "--lr", "3e-3",
            "--block-lr", "3e-3", "--rank", "4", "--save-every-min", "0", "--threads", "1", *extra]
    return mfs_main(argv)


def test_joint_trains_every_tier_exports_a_delta_and_resumes(tiny, tmp_path, capsys):  # noqa: F811
    base, txt = tiny
    out = tmp_path / "j"
    assert _run(base, txt, out, "--steps", "20", "--eval-every", "10", "--patience", "0",
                "--weights", "1,1,2") == 0
    evals = [json.loads(x) for x in (out / "eval_log.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evals] == [0, 10, 20]
    assert evals[0]["top_vs_original"] == pytest.approx(1.0, abs=1e-4)  # the delta starts at zero
    for name in ("small", "medium"):
        assert evals[-1][f"{name}_ppl"] < evals[0][f"{name}_ppl"]
    m = Manifest.read(out)
    assert m.weights == {"kind": "delta", "file": "joint.safetensors"}
    assert [t.block_layers for t in m.tiers] == [1, 1, 0]
    prov = json.loads((out / "provenance.json").read_text())
    assert prov["spec"] == str(txt) and prov["windows"] > 0 and "heldout_chat.jsonl" in prov["answers"]
    # the loader merges the delta into the trunk: the top tier is no longer the original, and the
    # served model's logits equal the training model's at the best step
    fam, orig = load_family(str(out)), load_family(str(base), tiers="2,3,4")
    ids = torch.tensor([[5, 9, 23, 71, 2, 40, 41]])
    with torch.no_grad():
        new, old = fam.model.exit_hidden(ids), orig.model.exit_hidden(ids)
        assert not torch.allclose(fam.model.logits(new[-1]), orig.model.logits(old[-1]))
    from safetensors.torch import load_file  # noqa: PLC0415
    sd = load_file(str(out / "joint.safetensors"))
    assert any(k.endswith(".lora_A") for k in sd) and any(k.startswith("exit_blocks.0.") for k in sd)
    assert all(v.dtype == torch.float16 for v in sd.values())
    assert _run(base, txt, out, "--steps", "30", "--eval-every", "10", "--patience", "0", "--resume",
                "--weights", "1,1,2") == 0
    assert "resumed at step 20" in capsys.readouterr().out
    evals = [json.loads(x) for x in (out / "eval_log.jsonl").read_text().splitlines()]
    assert [e["step"] for e in evals] == [0, 10, 20, 30]


def test_joint_refuses_bad_options(tiny, tmp_path, capsys):  # noqa: F811
    base, txt = tiny
    assert _run(base, txt, tmp_path / "a", "--lora-rank", "8") == 2
    assert "--lora-rank is not an option of --method joint" in capsys.readouterr().err
    assert _run(base, txt, tmp_path / "b", "--weights", "1,1") == 2
    assert "one lambda per tier" in capsys.readouterr().err
    argv = ["precipitate", "--method", "exit-blocks", "--base", str(base), "--data", str(txt),
            "--out", str(tmp_path / "c"), "--rank", "4"]
    assert mfs_main(argv) == 2
    assert "--rank is not an option of --method exit-blocks" in capsys.readouterr().err
    # a pydoc-only held-out set writes no answers
    assert _run(base, txt, tmp_path / "d", "--steps", "2", "--eval-every", "2",
                "--heldout-answers", "skip") == 0
    assert "pydoc only" in capsys.readouterr().out
    assert not (tmp_path / "d" / "data" / "heldout_chat.jsonl").exists()


def test_parts_split_and_assemble(tmp_path):
    from training import parts  # noqa: PLC0415
    src = tmp_path / "w.safetensors"
    src.write_bytes(bytes(range(256)) * 100)
    d = tmp_path / "art"
    (d / "parts").mkdir(parents=True)
    (d / "mfs.json").write_text("{}")
    man = json.loads(parts.split(src, d / "parts", max_bytes=10_000).read_text())
    assert [p["bytes"] for p in man["parts"]] == [10_000, 10_000, 5_600]
    assert mfs_main(["precipitate", "--assemble", str(d)]) == 0
    assert (d / "w.safetensors").read_bytes() == src.read_bytes()
    p1 = d / "parts" / man["parts"][1]["name"]
    p1.write_bytes(b"x" + p1.read_bytes()[1:])  # a corrupted part is refused
    with pytest.raises(ValueError, match="sha256"):
        parts.assemble(d)


def test_gpu_precipitate_joint_dry_run_writes_parts_within_its_budget(tiny, tmp_path):  # noqa: F811
    """The whole GPU pipeline on the CPU (what CI runs): data, training, eval, parts; then assembled."""
    base, txt = tiny
    out = tmp_path / "dry"
    rc = mfs_main(["gpu-precipitate", "--dry-run", "--method", "joint", "--out", str(out), "--base",
                   str(base), "--tiers", "2,3,4", "--data", str(txt), "--threads", "1", "--minutes", "5",
                   "--eval-reserve-minutes", "1", "--part-mb", "0.01"])
    assert rc == 0
    res = json.loads((out / "eval.json").read_text())
    g = res["gpu_precipitate"]
    assert g["device"] == "cpu (dry run)" and g["method"] == "joint"
    assert g["within_budget"] == (g["wall_minutes"] <= 5)
    assert [t["name"] for t in res["tiers"]] == ["small", "medium", "large"]
    assert len(g["parts"]) > 1  # 10 kB parts: the small artifact is cut in several
    whole = (out / "joint.safetensors").read_bytes()
    (out / "joint.safetensors").unlink()
    assert mfs_main(["precipitate", "--assemble", str(out)]) == 0
    assert (out / "joint.safetensors").read_bytes() == whole
    assert load_family(str(out)).model.num_segments == 3


def test_joint_warm_start_begins_where_the_exit_blocks_artifact_is(tiny, tmp_path):  # noqa: F811
    """--init-from: with the trunk delta at zero, step 0's held-out loss of every lower tier is the
    exit-block artifact's, also when --block-layers adds a layer (it starts as the identity)."""
    from training.exit_features import heldout_windows  # noqa: PLC0415
    from training.joint import Original, evaluate_joint  # noqa: PLC0415
    base, txt = tiny
    eb = tmp_path / "eb"
    assert mfs_main(["precipitate", "--method", "exit-blocks", "--base", str(base), "--tiers", "2,3,4",
                     "--data", str(txt), "--out", str(eb), "--seq-len", "32", "--cache-tokens", "1024",
                     "--heldout-tokens", "256", "--batch-size", "4", "--topk", "8", "--lr", "3e-3",
                     "--steps", "10", "--eval-every", "10", "--patience", "0", "--save-every-min", "0",
                     "--threads", "1", "--autocast", "none"]) == 0
    fam = load_family(str(eb))
    for blocks in ("1", "2,1"):
        out = tmp_path / f"j{blocks}"
        assert _run(base, txt, out, "--steps", "0", "--init-from", str(eb / "exit-blocks.safetensors"),
                    "--block-layers", blocks) == 0
        step0 = json.loads((out / "eval_log.jsonl").read_text().splitlines()[0])
        held = heldout_windows(fam.model, fam.tokenizer, 1, 32, 256, out / "data")
        ref = evaluate_joint(fam.model, Original(fam.model), held)
        for name in ("small", "medium"):
            assert step0[f"{name}_ppl"] == pytest.approx(ref["tiers"][name]["ppl"], rel=1e-4, abs=1e-4)
    cold = tmp_path / "cold"
    assert _run(base, txt, cold, "--steps", "0") == 0
    step0 = json.loads((cold / "eval_log.jsonl").read_text().splitlines()[0])
    assert step0["small_ppl"] != pytest.approx(ref["tiers"]["small"]["ppl"], rel=1e-3)
