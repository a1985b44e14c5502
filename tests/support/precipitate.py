"""A tiny random Llama with a char-level tokenizer and a training text: what the precipitation tests
train (CPU, seconds)."""
from __future__ import annotations

import string

import pytest
import torch

TEXT = ("The quick brown fox jumps over the lazy dog. " * 3 +
        "A nested model serves a family of models from one set of weights. " * 3 +
        "Every tier has its own exit, and small tiers are the lower part of large ones. ") * 40


def _char_tokenizer():
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers  # noqa: PLC0415
    from transformers import PreTrainedTokenizerFast  # noqa: PLC0415
    chars = string.printable[:95]
    vocab = {"<unk>": 0, "<eos>": 1, **{c: i + 2 for i, c in enumerate(chars)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    t = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", eos_token="<eos>")
    t.chat_template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}<eos>{% endfor %}"
                       "{% if add_generation_prompt %}<assistant>{% endif %}")
    return t


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny random Llama (HF directory with a char-level tokenizer) and a training text file."""
    from transformers import LlamaConfig, LlamaForCausalLM  # noqa: PLC0415
    d = tmp_path_factory.mktemp("tiny")
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      eos_token_id=1, bos_token_id=1, pad_token_id=0)
    LlamaForCausalLM(cfg).save_pretrained(d)
    _char_tokenizer().save_pretrained(d)
    txt = d / "train.txt"
    txt.write_text(TEXT)
    return d, txt
