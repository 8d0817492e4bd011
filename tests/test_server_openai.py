"""The OpenAI-compatible endpoints, driven by the official `openai` client against
`radixserve serve` on a tiny random Llama (SmolLM2's tokenizer and chat template)."""

from __future__ import annotations

import http.client
import json
import re
import time
import urllib.error
import urllib.request
from typing import Any

import openai
import pytest

from conftest import VOCAB
from radixserve.client.result import RequestResult
from radixserve.engine.protocol import FinishReason, RequestOutput, RequestSpec
from radixserve.model.tokenizer import open_tokenizer
from radixserve.sampling.params import SamplingParams
from radixserve.server.openai_api import ChoiceTracker

MODEL = "tiny"
NO_EOS = {"ignore_eos": True}  # a random model may sample EOS; lengths stay exact without it
LONG_SYSTEM = "You are a careful assistant who answers in short plain sentences. " * 20


@pytest.fixture(scope="module")
def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)


def user(content: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": content}]


def post(server, path: str, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
    request = urllib.request.Request(
        server.url + path, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    try:
        with urllib.request.urlopen(request) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def complete(client, stream: bool = False, **kwargs):
    kwargs = {"model": MODEL, "max_tokens": 6, "temperature": 0, "extra_body": NO_EOS} | kwargs
    return client.completions.create(stream=stream, **kwargs)


def chat(client, stream: bool = False, **kwargs):
    kwargs = {"model": MODEL, "max_tokens": 6, "temperature": 0, "extra_body": NO_EOS} | kwargs
    return client.chat.completions.create(stream=stream, **kwargs)


def call_and_prompt(chat_api: bool, text: str):
    """The API call and its prompt argument for `text`, chat or completion."""
    return (chat, {"messages": user(text)}) if chat_api else (complete, {"prompt": text})


def streamed_text(chunks, chat_api: bool) -> tuple[dict[int, str], dict[int, str], list]:
    """Concatenated text and finish reason per choice index, and all chunks."""
    texts: dict[int, str] = {}
    finishes: dict[int, str] = {}
    chunks = list(chunks)
    for chunk in chunks:
        for choice in chunk.choices:
            piece = (choice.delta.content if chat_api else choice.text) or ""
            texts[choice.index] = texts.get(choice.index, "") + piece
            if choice.finish_reason is not None:
                assert choice.index not in finishes, "a choice finished twice"
                finishes[choice.index] = choice.finish_reason
    return texts, finishes, chunks


# ---- models, shapes ----------------------------------------------------------------------


def test_models_lists_the_served_model(client):
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    card = models.data[0]
    assert card.object == "model" and card.owned_by == "radixserve"
    assert card.model_extra["max_model_len"] == 2048


def test_completion_shape_and_usage(client, server):
    response = complete(client, prompt="The quick brown fox")
    assert response.object == "text_completion" and response.id.startswith("cmpl-")
    assert response.model == MODEL
    [choice] = response.choices
    assert choice.index == 0 and choice.finish_reason == "length" and choice.text
    assert choice.logprobs is None
    _, tokens = post(server, "/tokenize", {"prompt": "The quick brown fox"})
    usage = response.usage
    assert (usage.prompt_tokens, usage.completion_tokens) == (tokens["count"], 6)
    assert usage.total_tokens == tokens["count"] + 6


def test_chat_shape_and_usage(client, server):
    response = chat(client, messages=user("Hi there"))
    assert response.object == "chat.completion" and response.id.startswith("chatcmpl-")
    [choice] = response.choices
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason == "length"
    _, tokens = post(server, "/tokenize", {"messages": user("Hi there")})
    assert response.usage.prompt_tokens == tokens["count"]
    assert response.usage.completion_tokens == 6


def test_default_max_tokens_fills_the_context(client, server):
    prompt = [5] * 2040  # 8 tokens of room in the 2048-token context
    response = complete(client, prompt=prompt, max_tokens=None)
    assert response.usage.completion_tokens == 8
    assert response.choices[0].finish_reason == "length"


def test_max_tokens_beyond_the_context_is_rejected_not_clipped(client, server):
    prompt = [5] * 2040
    assert complete(client, prompt=prompt, max_tokens=8).usage.completion_tokens == 8
    with pytest.raises(openai.BadRequestError) as exc:
        complete(client, prompt=prompt, max_tokens=9)
    assert exc.value.param == "max_tokens"
    assert exc.value.body["message"] == (
        "max_tokens is 9 but the context length is 2048 and the prompt has 2040 tokens: "
        "at most 8 tokens can be generated"
    )
    _, tokens = post(server, "/tokenize", {"messages": user("Hi")})
    room = 2048 - tokens["count"]
    for name in ("max_tokens", "max_completion_tokens"):
        with pytest.raises(openai.BadRequestError) as exc:
            chat(client, messages=user("Hi"), **{"max_tokens": None, name: 5000})
        assert exc.value.param == name
        message = exc.value.body["message"]
        assert message.startswith(f"{name} is 5000 but the context length is 2048")
        assert message.endswith(f"at most {room} tokens can be generated")


# ---- streaming ---------------------------------------------------------------------------


@pytest.mark.parametrize("chat_api", [False, True])
def test_greedy_stream_adds_up_to_the_full_text(client, chat_api):
    call, prompt = (
        (chat, {"messages": user("Tell me")}) if chat_api else (complete, {"prompt": "Once"})
    )
    full = call(client, max_tokens=24, **prompt)
    texts, finishes, chunks = streamed_text(call(client, True, max_tokens=24, **prompt), chat_api)
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
def test_stream_include_usage_ends_with_a_usage_chunk(client, chat_api):
    call, prompt = call_and_prompt(chat_api, "Hi")
    full = call(client, **prompt)
    options = {"include_usage": True}
    chunks = list(call(client, True, stream_options=options, **prompt))
    assert chunks[-1].choices == []
    assert chunks[-1].usage.completion_tokens == 6
    assert chunks[-1].usage.prompt_tokens == full.usage.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])


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


# ---- sampling options --------------------------------------------------------------------


def test_n_choices_per_prompt(client):
    response = complete(client, prompt=["First prompt", "Second one"], n=2)
    assert [c.index for c in response.choices] == [0, 1, 2, 3]
    texts = [c.text for c in response.choices]
    assert texts[0] == texts[1] and texts[2] == texts[3]  # greedy: one answer per prompt
    assert response.usage.completion_tokens == 4 * 6
    single = complete(client, prompt="First prompt").usage.prompt_tokens
    single += complete(client, prompt="Second one").usage.prompt_tokens
    assert response.usage.prompt_tokens == single  # each prompt counted once


def test_chat_n_streamed(client):
    stream = chat(client, True, messages=user("Hello"), n=2, temperature=1.0, seed=3)
    texts, finishes, chunks = streamed_text(stream, chat_api=True)
    assert set(texts) == {0, 1} and finishes == {0: "length", 1: "length"}
    roles = [c.choices[0].index for c in chunks if c.choices[0].delta.role == "assistant"]
    assert sorted(roles) == [0, 1]


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_ends_and_is_trimmed(client, stream):
    base = complete(client, prompt="Count with me", max_tokens=10, logprobs=0)
    text, tokens = base.choices[0].text, base.choices[0].logprobs.tokens
    stop = max(tokens[3:7], key=len)
    assert stop.strip() and "\ufffd" not in stop
    expected = text[: text.find(stop)]
    if stream:
        chunks = complete(client, True, prompt="Count with me", max_tokens=10, stop=[stop])
        texts, finishes, _ = streamed_text(chunks, chat_api=False)
        assert texts == {0: expected} and finishes == {0: "stop"}
    else:
        response = complete(client, prompt="Count with me", max_tokens=10, stop=stop)
        assert response.choices[0].text == expected
        assert response.choices[0].finish_reason == "stop"


def test_seed_makes_sampling_reproducible(client):
    def sample(seed: int) -> str:
        response = chat(client, messages=user("Pick a word"), temperature=1.0, seed=seed)
        return response.choices[0].message.content

    assert sample(7) == sample(7)
    assert sample(7) != sample(8)


def test_cached_tokens_on_a_repeated_system_prompt(client):
    messages = [{"role": "system", "content": LONG_SYSTEM}, *user("What is two plus two?")]
    chat(client, messages=messages, max_tokens=2)
    usage = chat(client, messages=messages, max_tokens=2).usage
    assert usage.prompt_tokens > 200
    assert 0 < usage.prompt_tokens_details.cached_tokens <= usage.prompt_tokens


# ---- logprobs and echo -------------------------------------------------------------------


def test_completion_logprobs(client):
    response = complete(client, prompt="Logprobs please", logprobs=2)
    logprobs = response.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == 6
    offsets = [sum(len(t) for t in logprobs.tokens[:i]) for i in range(6)]
    assert logprobs.text_offset == offsets
    for token, value, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs):
        assert 2 <= len(top) <= 3 and top[token] == value  # top-2 plus the sampled token
        assert value == pytest.approx(max(top.values()))  # greedy picks the most likely


