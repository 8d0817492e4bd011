"""The OpenAI-compatible endpoints' shapes, driven by the official `openai` client against
`radixserve serve` on a tiny random Llama (conftest's `server`, SmolLM2's tokenizer and chat
template): the model list, completion and chat shapes and usage, max_tokens against the
context, and /tokenize and /detokenize."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from types import SimpleNamespace
from typing import Any

import openai
import pytest
from openai_calls import MODEL, NO_EOS, chat, complete, user

from radixserve.server.openai_api import prompt_ids
from radixserve.server.openai_protocol import parse_request


def post(server, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    request = urllib.request.Request(
        server.url + path, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_models_lists_the_served_model(openai_client):
    models = openai_client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    card = models.data[0]
    assert card.object == "model" and card.owned_by == "radixserve"
    assert card.model_extra["max_model_len"] == 2048


def test_completion_shape_and_usage(openai_client, server):
    response = complete(openai_client, prompt="The quick brown fox")
    assert response.object == "text_completion" and response.id.startswith("cmpl-")
    assert response.model == MODEL
    [choice] = response.choices
    assert choice.index == 0 and choice.finish_reason == "length" and choice.text
    assert choice.logprobs is None
    _, tokens = post(server, "/tokenize", {"prompt": "The quick brown fox"})
    usage = response.usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (tokens["count"], 6)
    assert usage.total_tokens == tokens["count"] + 6


def test_chat_shape_and_usage(openai_client, server):
    response = chat(openai_client, messages=user("Hi there"))
    assert response.object == "chat.completion" and response.id.startswith("chatcmpl-")
    [choice] = response.choices
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason == "length"
    _, tokens = post(server, "/tokenize", {"messages": user("Hi there")})
    assert response.usage.prompt_tokens == tokens["count"]
    assert response.usage.completion_tokens == 6


def test_default_max_tokens_fills_the_context(openai_client, server):
    prompt = [5] * 2040  # 8 tokens of room in the 2048-token context
    response = complete(openai_client, prompt=prompt, max_tokens=None)
    assert response.usage.completion_tokens == 8
    assert response.choices[0].finish_reason == "length"


def test_max_tokens_beyond_the_context_is_rejected_not_clipped(openai_client, server):
    prompt = [5] * 2040
    assert complete(openai_client, prompt=prompt, max_tokens=8).usage.completion_tokens == 8
    with pytest.raises(openai.BadRequestError) as exc:
        complete(openai_client, prompt=prompt, max_tokens=9)
    assert exc.value.param == "max_tokens"
    assert exc.value.body["message"] == (
        "max_tokens is 9 but the context length is 2048 and the prompt has 2040 tokens: "
        "at most 8 tokens can be generated"
    )
    _, tokens = post(server, "/tokenize", {"messages": user("Hi")})
    room = 2048 - tokens["count"]
    for name in ("max_tokens", "max_completion_tokens"):
        with pytest.raises(openai.BadRequestError) as exc:
            chat(openai_client, messages=user("Hi"), **{"max_tokens": None, name: 5000})
        assert exc.value.param == name
        message = exc.value.body["message"]
        assert message.startswith(f"{name} is 5000 but the context length is 2048")
        assert message.endswith(f"at most {room} tokens can be generated")


@pytest.mark.parametrize("prefix", ["", "/v1"])  # SGLang serves both
def test_tokenize_detokenize_round_trip(server, prefix):
    status, tokens = post(server, prefix + "/tokenize", {"prompt": "Hello, round trip!"})
    assert status == 200 and tokens["count"] == len(tokens["tokens"]) > 0
    assert tokens["max_model_len"] == 2048
    status, text = post(server, prefix + "/detokenize", {"tokens": tokens["tokens"]})
    assert (status, text) == (200, {"prompt": "Hello, round trip!"})


def test_tokenize_rejects_bad_input(server):
    status, body = post(server, "/detokenize", {"tokens": [-1]})
    assert status == 400 and body["error"]["param"] == "tokens"
    status, body = post(server, "/tokenize", {"prompt": "a", "messages": user("b")})
    assert status == 400
    status, body = post(server, "/tokenize", {"prompt": "a", "model": "other"})
    assert status == 404 and body["error"]["param"] == "model"


# ---- vLLM's return_token_ids ---------------------------------------------------------------

IDS = {"return_token_ids": True, "ignore_eos": True}


def test_chat_return_token_ids_whole_and_streamed(openai_client, server):
    messages = user("Count to three.")
    response = chat(openai_client, messages=messages, max_tokens=8, extra_body=IDS)
    _, tokens = post(server, "/tokenize", {"messages": messages})
    assert response.model_extra["prompt_token_ids"] == tokens["tokens"]
    [choice] = response.choices
    output_ids = choice.model_extra["token_ids"]
    assert len(output_ids) == response.usage.completion_tokens == 8
    _, text = post(server, "/detokenize", {"tokens": output_ids})
    assert text["prompt"] == choice.message.content
    chunks = list(chat(openai_client, stream=True, messages=messages, max_tokens=8,
                       extra_body=IDS))  # fmt: skip
    assert chunks[0].model_extra["prompt_token_ids"] == tokens["tokens"]
    assert all("prompt_token_ids" not in c.model_extra for c in chunks[1:])
    streamed = [i for c in chunks for ch in c.choices for i in ch.model_extra.get("token_ids", [])]
    assert streamed == output_ids
    plain = chat(openai_client, messages=messages, max_tokens=8)
    assert "prompt_token_ids" not in plain.model_extra
    assert "token_ids" not in plain.choices[0].model_extra


def test_completion_return_token_ids_per_choice(openai_client, server):
    prompts = ["The sky is", "One, two,"]
    response = complete(openai_client, prompt=prompts, n=2, max_tokens=5, extra_body=IDS)
    expected = [post(server, "/tokenize", {"prompt": p})[1]["tokens"] for p in prompts]
    for i, choice in enumerate(response.choices):
        assert choice.model_extra["prompt_token_ids"] == expected[i // 2]
        assert len(choice.model_extra["token_ids"]) == 5
    chunks = list(complete(openai_client, stream=True, prompt=prompts, n=2, max_tokens=5,
                           extra_body=IDS))  # fmt: skip
    seen: dict[int, list] = {}
    for chunk in chunks:
        for choice in chunk.choices:
            extra = choice.model_extra
            assert ("prompt_token_ids" in extra) == (choice.index not in seen)
            seen.setdefault(choice.index, []).extend(extra["token_ids"])
    assert [seen[i] for i in range(4)] == [c.model_extra["token_ids"] for c in response.choices]
    with pytest.raises(openai.BadRequestError, match="return_token_ids"):
        complete(openai_client, prompt="x", extra_body={"return_token_ids": "yes"})


# ---- vLLM's prompt_logprobs ------------------------------------------------------------------


def test_completion_prompt_logprobs_score_every_prompt_token(openai_client):
    prompt = "The quick brown fox jumps"
    response = complete(openai_client, prompt=prompt, logprobs=1, max_tokens=3,
                        extra_body=NO_EOS | {"prompt_logprobs": 2})  # fmt: skip
    echoed = complete(openai_client, prompt=prompt, logprobs=1, max_tokens=3, echo=True)
    [choice] = response.choices
    scored = choice.model_extra["prompt_logprobs"]
    prompt_len = response.usage.prompt_tokens
    assert len(scored) == prompt_len and scored[0] is None
    echo_values = echoed.choices[0].logprobs.token_logprobs[1:prompt_len]
    for position, expected in zip(scored[1:], echo_values):
        token, *tops = position.items()  # the prompt's token first, then the top 2
        assert token[1]["logprob"] == pytest.approx(expected, abs=1e-4)
        ranked = sorted(v["rank"] for v in position.values())
        assert {1, 2} <= set(ranked) and token[1]["rank"] >= 1
        best = max(v["logprob"] for v in position.values())
        assert (token[1]["rank"] == 1) == (token[1]["logprob"] == pytest.approx(best, abs=1e-6))
        assert all(isinstance(v["decoded_token"], str) for v in position.values())
    # the choice's own logprobs: output tokens only, one alternative each (not the prompt's 2)
    assert len(choice.logprobs.token_logprobs) == 3
    assert all(len(top) <= 2 for top in choice.logprobs.top_logprobs)


def test_chat_prompt_logprobs_and_streaming_refused(openai_client):
    response = chat(openai_client, messages=user("Hi"), max_tokens=2,
                    extra_body=NO_EOS | {"prompt_logprobs": 0})  # fmt: skip
    scored = response.model_extra["prompt_logprobs"]
    assert len(scored) == response.usage.prompt_tokens and scored[0] is None
    assert all(len(position) == 1 for position in scored[1:])  # k = 0: the prompt token only
    assert response.choices[0].logprobs is None
    for extra, field in [({"prompt_logprobs": 21}, "prompt_logprobs"),
                         ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs")]:  # fmt: skip
        with pytest.raises(openai.BadRequestError, match=field):
            complete(openai_client, prompt="x", extra_body=extra)


# ---- request ids and special tokens ----------------------------------------------------------


def test_a_chat_request_named_by_rid_or_request_id_is_aborted_by_it(openai_client, server):
    for name in ("rid", "request_id"):
        rid = f"agent-step-{name}"
        stream = chat(openai_client, stream=True, messages=user("Go on and on."), max_tokens=2000,
                      extra_body=NO_EOS | {name: rid})  # fmt: skip
        chunks = iter(stream)
        next(chunks)  # the role chunk: the request runs
        status, reply = post(server, "/abort_request", {"rid": rid})
        assert status == 200 and reply == {"success": True}
        finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
        assert finishes[-1] == "abort" and len(finishes) < 2000
    with pytest.raises(openai.BadRequestError) as caught:
        chat(openai_client, messages=user("x"), extra_body={"rid": "a", "request_id": "b"})
    assert caught.value.param == "request_id"


def test_add_special_tokens_follows_vllms_defaults():
    class Recorder:
        chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}"

        def __init__(self):
            self.calls = []

        def encode(self, text, add_special_tokens=True):
            self.calls.append(add_special_tokens)
            return [1, 2]

        def apply_chat_template(self, messages, **kwargs):
            return "".join(m["content"] for m in messages)

    state = SimpleNamespace(tokenizer=Recorder(), tool_parser="qwen25")
    for body, chat_api, expected in [
        ({"prompt": "a"}, False, True),
        ({"prompt": "a", "add_special_tokens": False}, False, False),
        ({"messages": user("a")}, True, False),
        ({"messages": user("a"), "add_special_tokens": True}, True, True),
    ]:  # fmt: skip
        state.tokenizer.calls.clear()
        prompt_ids(state, parse_request(body | {"model": MODEL}, chat_api))
        assert state.tokenizer.calls == [expected]
