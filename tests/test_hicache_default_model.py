"""Warm restart on the default model: a restarted engine serves a long system prompt from
its tier file, with the tokens it would have computed."""

from __future__ import annotations

import pytest

from radixserve import Engine

pytestmark = pytest.mark.slow

SYSTEM = "You are the help desk of a hardware store. " + " ".join(
    f"Rule {i}: answer questions about aisle {i} politely and briefly." for i in range(24)
)
GREEDY = {"temperature": 0, "max_new_tokens": 12}


def _ask(engine: Engine, question: str) -> dict:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
    text = engine.tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=False
    )
    return engine.generate(text, GREEDY)


def test_a_restarted_server_serves_the_system_prompt_from_its_tier_file(tmp_path):
    flags = {"max_total_tokens": 4096, "enable_hierarchical_cache": True}
    flags["hicache_dir"] = str(tmp_path)
    with Engine(**flags) as engine:
        first = _ask(engine, "Do you cut keys?")
    with Engine(**flags) as engine:
        again = _ask(engine, "Do you cut keys?")
        engine.check_integrity()
    assert first["meta_info"]["cached_tokens"] == 0
    whole_pages = (again["meta_info"]["prompt_tokens"] - 1) // 16 * 16  # the last one runs
    assert again["meta_info"]["cached_tokens"] == whole_pages > 300
    assert (
        again["meta_info"]["cached_tokens_details"]["host"] == again["meta_info"]["cached_tokens"]
    )
    assert again["text"] == first["text"]
