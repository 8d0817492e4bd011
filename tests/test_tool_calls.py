"""Tool calls and structured output on the OpenAI API: parsing, forced-call schemas, prompt
rendering (no server), then `tool_choice` and `response_format` through the `openai` client
against `radixserve serve` on a tiny random Llama.

The model is random: the tests rely only on what the grammar guarantees, with bounded schemas
(enums, integer ranges, short strings, no extra properties) so that output ends in time."""

from __future__ import annotations

import json
import re

import jsonschema
import openai
import pytest
import xgrammar

from conftest import VOCAB
from radixserve.model.tokenizer import open_tokenizer
from radixserve.server.chat_messages import check_messages
from radixserve.server.chat_prompt import plain_tool_messages, render_chat, template_renders_tools
from radixserve.server.errors import BadRequest
from radixserve.server.tool_calls import (
    ToolCallParser,
    call_schema,
    check_tool_choice,
    check_tools,
    parse_tool_calls,
)

MODEL = "tiny"
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit", "days"],
    "additionalProperties": False,
}
ADD = {
    "type": "object",
    "properties": {
        "a": {"type": "integer", "minimum": -50, "maximum": 50},
        "b": {"type": "integer", "minimum": -50, "maximum": 50},
    },
    "required": ["a", "b"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "Forecast for a city",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "add", "parameters": ADD}},
]  # fmt: skip
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
NAMES = list(SCHEMAS)
CALL = '{"name": "add", "arguments": {"a": 1, "b": 2}}'
HISTORY = [
    {"role": "user", "content": "What is 1 + 2?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "add", "arguments": '{"a": 1, "b": 2}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "3"},
]  # fmt: skip


# ---- parsing -----------------------------------------------------------------------------


def test_blocks_become_calls_and_the_rest_content():
    parsed = parse_tool_calls(f"Let me add.\n<tool_call>{CALL}</tool_call>\n", NAMES)
    assert parsed.content == "Let me add."
    [call] = parsed.calls
    assert (call.index, call.name, json.loads(call.arguments)) == (0, "add", {"a": 1, "b": 2})
    assert re.fullmatch(r"call_[0-9a-f]{32}", call.id)


def test_several_blocks_keep_their_order_and_the_text_between():
    weather = '{"name": "get_weather", "arguments": {"city": "Oslo"}}'
    text = f"<tool_call>\n{CALL}\n</tool_call> and <tool_call>{weather}</tool_call> done"
    parsed = parse_tool_calls(text, NAMES)
    assert [(c.index, c.name) for c in parsed.calls] == [(0, "add"), (1, "get_weather")]
    assert parsed.content == "anddone"


def test_a_bare_json_call_is_a_call():
    parsed = parse_tool_calls(f"  {CALL}\n", NAMES)
    assert parsed.content == "" and [c.name for c in parsed.calls] == ["add"]
    assert parse_tool_calls('{"name": "add"}', NAMES).calls[0].arguments == "{}"


def test_raw_control_characters_in_arguments_come_back_escaped():
    # xgrammar lets raw control characters into length-bounded strings; JSON forbids them
    [call] = parse_tool_calls(
        '{"name": "get_weather", "arguments": {"city": "a\x0eb"}}', NAMES
    ).calls
    assert (
        call.arguments == '{"city": "a\\u000eb"}' and json.loads(call.arguments)["city"] == "a\x0eb"
    )


@pytest.mark.parametrize(
    "text",
    [
        "Just an answer.",
        '{"name": "subtract", "arguments": {}}',  # unknown tool
        '{"answer": 3}',  # JSON, but not a call
        f"{CALL} trailing words",  # more than the call
        "<tool_call>{not json}</tool_call>",
        '<tool_call>{"name": "add", "arguments": [1, 2]}</tool_call>',
        '<tool_call>{"name": "add", "arguments": {}, "extra": 1}</tool_call>',
        '<tool_call>{"name": ["add"], "arguments": {}}</tool_call>',
        "<tool_call>" + CALL[:-3],  # cut off mid-call
    ],
)
def test_malformed_calls_stay_content(text):
    parsed = parse_tool_calls(text, NAMES)
    assert parsed.calls == [] and parsed.content == text


def test_an_unclosed_last_block_still_counts():
    parsed = parse_tool_calls(f"<tool_call>{CALL}", NAMES)
    assert parsed.content == "" and [c.name for c in parsed.calls] == ["add"]


@pytest.mark.parametrize(
    "text",
    [
        f"Sure thing.  <tool_call>{CALL}</tool_call>  Anything else?",
        f"{CALL}",
        "a < b and <tool but not a call <tool_call",
        "<tool_call>{bad}</tool_call> then text\n",
        f"x<tool_call>{CALL}</tool_call><tool_call>{CALL}</tool_call>",
    ],
)
@pytest.mark.parametrize("piece", [1, 3, 7])
def test_streamed_parse_matches_the_whole_parse(text, piece):
    whole = parse_tool_calls(text, NAMES)
    parser, content, calls = ToolCallParser(NAMES), "", []
    pieces = [text[i : i + piece] for i in range(0, len(text), piece)]
    for i, chunk in enumerate(pieces):
        out = parser.feed(chunk, final=i == len(pieces) - 1)
        assert "<tool_call>" not in out.content or not whole.calls
        content, calls = content + out.content, calls + out.calls
    assert content == whole.content
    assert [(c.index, c.name, c.arguments) for c in calls] == [
        (c.index, c.name, c.arguments) for c in whole.calls
    ]


def test_content_streams_before_the_call_ends():
    parser = ToolCallParser(NAMES)
    assert parser.feed("Adding now. <tool").content == "Adding now."
    assert parser.feed('_call>{"name": "add", ').content == ""
    out = parser.feed('"arguments": {}}</tool_call>', final=True)
    assert [c.name for c in out.calls] == ["add"] and out.content == ""


# ---- request checks and schemas ----------------------------------------------------------


@pytest.mark.parametrize(
    "tools",
    [
        {"type": "function"},
        [{"type": "retrieval"}],
        [{"type": "function", "function": {"name": "has space"}}],
        [{"type": "function", "function": {"name": "f", "parameters": "{}"}}],
        [{"type": "function", "function": {"name": "f", "extra": 1}}],
        [{"type": "function", "function": {"name": "f"}}] * 2,
    ],
)
def test_bad_tools_name_the_field(tools):
    with pytest.raises(BadRequest) as exc:
        check_tools(tools)
    assert exc.value.param == "tools"


@pytest.mark.parametrize(
    "choice", ["always", {"type": "function", "function": {"name": "mul"}}, {"type": "function"}]
)
def test_bad_tool_choice_names_the_field(choice):
    with pytest.raises(BadRequest) as exc:
        check_tool_choice(choice, check_tools(TOOLS))
    assert exc.value.param == "tool_choice"


def test_tool_choice_defaults():
    assert check_tool_choice(None, check_tools(TOOLS)).mode == "auto"
    assert check_tool_choice(None, []).mode == "none"
    assert check_tool_choice("auto", []).mode == "none"
    assert check_tools([{"type": "function", "function": {"name": "f"}}])[0]["function"][
        "parameters"
    ] == {"type": "object", "properties": {}, "additionalProperties": False}


def test_call_schema_allows_exactly_the_tools_calls():
    schema = call_schema(check_tools(TOOLS))
    assert [case["properties"]["name"] for case in schema["anyOf"]] == [
        {"const": "get_weather"},
        {"const": "add"},
    ]
    jsonschema.validate({"name": "add", "arguments": {"a": 1, "b": -2}}, schema)
    for bad in ({"name": "add", "arguments": {"a": 1}}, {"name": "mul", "arguments": {}},
                {"name": "add", "arguments": {"a": 1, "b": 2}, "x": 0}):  # fmt: skip
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    xgrammar.Grammar.from_json_schema(json.dumps(schema))  # compiles


def test_call_schema_of_a_named_tool():
    schema = call_schema(check_tools(TOOLS), "add")
    assert schema["properties"] == {"name": {"const": "add"}, "arguments": ADD}
    assert schema["required"] == ["name", "arguments"]


# ---- prompts -----------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer():
    return open_tokenizer(None, VOCAB, MODEL)  # SmolLM2's, as the server fixture uses


TOOL_TEMPLATE = (
    "{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}|{% endif %}"
    "{% for m in messages %}{{ m.role }}: {{ m.content }}"
    "{% for c in m.tool_calls or [] %}CALL {{ c.function.name }}"
    "{{ c.function.arguments | tojson }}{% endfor %}|{% endfor %}"
)


@pytest.fixture
def tool_tokenizer(tokenizer):
    """SmolLM2's tokenizer with a template that renders tools, as Qwen's or Llama 3.1's do."""
    original = tokenizer.chat_template
    tokenizer.chat_template = TOOL_TEMPLATE
    yield tokenizer
    tokenizer.chat_template = original


def test_smollm_template_gets_tools_in_a_system_prompt(tokenizer):
    assert not template_renders_tools(tokenizer)
    text = render_chat(tokenizer, [{"role": "user", "content": "Hi"}], {}, check_tools(TOOLS))
    system = text.split("<|im_end|>")[0]
    assert system.startswith("<|im_start|>system\n# Tools")
    lines = system.split("<tools>\n")[1].split("\n</tools>")[0].splitlines()
    assert [json.loads(line) for line in lines] == check_tools(TOOLS)
    assert '<tool_call>{"name": <function-name>, "arguments": <arguments-json-object>}' in system
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


def test_the_tools_prompt_joins_an_existing_system_message():
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    converted = plain_tool_messages(messages, check_tools(TOOLS))
    assert len(converted) == 2 and converted[0]["content"].startswith("Be brief.\n\n# Tools")


def test_history_calls_and_results_become_tagged_text(tokenizer):
    history = check_messages([*HISTORY, {"role": "tool", "tool_call_id": "c2", "content": "4"}])
    text = render_chat(tokenizer, history, {})
    assert f"<|im_start|>assistant\n<tool_call>{CALL}</tool_call><|im_end|>" in text
    results = "<tool_response>\n3\n</tool_response>\n<tool_response>\n4\n</tool_response>"
    assert f"<|im_start|>user\n{results}<|im_end|>\n<|im_start|>assistant\n" in text
    assert "# Tools" not in text  # no tools offered


def test_messages_keep_tool_fields_and_accept_empty_tool_calls():
    checked = check_messages([*HISTORY, {"role": "assistant", "content": "3", "tool_calls": []}])
    assert checked[1] == {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "add", "arguments": {"a": 1, "b": 2}},
            }
        ],
    }
    assert checked[2] == {"role": "tool", "content": "3", "tool_call_id": "call_1"}
    assert checked[3] == {"role": "assistant", "content": "3"}


