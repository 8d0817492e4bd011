"""Sequence classifiers and reward models (`*ForSequenceClassification`) with --is-embedding:
the score head over the last token, as transformers computes it, through Engine.encode,
SGLang's /classify and /encode shape and vLLM's /classify shape."""

from __future__ import annotations

import numpy as np
import pytest
import requests
import torch
from transformers import AutoModelForSequenceClassification, LlamaConfig, Qwen3Config

from conftest import TINY, VOCAB, ServerProcess, make_engine, prompt_ids
from radixserve.config.model import UnsupportedModelError
from radixserve.server.classify_api import class_probs

LABELS = {0: "negative", 1: "neutral", 2: "positive"}


def save_classifier(folder, config) -> torch.nn.Module:
    torch.manual_seed(4)
    model = AutoModelForSequenceClassification.from_config(config, dtype=torch.float32).eval()
    model.save_pretrained(folder)
    return model


def hf_scores(model, ids: list[int]) -> np.ndarray:
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0].numpy()


@pytest.fixture(scope="module")
def classifier(tmp_path_factory):
    folder = tmp_path_factory.mktemp("classifier")
    config = LlamaConfig(**(TINY | {"vocab_size": VOCAB}), id2label=LABELS,
                         label2id={v: k for k, v in LABELS.items()})  # fmt: skip
    return folder, save_classifier(folder, config)


def test_a_reward_model_scores_as_transformers_does_cold_and_warm(tmp_path):
    config = Qwen3Config(**(TINY | {"vocab_size": VOCAB}), head_dim=16, num_labels=1)
    model = save_classifier(tmp_path, config)
    prompts = [prompt_ids(1, 40), prompt_ids(1, 40) + prompt_ids(2, 6), prompt_ids(3, 7)]
    engine = make_engine(tmp_path, is_embedding=True)
    try:
        outs = engine.encode(input_ids=prompts)
        with pytest.raises(ValueError, match="does not generate"):
            engine.generate(input_ids=prompts[0])
        # Engine.score on a classifier: the head over query + item (prompts[1] is one)
        (scored,) = engine.score(query=prompts[0], items=[prompt_ids(2, 6)])
        with pytest.raises(ValueError, match="^label_token_ids"):
            engine.score(query=prompts[0], items=[prompt_ids(2, 6)], label_token_ids=[1])
        (ranked,) = engine.rerank([["a question", "an answer"]])  # a one-output cross-encoder
    finally:
        engine.shutdown()
    assert outs[1]["meta_info"]["cached_tokens"] == 32  # the first prompt's pages
    assert abs(scored[0] - hf_scores(model, prompts[1])[0]) < 1e-4
    pair = engine.tokenizer("a question", "an answer")["input_ids"]
    assert abs(ranked["embedding"] - 1 / (1 + np.exp(-hf_scores(model, pair)[0]))) < 1e-5
    for ids, out in zip(prompts, outs):
        reward = out["embedding"]  # SGLang's: the head's one output, unnormalized
        assert len(reward) == 1 and abs(reward[0] - hf_scores(model, ids)[0]) < 1e-4
    with pytest.raises(UnsupportedModelError, match="--is-embedding"):
        make_engine(tmp_path)


def test_classify_in_vllms_and_sglangs_shapes(classifier):
    folder, model = classifier
    server = ServerProcess(str(folder), "--is-embedding", "--served-model-name", "cls")
    try:
        ids = [prompt_ids(4, 12), prompt_ids(5, 30)]
        answer = requests.post(server.url + "/classify", json={"input": ids}).json()
        assert answer["object"] == "list" and answer["model"] == "cls"
        assert answer["usage"]["prompt_tokens"] == 42
        for item, prompt in zip(answer["data"], ids):
            expected = class_probs(hf_scores(model, prompt))
            assert np.abs(np.array(item["probs"]) - expected).max() < 1e-5
            assert item["label"] == LABELS[int(expected.argmax())] and item["num_classes"] == 3
        sglang = requests.post(server.url + "/v1/classify", json={"input_ids": ids[0]}).json()
        assert np.abs(np.array(sglang["embedding"]) - hf_scores(model, ids[0])).max() < 1e-4
        encoded = requests.post(server.url + "/encode", json={"input_ids": ids[0]}).json()
        assert encoded["embedding"] == sglang["embedding"]
        refused = requests.post(server.url + "/v1/embeddings", json={"input": "hi"})
        assert refused.status_code == 400 and "/classify" in refused.json()["error"]["message"]
        bad = requests.post(server.url + "/classify", json={"input": [], "model": "cls"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "input"
        items = [ids[1][:5], ids[1][5:9]]  # /v1/score on a classifier: its head's softmax
        body = {"query": ids[0], "items": items, "apply_softmax": True}
        scored = requests.post(server.url + "/v1/score", json=body).json()["scores"]
        for row, item in zip(scored, items):
            want = class_probs(hf_scores(model, ids[0] + item))
            assert np.abs(np.array(row) - want).max() < 1e-5
        bad = requests.post(server.url + "/v1/score", json=body | {"label_token_ids": [1]})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "label_token_ids"
        ranked = requests.post(server.url + "/rerank", json={"query": "q", "documents": ["a"]})
        assert ranked.status_code == 400 and "3 outputs" in ranked.json()["error"]["message"]
    finally:
        assert server.stop() == 0


def test_classify_is_refused_where_there_is_no_classifier(server):
    r = requests.post(server.url + "/classify", json={"input": "hello"})
    assert r.status_code == 400 and "--is-embedding" in r.json()["error"]["message"]
    assert class_probs(np.array([0.0])).tolist() == [0.5]
    assert np.allclose(class_probs(np.array([1.0, 1.0])), [0.5, 0.5])
