"""Ollama's API (/, /api/version, /api/tags, /api/show, /api/chat, /api/generate), driven by
the official `ollama` Python library against the shared `radixserve serve` on the tiny random
model, its answers compared with the OpenAI endpoints' for the same request."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
import uuid
from typing import Any

import jsonschema
import ollama
import pytest
from tool_call_data import ADD, TOOLS, WEATHER

from conftest import API_KEY
from radixserve.server.ollama_response import ModelFacts
from radixserve.server.tool_calls import call_schema

MODEL = "tiny"
GREEDY = {"temperature": 0, "num_predict": 6}
QUESTION = [{"role": "user", "content": "What is 1 + 2?"}]


@pytest.fixture(scope="module")
def client(server) -> ollama.Client:
    return ollama.Client(host=server.url)


def post(url: str, path: str, body: Any, headers: dict | None = None) -> tuple[int, Any]:
    headers = {"Content-Type": "application/json"} | (headers or {})
    request = urllib.request.Request(url + path, json.dumps(body).encode(), headers)
    try:
        with urllib.request.urlopen(request) as response:
            return response.status, response.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def openai_chat(openai_client, messages, max_tokens=6, **extra):
    extra = {"temperature": 0} | extra
    return openai_client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=max_tokens, **extra
    )


# ---- models ------------------------------------------------------------------------------


def test_root_version_tags_and_show(client, server):
    with urllib.request.urlopen(server.url + "/") as response:
        assert response.read().decode() == "Ollama is running"
    head = urllib.request.Request(server.url + "/", method="HEAD")
    with urllib.request.urlopen(head) as response:
        assert response.status == 200
    with urllib.request.urlopen(server.url + "/api/version") as response:
        assert json.loads(response.read())["version"]
    [loaded] = client.ps().models
    assert loaded.model == MODEL and loaded.expires_at.year == 9999 and loaded.context_length
    [model] = client.list().models
    assert model.model == MODEL and model.size > 0 and len(model.digest) == 64
    assert model.details.format == "safetensors" and model.details.family == "llama"
    shown = client.show(MODEL + ":latest")  # Ollama's default tag names the same model
    assert shown.template and "completion" in shown.capabilities and "tools" in shown.capabilities
    assert shown.modelinfo["llama.context_length"] > 0
    with pytest.raises(ollama.ResponseError) as caught:
        client.show("llama3")
    assert caught.value.status_code == 404 and "llama3" in caught.value.error


# ---- chat --------------------------------------------------------------------------------


def test_chat_equals_chat_completions_streamed_or_not(client, openai_client):
    reply = client.chat(MODEL, QUESTION, options=GREEDY)
    expected = openai_chat(openai_client, QUESTION)
    assert reply.message.role == "assistant"
    assert reply.message.content == expected.choices[0].message.content
    assert reply.done and reply.done_reason == {"length": "length"}.get(
        expected.choices[0].finish_reason, "stop"
    )
    assert reply.prompt_eval_count == expected.usage.prompt_tokens
    assert reply.eval_count == expected.usage.completion_tokens
    assert reply.total_duration >= reply.eval_duration > 0 and reply.created_at.endswith("Z")
    chunks = list(client.chat(MODEL, QUESTION, options=GREEDY, stream=True))
    assert [c.done for c in chunks] == [False] * (len(chunks) - 1) + [True]
    assert "".join(c.message.content for c in chunks) == reply.message.content
    assert chunks[-1].message.content == "" and chunks[-1].done_reason == reply.done_reason
    assert chunks[-1].eval_count == reply.eval_count


def test_chat_options_map_to_sampling(client, openai_client):
    options = {
        "temperature": 0.8,
        "top_k": 20,
        "top_p": 0.9,
        "seed": 7,
        "num_predict": 8,
        "repeat_penalty": 1.1,
        "num_ctx": 4096,
        "mirostat": 0,
    }
    reply = client.chat(MODEL, QUESTION, options=options)
    expected = openai_chat(
        openai_client,
        QUESTION,
        max_tokens=8,
        temperature=0.8,
        top_p=0.9,
        seed=7,
        extra_body={"top_k": 20, "repetition_penalty": 1.1},
    )
    assert reply.message.content == expected.choices[0].message.content
    stopped = client.chat(MODEL, QUESTION, options=GREEDY | {"num_predict": 12, "stop": ["e"]})
    assert "e" not in stopped.message.content


def test_chat_format_schema_and_json(client):
    schema = {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
        "required": ["n"],
        "additionalProperties": False,
    }
    reply = client.chat(MODEL, QUESTION, format=schema, options={"temperature": 0})
    jsonschema.validate(json.loads(reply.message.content), schema)
    reply = client.chat(
        MODEL, QUESTION, format="json", options={"temperature": 0, "num_predict": 400}
    )
    if reply.done_reason == "stop":  # a free JSON object may outrun the limit
        assert isinstance(json.loads(reply.message.content), dict)


def test_chat_tool_calls_and_tool_history(client):
    # The random model calls a tool when its output is held to a call's shape (qwen25's
    # bare JSON call); the tracker reads it as a call, with object arguments.
    for stream in (False, True):
        replies = client.chat(
            MODEL,
            QUESTION,
            tools=TOOLS,
            format=call_schema(TOOLS),
            options={"temperature": 0},
            stream=stream,
        )
        calls = [c for r in (replies if stream else [replies]) for c in r.message.tool_calls or []]
        [call] = calls
        schema = {"get_weather": WEATHER, "add": ADD}[call.function.name]
        jsonschema.validate(dict(call.function.arguments), schema)
    history = QUESTION + [
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [{"function": {"name": "add", "arguments": {"a": 1, "b": 2}}}],
        },
        {"role": "tool", "content": "3", "tool_name": "add"},
    ]
    reply = client.chat(MODEL, history, tools=TOOLS, options=GREEDY)
    assert reply.done
    history[1]["thinking"] = "I add them."  # the turn's reasoning, for templates that keep it
    assert client.chat(MODEL + ":latest", history, tools=TOOLS, options=GREEDY).model == (
        MODEL + ":latest"
    )


def test_chat_logprobs(client):
    reply = client.chat(MODEL, QUESTION, options=GREEDY, logprobs=True, top_logprobs=3)
    assert len(reply.logprobs) == reply.eval_count
    for entry in reply.logprobs:
        tops = entry.top_logprobs
        assert len(tops) == 3 and entry.logprob == pytest.approx(max(t.logprob for t in tops))
    text = "".join(entry.token for entry in reply.logprobs)
    assert text.strip() and reply.message.content.startswith(text.strip()[:1])


def test_empty_chat_and_generate_load_the_model(client):
    reply = client.chat(MODEL, [])
    assert reply.done and reply.done_reason == "load" and reply.message.content == ""
    reply = client.generate(MODEL, "")
    assert reply.done and reply.done_reason == "load" and reply.response == ""


# ---- generate ----------------------------------------------------------------------------


def test_generate_is_a_user_turn_and_context_continues_it(client, openai_client, server):
    reply = client.generate(MODEL, "What is 1 + 2?", system="Be brief.", options=GREEDY)
    messages = [{"role": "system", "content": "Be brief."}] + QUESTION
    expected = openai_chat(openai_client, messages)
    assert reply.response == expected.choices[0].message.content
    assert len(reply.context) == reply.prompt_eval_count + reply.eval_count
    follow = client.generate(MODEL, "And 2 + 3?", context=reply.context, options=GREEDY)
    _, tokens = post(
        server.url, "/tokenize", {"messages": [{"role": "user", "content": "And 2 + 3?"}]}
    )
    assert follow.prompt_eval_count == len(reply.context) + len(json.loads(tokens)["tokens"])
    assert follow.context[: len(reply.context)] == list(reply.context)


def test_raw_generate_equals_completions(client, openai_client):
    reply = client.generate(MODEL, "The sky is", raw=True, options=GREEDY)
    expected = openai_client.completions.create(
        model=MODEL, prompt="The sky is", max_tokens=6, temperature=0
    )
    assert reply.response == expected.choices[0].text
    chunks = list(client.generate(MODEL, "The sky is", raw=True, options=GREEDY, stream=True))
    assert "".join(c.response for c in chunks) == reply.response and chunks[-1].context


# ---- errors, tenants, keys ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("body", "status", "named"),
    [
        ({"model": "llama3", "messages": QUESTION}, 404, "llama3"),
        (
            {"model": MODEL, "messages": QUESTION, "options": {"mirostat": 2}},
            400,
            "options.mirostat",
        ),
        (
            {"model": MODEL, "messages": QUESTION, "options": {"num_predict": 10**6}},
            400,
            "options.num_predict",
        ),
        (
            {"model": MODEL, "messages": QUESTION, "options": {"temperature": "hot"}},
            400,
            "options.temperature",
        ),
        ({"model": MODEL, "messages": QUESTION, "think": True}, 400, "think"),
        (
            {
                "model": MODEL,
                "messages": [{"role": "user", "content": "x", "images": ["aGk="]}],
                "stream": False,
            },
            400,
            "messages[0].images",
        ),
        ({"model": MODEL, "messages": QUESTION, "frobnicate": 1}, 400, "frobnicate"),
        ({"model": MODEL, "prompt": "x", "template": "{{ .Prompt }}"}, 400, "template"),
        ({"model": MODEL, "prompt": "x", "context": [-1]}, 400, "context"),
        ({"model": MODEL, "messages": QUESTION, "format": "yaml"}, 400, "format"),
    ],
)
def test_bad_requests_answer_ollama_errors(server, body, status, named):
    path = "/api/generate" if "prompt" in body else "/api/chat"
    code, answer = post(server.url, path, body)
    assert code == status and set(answer) == {"error"} and named in answer["error"]


def test_cache_salt_header_keeps_tenants_apart(server, openai_client):
    messages = [{"role": "user", "content": f"Tenant note {uuid.uuid4().hex} " * 8}]
    headers = {"X-Cache-Salt": "tenant-a"}
    tenant_a = ollama.Client(host=server.url, headers=headers)
    tenant_a.chat(MODEL, messages, options=GREEDY | {"num_predict": 1})
    # The default namespace shares at most the template's head (its default system prompt)
    # with earlier requests; the tenant's own namespace holds the whole conversation.
    other = openai_chat(openai_client, messages, max_tokens=1)
    same = openai_chat(openai_client, messages, max_tokens=1, extra_headers=headers)
    prompt_len = same.usage.prompt_tokens
    assert other.usage.prompt_tokens_details.cached_tokens < 32
    assert same.usage.prompt_tokens_details.cached_tokens >= prompt_len - 16


def test_keys_guard_the_api_but_not_the_heartbeat(keyed_server):
    with urllib.request.urlopen(keyed_server.url + "/") as response:
        assert response.status == 200
    with pytest.raises(ollama.ResponseError) as caught:
        ollama.Client(host=keyed_server.url).list()
    assert caught.value.status_code == 401
    keyed = ollama.Client(host=keyed_server.url, headers={"Authorization": f"Bearer {API_KEY}"})
    assert [m.model for m in keyed.list().models]


def test_model_facts_of_the_default_gguf():
    facts = ModelFacts.read(None, "LlamaForCausalLM", "float32")
    details = facts.details()
    assert details["format"] == "gguf" and details["family"] == "llama"
    assert details["quantization_level"] == "Q4_1" and details["parameter_size"] == "135M"
    assert facts.size > 50_000_000 and facts.entry("m")["modified_at"].endswith("Z")
