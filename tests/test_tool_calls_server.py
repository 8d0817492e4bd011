"""`tool_choice` and `response_format` through the `openai` client against `radixserve serve`
(conftest's `server`) on a tiny random Llama.

The model is random: the tests rely only on what the grammar guarantees, with bounded schemas
(enums, integer ranges, short strings, no extra properties) so that output ends in time."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest
import requests
from tool_call_data import ADD, HISTORY, MODEL, NAMES, SCHEMAS, TOOLS, WEATHER


def chat(client, stream: bool = False, **kwargs):
    kwargs = {"model": MODEL, "messages": [{"role": "user", "content": "Help me"}],
              "max_tokens": 200, "temperature": 0} | kwargs  # fmt: skip
    return client.chat.completions.create(stream=stream, **kwargs)


def check_call(call, names=NAMES) -> dict:
    """A returned call is well formed; its arguments validate against its tool's schema."""
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name in names
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, SCHEMAS[call.function.name])
    return arguments


def streamed_calls(chunks) -> tuple[str, list[dict], str | None]:
    """Content, calls reassembled from tool-call deltas (by index), and the finish reason;
    a call's first delta carries its id and name, later ones only argument fragments."""
    content, calls, finish = "", {}, None
    for chunk in chunks:
        [choice] = chunk.choices
        content += choice.delta.content or ""
        for delta in choice.delta.tool_calls or []:
            first = delta.index not in calls
            assert (delta.id is not None, delta.function.name is not None) == (first, first)
            call = calls.setdefault(delta.index, {"id": "", "name": "", "arguments": "", "n": 0})
            call["id"] += delta.id or ""
            call["name"] += delta.function.name or ""
            call["arguments"] += delta.function.arguments or ""
            call["n"] += 1
        finish = choice.finish_reason or finish
    return content, [calls[i] for i in sorted(calls)], finish


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_required_tool_choice_returns_a_valid_call(openai_client, seed):
    response = chat(openai_client, tools=TOOLS, tool_choice="required", temperature=1.0, seed=seed)
    [choice] = response.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    check_call(call)


def test_required_tool_choice_streamed(openai_client):
    kwargs = {"tools": TOOLS, "tool_choice": "required", "temperature": 1.0, "seed": 5}
    full = chat(openai_client, **kwargs).choices[0].message.tool_calls[0]
    content, [call], finish = streamed_calls(chat(openai_client, True, **kwargs))
    assert content == "" and finish == "tool_calls" and call["id"].startswith("call_")
    assert call["n"] > 2  # the arguments arrive as fragments, not in one delta
    assert (call["name"], call["arguments"]) == (full.function.name, full.function.arguments)
    jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])


@pytest.mark.parametrize("stream", [False, True])
def test_named_tool_choice_calls_that_tool(openai_client, stream):
    choice = {"type": "function", "function": {"name": "add"}}
    if stream:
        _, [call], finish = streamed_calls(
            chat(openai_client, True, tools=TOOLS, tool_choice=choice)
        )
        assert finish == "tool_calls" and call["name"] == "add"
        jsonschema.validate(json.loads(call["arguments"]), ADD)
    else:
        response = chat(openai_client, tools=TOOLS, tool_choice=choice)
        assert check_call(response.choices[0].message.tool_calls[0], ["add"]).keys() == {"a", "b"}


# A regex makes the random model "decide" to call a tool, exercising the auto-mode parser.
AUTO_CALL = (
    r'Sure\. <tool_call>\{"name": "add", "arguments": \{"a": [1-9], "b": [1-9]\}\}</tool_call>'
)


@pytest.mark.parametrize("stream", [False, True])
def test_auto_tool_choice_finds_calls_in_the_text(openai_client, stream):
    kwargs = {"tools": TOOLS, "extra_body": {"regex": AUTO_CALL}}
    if stream:
        content, [call], finish = streamed_calls(chat(openai_client, True, **kwargs))
        arguments = json.loads(call["arguments"])
    else:
        choice = chat(openai_client, **kwargs).choices[0]
        content, finish = choice.message.content, choice.finish_reason
        arguments = check_call(choice.message.tool_calls[0], ["add"])
    assert (content, finish) == ("Sure.", "tool_calls")
    jsonschema.validate(arguments, ADD)


TWO_CALLS = AUTO_CALL + r"\n" + AUTO_CALL.removeprefix(r"Sure\. ")