def test_a_tool_template_gets_tools_and_turns_as_they_are(tool_tokenizer):
    assert template_renders_tools(tool_tokenizer)
    text = render_chat(tool_tokenizer, check_messages(HISTORY), {}, check_tools(TOOLS))
    assert text.startswith("TOOLS:get_weather;add;|user: What is 1 + 2?|")
    assert text.endswith('|assistant: CALL add{"a": 1, "b": 2}|tool: 3|')
    assert "<tool_call>" not in text


# ---- through the server ------------------------------------------------------------------


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)


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
def test_required_tool_choice_returns_a_valid_call(client, seed):
    response = chat(client, tools=TOOLS, tool_choice="required", temperature=1.0, seed=seed)
    [choice] = response.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    check_call(call)


def test_required_tool_choice_streamed(client):
    kwargs = {"tools": TOOLS, "tool_choice": "required", "temperature": 1.0, "seed": 5}
    full = chat(client, **kwargs).choices[0].message.tool_calls[0]
    content, [call], finish = streamed_calls(chat(client, True, **kwargs))
    assert content == "" and finish == "tool_calls" and call["id"].startswith("call_")
    assert call["n"] > 2  # the arguments arrive as fragments, not in one delta
    assert (call["name"], call["arguments"]) == (full.function.name, full.function.arguments)
    jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])


