"""The trainer loop (training/loop.py) on a tiny random Llama (CPU, seconds): a run stopped by its time
budget and resumed ends in the state an uninterrupted run reaches, and the LoRA method's repair phase
takes over when the budget ends its main phase. The budget's clock is made to count every training
step as 1000 s, so where the budget ends does not depend on the machine's speed."""
from __future__ import annotations

import json
import time

import pytest
import torch

from mfs.cli import main as mfs_main
from tests.support.precipitate import tiny  # noqa: F401 - the module fixture
from training import exitblocks, joint, lora
from training.loop import STATE, Budget

STEP_S = 1000.0
COMMON = ("--tiers", "2,3,4", "--seq-len", "32", "--batch-size", "4", "--save-every-min", "0",
          "--threads", "1", "--autocast", "none")
METHODS = {
    "joint": (joint.Joint, ("--cache-tokens", "1024", "--heldout-tokens", "256", "--heldout-answers", "skip",
                            "--topk", "8", "--lr", "3e-3", "--block-lr", "3e-3", "--rank", "4",
                            "--eval-every", "4", "--patience", "0", "--reserve-s", "0")),
    "exit-blocks": (exitblocks.ExitBlocks, ("--cache-tokens", "1024", "--heldout-tokens", "256",
                                            "--heldout-answers", "skip", "--topk", "8", "--lr", "3e-3",
                                            "--eval-every", "4", "--patience", "0")),
    "lora": (lora.LoRA, ("--lora-rank", "4", "--lr", "1e-2", "--warmup", "1")),
}


def _run(method, base, data, out, *extra):
    argv = ["precipitate", "--method", method, "--base", str(base), "--data", str(data), "--out", str(out),
            *COMMON, *METHODS[method][1], *extra]
    return mfs_main(argv)


def _slow_steps(monkeypatch, cls):
    """Every step of ``cls`` takes STEP_S more on the budget's clock."""
    offset = [0.0]
    real, step = time.monotonic, cls.step

    def slow(self, *a):
        offset[0] += STEP_S
        return step(self, *a)

    monkeypatch.setattr(Budget, "clock", staticmethod(lambda: real() + offset[0]))
    monkeypatch.setattr(cls, "step", slow)


def _log(path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


@pytest.mark.parametrize("method", ["joint", "exit-blocks"])
def test_a_run_stopped_by_its_budget_and_resumed_ends_as_an_uninterrupted_one(
        tiny, tmp_path, monkeypatch, capsys, method):  # noqa: F811
    base, txt = tiny
    assert _run(method, base, txt, tmp_path / "whole", "--steps", "10") == 0
    cut = tmp_path / "cut"
    _slow_steps(monkeypatch, METHODS[method][0])
    # 100 min = 6000 s: the budget is spent after 6 steps of 1000 s (the last evaluation's time is
    # real seconds, well under one step)
    assert _run(method, base, txt, cut, "--steps", "10", "--max-minutes", "100") == 0
    assert "stopped at step 6: --max-minutes reached" in capsys.readouterr().out
    monkeypatch.undo()
    assert _run(method, base, txt, cut, "--steps", "10", "--resume") == 0
    assert "resumed at step 6" in capsys.readouterr().out
    whole, resumed = (torch.load(d / STATE, weights_only=False) for d in (tmp_path / "whole", cut))
    assert whole["st"]["step"] == resumed["st"]["step"] == 10
    assert whole["st"]["tokens"] == resumed["st"]["tokens"]
    key = "trainable" if method == "joint" else "exit_state"
    assert whole[key].keys() == resumed[key].keys()
    for k, v in whole[key].items():
        assert torch.equal(v, resumed[key][k]), k
    # the evaluations: the cut run's extra one at its stop, the rest equal to the uninterrupted run's
    ew, ec = _log(tmp_path / "whole" / "eval_log.jsonl"), _log(cut / "eval_log.jsonl")
    assert [e["step"] for e in ew] == [0, 4, 8, 10] and [e["step"] for e in ec] == [0, 4, 6, 8, 10]
    strip = [{k: v for k, v in e.items() if k != "train_minutes"} for e in ew]
    assert strip == [{k: v for k, v in e.items() if k != "train_minutes"} for e in ec if e["step"] != 6]


def test_the_budget_ends_the_lora_main_phase_and_the_repair_phase_follows(tiny, tmp_path, monkeypatch,
                                                                          capsys):  # noqa: F811
    base, txt = tiny
    _slow_steps(monkeypatch, lora.LoRA)
    assert _run("lora", base, txt, tmp_path / "a", "--steps", "10", "--repair-steps", "2",
                "--max-minutes", "100") == 0
    out = capsys.readouterr().out
    assert "--max-minutes reached at step 6: the main phase ends here, repair follows" in out
    assert "stopped at step 8: all 8 steps done" in out
    assert [r["phase"] for r in _log(tmp_path / "a" / "train_log.jsonl")] == ["main"] * 6 + ["repair"] * 2


def test_the_budget_counts_from_its_start_and_refuses_a_negative_one(monkeypatch):
    now = [100.0]
    monkeypatch.setattr(Budget, "clock", staticmethod(lambda: now[0]))
    b = Budget(2)
    assert b.share(0.25) == 130.0 and b.left() == 120.0 and not b.spent()
    now[0] = 200.0
    assert b.spent(reserve_s=20.0) and not b.spent() and b.decay(1) == pytest.approx(20 / 60)
    now[0] = 230.0
    assert b.spent() and b.decay(1) == 0.1 and b.minutes() == pytest.approx(130 / 60)
    b.lift()
    assert not b.spent() and b.left() is None and b.decay(1) == 1.0
    unbounded = Budget(None)
    assert unbounded.share(0.5) is None and not unbounded.spent(reserve_s=1e9)
    with pytest.raises(ValueError, match="--max-minutes must be >= 0"):
        Budget(-1)
