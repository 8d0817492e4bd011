"""Streaming on the OpenAI-compatible endpoints (conftest's `server`, through the `openai`
client): streamed text adds up to the full one, a usage chunk ends the stream on request, a
client that hangs up aborts its request; and, without a server, the per-choice deltas hold
back half characters and a possible stop string."""

from __future__ import annotations

import http.client
import json
import re
import time
import urllib.request

import pytest
from openai_calls import MODEL, chat, complete, streamed_text, user

from conftest import VOCAB
from radixserve.client.result import RequestResult
from radixserve.engine.protocol import FinishReason, RequestOutput, RequestSpec
from radixserve.model.tokenizer import open_tokenizer
from radixserve.sampling.params import SamplingParams
from radixserve.server.choice_trackers import ChoiceTracker


def call_and_prompt(chat_api: bool, text: str):
    """The API call and its prompt argument for `text`, chat or completion."""
    return (chat, {"messages": user(text)}) if chat_api else (complete, {"prompt": text})


@pytest.mark.parametrize("chat_api", [False, True])
def test_greedy_stream_adds_up_to_the_full_text(openai_client, chat_api):
    call, prompt = (
        (chat, {"messages": user("Tell me")}) if chat_api else (complete, {"prompt": "Once"})
    )
    full = call(openai_client, max_tokens=24, **prompt)
    texts, finishes, chunks = streamed_text(
        call(openai_client, True, max_tokens=24, **prompt), chat_api
    )
    expected = full.choices[0].message.content if chat_api else full.choices[0].text
    assert texts == {0: expected} and finishes == {0: "length"}
    assert all(c.usage is None for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.id == chunks[0].id for c in chunks)
    if chat_api:
        assert chunks[0].object == "chat.completion.chunk"
        assert chunks[0].choices[0].delta.role == "assistant"
        assert chunks[0].choices[0].delta.content == ""


@pytest.mark.parametrize("chat_api", [False, True])
def test_stream_include_usage_ends_with_a_usage_chunk(openai_client, chat_api):
    call, prompt = call_and_prompt(chat_api, "Hi")
    full = call(openai_client, **prompt)
    options = {"include_usage": True}
    chunks = list(call(openai_client, True, stream_options=options, **prompt))
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == 6
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])


@pytest.mark.parametrize("chat_api", [False, True])
def test_continuous_usage_stats_put_usage_in_every_chunk(openai_client, chat_api):
    """vLLM's and SGLang's stream_options.continuous_usage_stats (with include_usage): each
    chunk carries its choice's usage so far; the last, usage-only chunk the total."""
    call, prompt = call_and_prompt(chat_api, "Hi")
    options = {"include_usage": True, "continuous_usage_stats": True}
    chunks = list(call(openai_client, True, stream_options=options, **prompt))
    counts = [c.usage.completion_tokens for c in chunks[:-1]]
    assert counts == sorted(counts) and counts[-1] == 6 and chunks[-1].usage.completion_tokens == 6
    assert all(c.usage.prompt_tokens == chunks[-1].usage.prompt_tokens for c in chunks)
    alone = {"continuous_usage_stats": True}  # without include_usage: no usage at all
    assert all(c.usage is None for c in call(openai_client, True, stream_options=alone, **prompt))


@pytest.mark.parametrize("stream", [True, False])
def test_client_disconnect_aborts_the_request(server, stream):
    def aborted() -> float:
        with urllib.request.urlopen(server.url + "/metrics") as response:
            text = response.read().decode()
        match = re.search(r'request_success_total\{finished_reason="abort"\} (\S+)', text)
        return float(match.group(1)) if match else 0.0

    before = aborted()
    connection = http.client.HTTPConnection("127.0.0.1", server.port, timeout=30)
    body = {"model": MODEL, "prompt": "Hello", "stream": stream, "ignore_eos": True}
    json_type = {"Content-Type": "application/json"}
    connection.request("POST", "/v1/completions", json.dumps(body), json_type)  # ~2000 tokens
    if stream:
        response = connection.getresponse()
        assert response.status == 200 and response.readline().startswith(b"data: ")
    else:
        time.sleep(0.3)
    connection.close()
    deadline = time.monotonic() + 10
    while aborted() == before and time.monotonic() < deadline:
        time.sleep(0.05)
    assert aborted() == before + 1


@pytest.fixture(scope="module")
def tokenizer():
    return open_tokenizer(None, VOCAB, MODEL)  # SmolLM2's, as the server fixture uses


def track(tokenizer, text: str, finish, num_tokens: int | None = None, **params):
    """Feeds `text`'s tokens one delta at a time to a ChoiceTracker; returns its deltas."""
    ids = tokenizer.encode(text)[:num_tokens]
    result = RequestResult(RequestSpec("id", "r", [1], SamplingParams(**params), 0), tokenizer)
    tracker, deltas = ChoiceTracker(result, tokenizer), []
    for i, token in enumerate(ids):
        last = i == len(ids) - 1
        result.apply(RequestOutput("id", [token], finish_reason=finish if last else None))
        deltas.append(tracker.next_delta())
    assert tracker.next_delta() is None
    return deltas


def test_deltas_hold_back_half_characters(tokenizer):
    deltas = track(tokenizer, "日本語 ok", FinishReason.of_length(3))
    texts = [d.text for d in deltas if d is not None]
    assert "".join(texts) == "日本語 ok" and not any(t.endswith("\ufffd") for t in texts)
    assert [d.finish_reason for d in deltas if d is not None][-1] == "length"


def test_deltas_hold_back_a_possible_stop_string(tokenizer):
    # tokens "a", "\n", "\n": the first newline may begin the stop "\n\n", so it waits
    deltas = track(tokenizer, "a\n\nb", FinishReason.stop("\n\n"), 3, stop="\n\n")
    assert [None if d is None else (d.text, d.finish_reason) for d in deltas] == [
        ("a", None),
        None,
        ("", "stop"),
    ]


def test_aborted_choice_finishes_with_abort(tokenizer):
    deltas = track(tokenizer, "Hi", FinishReason.abort("aborted by the client"))
    assert deltas[-1].finish_reason == "abort"
