"""Incremental detokenization that only ever emits whole characters.

Byte-level BPE tokens can end inside a UTF-8 character; decoding the running suffix and holding back a
trailing U+FFFD until the next token completes it keeps streamed text exact.
"""
from __future__ import annotations


class IncrementalDetokenizer:
    def __init__(self, tokenizer, prefix_window: int = 6):
        self.tok = tokenizer
        self.ids: list[int] = []
        self.prefix_offset = 0  # start of the context decoded before the new tokens
        self.read_offset = 0    # tokens whose text has already been emitted
        self.window = prefix_window

    def push(self, new_ids: list[int]) -> str:
        """Adds tokens, returns the newly completed text (may be empty)."""
        self.ids.extend(new_ids)
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if full.endswith("\ufffd") or len(full) <= len(prefix):
            return ""  # an incomplete character: wait for the next token
        out = full[len(prefix):]
        self.read_offset = len(self.ids)
        self.prefix_offset = max(0, self.read_offset - self.window)
        return out

    def flush(self) -> str:
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        self.read_offset = len(self.ids)
        return full[len(prefix):] if len(full) > len(prefix) else ""

    def _decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True) if ids else ""
