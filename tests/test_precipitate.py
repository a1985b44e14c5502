"""Knowledge Precipitation on a tiny random Llama (CPU, seconds), plus the shipped default (slow)."""
from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from worker import checkpoint as ckpt
from mfs.cli import main as mfs_main
from worker.family import build_model, load_family
from family.manifest import parse_tiers
from worker.loader import load_base
from tests.support.precipitate import TEXT, tiny  # noqa: F401 - the module fixture


def _precipitate(base, data, out, *extra):
    argv = ["precipitate", "--base", str(base), "--tiers", "2,3,4", "--data", str(data),
            "--out", str(out), "--batch-size", "4", "--seq-len", "32", "--warmup", "1",
            "--save-every-min", "0", "--threads", "1", "--autocast", "none", *extra]
    assert mfs_main(argv) == 0


def _exit_losses(model, ids) -> list[float]:
    with torch.no_grad():
        return [float(F.cross_entropy(model.logits(h[:, :-1]).reshape(-1, model.cfg.vocab_size),
                                      ids[:, 1:].reshape(-1))) for h in model.exit_hidden(ids)]


def _probe_ids(tok):
    return torch.tensor([tok.encode(TEXT[i:i + 48], add_special_tokens=False) for i in (0, 200, 400)])


@pytest.mark.parametrize("rank", [0, 4])
def test_precipitation_lowers_every_exit_loss(tiny, tmp_path, rank):
    base, txt = tiny
    before = load_family(str(base), tiers="2,3,4")
    ids = _probe_ids(before.tokenizer)
    l0 = _exit_losses(before.model, ids)
    _precipitate(base, txt, tmp_path / "out", "--steps", "12", "--lora-rank", str(rank),
                 "--lr", "1e-2" if rank else "3e-3", "--exit-lr", "1e-2", "--ce", "1", "--kl", "0.5")
    after = load_family(str(tmp_path / "out"))
    assert after.manifest.precipitated
    assert after.manifest.weights["kind"] == ("delta" if rank else "full")
    l1 = _exit_losses(after.model, ids)
    assert all(b < a for a, b in zip(l0, l1)), (l0, l1)


@pytest.mark.parametrize("kind", ["full", "delta"])
def test_checkpoint_round_trip(tiny, tmp_path, kind):
    """save -> load_family -> the same logits at every tier as the in-memory trained model."""
    from training.lora import export  # noqa: PLC0415
    base, _ = tiny
    bw = load_base(base)
    tiers = parse_tiers("2,3,4", 4)
    model = build_model(bw, tiers)
    torch.manual_seed(1)
    with torch.no_grad():
        if kind == "delta":
            ckpt.add_lora(model, 4)
            for m in ckpt.lora_modules(model).values():
                m.lora_B.normal_(0, 0.05)
        else:
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.02)
        for p in model.exit_norms:
            p.mul_(1 + 0.3 * torch.rand_like(p))
    export(model, tmp_path, {"path": str(base)}, "tiny", tiers, kind, torch.float32, {"test": True})
    loaded = load_family(str(tmp_path))
    assert not any(isinstance(m, ckpt.LoRALinear) for m in loaded.model.modules())  # merged
    ids = torch.randint(2, 97, (2, 40))
    with torch.no_grad():
        want = [model.logits(h) for h in model.exit_hidden(ids)]
        got = [loaded.model.logits(h) for h in loaded.model.exit_hidden(ids)]
    for w, g in zip(want, got):
        torch.testing.assert_close(g, w, atol=2e-5, rtol=1e-5)
    raw = load_family(str(base), tiers="2,3,4")
    with torch.no_grad():
        assert not torch.allclose(raw.model.logits(raw.model.exit_hidden(ids)[0]), got[0])


