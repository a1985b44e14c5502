"""A prompt as token ids: plain text or one user turn through the model's chat template."""
from __future__ import annotations


def encode_prompt(tokenizer, prompt: str, chat: bool) -> list[int]:
    if tokenizer is None:
        raise ValueError("this model has no tokenizer; it can only serve token ids")
    if chat:
        ids = tokenizer.apply_chat_template([{"role": "user", "content": prompt}],
                                            add_generation_prompt=True, tokenize=True)
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)
    return tokenizer.encode(prompt)
