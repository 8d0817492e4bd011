"""`--reasoning-parser` through the real `openai` and `anthropic` SDKs against one
`radixserve serve --reasoning-parser deepseek-r1` on the tiny random model. The model knows no
format: a regex forces `<think>...</think>answer` (with thinking off, so that the regex is not
deferred and the parser finds the opening tag itself), and a reasoning budget ends free
reasoning so that a constraint after it can be checked."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import anthropic
import jsonschema
import ollama
import openai
import pytest
from tool_call_data import ADD

from conftest import ServerProcess, stop_running

MODEL = "tiny"
THINK = r"<think>[a-z ]{4,20}</think>[a-z ]{1,12}"
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}
GREEDY = {"temperature": 0, "ignore_eos": True}
QUESTION = [{"role": "user", "content": "What is 1 + 2?"}]
SCHEMA = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"],
          "additionalProperties": False}  # fmt: skip
TOOLS = [{"type": "function", "function": {"name": "add", "parameters": ADD}}]


@pytest.fixture(scope="module")
def server(tiny_chat_model):
    proc = ServerProcess(tiny_chat_model, "--served-model-name", MODEL,
                         "--reasoning-parser", "deepseek-r1")  # fmt: skip
    yield proc
    stop_running([proc])


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)


@pytest.fixture(scope="module")
def claude(server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0)


def chat(client, stream: bool = False, **extra):
    body = {"regex": THINK} | NO_THINKING | GREEDY | extra
    return client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=48,
                                          stream=stream, extra_body=body)  # fmt: skip


def whole_text(message) -> str:
    return f"<think>{message.reasoning_content}</think>{message.content}"


# ---- chat completions --------------------------------------------------------------------


def test_chat_reasoning_content_and_streamed_deltas_agree(client):
    message = chat(client).choices[0].message
    assert message.reasoning_content and message.content
    assert re.fullmatch(THINK, whole_text(message))
    chunks = list(chat(client, stream=True))
    reasoning = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or ""
                        for c in chunks if c.choices)  # fmt: skip
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert (reasoning, content) == (message.reasoning_content, message.content)
    assert sum(bool(getattr(c.choices[0].delta, "reasoning_content", None))
               for c in chunks if c.choices) > 1  # streamed, not sent whole  # fmt: skip


def test_stream_reasoning_false_sends_it_in_one_delta(client):
    chunks = list(chat(client, stream=True, stream_reasoning=False))
    sent = [c.choices[0].delta.reasoning_content for c in chunks
            if c.choices and getattr(c.choices[0].delta, "reasoning_content", None)]  # fmt: skip
    assert len(sent) == 1 and sent[0] == chat(client).choices[0].message.reasoning_content


def test_separate_reasoning_false_leaves_the_text_whole(client):
    message = chat(client, separate_reasoning=False).choices[0].message
    assert re.fullmatch(THINK, message.content)
    assert getattr(message, "reasoning_content", None) is None


def test_tool_calls_are_read_from_the_content_only(client):
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    pattern = r"<think>[a-z ]{4,12}</think>" + re.escape(call)
    response = client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=64, tools=TOOLS,
        extra_body={"regex": pattern} | NO_THINKING | GREEDY,
    )  # fmt: skip
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.reasoning_content
    [tool_call] = choice.message.tool_calls
    assert json.loads(tool_call.function.arguments) == {"a": 1, "b": 2}


@pytest.mark.parametrize("stream", [False, True])
def test_json_schema_applies_after_the_reasoning(client, stream):
    """Thinking on: the reasoning runs free (ended by the budget), then the schema holds."""
    response = client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=64, stream=stream,
        response_format={"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMA}},
        extra_body={"max_reasoning_tokens": 8, "temperature": 1.0, "seed": 5,
                    "ignore_eos": True},
    )  # fmt: skip
    if stream:
        chunks = [c for c in response if c.choices]
        reasoning = "".join(getattr(c.choices[0].delta, "reasoning_content", None) or ""
                            for c in chunks)  # fmt: skip
        content = "".join(c.choices[0].delta.content or "" for c in chunks)
    else:
        message = response.choices[0].message
        reasoning, content = message.reasoning_content, message.content
    assert reasoning
    jsonschema.validate(json.loads(content), SCHEMA)


def test_bad_reasoning_options_are_400s_naming_the_field(client):
    for extra, field in [({"separate_reasoning": "yes"}, "separate_reasoning"),
                         ({"max_reasoning_tokens": -1}, "max_reasoning_tokens")]:  # fmt: skip
        with pytest.raises(openai.BadRequestError, match=field):
            chat(client, **extra)


# ---- Anthropic Messages ------------------------------------------------------------------


def message(claude, **kwargs):
    kwargs = {"model": MODEL, "max_tokens": 48, "messages": QUESTION,
              "extra_body": {"regex": THINK} | NO_THINKING | GREEDY} | kwargs  # fmt: skip
    return claude.messages.create(**kwargs)


def test_messages_thinking_block_then_text(claude):
    reply = message(claude)
    assert [b.type for b in reply.content] == ["thinking", "text"]
    thinking, text = reply.content
    assert re.fullmatch(THINK, f"<think>{thinking.thinking}</think>{text.text}")
    with claude.messages.stream(
        model=MODEL,
        max_tokens=48,
        messages=QUESTION,
        extra_body={"regex": THINK} | NO_THINKING | GREEDY,
    ) as events:
        kinds = [(e.type, getattr(getattr(e, "delta", None), "type", None)) for e in events]
        final = events.get_final_message()
    assert [b.model_dump() for b in final.content] == [b.model_dump() for b in reply.content]
    starts = [k for k in kinds if k[0] == "content_block_start"]
    assert len(starts) == 2 and ("content_block_delta", "thinking_delta") in kinds
    first_text = kinds.index(("content_block_delta", "text_delta"))
    assert kinds.index(("content_block_delta", "thinking_delta")) < first_text


@pytest.mark.parametrize("stream", [False, True])
def test_messages_budget_then_forced_tool_use_streams_json_fragments(claude, stream):
    kwargs = {"model": MODEL, "max_tokens": 96, "messages": QUESTION,
              "thinking": {"type": "enabled", "budget_tokens": 8},
              "tools": [{"name": "add", "input_schema": ADD}], "tool_choice": {"type": "any"},
              "extra_body": {"temperature": 1.0, "seed": 7, "ignore_eos": True}}  # fmt: skip
    if stream:
        with claude.messages.stream(**kwargs) as events:
            kinds = [getattr(getattr(e, "delta", None), "type", None) for e in events]
            reply = events.get_final_message()
        assert kinds.count("input_json_delta") >= 2  # argument fragments as they are read
    else:
        reply = claude.messages.create(**kwargs)
    assert [b.type for b in reply.content] == ["thinking", "tool_use"]
    assert reply.content[0].thinking and reply.stop_reason == "tool_use"
    jsonschema.validate(reply.content[1].input, ADD)


def test_messages_thinking_history_is_accepted_and_bad_thinking_named(claude):
    history = [*QUESTION, {"role": "assistant", "content": [
        {"type": "thinking", "thinking": "easy", "signature": ""},
        {"type": "text", "text": "3"}]}, {"role": "user", "content": "And 2 + 2?"}]  # fmt: skip
    assert message(claude, messages=history).content[0].type == "thinking"
    for thinking in ({"type": "enabled"}, {"type": "enabled", "budget_tokens": 48}):
        with pytest.raises(anthropic.BadRequestError, match="thinking"):
            message(claude, thinking=thinking)


def test_unknown_parser_fails_at_start_naming_the_flag(tiny_chat_model):
    done = subprocess.run(
        [sys.executable, "-m", "radixserve.cli", "serve", tiny_chat_model,
         "--reasoning-parser", "r2"], capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert done.returncode != 0
    assert "--reasoning-parser 'r2' is not one of deepseek-r1" in done.stderr


def test_content_blocks_stream_thinking_then_call_fragments():
    from radixserve.server.anthropic_response import ContentBlocks
    from radixserve.server.openai_response import Delta
    from radixserve.server.tool_calls import ToolCall, ToolCallDelta

    blocks = ContentBlocks()
    events = blocks.add(Delta("", [], None, reasoning="hm"))
    events += blocks.add(Delta("", [], None, reasoning=" ok"))
    events += blocks.add(Delta("", [], None, [], [ToolCallDelta(0, "call_ab", "add", '{"a": ')]))
    events += blocks.add(Delta("", [], None, [], [ToolCallDelta(0, None, None, "1}")]))
    events += blocks.add(
        Delta("done", [], "tool_calls", [ToolCall(0, "call_ab", "add", '{"a": 1}')])
    )
    events += blocks.close()
    shapes = [
        (name, data.get("index"), (data.get("delta") or {}).get("type")) for name, data in events
    ]
    assert shapes == [
        ("content_block_start", 0, None), ("content_block_delta", 0, "thinking_delta"),
        ("content_block_delta", 0, "thinking_delta"), ("content_block_stop", 0, None),
        ("content_block_start", 1, None), ("content_block_delta", 1, "input_json_delta"),
        ("content_block_delta", 1, "input_json_delta"), ("content_block_stop", 1, None),
        ("content_block_start", 2, None), ("content_block_delta", 2, "text_delta"),
        ("content_block_stop", 2, None),
    ]  # fmt: skip
    assert blocks.blocks == [
        {"type": "thinking", "thinking": "hm ok", "signature": ""},
        {"type": "tool_use", "id": "toolu_ab", "name": "add", "input": {"a": 1}},
        {"type": "text", "text": "done"},
    ]


# ---- Ollama ------------------------------------------------------------------------------


def test_ollama_think_splits_thinking_as_chat_completions_does(server, client):
    local = ollama.Client(host=server.url)
    options = {"temperature": 0, "num_predict": 12}
    for think, extra in [(True, {}), (False, NO_THINKING)]:
        expected = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=12,
                                                  temperature=0, extra_body=extra)  # fmt: skip
        message = expected.choices[0].message
        reply = local.chat(MODEL, QUESTION, think=think, options=options)
        assert reply.message.content == (message.content or "")
        assert (reply.message.thinking or None) == getattr(message, "reasoning_content", None)
        chunks = list(local.chat(MODEL, QUESTION, think=think, options=options, stream=True))
        assert "".join(c.message.thinking or "" for c in chunks) == (reply.message.thinking or "")
    assert "thinking" in local.show(MODEL).capabilities
    assert local.generate(MODEL, "Hi", think=True, options=options).thinking


# ---- OpenAI Responses --------------------------------------------------------------------


def respond(client, stream: bool = False, **extra):
    body = {"regex": THINK} | NO_THINKING | GREEDY | extra
    return client.responses.create(model=MODEL, input="What is 1 + 2?", max_output_tokens=48,
                                   stream=stream, extra_body=body)  # fmt: skip


def test_responses_reasoning_item_before_the_message_and_streamed(client):
    response = respond(client)
    kinds = [item.type for item in response.output]
    assert kinds == ["reasoning", "message"]
    reasoning = response.output[0].content[0].text
    assert re.fullmatch(THINK, f"<think>{reasoning}</think>{response.output_text}")
    assert 0 < response.usage.output_tokens_details.reasoning_tokens < response.usage.output_tokens
    events = list(respond(client, stream=True))
    deltas = [e.delta for e in events if e.type == "response.reasoning_text.delta"]
    assert len(deltas) > 1 and "".join(deltas) == reasoning
    done = [e for e in events if e.type == "response.output_item.done"]
    assert [e.item.type for e in done] == ["reasoning", "message"]
    assert events[-1].response.output_text == response.output_text


def test_responses_include_encrypted_reasoning_replays_it_without_store(client):
    response = respond(client, include=["reasoning.encrypted_content"], store=False)
    reasoning = response.output[0]
    assert reasoning.type == "reasoning" and reasoning.encrypted_content.startswith("rsv1:")
    assert getattr(respond(client).output[0], "encrypted_content", None) is None
    replay = [{"role": "user", "content": "What is 1 + 2?"},
              {"type": "reasoning", "id": reasoning.id, "summary": [],
               "encrypted_content": reasoning.encrypted_content},
              {"role": "assistant", "content": response.output_text},
              {"role": "user", "content": "And 2 + 2?"}]  # fmt: skip
    again = client.responses.create(model=MODEL, input=replay, max_output_tokens=4, store=False)
    assert again.status in ("completed", "incomplete")
    forged = [{"type": "reasoning", "summary": [], "encrypted_content": "x"}]
    for body, field in [({"include": ["message.output_text.logprobs"]}, "include"),
                        ({"input": forged}, "encrypted_content")]:  # fmt: skip
        with pytest.raises(openai.BadRequestError, match=field):
            respond(client, **body)


def test_responses_schema_after_reasoning_and_reasoning_effort(client):
    fmt = {"type": "json_schema", "name": "n", "schema": SCHEMA}
    response = client.responses.create(
        model=MODEL, input="What is 1 + 2?", max_output_tokens=64, text={"format": fmt},
        reasoning={"effort": "low"},
        extra_body={"max_reasoning_tokens": 8, "temperature": 1.0, "seed": 5, "ignore_eos": True},
    )  # fmt: skip
    assert response.output[0].type == "reasoning" and response.output[0].content[0].text
    jsonschema.validate(json.loads(response.output_text), SCHEMA)
    assert response.reasoning.effort == "low"
    for body, field in [({"reasoning": {"effort": "max"}}, "reasoning.effort"),
                        ({"reasoning": "high"}, "reasoning"),
                        ({"text": {"format": fmt}}, "regex")]:  # fmt: skip
        with pytest.raises(openai.BadRequestError, match=field):
            respond(client, **body)