def test_chat_logprobs(client):
    response = chat(client, messages=user("Logprobs"), logprobs=True, top_logprobs=2)
    content = response.choices[0].logprobs.content
    assert len(content) == 6
    for entry in content:
        assert entry.bytes == list(entry.token.encode())
        assert len(entry.top_logprobs) == 2
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob


def test_streamed_logprobs_match_the_full_response(client):
    full = chat(client, messages=user("Stream logprobs"), logprobs=True, top_logprobs=1)
    chunks = chat(client, True, messages=user("Stream logprobs"), logprobs=True, top_logprobs=1)
    streamed = [e for c in chunks for ch in c.choices if ch.logprobs for e in ch.logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in full.choices[0].logprobs.content]


def test_echo_returns_the_prompt_and_its_logprobs(client):
    response = complete(client, prompt="Echo this prompt", max_tokens=3, echo=True, logprobs=1)
    choice = response.choices[0]
    assert choice.text.startswith("Echo this prompt")
    num_prompt = response.usage.prompt_tokens
    assert len(choice.logprobs.tokens) == num_prompt + 3
    assert choice.logprobs.token_logprobs[0] is None and choice.logprobs.top_logprobs[0] is None
    assert all(v is not None for v in choice.logprobs.token_logprobs[1:])
    assert choice.logprobs.text_offset[num_prompt] == len("Echo this prompt")


