"""A client that is gone before its stream's first byte is written: the streaming handlers
end the requests they submitted (found by the HTTP fuzz's disconnects, fuzz_lifecycle.py,
where it is a race: the connection closes while the prompt is rendered, and the request is
submitted before the headers fail to go out; it then ran to its max_tokens).

In process: the server's app over conftest's Engine, on an aiohttp test server; aiohttp's
failure to write the stream's headers to a closing connection is made certain by a
`prepare` that raises as aiohttp does then."""

from __future__ import annotations

import asyncio

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestClient, TestServer

from radixserve.config import ServerConfig
from radixserve.server.app import build_app
from radixserve.server.metrics import ServerMetrics
from radixserve.server.state import ServerState

HI = [{"role": "user", "content": "hi"}]
LONG = 400  # tokens: far more than the test takes to look
STREAMS = {
    "/generate": {"text": "hi", "sampling_params": {"max_new_tokens": LONG, "ignore_eos": True}},
    "/v1/chat/completions": {"messages": HI, "max_tokens": LONG, "n": 2, "ignore_eos": True},
    "/v1/responses": {"model": "tiny", "input": "hi", "max_output_tokens": LONG,
                      "ignore_eos": True},
    "/v1/messages": {"model": "tiny", "messages": HI, "max_tokens": LONG, "ignore_eos": True},
}  # fmt: skip


def app_over(engine) -> web.Application:
    state = ServerState(
        client=engine.client,
        builder=engine.builder,
        tokenizer=engine.tokenizer,
        config=ServerConfig(),
        engine_args={},
        model_path="tiny",
        served_model_name="tiny",
        max_running_requests=8,
        metrics=ServerMetrics(),
    )
    return build_app(state)


SHORT = {
    "/generate": {"sampling_params": {"max_new_tokens": 1}},
    "/v1/chat/completions": {"max_tokens": 1},
    "/v1/responses": {"max_output_tokens": 1},
    "/v1/messages": {"max_tokens": 1},
}
"""What turns each stream's body into a one-token request answered in full."""


@pytest.mark.parametrize("path", sorted(STREAMS))
def test_a_stream_whose_client_is_gone_before_its_headers_ends_its_requests(
    engine, path, monkeypatch
):
    prepare = web.StreamResponse.prepare

    async def client_gone(self, request):
        if self.content_type == "text/event-stream":  # as aiohttp raises once it is closing
            raise aiohttp.ClientConnectionResetError("Cannot write to closing transport")
        return await prepare(self, request)

    monkeypatch.setattr(web.StreamResponse, "prepare", client_gone)
    short = STREAMS[path] | SHORT[path] | {"stream": False}

    async def go():
        async with TestClient(TestServer(app_over(engine))) as client:
            await client.post(path, json=STREAMS[path] | {"stream": True})  # no one reads it
            left = engine.client.active_request_ids()
            answered = await client.post(path, json=short)
            return left, answered.status

    left, status = asyncio.run(go())
    assert left == [], "the gone client's requests still run"
    assert status == 200  # and the server still answers
    engine.check_integrity()  # no KV page lost
