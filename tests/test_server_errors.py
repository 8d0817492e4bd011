"""Error answers through HTTP, in each API's shape: nested unknown fields of a Messages body
named as quoted paths, a chat request to a model without a chat template naming the field
that needed it, and the error types of statuses without a route of their own (409, 422).

The app is the server's own (build_app) on an in-process aiohttp server; its engine is never
reached (every request here fails before one is submitted), so no model is loaded and no
server process started."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer
from test_bounds import tiny_tokenizer

from radixserve.config import ServerConfig
from radixserve.server.app import build_app
from radixserve.server.errors import BadRequest
from radixserve.server.state import ServerState

HI = [{"role": "user", "content": "hi"}]
MESSAGES = {"model": "tiny", "max_tokens": 1, "messages": HI}


def no_template_app() -> web.Application:
    """The server's app for a model whose tokenizer has no chat template; the engine is a
    stand-in that nothing here reaches."""
    tokenizer = tiny_tokenizer()
    assert tokenizer.chat_template is None
    state = ServerState(
        client=None,
        builder=SimpleNamespace(lora_adapters={}),
        tokenizer=tokenizer,
        config=ServerConfig(),
        engine_args={},
        model_path="tiny",
        served_model_name="tiny",
        max_running_requests=1,
        metrics=None,
    )
    return build_app(state)


def send(app: web.Application, requests: list[tuple[str, str, Any]]) -> list[tuple[int, dict]]:
    """(status, JSON answer) of each (method, path, body) sent to `app` over HTTP."""

    async def go():
        answers = []
        async with TestClient(TestServer(app)) as client:
            for method, path, body in requests:
                response = await client.request(method, path, json=body)
                answers.append((response.status, await response.json()))
        return answers

    return asyncio.run(go())


def anthropic_error(status: int, answer: dict) -> tuple[str, str]:
    """(type, message) of an error in Anthropic's shape."""
    assert status >= 400 and answer["type"] == "error", answer
    assert set(answer["error"]) == {"type", "message"}, answer
    return answer["error"]["type"], answer["error"]["message"]


TEXT_WITH = {"type": "text", "text": "x"}
RESULT = {"type": "tool_result", "tool_use_id": "t"}


@pytest.mark.parametrize(
    "messages, path, of",
    [
        ([HI[0] | {"foo": 1}], "messages[0].foo", "a message"),
        (
            [{"role": "user", "content": [TEXT_WITH | {"": 2}]}],
            "messages[0].content[0].",
            "a text block",
        ),
        (
            [
                HI[0],
                {"role": "user", "content": [RESULT | {"content": [TEXT_WITH | {"bogus": 3}]}]},
            ],
            "messages[1].content[0].content[0].bogus",
            "a text block",
        ),
    ],
)
def test_a_nested_unknown_field_is_named_by_its_quoted_path(messages, path, of):
    """As a top-level one ('bogus' is not a known field): the path, quoted, starts the
    message (an empty name still shows) and the answer is Anthropic's 400."""
    body = MESSAGES | {"messages": messages}
    count_body = body | {"max_tokens": None}
    requests = [("POST", "/v1/messages", body), ("POST", "/v1/messages/count_tokens", count_body)]
    for status, answer in send(no_template_app(), requests):
        kind, message = anthropic_error(status, answer)
        assert status == 400 and kind == "invalid_request_error"
        assert message.startswith(f"{path!r} is not a known field of {of}; got "), message


def test_a_nested_unknown_tool_field_is_named_by_its_quoted_path():
    tool = {"name": "f", "input_schema": {"type": "object"}, "strict": True}
    request = ("POST", "/v1/messages", MESSAGES | {"tools": [tool]})
    [(status, answer)] = send(no_template_app(), [request])
    _, message = anthropic_error(status, answer)
    assert message.startswith("'tools[0].strict' is not a known field of a tool; got True")


RESPONSES = {"model": "tiny", "max_output_tokens": 1}
FUNCTION = {"name": "f", "parameters": {"type": "object"}}


