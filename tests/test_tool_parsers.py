"""Tool-call parsers per model family (radixserve/server/tool_parsers/), no server: each
family's recorded model output parsed whole and streamed cut at every character, several
calls, text before a call, malformed calls left as content, its forced-call grammar, the
JSON re-serializer its arguments stream through, and choosing a family by name or template.

The recorded outputs are written as each family's models emit them (their chat templates'
and model cards' examples), including the whitespace around the markers."""

from __future__ import annotations

import json

import pytest
from xgrammar import Grammar
from xgrammar.testing import _is_grammar_accept_string

from radixserve.server.response_format import forced_call_constraint
from radixserve.server.tool_calls import ToolChoice, check_tools, tool_schemas
from radixserve.server.tool_parsers import (
    ToolCallParser,
    detect_tool_parser,
    resolve_tool_parser,
    tool_format,
    tool_parser_names,
)
from radixserve.server.tool_parsers.json_stream import JsonStreamer

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "days"],
}
ADD = {
    "type": "object",
    "properties": {"a": {"type": "integer"}, "b": {"type": "number"}},
    "required": ["a", "b"],
}
TOOLS = check_tools([
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "add", "parameters": ADD}},
])  # fmt: skip
NAMES = ["get_weather", "add"]
PARIS = {"city": "Paris", "unit": "celsius", "days": 3}
SUM = {"a": 1, "b": 2.5}

DS_CALL = (
    "<｜tool▁call▁begin｜>function<｜tool▁sep｜>{name}\n```json\n{args}\n```<｜tool▁call▁end｜>"
)
# (family, recorded output, content, calls); every output has text before its calls
RECORDED = [
    ("qwen25", 'Let me check both.\n<tool_call>\n{"name": "get_weather", "arguments": '
     '{"city": "Paris", "unit": "celsius", "days": 3}}\n</tool_call>\n<tool_call>\n'
     '{"name": "add", "arguments": {"a": 1, "b": 2.5}}\n</tool_call>',
     "Let me check both.", [("get_weather", PARIS), ("add", SUM)]),
    ("llama3", 'Checking. <|python_tag|>{"name": "get_weather", "parameters": {"city": '
     '"Paris", "unit": "celsius", "days": 3}}; {"name": "add", "parameters": {"a": 1, '
     '"b": 2.5}}', "Checking.", [("get_weather", PARIS), ("add", SUM)]),
    ("mistral", 'Sure.[TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Paris", '
     '"unit": "celsius", "days": 3}, "id": "a1B2c3D4e"}, {"name": "add", "arguments": '
     '{"a": 1, "b": 2.5}, "id": "f5G6h7J8k"}]', "Sure.", [("get_weather", PARIS), ("add", SUM)]),
    ("mistral", 'Sure.[TOOL_CALLS]get_weather[ARGS]{"city": "Paris", "unit": "celsius", '
     '"days": 3}[TOOL_CALLS]add[ARGS]{"a": 1, "b": 2.5}', "Sure.",
     [("get_weather", PARIS), ("add", SUM)]),
    ("pythonic", "[get_weather(city='Paris', unit=\"celsius\", days=3), add(a=1, b=2.5)]",
     "", [("get_weather", PARIS), ("add", SUM)]),
    ("deepseekv3", "I will look it up.\n\n<｜tool▁calls▁begin｜>"
     + DS_CALL.format(name="get_weather", args=json.dumps(PARIS)) + "\n"
     + DS_CALL.format(name="add", args='{"a": 1,\n "b": 2.5}') + "<｜tool▁calls▁end｜>",
     "I will look it up.", [("get_weather", PARIS), ("add", SUM)]),
    ("qwen3_coder", "I'll look that up.\n<tool_call>\n<function=get_weather>\n<parameter=city>"
     "\nParis\n</parameter>\n<parameter=unit>\ncelsius\n</parameter>\n<parameter=days>\n3\n"
     "</parameter>\n</function>\n</tool_call>\n<tool_call>\n<function=add>\n<parameter=a>\n1"
     "\n</parameter>\n<parameter=b>\n2.5\n</parameter>\n</function>\n</tool_call>",
     "I'll look that up.", [("get_weather", PARIS), ("add", SUM)]),
]  # fmt: skip
IDS = [f"{family}-{i}" for i, (family, *_) in enumerate(RECORDED)]


def parser(family: str, streaming: bool = True) -> ToolCallParser:
    return ToolCallParser(NAMES, family, tool_schemas(TOOLS), streaming)


def whole(family: str, text: str):
    """The parse a request that is not streamed gets."""
    return parser(family, streaming=False).feed(text, final=True)


