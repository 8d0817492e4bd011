"""Bad values on the OpenAI-compatible endpoints (conftest's `server`, through the `openai`
client) are refused naming the field; an unknown model is not found; the bounds of the
temperature and the seed are accepted."""

from __future__ import annotations

import openai
import pytest
from openai_calls import chat, complete, user


def test_unknown_model_is_not_found(openai_client):
    with pytest.raises(openai.NotFoundError) as exc:
        complete(openai_client, model="gpt-4", prompt="Hi")
    assert exc.value.param == "model"
    with pytest.raises(openai.NotFoundError):
        chat(openai_client, model="gpt-4", messages=user("Hi"))


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
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"logit_bias": {"1000000000": 1}}, "logit_bias"),
        ({"prompt": [1, 10**9]}, "prompt"),
        ({"prompt": "x " * 3000}, "prompt"),
    ],
)
def test_bad_completion_values_name_the_field(openai_client, kwargs, field):
    with pytest.raises(openai.BadRequestError) as exc:
        complete(openai_client, **({"prompt": "Hi"} | kwargs))
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
def test_bad_chat_values_name_the_field(openai_client, kwargs, field):
    with pytest.raises(openai.BadRequestError) as exc:
        chat(openai_client, **({"messages": user("Hi")} | kwargs))
    assert field in exc.value.message and exc.value.param == field


def test_seed_beyond_64_bits_is_used_modulo_2_64(openai_client):
    texts = [complete(openai_client, prompt="Hi", temperature=1.0, seed=s).choices[0].text
             for s in (7, 2**70 + 7)]  # fmt: skip
    assert texts[0] == texts[1]


def test_temperature_bounds_are_inclusive(openai_client):
    for temperature in (0, 2):
        assert complete(openai_client, prompt="Hi", temperature=temperature).choices[0].text
        assert chat(openai_client, messages=user("Hi"), temperature=temperature).choices[0].message
