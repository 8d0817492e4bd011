"""Sampling options and logprobs on the OpenAI-compatible endpoints (conftest's `server`,
through the `openai` client): n choices, stop strings, seeds, cached tokens of a repeated
system prompt, completion and chat logprobs, and echo."""

from __future__ import annotations

import openai
import pytest
from native_http import post, run
from openai_calls import NO_EOS, chat, complete, streamed_text, user

LONG_SYSTEM = "You are a careful assistant who answers in short plain sentences. " * 20


def test_n_choices_per_prompt(openai_client):
    response = complete(openai_client, prompt=["First prompt", "Second one"], n=2)
    assert [c.index for c in response.choices] == [0, 1, 2, 3]
    texts = [c.text for c in response.choices]
    assert texts[0] == texts[1] and texts[2] == texts[3]  # greedy: one answer per prompt
    assert response.usage.completion_tokens == 4 * 6
    single = complete(openai_client, prompt="First prompt").usage.prompt_tokens
    single += complete(openai_client, prompt="Second one").usage.prompt_tokens
    assert response.usage.prompt_tokens == single  # each prompt counted once


def test_chat_n_streamed(openai_client):
    stream = chat(openai_client, True, messages=user("Hello"), n=2, temperature=1.0, seed=3)
    texts, finishes, chunks = streamed_text(stream, chat_api=True)
    assert set(texts) == {0, 1} and finishes == {0: "length", 1: "length"}
    roles = [c.choices[0].index for c in chunks if c.choices[0].delta.role == "assistant"]
    assert sorted(roles) == [0, 1]


@pytest.mark.parametrize("stream", [False, True])
def test_stop_string_ends_and_is_trimmed(openai_client, stream):
    base = complete(openai_client, prompt="Count with me", max_tokens=10, logprobs=0)
    text, tokens = base.choices[0].text, base.choices[0].logprobs.tokens
    stop = max(tokens[3:7], key=len)
    assert stop.strip() and "\ufffd" not in stop
    expected = text[: text.find(stop)]
    if stream:
        chunks = complete(openai_client, True, prompt="Count with me", max_tokens=10, stop=[stop])
        texts, finishes, _ = streamed_text(chunks, chat_api=False)
        assert texts == {0: expected} and finishes == {0: "stop"}
    else:
        response = complete(openai_client, prompt="Count with me", max_tokens=10, stop=stop)
        assert response.choices[0].text == expected
        assert response.choices[0].finish_reason == "stop"


def test_seed_makes_sampling_reproducible(openai_client):
    def sample(seed: int) -> str:
        response = chat(openai_client, messages=user("Pick a word"), temperature=1.0, seed=seed)
        return response.choices[0].message.content

    assert sample(7) == sample(7)
    assert sample(7) != sample(8)


def test_cached_tokens_on_a_repeated_system_prompt(openai_client):
    messages = [{"role": "system", "content": LONG_SYSTEM}, *user("What is two plus two?")]
    chat(openai_client, messages=messages, max_tokens=2)
    usage = chat(openai_client, messages=messages, max_tokens=2).usage
    assert usage.prompt_tokens > 200
    assert 0 < usage.prompt_tokens_details.cached_tokens <= usage.prompt_tokens


def test_logit_bias_forces_and_bans_tokens(openai_client, server):
    """OpenAI's logit_bias (token id strings -> [-100, 100]) is the native sampling param."""
    params = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}
    body = {"text": "Bias me", "sampling_params": params}
    status, native = run(post(server.url + "/generate", body))
    assert status == 200
    forced = complete(openai_client, prompt="Bias me", temperature=1.0, logit_bias={"77": 100})
    chat_forced = chat(openai_client, messages=user("Bias me"), logit_bias={"77": 100})
    body["sampling_params"]["logit_bias"] = {"77": 100}
    status, native_forced = run(post(server.url + "/generate", body))
    assert status == 200 and native_forced["output_ids"] == [77] * 6
    assert forced.choices[0].text == chat_forced.choices[0].message.content == native_forced["text"]
    plain = complete(openai_client, prompt="Bias me").choices[0].text
    banned = complete(openai_client, prompt="Bias me",
                      logit_bias={str(native["output_ids"][0]): -100})  # fmt: skip
    assert plain == native["text"] and banned.choices[0].text != plain


