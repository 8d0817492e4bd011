"""Fill-in-the-middle: a completion's `suffix` (and Ollama generate's) becomes the model's FIM
prompt (SGLang's --completion-template formats), found from the vocabulary when not named."""

from __future__ import annotations

import json

import openai
import pytest
import requests
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from conftest import TINY, ServerProcess
from radixserve.model.tokenizer import model_tokenizer
from radixserve.server.completion_template import TEMPLATES, resolve_completion_template

STAR = ["<fim_prefix>", "<fim_middle>", "<fim_suffix>"]
PREFIX, SUFFIX = "def add(a, b):\n    ", "\n    return total\n"


@pytest.fixture(scope="module")
def fim_model(tmp_path_factory) -> str:
    """A tiny Llama whose tokenizer (the default model's) gains StarCoder's FIM tokens."""
    folder = tmp_path_factory.mktemp("fim_model")
    tokenizer = model_tokenizer(None)
    tokenizer.add_special_tokens({"additional_special_tokens": STAR})
    tokenizer.save_pretrained(folder)
    torch.manual_seed(2)
    config = LlamaConfig(**(TINY | {"vocab_size": len(tokenizer) + 5}))
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="module")
def fim_server(fim_model):
    proc = ServerProcess(fim_model, "--served-model-name", "coder")
    yield proc
    assert proc.stop() == 0


def test_suffix_becomes_the_fim_prompt_on_completions_and_ollama(fim_server):
    client = openai.OpenAI(base_url=fim_server.url + "/v1", api_key="none")
    greedy = {"model": "coder", "max_tokens": 6, "temperature": 0}
    filled = client.completions.create(prompt=PREFIX, suffix=SUFFIX, **greedy)
    fim = "<fim_prefix>" + PREFIX + "<fim_suffix>" + SUFFIX + "<fim_middle>"
    by_hand = client.completions.create(prompt=fim, **greedy)
    assert filled.choices[0].text == by_hand.choices[0].text
    assert filled.usage.prompt_tokens == by_hand.usage.prompt_tokens
    tokens = requests.post(fim_server.url + "/tokenize", json={"prompt": fim}).json()["tokens"]
    assert len(tokens) == filled.usage.prompt_tokens  # the FIM markers are single tokens
    plain = client.completions.create(prompt=PREFIX, suffix="", **greedy)
    assert plain.usage.prompt_tokens < filled.usage.prompt_tokens  # "" is no suffix
    body = {"model": "coder", "prompt": PREFIX, "suffix": SUFFIX, "stream": False,
            "options": {"temperature": 0, "num_predict": 6}}  # fmt: skip
    answer = requests.post(fim_server.url + "/api/generate", json=body).json()
    assert answer["response"] == filled.choices[0].text
    assert answer["prompt_eval_count"] == filled.usage.prompt_tokens
    shown = requests.post(fim_server.url + "/api/show", json={"model": "coder"}).json()
    assert shown["capabilities"] == ["completion", "tools", "insert"]  # Ollama's name for FIM


@pytest.mark.parametrize(
    "body, param",
    [
        ({"prompt": [1, 2, 3], "suffix": "x"}, "suffix"),
        ({"prompt": "a", "suffix": "x", "echo": True}, "suffix"),
        ({"prompt": "a", "suffix": 3}, "suffix"),
    ],
)
def test_bad_suffixes_are_a_400(fim_server, body, param):
    r = requests.post(fim_server.url + "/v1/completions", json=body | {"max_tokens": 2})
    assert r.status_code == 400 and r.json()["error"]["param"] == param


def test_a_model_without_fim_tokens_refuses_a_suffix(server):
    r = requests.post(server.url + "/v1/completions",
                      json={"prompt": "a", "suffix": "b", "max_tokens": 2})  # fmt: skip
    assert r.status_code == 400 and r.json()["error"]["param"] == "suffix"
    assert "--completion-template" in r.json()["error"]["message"]
    body = {"model": "tiny", "prompt": "a", "suffix": "b", "system": "s", "stream": False}
    r = requests.post(server.url + "/api/generate", data=json.dumps(body),
                      headers={"Content-Type": "application/json"})  # fmt: skip
    assert r.status_code == 400 and r.json() == {
        "error": "system does not go with suffix (a fill-in-the-middle prompt)"
    }


def test_templates_resolve_from_the_vocabulary_or_fail_naming_the_flag(fim_model):
    with_fim = model_tokenizer(fim_model)
    assert resolve_completion_template(None, with_fim) is TEMPLATES["star_coder"]
    assert resolve_completion_template(None, model_tokenizer(None)) is None
    with pytest.raises(ValueError, match="--completion-template qwen_coder: .*'<\\|fim_prefix"):
        resolve_completion_template("qwen_coder", with_fim)
    with pytest.raises(ValueError, match="--completion-template 'bogus' is not a known format"):
        resolve_completion_template("bogus", with_fim)
    deepseek = TEMPLATES["deepseek_coder"].prompt("a", "b")
    assert deepseek == "<｜fim▁begin｜>a<｜fim▁hole｜>b<｜fim▁end｜>"