@pytest.mark.parametrize("stream", [False, True])
def test_named_tool_choice_calls_that_tool(client, stream):
    choice = {"type": "function", "function": {"name": "add"}}
    if stream:
        _, [call], finish = streamed_calls(chat(client, True, tools=TOOLS, tool_choice=choice))
        assert finish == "tool_calls" and call["name"] == "add"
        jsonschema.validate(json.loads(call["arguments"]), ADD)
    else:
        response = chat(client, tools=TOOLS, tool_choice=choice)
        assert check_call(response.choices[0].message.tool_calls[0], ["add"]).keys() == {"a", "b"}


# A regex makes the random model "decide" to call a tool, exercising the auto-mode parser.
AUTO_CALL = (
    r'Sure\. <tool_call>\{"name": "add", "arguments": \{"a": [1-9], "b": [1-9]\}\}</tool_call>'
)


@pytest.mark.parametrize("stream", [False, True])
def test_auto_tool_choice_finds_calls_in_the_text(client, stream):
    kwargs = {"tools": TOOLS, "extra_body": {"regex": AUTO_CALL}}
    if stream:
        content, [call], finish = streamed_calls(chat(client, True, **kwargs))
        arguments = json.loads(call["arguments"])
    else:
        choice = chat(client, **kwargs).choices[0]
        content, finish = choice.message.content, choice.finish_reason
        arguments = check_call(choice.message.tool_calls[0], ["add"])
    assert (content, finish) == ("Sure.", "tool_calls")
    jsonschema.validate(arguments, ADD)


