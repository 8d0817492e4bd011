"""The Responses API's `truncation: "auto"` against the shared server (a 2,048-token context):
a conversation longer than the context loses its oldest items, no more than it must."""

from __future__ import annotations

import openai
import pytest

MODEL = "tiny"


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)


def test_truncation_auto_drops_the_oldest_items_to_fit(client):
    words = " ".join(f"word{i}" for i in range(120))  # ~240 tokens a turn
    turns = []
    for i in range(12):  # ~2,900 tokens: more than the server's 2,048-token context
        turns += [{"role": "user", "content": f"{i} {words}"},
                  {"type": "function_call", "call_id": f"c{i}", "name": "add",
                   "arguments": '{"a": 1, "b": 2}'},
                  {"type": "function_call_output", "call_id": f"c{i}", "output": "3"}]  # fmt: skip
    turns.append({"role": "user", "content": "And now?"})
    body = {"model": MODEL, "input": turns, "max_output_tokens": 8}
    with pytest.raises(openai.BadRequestError):
        client.responses.create(**body)
    response = client.responses.create(**body, truncation="auto")
    assert response.truncation == "auto" and response.status in ("completed", "incomplete")
    assert 2048 - 8 - 400 < response.usage.input_tokens <= 2048 - 8  # only what had to go