@pytest.mark.parametrize(
    "path, body, name, of",
    [
        (
            "/v1/responses",
            RESPONSES | {"input": [{"type": "message", "role": "user", "content": "hi", "x": 1}]},
            "input[0].x",
            "a message",
        ),
        (
            "/v1/responses",
            RESPONSES
            | {
                "input": [{"role": "user", "content": [{"type": "input_text", "text": "a", "": 1}]}]
            },
            "input[0].content[0].",
            "an input_text part",
        ),
        (
            "/v1/responses",
            RESPONSES | {"input": "hi", "tools": [{"type": "function", **FUNCTION, "x": 1}]},
            "tools[0].x",
            "a tool",
        ),
        (
            "/v1/chat/completions",
            {"messages": HI, "tools": [{"type": "function", "function": FUNCTION | {"x": 1}}]},
            "tools[0].function.x",
            "a function",
        ),
    ],
)
def test_openai_nested_unknown_fields_are_named_by_their_quoted_paths(path, body, name, of):
    """Responses' input items, content parts and tools, and chat completions' tool functions:
    the quoted path starts the message, as at the top level, in OpenAI's 400."""
    [(status, answer)] = send(no_template_app(), [("POST", path, body)])
    assert status == 400, answer
    message = answer["error"]["message"]
    assert message.startswith(f"{name!r} is not a known field of {of}"), message


def test_a_chat_without_a_chat_template_is_a_400_naming_the_field_that_needed_one():
    requests = [
        ("POST", "/v1/chat/completions", {"messages": HI, "max_tokens": 1}),
        ("POST", "/tokenize", {"messages": HI}),
        ("POST", "/v1/responses", {"model": "tiny", "input": "hi", "max_output_tokens": 1}),
        ("POST", "/v1/messages", MESSAGES),
        ("POST", "/v1/messages/count_tokens", {"model": "tiny", "messages": HI}),
    ]
    chat, tokenize, responses, messages, count = send(no_template_app(), requests)
    openai_answers = [(chat, "messages"), (tokenize, "messages"), (responses, "input")]
    for (status, answer), param in openai_answers:
        assert status == 400, answer
        error = answer["error"]
        assert error["param"] == param and error["type"] == "BadRequestError", error
        assert error["message"].startswith(param) and "no chat template" in error["message"]
    for status, answer in (messages, count):
        kind, message = anthropic_error(status, answer)
        assert status == 400 and kind == "invalid_request_error", answer
        assert message.startswith("messages") and "no chat template" in message, message


def raising(status: int):
    async def handler(request: web.Request) -> web.Response:
        raise BadRequest(f"messages: refused with {status}", param="messages", status=status)

    return handler


@pytest.mark.parametrize(
    "status, openai_type, anthropic_type",
    [
        (409, "ConflictError", "invalid_request_error"),
        (422, "UnprocessableEntityError", "invalid_request_error"),
        (408, "BadRequestError", "invalid_request_error"),
        (415, "UnsupportedMediaTypeError", "invalid_request_error"),
        (504, "InternalServerError", "timeout_error"),
        (500, "InternalServerError", "api_error"),
    ],
)
def test_statuses_without_a_route_of_their_own_get_each_apis_error_type(
    status, openai_type, anthropic_type
):
    """No route answers 409 or 422 today, but any handler may raise a BadRequest with any
    status: the OpenAI type is the name the openai client gives it (ConflictError, ...),
    Anthropic's is invalid_request_error for a 4xx (as Anthropic's docs use it for the 4xx
    they list no type for), a server error's type for a 5xx."""
    app = no_template_app()
    app.router.add_put("/v1/chat/completions", raising(status))  # beside the real POST routes
    app.router.add_put("/v1/messages", raising(status))
    (openai_status, openai), (anthropic_status, anthropic) = send(
        app, [("PUT", "/v1/chat/completions", {}), ("PUT", "/v1/messages", {})]
    )
    assert openai_status == anthropic_status == status
    assert openai["error"]["type"] == openai_type and openai["error"]["param"] == "messages"
    assert openai["error"]["code"] == status
    assert anthropic_error(status, anthropic) == (
        anthropic_type,
        f"messages: refused with {status}",
    )


def test_a_real_415_on_the_messages_path_is_an_invalid_request_error():
    """A keyless server's 415 for a body sent without a JSON Content-Type: a client error,
    typed as one (it was api_error, Anthropic's type for a server fault)."""

    async def go():
        async with TestClient(TestServer(no_template_app())) as client:
            response = await client.post("/v1/messages", data=b"{}")
            return response.status, await response.json()

    status, answer = asyncio.run(go())
    assert status == 415 and anthropic_error(status, answer)[0] == "invalid_request_error"