# ---- errors ------------------------------------------------------------------------------


def test_unknown_model_is_not_found(client):
    with pytest.raises(openai.NotFoundError) as exc:
        complete(client, model="gpt-4", prompt="Hi")
    assert exc.value.param == "model"
    with pytest.raises(openai.NotFoundError):
        chat(client, model="gpt-4", messages=user("Hi"))


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"temperature": -1}, "temperature"),
        ({"temperature": 2.5}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"max_tokens": -1}, "max_tokens"),
        ({"n": 0}, "n"),
        ({"logprobs": 21}, "logprobs"),
        ({"seed": "x"}, "seed"),
        ({"stop": 5}, "stop"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"extra_body": {"min_tokens": 9}}, "min_tokens"),
        ({"extra_body": {"top_k": 0}}, "top_k"),
        ({"extra_body": {"no_such_field": 1}}, "no_such_field"),
        ({"extra_body": {"logit_bias": {"5": 1}}}, "logit_bias"),
        ({"prompt": [1, 10**9]}, "prompt"),
        ({"prompt": "x " * 3000}, "prompt"),
    ],
)
def test_bad_completion_values_name_the_field(client, kwargs, field):
    with pytest.raises(openai.BadRequestError) as exc:
        complete(client, **({"prompt": "Hi"} | kwargs))
    assert field in exc.value.message and exc.value.param == field


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"temperature": 2.01}, "temperature"),
        ({"temperature": -0.5}, "temperature"),
        ({"max_completion_tokens": -2}, "max_completion_tokens"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"extra_body": {"chat_template_kwargs": [1]}}, "chat_template_kwargs"),
    ],
)
def test_bad_chat_values_name_the_field(client, kwargs, field):
    with pytest.raises(openai.BadRequestError) as exc:
        chat(client, **({"messages": user("Hi")} | kwargs))
    assert field in exc.value.message and exc.value.param == field


def test_seed_beyond_64_bits_is_used_modulo_2_64(client):
    texts = [complete(client, prompt="Hi", temperature=1.0, seed=s).choices[0].text
             for s in (7, 2**70 + 7)]  # fmt: skip
    assert texts[0] == texts[1]


def test_temperature_bounds_are_inclusive(client):
    for temperature in (0, 2):
        assert complete(client, prompt="Hi", temperature=temperature).choices[0].text
        assert chat(client, messages=user("Hi"), temperature=temperature).choices[0].message


# ---- tokenize ----------------------------------------------------------------------------


def test_tokenize_detokenize_round_trip(server):
    status, tokens = post(server, "/tokenize", {"prompt": "Hello, round trip!"})
    assert status == 200 and tokens["count"] == len(tokens["tokens"]) > 0
    assert tokens["max_model_len"] == 2048
    status, text = post(server, "/detokenize", {"tokens": tokens["tokens"]})
    assert (status, text) == (200, {"prompt": "Hello, round trip!"})


def test_tokenize_rejects_bad_input(server):
    status, body = post(server, "/detokenize", {"tokens": [-1]})
    assert status == 400 and body["error"]["param"] == "tokens"
    status, body = post(server, "/tokenize", {"prompt": "a", "messages": user("b")})
    assert status == 400
    status, body = post(server, "/tokenize", {"prompt": "a", "model": "other"})
    assert status == 404 and body["error"]["param"] == "model"


# ---- stream deltas (no server) -----------------------------------------------------------


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