def streamed(family: str, pieces: list[str]) -> tuple[str, list[dict]]:
    """Content and calls rebuilt from the deltas, as an OpenAI client accumulates them;
    checks that only a call's first delta carries its id and name."""
    p, content, calls = parser(family), "", {}
    for i, piece in enumerate(pieces):
        out = p.feed(piece, final=i == len(pieces) - 1)
        content += out.content
        for delta in out.deltas:
            first = delta.index not in calls
            assert (delta.id is not None, delta.name is not None) == (first, first)
            call = calls.setdefault(delta.index, {"id": delta.id, "name": delta.name, "args": ""})
            call["args"] += delta.arguments
    return content, [calls[i] for i in sorted(calls)]


@pytest.mark.parametrize(("family", "text", "content", "expected"), RECORDED, ids=IDS)
def test_recorded_output_parses_into_content_and_calls(family, text, content, expected):
    out = whole(family, text)
    assert out.content == content
    assert [(c.name, json.loads(c.arguments)) for c in out.calls] == expected
    assert [c.index for c in out.calls] == list(range(len(expected)))
    assert len({c.id for c in out.calls}) == len(expected)


@pytest.mark.parametrize(("family", "text", "content", "expected"), RECORDED, ids=IDS)
def test_recorded_output_streams_alike_at_every_split(family, text, content, expected):
    calls = [(c.name, c.arguments) for c in whole(family, text).calls]
    cuts = [[text[:i], text[i:]] for i in range(len(text) + 1)] + [list(text)]
    for pieces in cuts:
        got_content, got_calls = streamed(family, pieces)
        assert got_content == content, pieces
        assert [(c["name"], c["args"]) for c in got_calls] == calls, pieces


def test_arguments_stream_as_fragments_before_the_call_ends():
    p = parser("qwen25")
    out = p.feed('<tool_call>{"name": "get_weather", "arguments": {"city": "Pa')
    [first] = out.deltas
    assert (first.name, first.arguments) == ("get_weather", '{"city": "Pa')
    assert first.to_openai()["function"]["name"] == "get_weather" and not out.calls
    out = p.feed('ris", "days": 2}}</tool_call>', final=True)
    assert [d.to_openai() for d in out.deltas] == [
        {"index": 0, "function": {"arguments": 'ris", "days": 2}'}}
    ]
    assert json.loads(out.calls[0].arguments) == {"city": "Paris", "days": 2}


@pytest.mark.parametrize(
    ("family", "text"),
    [
        ("qwen25", '<tool_call>{"name": "delete_all", "arguments": {}}</tool_call> ok'),
        ("qwen25", "<tool_call>not json</tool_call>"),
        ("llama3", '{"name": "add", "arguments": 5} is how I would write it'),
        ("mistral", "[TOOL_CALLS] [1, 2, 3]"),
        ("pythonic", "[Note] the list [1, 2] is short"),
        ("pythonic", "[rm(path='/')]"),
        ("deepseekv3", "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>x\n"),
        ("qwen3_coder", "<tool_call>\n<function=shell>\n</function>\n</tool_call>"),
    ],
)
def test_malformed_calls_stay_content(family, text):
    out = whole(family, text)
    assert (out.content, out.calls) == (text, [])
    assert streamed(family, list(text)) == (text, [])


def test_a_streamed_call_cut_short_ends_with_valid_json_arguments():
    text = '<tool_call>{"name": "get_weather", "arguments": {"city": "Par'
    content, [call] = streamed("qwen25", [text[:30], text[30:]])
    assert json.loads(call["args"]) == {"city": "Par"} and content == ""
    broken = '{"name": "add", "parameters": {"a": 1, "b": } and'
    content, [call] = streamed("llama3", list(broken))
    assert json.loads(call["args"]) == {"a": 1} and content == "} and"
    for family, output in [("qwen25", text), ("llama3", broken)]:  # not streamed: content
        assert (whole(family, output).content, whole(family, output).calls) == (output, [])


def test_qwen3_coder_types_values_by_the_schema():
    text = ("<tool_call>\n<function=get_weather>\n<parameter=city>\n42\n</parameter>\n"
            "<parameter=days>\nseven\n</parameter>\n</function>\n</tool_call>")  # fmt: skip
    [call] = whole("qwen3_coder", text).calls
    assert json.loads(call.arguments) == {"city": "42", "days": "seven"}  # unparsable: a string


def test_pythonic_is_read_with_ast_never_evaluated():
    text = "[add(a=__import__('os').getpid(), b=2)]"
    assert (whole("pythonic", text).content, whole("pythonic", text).calls) == (text, [])
    content, calls = streamed("pythonic", [text])
    assert [json.loads(c["args"]) for c in calls] == [{}]  # streamed: the call, no arguments
    assert content == "__import__('os').getpid(), b=2)]"  # and the rest as text


