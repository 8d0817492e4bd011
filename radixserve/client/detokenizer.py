"""Incremental detokenization: each new token costs a decode of a few tokens, not of all.

Keeps two offsets into the ids (as vLLM and HF's streamers do): text is settled up to
`read_offset`; the tokens from `prefix_offset` give the decoder the context it needs to
place spaces right. A decode that ends in U+FFFD (half a UTF-8 character) waits for more.
"""

from __future__ import annotations


class IncrementalDetokenizer:
    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.text = ""
        self.prefix_offset = 0
        self.read_offset = 0

    def update(self, ids: list[int]) -> str:
        """The settled text of `ids` (which only ever grow): never ends in a half character."""
        if len(ids) > self.read_offset:
            prefix = self._decode(ids[self.prefix_offset : self.read_offset])
            full = self._decode(ids[self.prefix_offset :])
            if len(full) > len(prefix) and not full.endswith("\ufffd"):
                self.text += full[len(prefix) :]
                self.prefix_offset, self.read_offset = self.read_offset, len(ids)
        return self.text

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)
