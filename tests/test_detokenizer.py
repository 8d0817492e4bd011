"""Incremental detokenization equals a full decode, one token at a time, with no half chars."""

from __future__ import annotations

import pytest

from radixserve.client.detokenizer import IncrementalDetokenizer
from radixserve.model.tokenizer import open_tokenizer

TEXTS = [
    "Hello world, this is a test.",
    "日本語のテキストと emoji 🎉🎉 mixed with ASCII.",
    "  leading spaces\n\nand\ttabs  ",
    "<|im_start|>user\nHi<|im_end|>",
]


@pytest.fixture(scope="module")
def tokenizer():
    return open_tokenizer(None, 49152, "SmolLM2")


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("skip_special", [True, False])
def test_incremental_text_matches_full_decode(tokenizer, text, skip_special):
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer, skip_special)
    seen = []
    for i in range(1, len(ids) + 1):
        seen.append(detok.update(ids[:i]))
        assert not seen[-1].endswith("\ufffd")
        assert seen[-1] == "" or tokenizer.decode(
            ids[:i], skip_special_tokens=skip_special
        ).startswith(seen[-1])
    assert seen[-1] == tokenizer.decode(ids, skip_special_tokens=skip_special)
    assert all(b.startswith(a) for a, b in zip(seen, seen[1:]))