@pytest.mark.parametrize("family", sorted({family for family, *_ in RECORDED}))
def test_written_history_calls_parse_back(family):
    arguments = {"city": 'Zürich\n"old town"', "days": 2, "unit": "celsius"}
    if family != "qwen3_coder":  # it types values by the schema, which has only these
        arguments |= {"flags": [True, None], "x": {}}
    text = tool_format(family).write_call("get_weather", arguments)
    [call] = whole(family, text).calls
    assert (call.name, json.loads(call.arguments)) == ("get_weather", arguments)


def test_plain_prompt_speaks_the_familys_format():
    from radixserve.server.chat_prompt import plain_tool_messages

    history = [
        {"role": "user", "content": "1 + 2?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "add", "arguments": SUM}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "3.5"},
    ]  # fmt: skip
    system, _, assistant, _ = plain_tool_messages(history, TOOLS, "llama3")
    assert '{"name": <function-name>, "parameters": <arguments-json-object>}' in system["content"]
    assert assistant["content"] == '{"name": "add", "parameters": {"a": 1, "b": 2.5}}'


# ---- forced calls ------------------------------------------------------------------------

FORCED = {
    "qwen25": '{"name": "add", "arguments": {"a": 1, "b": 2.5}}',
    "llama3": '{"name": "add", "parameters": {"a": 1, "b": 2.5}}',
    "mistral": '[TOOL_CALLS][{"name": "add", "arguments": {"a": 1, "b": 2.5}}]',
    "pythonic": "[add(a=1, b=2.5)]",
    "deepseekv3": "<｜tool▁calls▁begin｜>" + DS_CALL.format(name="add", args='{"a": 1, "b": 2.5}')
    + "<｜tool▁calls▁end｜>",
    "qwen3_coder": "<tool_call>\n<function=add>\n<parameter=a>\n1\n</parameter>\n<parameter=b>"
    "\n2.5\n</parameter>\n</function>\n</tool_call>",
}  # fmt: skip


def forced_grammar(family: str, name: str | None):
    constraint = forced_call_constraint(TOOLS, ToolChoice("function", name), family)
    if constraint.kind == "json_schema":
        return Grammar.from_json_schema(json.dumps(constraint.spec), any_whitespace=False)
    return Grammar.from_ebnf(constraint.spec)


@pytest.mark.parametrize("family", list(FORCED))
def test_forced_call_is_the_familys_format_and_parses_back(family):
    grammar = forced_grammar(family, "add")
    assert _is_grammar_accept_string(grammar, FORCED[family])
    assert not _is_grammar_accept_string(grammar, FORCED[family].replace("2.5", '"x"'))
    assert not _is_grammar_accept_string(forced_grammar(family, "get_weather"), FORCED[family])
    [call] = whole(family, FORCED[family]).calls
    assert (call.name, json.loads(call.arguments)) == ("add", SUM)


def test_forced_string_parameters():
    weather = forced_grammar("pythonic", "get_weather")
    assert _is_grammar_accept_string(weather, '[get_weather(city="Oslo", days=2)]')
    coder = forced_grammar("qwen3_coder", None)
    call = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n"
            "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>")  # fmt: skip
    assert _is_grammar_accept_string(coder, call)
    assert not _is_grammar_accept_string(coder, call.replace("Oslo", "x" * 13))


# ---- the JSON re-serializer --------------------------------------------------------------


@pytest.mark.parametrize(
    "text",
    ['{"a":1,"b":[true,null,{"c":"x\\"y\\u00e9\\n"}],"d":-0.5e3}', '{ }', '{"k": [ ]}',
     '{"emoji": "\\ud83d\\ude00", "t": "tab\\there", "s": "/\\/"}'],
)  # fmt: skip
def test_json_streamer_rewrites_what_json_reads_the_same(text):
    streamer, out = JsonStreamer(), ""
    for ch in text:
        streamer.feed(ch)
        out += streamer.take()
        assert json.loads(out + streamer.closers()) is not None  # valid at every point
    assert streamer.done and json.loads(out) == json.loads(text)


@pytest.mark.parametrize("text", ['{"a": tru}', '{"a" 1}', '{"a": 1,}', '{"a": 01}', '{"a": "x'])
def test_json_streamer_stops_at_the_first_error(text):
    streamer = JsonStreamer()
    streamer.feed(text, final=True)
    assert streamer.failed or not streamer.done
    assert isinstance(json.loads(streamer.take() + streamer.closers()), dict)
    array = JsonStreamer()
    assert array.feed("[1]") == 0 and array.failed  # arguments are an object


