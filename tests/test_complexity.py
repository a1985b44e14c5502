"""The complexity scorer: features, the formula, tier mapping, configuration."""
from __future__ import annotations

import json

import pytest

from gateway.complexity import ComplexityConfig, chat_text, features, score_prompt

CODE_Q = ("Explain why this Python function has a bug and how to fix it:\n```python\ndef f(x):\n"
          "    return x +\n```")


@pytest.mark.parametrize("text,tokens,turns,tier", [
    ("What is the capital of France?", 8, 1, 0),
    ("hi", 1, 1, 0),
    ("Tell me a joke about cats.", 8, 1, 0),
    ("Explain step by step why the sky is blue.", 12, 1, 1),
    ("Solve the equation 3x + 4 = 19 and calculate x.", 15, 1, 1),
    (CODE_Q, 40, 1, 2),
    ("Prove that the sum of the first n odd numbers is n^2. Explain each step and justify it.", 25, 1, 2),
    ("Summarize this.", 1500, 1, 1),              # length alone
    ("Summarize and explain why.", 1500, 1, 2),   # length + cues
])
def test_default_tiers(text, tokens, turns, tier):
    assert score_prompt(text, tokens, turns, 3).tier == tier


def test_features_counted():
    f = features("Steps:\n1. install\n2. run\n- check\n```sh\nmake\n```\nWhy? 2 + 2", 30, 3)
    assert f["list_items"] == 3 and f["code_fences"] == 1
    assert f["reasoning_cues"] == 1 and f["math_cues"] >= 1 and f["user_turns"] == 3


def test_cue_words_match_whole_words_only():
    # "capital" contains "api", "whyever" contains "why", "reasonable"... only whole words count
    f = features("The capital is reasonable, whyever", 5)
    assert f["code_cues"] == 0 and f["reasoning_cues"] == 0


def test_score_is_the_documented_sum():
    cfg = ComplexityConfig()
    s = score_prompt("Explain why.", 512, 3, 3, cfg)
    # length 512/1024 = 0.5; reasoning 2 cues / 3; depth (3 - 1) / 4 * 0.5
    assert s.features["length"] == pytest.approx(0.5)
    assert s.features["reasoning"] == pytest.approx(2 / 3)
    assert s.features["depth"] == pytest.approx(0.25)
    assert s.score == pytest.approx(0.5 + 2 / 3 + 0.25, abs=1e-4)
    assert s.tier == 1


def test_saturation_caps_each_feature():
    s = score_prompt("why explain prove derive justify compare analyze", 10 ** 6, 50, 3)
    assert s.features["length"] == 1.0 and s.features["reasoning"] == 1.0 and s.features["depth"] == 0.5


def test_conversation_depth_raises_the_tier():
    cfg = ComplexityConfig(w_depth=1.0, thresholds=[0.5, 1.5])
    assert score_prompt("ok", 3, 1, 3, cfg).tier == 0
    assert score_prompt("ok", 3, 5, 3, cfg).tier == 1


def test_tier_clamped_to_family_size():
    assert score_prompt(CODE_Q, 40, 1, 2).tier == 1
    assert score_prompt(CODE_Q, 40, 1, 1).tier == 0
    assert score_prompt("hi", 1, 1, 5, ComplexityConfig(thresholds=[0.0, 0.0, 0.0, 0.0])).tier == 4


def test_thresholds_override():
    cfg = ComplexityConfig(thresholds=[10.0, 20.0])
    assert score_prompt(CODE_Q, 40, 1, 3, cfg).tier == 0
    assert score_prompt("hi", 1, 1, 3, ComplexityConfig(thresholds=[0.0, 0.0])).tier == 2


def test_load_from_file_and_inline(tmp_path):
    p = tmp_path / "c.json"
    p.write_text(json.dumps({"w_code": 3.0, "thresholds": [0.2, 0.4]}))
    cfg = ComplexityConfig.load(str(p))
    assert cfg.w_code == 3.0 and cfg.thresholds == [0.2, 0.4] and cfg.w_math == 1.0
    assert ComplexityConfig.load('{"cue_full": 5}').cue_full == 5
    assert ComplexityConfig.load(None) == ComplexityConfig()


@pytest.mark.parametrize("raw", ['{"w_nope": 1}', '{"thresholds": [2, 1]}', '[1, 2]', '{"cue_full": 0}'])
def test_bad_config_rejected(raw):
    with pytest.raises(ValueError):
        ComplexityConfig.load(raw)


def test_chat_text_reads_user_and_system_turns():
    msgs = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "a"},
            {"role": "assistant", "content": "EXPLAIN WHY"}, {"role": "user", "content": "b"}]
    text, turns = chat_text(msgs)
    assert turns == 2 and "You are terse." in text and "EXPLAIN" not in text