@pytest.mark.parametrize("stream", [False, True])
def test_parallel_tool_calls_false_keeps_the_first_call(openai_client, stream):
    kwargs = {"tools": TOOLS, "max_tokens": 160, "extra_body": {"regex": TWO_CALLS}}
    for parallel, expected in [(None, 2), (False, 1)]:
        extra = {} if parallel is None else {"parallel_tool_calls": parallel}
        if stream:
            _, calls, finish = streamed_calls(chat(openai_client, True, **kwargs, **extra))
        else:
            choice = chat(openai_client, **kwargs, **extra).choices[0]
            calls, finish = choice.message.tool_calls, choice.finish_reason
        assert len(calls) == expected and finish == "tool_calls"


@pytest.mark.parametrize("api", ["responses", "messages"])
def test_one_call_only_on_the_agent_apis(server, api):
    """Responses' parallel_tool_calls false and Messages' disable_parallel_tool_use keep the
    first of two calls (the same rule as chat completions': choice_trackers.chat_tracker)."""
    add = TOOLS[1]["function"]
    if api == "responses":
        tools = [{"type": "function", "name": "add", "parameters": add["parameters"]}]
        body = {"model": MODEL, "input": "Help me", "tools": tools, "max_output_tokens": 160,
                "regex": TWO_CALLS}  # fmt: skip
        off = {"parallel_tool_calls": False}
        count = lambda out: sum(i["type"] == "function_call" for i in out["output"])  # noqa: E731
    else:
        tools = [{"name": "add", "input_schema": add["parameters"]}]
        body = {"model": MODEL, "messages": [{"role": "user", "content": "Help me"}],
                "tools": tools, "max_tokens": 160, "regex": TWO_CALLS}  # fmt: skip
        off = {"tool_choice": {"type": "auto", "disable_parallel_tool_use": True}}
        count = lambda out: sum(b["type"] == "tool_use" for b in out["content"])  # noqa: E731
    path = "/v1/responses" if api == "responses" else "/v1/messages"
    both, first = (requests.post(server.url + path, json=b).json() for b in (body, body | off))
    assert (count(both), count(first)) == (2, 1), (both, first)


def test_auto_without_a_call_is_a_plain_message(openai_client):
    choice = chat(
        openai_client, tools=TOOLS, max_tokens=8, extra_body={"ignore_eos": True}
    ).choices[0]
    assert choice.finish_reason == "length" and choice.message.tool_calls is None
    assert choice.message.content


def test_tool_choice_none_leaves_the_tools_out(openai_client):
    plain = chat(openai_client, max_tokens=4)
    response = chat(openai_client, max_tokens=4, tools=TOOLS, tool_choice="none")
    assert response.usage.prompt_tokens == plain.usage.prompt_tokens
    assert response.choices[0].message.content == plain.choices[0].message.content


def test_offered_tools_are_in_the_prompt(openai_client):
    plain = chat(openai_client, max_tokens=1).usage.prompt_tokens
    assert chat(openai_client, max_tokens=1, tools=TOOLS).usage.prompt_tokens > plain + 50


@pytest.mark.parametrize("stream", [False, True])
def test_history_with_a_tool_call_and_result_generates(openai_client, server, stream):
    kwargs = {"messages": HISTORY, "tools": TOOLS, "max_tokens": 5,
              "extra_body": {"ignore_eos": True}}  # fmt: skip
    if stream:
        content, calls, finish = streamed_calls(chat(openai_client, True, **kwargs))
    else:
        choice = chat(openai_client, **kwargs).choices[0]
        content, calls, finish = (
            choice.message.content,
            choice.message.tool_calls,
            choice.finish_reason,
        )
    assert content and not calls and finish == "length"


def test_response_format_json_schema_validates(openai_client):
    json_schema = {"name": "forecast", "schema": WEATHER, "strict": True}
    response_format = {"type": "json_schema", "json_schema": json_schema}
    for seed in range(3):
        choice = chat(openai_client, response_format=response_format, temperature=1.0, seed=seed)
        assert choice.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(choice.choices[0].message.content), WEATHER)


def test_response_format_json_object_is_an_object(openai_client):
    messages = [{"role": "user", "content": "JSON please"}]
    choices = [chat(openai_client, messages=messages, response_format={"type": "json_object"},
                    temperature=1.0, seed=seed).choices[0] for seed in range(6)]  # fmt: skip
    finished = [c for c in choices if c.finish_reason == "stop"]
    assert finished  # a random model may also ramble on inside a string until max_tokens
    assert all(isinstance(json.loads(c.message.content), dict) for c in finished)


def test_response_format_on_completions_and_text_is_no_constraint(openai_client):
    kwargs = {"model": MODEL, "prompt": "Forecast:", "max_tokens": 200, "temperature": 0}
    response_format = {"type": "json_schema", "json_schema": {"name": "add", "schema": ADD}}
    response = openai_client.completions.create(
        extra_body={"response_format": response_format}, **kwargs
    )
    jsonschema.validate(json.loads(response.choices[0].text), ADD)
    text = {"response_format": {"type": "text"}, "ignore_eos": True}
    response = openai_client.completions.create(**(kwargs | {"max_tokens": 6, "extra_body": text}))
    assert response.choices[0].finish_reason == "length"