# ---- choosing the family -----------------------------------------------------------------


def test_names_aliases_and_template_detection():
    assert {"qwen25", "hermes", "llama3_json", "deepseek_v3", "qwen3_coder"} <= set(
        tool_parser_names()
    )
    assert [tool_format(n).name for n in ("hermes", "llama3_json", "deepseek_v3")] == [
        "qwen25", "llama3", "deepseekv3"
    ]  # fmt: skip
    with pytest.raises(ValueError, match="--tool-call-parser 'gpt5'"):
        tool_format("gpt5")
    assert detect_tool_parser("{{ '<tool_call>' }}{{ tools | tojson }}") == "qwen25"
    assert detect_tool_parser("<tool_call>\n<function={{ name }}>") == "qwen3_coder"
    assert detect_tool_parser("{%- if x %}<|python_tag|>{% endif %}") == "llama3"
    assert detect_tool_parser("[TOOL_CALLS] [{{ calls }}]") == "mistral"
    assert detect_tool_parser("<｜tool▁calls▁begin｜>") == "deepseekv3"
    assert detect_tool_parser("[TOOL_CALLS]<tool_call>") is None  # ambiguous
    assert resolve_tool_parser(None, "plain {{ content }}") == "qwen25"
    assert resolve_tool_parser("hermes", "[TOOL_CALLS]") == "qwen25"


# ---- through the server: a non-default family forced and streamed ------------------------

BOUNDED = check_tools([
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object", "additionalProperties": False, "required": ["city", "days"],
        "properties": {"city": {"type": "string", "maxLength": 8},
                       "days": {"type": "integer", "minimum": 1, "maximum": 7}}}}},
    {"type": "function", "function": {"name": "add", "parameters": {
        "type": "object", "additionalProperties": False, "required": ["a", "b"],
        "properties": {"a": {"type": "integer", "minimum": -9, "maximum": 9},
                       "b": {"type": "integer", "minimum": -9, "maximum": 9}}}}},
])  # fmt: skip


@pytest.fixture(scope="module")
def deepseek_client(tiny_chat_model):
    import openai

    from conftest import ServerProcess

    proc = ServerProcess(
        tiny_chat_model, "--served-model-name", "tiny", "--tool-call-parser", "deepseek_v3"
    )
    yield openai.OpenAI(base_url=proc.url + "/v1", api_key="x", max_retries=0)
    assert proc.stop() == 0


NAMED_ADD = {"type": "function", "function": {"name": "add"}}


@pytest.mark.parametrize("tool_choice", ["required", NAMED_ADD])
def test_forced_deepseek_call_streams_as_argument_fragments(deepseek_client, tool_choice):
    import jsonschema

    kwargs = {"model": "tiny", "messages": [{"role": "user", "content": "Weather in Oslo?"}],
              "tools": BOUNDED, "tool_choice": tool_choice, "max_tokens": 120,
              "temperature": 0}  # fmt: skip
    chunks = list(deepseek_client.chat.completions.create(stream=True, **kwargs))
    deltas = [d for c in chunks for d in (c.choices[0].delta.tool_calls or []) if c.choices]
    assert len(deltas) > 2 and {d.index for d in deltas} == {0}
    assert deltas[0].id.startswith("call_") and deltas[0].function.name in NAMES
    assert all(d.id is None and d.function.name is None for d in deltas[1:])
    content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    arguments = "".join(d.function.arguments or "" for d in deltas)
    assert content == "" and chunks[-1].choices[0].finish_reason == "tool_calls"
    schemas = tool_schemas(BOUNDED)
    jsonschema.validate(json.loads(arguments), schemas[deltas[0].function.name])
    [call] = deepseek_client.chat.completions.create(**kwargs).choices[0].message.tool_calls
    assert (call.function.name, call.function.arguments) == (deltas[0].function.name, arguments)


def test_serve_rejects_an_unknown_parser_before_loading_and_detects_from_the_template():
    from types import SimpleNamespace

    from radixserve.config import ServerConfig
    from radixserve.server import launch

    with pytest.raises(SystemExit, match="--tool-call-parser 'gpt5' is not one of qwen25"):
        launch.serve({"model": "/nonexistent"}, ServerConfig(tool_call_parser="gpt5"))
    llama = SimpleNamespace(chat_template="{{ '<|python_tag|>' }}")
    assert launch._tool_parser(ServerConfig(), llama) == "llama3"
    assert launch._tool_parser(ServerConfig(tool_call_parser="hermes"), llama) == "qwen25"
    assert launch._tool_parser(ServerConfig(), SimpleNamespace(chat_template=None)) == "qwen25"
