"""Reranking with a cross-encoder (a sequence classifier with one output, --is-embedding):
SGLang's /v1/rerank, vLLM's Jina / Cohere-style /rerank and /v2/rerank and its /score give each
document the sigmoid of the head over the tokenizer's (query, document) pair, as transformers
computes it, most relevant first; a generating model judges each pair yes or no through its
chat template (Qwen3-Reranker's recipe). (An embedding model's ranking, by cosine:
tests/test_embeddings.py.)"""

from __future__ import annotations

import math

import openai
import pytest
import requests
import torch
from transformers import AutoModelForSequenceClassification, LlamaConfig

from conftest import TINY, VOCAB, ServerProcess, hf_model
from radixserve.client.generative_rerank import DEFAULT_INSTRUCT, judge_messages
from radixserve.model.tokenizer import model_tokenizer

QUERY = (
    "Which city is the capital of France, the one where the government sits and the "
    "president lives, and which also holds the most museums of the country?"
)
DOCS = ["Paris is the capital of France.", "Bananas are yellow.", "Lyon is in France.",
        "The Eiffel tower stands in Paris."]  # fmt: skip


@pytest.fixture(scope="module")
def cross_encoder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("cross_encoder")
    torch.manual_seed(7)
    config = LlamaConfig(**(TINY | {"vocab_size": VOCAB}), num_labels=1)
    model = AutoModelForSequenceClassification.from_config(config, dtype=torch.float32).eval()
    model.save_pretrained(folder)
    proc = ServerProcess(str(folder), "--is-embedding", "--served-model-name", "ranker")
    yield proc, model
    assert proc.stop() == 0


def hf_relevance(model, query: str, doc: str) -> float:
    ids = model_tokenizer(None)(query, doc)["input_ids"]
    with torch.inference_mode():
        logit = float(model(torch.tensor([ids])).logits[0, 0])
    return 1 / (1 + math.exp(-logit))


def test_sglang_and_vllm_shapes_rank_as_transformers(cross_encoder):
    server, model = cross_encoder
    want = [hf_relevance(model, QUERY, doc) for doc in DOCS]
    order = sorted(range(len(DOCS)), key=lambda i: -want[i])
    sglang = requests.post(server.url + "/v1/rerank", json={"query": QUERY, "documents": DOCS})
    answer = sglang.json()
    assert [item["index"] for item in answer] == order, answer
    for item in answer:
        assert abs(item["score"] - want[item["index"]]) < 1e-5
        assert item["document"] == DOCS[item["index"]] and item["meta_info"]["prompt_tokens"] > 0
    body = {"query": QUERY, "documents": DOCS, "top_n": 2, "model": "ranker"}
    for path in ("/rerank", "/v2/rerank"):
        jina = requests.post(server.url + path, json=body).json()
        assert jina["model"] == "ranker" and jina["id"].startswith("rerank-")
        assert [r["index"] for r in jina["results"]] == order[:2]
        assert all(r["document"]["text"] == DOCS[r["index"]] for r in jina["results"])
        assert all(abs(r["relevance_score"] - want[r["index"]]) < 1e-5 for r in jina["results"])
        assert jina["usage"]["total_tokens"] > 4 * len(model_tokenizer(None)(QUERY)["input_ids"])
    brief = {"query": QUERY, "documents": DOCS, "top_n": 1, "return_documents": False}
    (top,) = requests.post(server.url + "/v1/rerank", json=brief).json()
    assert top["index"] == order[0] and "document" not in top
    # the pairs share the query's tokens (its full pages): a later call finds them cached
    again = requests.post(server.url + "/v1/rerank", json={"query": QUERY, "documents": ["Nice."]})
    assert again.json()[0]["meta_info"]["cached_tokens"] >= 16
    # ... within a tenant: another salt (body or X-Cache-Salt) sees none of it
    for extra, headers in (({"cache_salt": "t1"}, {}), ({}, {"X-Cache-Salt": "t2"})):
        body = {"query": QUERY, "documents": ["Nice."]} | extra
        other = requests.post(server.url + "/v1/rerank", json=body, headers=headers).json()
        assert other[0]["meta_info"]["cached_tokens"] == 0