def test_response_format_structural_tag_constrains_the_tagged_span(openai_client):
    """SGLang's structural_tag, in xgrammar's form: here one tag the whole output must be."""
    content = {"type": "json_schema", "json_schema": ADD}
    tag = {"type": "tag", "begin": "<call>", "content": content, "end": "</call>"}
    response_format = {"type": "structural_tag", "format": tag}
    choice = chat(openai_client, response_format=response_format).choices[0]
    text = choice.message.content
    assert choice.finish_reason == "stop", repr(text)
    assert text.startswith("<call>") and text.endswith("</call>")
    jsonschema.validate(json.loads(text.removeprefix("<call>").removesuffix("</call>")), ADD)


@pytest.mark.parametrize("name", ["regex", "json_schema"])
def test_extra_constraint_fields(openai_client, name):
    spec = r"(yes|no), [0-9]{2}" if name == "regex" else json.dumps(ADD)
    content = chat(openai_client, extra_body={name: spec}).choices[0].message.content
    if name == "regex":
        assert re.fullmatch(r"(yes|no), [0-9]{2}", content)
    else:
        jsonschema.validate(json.loads(content), ADD)


BAD_SCHEMA = {"type": "object", "properties": {"a": {"type": "nonsense"}}}


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"response_format": {"type": "json_schema",
                              "json_schema": {"name": "x", "schema": BAD_SCHEMA}}},
         "response_format"),
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"response_format": {"type": "structural_tag", "structures": [{"begin": "<a>"}],
                              "triggers": ["<a"]}}, "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": ADD}}},
         "response_format"),
        ({"response_format": {"type": "json_object"}, "extra_body": {"regex": "a+"}}, "regex"),
        ({"extra_body": {"regex": "(unclosed"}}, "regex"),
        ({"tools": TOOLS, "tool_choice": "required", "extra_body": {"ebnf": 'root ::= "a"'}},
         "tool_choice"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "mul"}}},
         "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": BAD_SCHEMA}}],
          "tool_choice": "required"}, "tools"),
        ({"tools": [{"type": "function"}]}, "tools"),
        ({"messages": [{"role": "tool", "content": "3"}]}, "messages[0].tool_call_id"),
        ({"messages": [{"role": "user", "content": "x", "tool_calls": []}]},
         "messages[0].tool_calls"),
        ({"messages": [{"role": "assistant", "tool_calls": [{"function": {"name": "add"}}]}]},
         "messages[0].tool_calls[0]"),
    ],
)  # fmt: skip
def test_bad_constraints_and_tools_name_the_field(openai_client, kwargs, field):
    with pytest.raises(openai.BadRequestError) as exc:
        chat(openai_client, **kwargs)
    assert exc.value.param == field and field.split("[")[0] in exc.value.message


@pytest.mark.parametrize(
    ("structured", "check"),
    [
        ({"choice": ["red", "green", 'say "blue"']}, lambda t: t in ("red", "green", 'say "blue"')),
        ({"regex": r"(yes|no), [0-9]{2}"}, lambda t: re.fullmatch(r"(yes|no), [0-9]{2}", t)),
        ({"json": ADD}, lambda t: jsonschema.validate(json.loads(t), ADD) is None),
        ({"grammar": 'root ::= "a" | "b"'}, lambda t: t in ("a", "b")),
        ({"json_object": True}, lambda t: isinstance(json.loads(t), dict)),
    ],
)
def test_vllm_structured_outputs(openai_client, structured, check):
    """vLLM's structured_outputs (its one constraint field since v0.12) on chat."""
    choice = chat(openai_client, extra_body={"structured_outputs": structured}).choices[0]
    if "json_object" not in structured or choice.finish_reason == "stop":
        assert check(choice.message.content), choice.message.content


@pytest.mark.parametrize(
    "structured",
    [{"choice": []}, {"regex": "(unclosed"}, {"json": ADD, "regex": "a"}, {"bogus": 1},
     {"grammar": {"x": 1}}, [1]],
)  # fmt: skip
def test_bad_structured_outputs_name_the_field(openai_client, structured):
    with pytest.raises(openai.BadRequestError) as exc:
        chat(openai_client, extra_body={"structured_outputs": structured})
    assert exc.value.param == "structured_outputs"
    with pytest.raises(openai.BadRequestError) as exc:  # one constraint per request
        chat(openai_client, extra_body={"structured_outputs": {"regex": "a"}, "regex": "b"})
    assert exc.value.param == "regex"
