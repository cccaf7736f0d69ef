"""Incremental detokenization that never splits a UTF-8 character.

A byte-level token can end in the middle of a multi-byte character; decoding it alone yields U+FFFD.
Text is emitted only once it decodes cleanly: the tokens since the last emission are decoded together
with a few tokens before them (the prefix window), so tokenizers whose decoding depends on the left
context (leading-space markers) produce the same text as decoding the whole output at once.
"""
from __future__ import annotations

from typing import Iterable

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer  # a `tokenizers.Tokenizer`
        self.skip_special_tokens = skip_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = 0  # start of the context window decoded with the new tokens
        self.read_offset = 0  # tokens before this one have been emitted as text

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)

    def push(self, token_ids: Iterable[int]) -> str:
        """Add tokens; return the text they complete ("" while a character is still incomplete)."""
        self.ids.extend(int(t) for t in token_ids)
        prefix_text = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full_text = self._decode(self.ids[self.prefix_offset:])
        if len(full_text) > len(prefix_text) and not full_text.endswith(REPLACEMENT):
            delta = full_text[len(prefix_text):]
            self.prefix_offset = self.read_offset
            self.read_offset = len(self.ids)
            return delta
        return ""

    def flush(self) -> str:
        """Text of tokens still held back at the end of generation (an incomplete character stays U+FFFD)."""
        prefix_text = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full_text = self._decode(self.ids[self.prefix_offset:])
        self.prefix_offset = self.read_offset = len(self.ids)
        return full_text[len(prefix_text):]