def test_vllms_score_pairs_in_order(cross_encoder):
    server, model = cross_encoder
    for path in ("/score", "/v1/score"):  # /v1/score is SGLang's, unless given text_1
        one = requests.post(server.url + path, json={"text_1": QUERY, "text_2": DOCS}).json()
        assert one["object"] == "list" and one["id"].startswith("score-")
        assert [d["index"] for d in one["data"]] == list(range(len(DOCS)))
        for item, doc in zip(one["data"], DOCS):
            assert item["object"] == "score"
            assert abs(item["score"] - hf_relevance(model, QUERY, doc)) < 1e-5
    pairs = {"text_1": ["a question", "another one"], "text_2": DOCS[:2], "model": "ranker"}
    each = requests.post(server.url + "/score", json=pairs).json()
    want = [hf_relevance(model, q, d) for q, d in zip(pairs["text_1"], pairs["text_2"])]
    assert [abs(d["score"] - w) < 1e-5 for d, w in zip(each["data"], want)] == [True, True]
    assert each["usage"]["prompt_tokens"] == each["usage"]["total_tokens"] > 0
    uneven = requests.post(server.url + "/score", json={"text_1": ["a", "b"], "text_2": DOCS[:3]})
    assert uneven.status_code == 400 and uneven.json()["error"]["param"] == "text_1"
    empty = requests.post(server.url + "/v1/score", json={"text_1": "a", "text_2": []})
    assert empty.status_code == 400 and empty.json()["error"]["param"] == "text_2"


def test_a_batch_of_rerank_lines(cross_encoder):
    from test_server_batches import line, records, upload, wait_ended

    server, model = cross_encoder
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none")
    body = {"query": QUERY, "documents": DOCS[:2]}
    uploaded = upload(client, [line("r", body, "/v1/rerank")])
    batch = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/rerank",
                                  completion_window="24h")  # fmt: skip
    batch = wait_ended(client, batch.id)
    ranked = records(client, batch.output_file_id)["r"]["response"]["body"]
    assert {item["index"]: item["score"] for item in ranked} == pytest.approx(
        {i: hf_relevance(model, QUERY, doc) for i, doc in enumerate(DOCS[:2])}, abs=1e-5
    )


@pytest.mark.parametrize(
    "body, param",
    [
        ({"query": "", "documents": ["a"]}, "query"),
        ({"query": "q", "documents": []}, "documents"),
        ({"query": "q", "documents": ["a", ""]}, "documents"),
        ({"query": "q", "documents": "a"}, "documents"),
        ({"query": "q", "documents": ["a"], "top_n": -1}, "top_n"),
        ({"query": "q", "documents": ["a"], "top_n": 1.5}, "top_n"),
        ({"query": "q", "documents": ["a"], "model": "other"}, "model"),
        ({"query": "q", "documents": ["a"], "return_documents": "no"}, "return_documents"),
        ({"query": "q", "documents": ["a"], "instruct": "x"}, "instruct"),
        ({"query": "q", "documents": ["a" * 40000]}, "documents"),
    ],
)
def test_bad_input_is_a_400_naming_the_field(cross_encoder, body, param):
    answer = requests.post(cross_encoder[0].url + "/v1/rerank", json=body)
    assert answer.status_code in (400, 404) and answer.json()["error"]["param"] == param, (
        answer.text
    )


def judged(model, tokenizer, instruct: str, query: str, doc: str) -> float:
    """transformers' P(yes) / (P(yes) + P(no)) after the judged chat."""
    messages = judge_messages(instruct, query, doc)
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True,
                                         enable_thinking=False)  # fmt: skip
    ids = tokenizer.encode(text, add_special_tokens=False)
    with torch.inference_mode():
        logprobs = torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].double(), -1)
    no, yes = (tokenizer.convert_tokens_to_ids(w) for w in ("no", "yes"))
    return float(torch.sigmoid(logprobs[yes] - logprobs[no]))


def test_a_generating_model_judges_each_pair_yes_or_no(server, tiny_chat_model):
    model, tokenizer = hf_model(tiny_chat_model), model_tokenizer(None)
    for instruct in (None, "Find passages about French cities"):
        body = {"query": QUERY, "documents": DOCS} | ({"instruct": instruct} if instruct else {})
        answer = requests.post(server.url + "/v1/rerank", json=body).json()
        task = instruct or DEFAULT_INSTRUCT
        want = {i: judged(model, tokenizer, task, QUERY, doc) for i, doc in enumerate(DOCS)}
        assert {item["index"]: item["score"] for item in answer} == pytest.approx(want, abs=1e-5)
        got = [item["score"] for item in answer]  # most relevant first
        assert got == sorted(got, reverse=True)
        # the chat's system turn, task and query come first: the later pairs hit them
        assert min(item["meta_info"]["cached_tokens"] for item in answer[1:]) >= 16
    pairs = requests.post(server.url + "/score", json={"text_1": QUERY, "text_2": DOCS[:2]})
    scores = [d["score"] for d in pairs.json()["data"]]
    want = [judged(model, tokenizer, DEFAULT_INSTRUCT, QUERY, doc) for doc in DOCS[:2]]
    assert scores == pytest.approx(want, abs=1e-5)
    bad = requests.post(server.url + "/v1/rerank", json={"query": "q", "documents": ["a"],
                                                         "instruct": ""})  # fmt: skip
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "instruct"