def test_auto_without_a_call_is_a_plain_message(client):
    choice = chat(client, tools=TOOLS, max_tokens=8, extra_body={"ignore_eos": True}).choices[0]
    assert choice.finish_reason == "length" and choice.message.tool_calls is None
    assert choice.message.content


def test_tool_choice_none_leaves_the_tools_out(client):
    plain = chat(client, max_tokens=4)
    response = chat(client, max_tokens=4, tools=TOOLS, tool_choice="none")
    assert response.usage.prompt_tokens == plain.usage.prompt_tokens
    assert response.choices[0].message.content == plain.choices[0].message.content


def test_offered_tools_are_in_the_prompt(client):
    plain = chat(client, max_tokens=1).usage.prompt_tokens
    assert chat(client, max_tokens=1, tools=TOOLS).usage.prompt_tokens > plain + 50


@pytest.mark.parametrize("stream", [False, True])
def test_history_with_a_tool_call_and_result_generates(client, server, stream):
    kwargs = {"messages": HISTORY, "tools": TOOLS, "max_tokens": 5,
              "extra_body": {"ignore_eos": True}}  # fmt: skip
    if stream:
        content, calls, finish = streamed_calls(chat(client, True, **kwargs))
    else:
        choice = chat(client, **kwargs).choices[0]
        content, calls, finish = (
            choice.message.content,
            choice.message.tool_calls,
            choice.finish_reason,
        )
    assert content and not calls and finish == "length"


def test_response_format_json_schema_validates(client):
    json_schema = {"name": "forecast", "schema": WEATHER, "strict": True}
    response_format = {"type": "json_schema", "json_schema": json_schema}
    for seed in range(3):
        choice = chat(client, response_format=response_format, temperature=1.0, seed=seed)
        assert choice.choices[0].finish_reason == "stop"
        jsonschema.validate(json.loads(choice.choices[0].message.content), WEATHER)


def test_response_format_json_object_is_an_object(client):
    messages = [{"role": "user", "content": "JSON please"}]
    choices = [chat(client, messages=messages, response_format={"type": "json_object"},
                    temperature=1.0, seed=seed).choices[0] for seed in range(6)]  # fmt: skip
    finished = [c for c in choices if c.finish_reason == "stop"]
    assert finished  # a random model may also ramble on inside a string until max_tokens
    assert all(isinstance(json.loads(c.message.content), dict) for c in finished)


def test_response_format_on_completions_and_text_is_no_constraint(client):
    kwargs = {"model": MODEL, "prompt": "Forecast:", "max_tokens": 200, "temperature": 0}
    response_format = {"type": "json_schema", "json_schema": {"name": "add", "schema": ADD}}
    response = client.completions.create(extra_body={"response_format": response_format}, **kwargs)
    jsonschema.validate(json.loads(response.choices[0].text), ADD)
    text = {"response_format": {"type": "text"}, "ignore_eos": True}
    response = client.completions.create(**(kwargs | {"max_tokens": 6, "extra_body": text}))
    assert response.choices[0].finish_reason == "length"


@pytest.mark.parametrize("name", ["regex", "json_schema"])
def test_extra_constraint_fields(client, name):
    spec = r"(yes|no), [0-9]{2}" if name == "regex" else json.dumps(ADD)
    content = chat(client, extra_body={name: spec}).choices[0].message.content
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
def test_bad_constraints_and_tools_name_the_field(client, kwargs, field):
    with pytest.raises(openai.BadRequestError) as exc:
        chat(client, **kwargs)
    assert exc.value.param == field and field.split("[")[0] in exc.value.message