def test_extra_key_follows_the_salt_as_in_sglang(openai_client):
    messages = [{"role": "system", "content": LONG_SYSTEM + "Keyed."}, *user("Hi")]

    def cached(headers=None, **fields) -> int:
        usage = chat(openai_client, messages=messages, max_tokens=1, extra_body=NO_EOS | fields,
                     extra_headers=headers)  # fmt: skip
        return usage.usage.prompt_tokens_details.cached_tokens

    assert cached(cache_salt="oa", extra_key="-k") == 0
    assert cached(cache_salt="oa-k") > 0 and cached(cache_salt="oa") == 0
    assert cached({"X-Cache-Salt": "oa-k"}) > 0  # the header names the namespace too


def test_completion_logprobs(openai_client):
    response = complete(openai_client, prompt="Logprobs please", logprobs=2)
    logprobs = response.choices[0].logprobs
    assert len(logprobs.tokens) == len(logprobs.token_logprobs) == 6
    offsets = [sum(len(t) for t in logprobs.tokens[:i]) for i in range(6)]
    assert logprobs.text_offset == offsets
    for token, value, top in zip(logprobs.tokens, logprobs.token_logprobs, logprobs.top_logprobs):
        assert 2 <= len(top) <= 3 and top[token] == value  # top-2 plus the sampled token
        assert value == pytest.approx(max(top.values()))  # greedy picks the most likely


def test_return_tokens_as_token_ids_names_logprob_tokens_by_id(openai_client, server):
    """vLLM's return_tokens_as_token_ids: every logprob token (top ones too) as token_id:N."""
    plain = complete(openai_client, prompt="Logprobs please", logprobs=2)
    named = complete(openai_client, prompt="Logprobs please", logprobs=2,
                     extra_body=NO_EOS | {"return_tokens_as_token_ids": True})  # fmt: skip
    tokens = named.choices[0].logprobs.tokens
    ids = [int(t.removeprefix("token_id:")) for t in tokens]
    assert "".join(plain.choices[0].logprobs.tokens) == native_text(server, ids)
    assert all(
        k.startswith("token_id:") for top in named.choices[0].logprobs.top_logprobs for k in top
    )
    assert named.choices[0].logprobs.text_offset == plain.choices[0].logprobs.text_offset
    chat_named = chat(openai_client, messages=user("Hi"), logprobs=True, top_logprobs=1,
                      extra_body=NO_EOS | {"return_tokens_as_token_ids": True})  # fmt: skip
    assert all(c.token.startswith("token_id:") for c in chat_named.choices[0].logprobs.content)


def test_chat_logprobs(openai_client):
    response = chat(openai_client, messages=user("Logprobs"), logprobs=True, top_logprobs=2)
    content = response.choices[0].logprobs.content
    assert len(content) == 6
    for entry in content:
        assert entry.bytes == list(entry.token.encode())
        assert len(entry.top_logprobs) == 2
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob)
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob


def test_streamed_logprobs_match_the_full_response(openai_client):
    full = chat(openai_client, messages=user("Stream logprobs"), logprobs=True, top_logprobs=1)
    chunks = chat(
        openai_client, True, messages=user("Stream logprobs"), logprobs=True, top_logprobs=1
    )
    streamed = [e for c in chunks for ch in c.choices if ch.logprobs for e in ch.logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in full.choices[0].logprobs.content]


def test_echo_returns_the_prompt_and_its_logprobs(openai_client):
    response = complete(
        openai_client, prompt="Echo this prompt", max_tokens=3, echo=True, logprobs=1
    )
    choice = response.choices[0]
    assert choice.text.startswith("Echo this prompt")
    num_prompt = response.usage.prompt_tokens
    assert len(choice.logprobs.tokens) == num_prompt + 3
    assert choice.logprobs.token_logprobs[0] is None and choice.logprobs.top_logprobs[0] is None
    assert all(v is not None for v in choice.logprobs.token_logprobs[1:])
    assert choice.logprobs.text_offset[num_prompt] == len("Echo this prompt")