def test_resume_continues_same_step_and_data(tiny, tmp_path):
    base, txt = tiny
    common = ("--lora-rank", "4", "--lr", "1e-2", "--seed", "3")
    _precipitate(base, txt, tmp_path / "a", "--steps", "6", *common)
    _precipitate(base, txt, tmp_path / "b", "--steps", "6", "--stop-after", "3", *common)
    _precipitate(base, txt, tmp_path / "b", "--steps", "6", "--resume", *common)
    la = [json.loads(x) for x in (tmp_path / "a" / "train_log.jsonl").read_text().splitlines()]
    lb = [json.loads(x) for x in (tmp_path / "b" / "train_log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in lb] == [1, 2, 3, 4, 5, 6]
    for ra, rb in zip(la, lb):
        assert ra["tokens"] == rb["tokens"]
        assert ra["ce"] == pytest.approx(rb["ce"], rel=1e-5, abs=1e-6)
    wa = ckpt.load_file(str(tmp_path / "a" / "delta.safetensors"))
    wb = ckpt.load_file(str(tmp_path / "b" / "delta.safetensors"))
    for k in wa:
        torch.testing.assert_close(wa[k], wb[k], atol=1e-3, rtol=1e-3)


def test_batch_order_is_a_function_of_seed_and_step():
    from training.data import BatchSampler, Source  # noqa: PLC0415
    s = [Source("a", torch.arange(1000)), Source("b", torch.arange(1000, 3000))]
    x, y = BatchSampler(s, 16, seed=5), BatchSampler(s, 16, seed=5)
    assert torch.equal(x.batch(7, 1, 4), y.batch(7, 1, 4))
    assert not torch.equal(x.batch(7, 1, 4), x.batch(8, 1, 4))
    assert not torch.equal(x.batch(7, 1, 4), BatchSampler(s, 16, seed=6).batch(7, 1, 4))


def test_heldout_is_disjoint_from_training_data():
    from training import data as D  # noqa: PLC0415
    D.check_disjoint()
    assert set(D.STDLIB_HELDOUT).isdisjoint(D.STDLIB_TRAIN)


@pytest.mark.slow
def test_default_family_is_precipitated_and_top_tier_knows_paris():
    from training.data import chat_ids  # noqa: PLC0415
    from engine import Engine  # noqa: PLC0415
    from worker.sampling import SamplingParams  # noqa: PLC0415
    fam = load_family("default")
    if fam.manifest.weights is not None:
        assert fam.manifest.precipitated
    eng = Engine(fam.model, num_blocks=64)
    prompt = chat_ids(fam.tokenizer, "What is the capital of France?")
    out = eng.generate([prompt], [fam.model.num_segments - 1], SamplingParams(max_tokens=20))[0]
    text = fam.tokenizer.decode(out, skip_special_tokens=True)
    assert "Paris" in text, text


def test_repair_phase_trains_only_the_top_segment(tiny, tmp_path):
    """Repair steps move the top tier only: the lower tiers' logits stay exactly as they were."""
    base, txt = tiny
    common = ("--lora-rank", "4", "--lr", "1e-2", "--steps", "4", "--kl", "1")
    _precipitate(base, txt, tmp_path / "a", *common)
    _precipitate(base, txt, tmp_path / "a", *common, "--repair-steps", "3", "--resume")
    log = [json.loads(x) for x in (tmp_path / "a" / "train_log.jsonl").read_text().splitlines()]
    assert [r["phase"] for r in log] == ["main"] * 4 + ["repair"] * 3
    _precipitate(base, txt, tmp_path / "b", *common)
    a, b = load_family(str(tmp_path / "a")), load_family(str(tmp_path / "b"))
    ids = _probe_ids(a.tokenizer)
    with torch.no_grad():
        ha, hb = a.model.exit_hidden(ids), b.model.exit_hidden(ids)
        for t in (0, 1):
            torch.testing.assert_close(a.model.logits(ha[t]), b.model.logits(hb[t]))
        assert not torch.allclose(a.model.logits(ha[2]), b.model.logits(hb[2]))


def test_eval_compares_with_the_untouched_original(tiny, tmp_path):
    """The original top tier in `mfs eval` of a checkpoint is the base model, not the checkpoint."""
    from evaluation.evaluate import evaluate, format_table  # noqa: PLC0415
    base, txt = tiny
    _precipitate(base, txt, tmp_path / "out", "--steps", "3", "--lora-rank", "4", "--lr", "5e-2")
    kw = dict(seq_len=32, heldout_tokens=256, max_tokens=4, log=lambda *_: None)
    res = evaluate(str(tmp_path / "out"), **kw)
    raw = evaluate(str(base), **kw)  # a plain HF directory: default thirds, top = all 4 layers
    assert res["original"]["ppl"]["all"] == pytest.approx(raw["tiers"][-1]["ppl"]["all"], rel=1e-6)
    assert res["tiers"][-1]["ppl"]["all"] != pytest.approx(res["original"]["ppl"]["all"], rel=1e-6)
    assert [r["name"] for r in res["tiers"]] == ["small", "medium", "large"]
    assert len(res["tiers"][0]["answers"]) == len(res["questions"])
    assert "| small |" in format_table(res)
