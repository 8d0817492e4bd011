"""Reasoning formats (radixserve/reasoning/): one output of each family in its own format,
whole and cut into pieces at every place (a marker split across chunks), the DSL's
`separate_reasoning`, and bad names."""

from __future__ import annotations

import re

import pytest

import radixserve.frontend_lang as sgl
from radixserve.frontend_lang import EngineBackend
from radixserve.reasoning import reasoning_format, reasoning_parser, split_reasoning

# Outputs written in each family's format, as the models emit them after their chat
# template: R1's template opens <think> (R1-0528 writes it again, R1 does not); Qwen3 opens
# it itself; gpt-oss writes harmony messages after `<|start|>assistant`.
DEEPSEEK_R1 = (
    "Okay, so I need to add 17 and 25. 17 + 25: 7 + 5 = 12, carry 1; 1 + 2 + 1 = 4.\n"
    "So it's 42.\n</think>\n\n17 + 25 = **42**."
)
DEEPSEEK_R1_0528 = "<think>\nThe user greets me.\n</think>\n\nHello! How can I help?"
QWEN3 = (
    "<think>\nOkay, the user asks for the capital of France. That's Paris.\n</think>\n\n"
    "The capital of France is Paris."
)
QWEN3_NO_THINKING = "The capital of France is Paris."
GPT_OSS = (
    '<|channel|>analysis<|message|>User asks: "What is 2+2?" Simple: 4.<|end|>'
    "<|start|>assistant<|channel|>final<|message|>2 + 2 = 4."
)
CASES = [
    ("deepseek-r1", DEEPSEEK_R1, DEEPSEEK_R1.split("\n</think>")[0], "17 + 25 = **42**."),
    ("deepseek-r1", DEEPSEEK_R1_0528, "The user greets me.", "Hello! How can I help?"),
    ("qwen3", QWEN3, "Okay, the user asks for the capital of France. That's Paris.",
     "The capital of France is Paris."),
    ("qwen3", QWEN3_NO_THINKING, "", QWEN3_NO_THINKING),
    ("gpt-oss", GPT_OSS, 'User asks: "What is 2+2?" Simple: 4.', "2 + 2 = 4."),
]  # fmt: skip


@pytest.mark.parametrize("name, text, reasoning, content", CASES)
def test_whole_output_splits_into_reasoning_and_content(name, text, reasoning, content):
    split = split_reasoning(text, name)
    assert (split.reasoning, split.content) == (reasoning, content)


@pytest.mark.parametrize("name, text, reasoning, content", CASES)
def test_streamed_pieces_add_up_to_the_whole_split_at_every_cut(name, text, reasoning, content):
    for cut in range(1, len(text)):
        for stream in (True, False):
            parser = reasoning_parser(name, stream_reasoning=stream)
            first, rest = parser.feed(text[:cut]), parser.feed(text[cut:], final=True)
            assert (first.reasoning + rest.reasoning, first.content + rest.content) == (
                reasoning, content), (name, cut)  # fmt: skip
            assert stream or not first.reasoning or parser.reasoning_ended


@pytest.mark.parametrize("name, text, reasoning, content", CASES)
def test_one_character_at_a_time_never_leaks_a_marker(name, text, reasoning, content):
    parser = reasoning_parser(name)
    pieces = [parser.feed(ch) for ch in text] + [parser.feed("", final=True)]
    assert "".join(p.reasoning for p in pieces) == reasoning
    assert "".join(p.content for p in pieces) == content
    assert not any("<|" in p.content or "think>" in p.content for p in pieces)


def test_without_stream_reasoning_the_reasoning_comes_whole_at_its_end():
    parser = reasoning_parser("qwen3", stream_reasoning=False)
    pieces = [parser.feed(QWEN3[i : i + 7]) for i in range(0, len(QWEN3), 7)]
    sent = [p.reasoning for p in pieces if p.reasoning]
    assert sent == ["Okay, the user asks for the capital of France. That's Paris."]


def test_an_output_cut_inside_the_reasoning_is_all_reasoning():
    assert split_reasoning("<think>\nStill thinking", "qwen3").reasoning == "Still thinking"
    assert split_reasoning("Still thinking", "deepseek-r1").content == ""
    assert split_reasoning("<think>a</think>b", "deepseek-r1", opened=False).content == "b"
    assert split_reasoning("plain", "deepseek-r1", opened=False).content == "plain"
    assert split_reasoning("plain text", "gpt-oss").content == "plain text"


def test_two_analysis_messages_join_and_commentary_is_content():
    head = "<|start|>assistant<|channel|>"
    text = (f"<|channel|>analysis<|message|>a<|end|>{head}analysis<|message|>b<|end|>"
            f"{head}commentary<|message|>c<|end|>")  # fmt: skip
    split = split_reasoning(text, "gpt-oss")
    assert (split.reasoning, split.content) == ("a\nb", "c")


def test_unknown_name_is_a_value_error_naming_the_flag():
    with pytest.raises(ValueError, match=r"--reasoning-parser 'r2'.*deepseek-r1, qwen3, gpt-oss"):
        reasoning_format("r2")
    with pytest.raises(ValueError, match="model_type"):
        sgl.separate_reasoning(sgl.gen("x"), model_type="r2")


def test_dsl_separate_reasoning_stores_content_and_reasoning(engine):
    pattern = r"<think>[a-z]{1,8}</think>[a-z]{1,8}"

    @sgl.function
    def think(s):
        s += "Q: "
        s += sgl.separate_reasoning(sgl.gen("x", regex=pattern, temperature=0, max_tokens=32),
                                    model_type="qwen3")  # fmt: skip

    state = think.run(backend=EngineBackend(engine))
    raw = f"<think>{state['x_reasoning_content']}</think>{state['x']}"
    assert re.fullmatch(pattern, raw) and state["x_reasoning_content"] and state["x"]
    assert state.text() == "Q: " + state["x"]