def test_continue_final_message_continues_the_assistant_turn(openai_client, server):
    """SGLang's and vLLM's chat extra: a last assistant turn is left open and continued."""
    messages = user("Name a colour.") + [{"role": "assistant", "content": "My favourite is"}]
    body = {"messages": messages, "add_generation_prompt": False}
    _, tokens = run(post(server.url + "/v1/tokenize", body))
    _, closed_text = run(post(server.url + "/v1/detokenize", {"tokens": tokens["tokens"]}))
    closed_text = closed_text["prompt"]
    prompt = closed_text[: closed_text.rindex("My favourite is") + len("My favourite is")]
    assert len(prompt) < len(closed_text)  # the template closed the turn after the text
    expected = complete(openai_client, prompt=prompt)
    extra = NO_EOS | {"continue_final_message": True}
    continued = chat(openai_client, messages=messages, extra_body=extra)
    assert continued.choices[0].message.content == expected.choices[0].text
    assert continued.usage.prompt_tokens == expected.usage.prompt_tokens
    closed = chat(openai_client, messages=messages)  # the turn closed, a new one opened
    assert closed.usage.prompt_tokens > continued.usage.prompt_tokens
    last_user = chat(openai_client, messages=user("Hi"), extra_body=extra)  # nothing to continue
    plain = chat(openai_client, messages=user("Hi"))
    assert last_user.usage.prompt_tokens == plain.usage.prompt_tokens
    with pytest.raises(openai.BadRequestError) as exc:
        chat(openai_client, messages=messages, extra_body={"continue_final_message": "yes"})
    assert exc.value.param == "continue_final_message"


def test_vllm_sampling_extras(openai_client, server):
    """vLLM's include_stop_str_in_output, allowed_token_ids, bad_words, truncate_prompt_tokens
    and (chat) add_generation_prompt."""
    base = complete(openai_client, prompt="Count with me", max_tokens=10, logprobs=0)
    stop = max(base.choices[0].logprobs.tokens[3:7], key=len)
    text = base.choices[0].text
    kept = complete(openai_client, prompt="Count with me", max_tokens=10, stop=[stop],
                    extra_body=NO_EOS | {"include_stop_str_in_output": True})  # fmt: skip
    assert kept.choices[0].text == text[: text.find(stop) + len(stop)]
    allowed = [77, 78, 79]
    params = {"temperature": 1.0, "max_new_tokens": 8, "ignore_eos": True}
    body = {"text": "Pick", "sampling_params": params | {"allowed_token_ids": allowed}}
    status, native = run(post(server.url + "/generate", body))
    assert status == 200 and set(native["output_ids"]) <= set(allowed)
    narrowed = complete(
        openai_client, prompt="Pick", extra_body=NO_EOS | {"allowed_token_ids": [77]}
    )
    assert narrowed.choices[0].text == native_text(server, [77] * 6)
    messages = user("Hi")
    opened = chat(openai_client, messages=messages).usage.prompt_tokens
    closed_turn = NO_EOS | {"add_generation_prompt": False}
    closed = chat(openai_client, messages=messages, extra_body=closed_turn).usage.prompt_tokens
    assert closed < opened
    tokens = base.choices[0].logprobs.tokens
    words = [(i, t) for i, t in enumerate(tokens) if t.startswith(" ") and t[1:].isalpha()]
    position, word = next((i, t) for i, t in words if single_token(server, t))
    banned = complete(openai_client, prompt="Count with me", max_tokens=10, logprobs=0,
                      extra_body=NO_EOS | {"bad_words": [word.strip()]})  # fmt: skip
    assert banned.choices[0].logprobs.tokens[:position] == tokens[:position]
    assert word not in banned.choices[0].logprobs.tokens
    long = complete(openai_client, prompt="one two three four five six seven eight nine ten")
    cut = complete(openai_client, prompt="one two three four five six seven eight nine ten",
                   extra_body=NO_EOS | {"truncate_prompt_tokens": 4})  # fmt: skip
    assert long.usage.prompt_tokens > 4 == cut.usage.prompt_tokens
    body = {"input_ids": list(range(300, 340)), "truncate_prompt_tokens": 7,
            "sampling_params": {"max_new_tokens": 1}, "return_prompt_token_ids": True}  # fmt: skip
    status, native = run(post(server.url + "/generate", body))
    assert status == 200 and native["prompt_token_ids"] == list(range(333, 340))
    status, bad = run(post(server.url + "/generate", body | {"truncate_prompt_tokens": 0}))
    assert status == 400 and bad["error"]["param"] == "truncate_prompt_tokens"
    conflicting = {"include_stop_str_in_output": True, "no_stop_trim": False}
    with pytest.raises(openai.BadRequestError) as exc:
        complete(openai_client, prompt="x", extra_body=conflicting)
    assert exc.value.param == "include_stop_str_in_output"


def single_token(server, text: str) -> bool:
    status, out = run(post(server.url + "/tokenize", {"prompt": text}))
    return status == 200 and len(out["tokens"]) == 1


def native_text(server, ids: list[int]) -> str:
    status, out = run(post(server.url + "/detokenize", {"tokens": ids}))
    assert status == 200
    return out["prompt"]
