"""Scoring (SGLang's Engine.score and POST /v1/score): each label token's probability after
query + item, as transformers computes it, cold and warm; the items share the query's pages;
text and token ids, item_first, apply_softmax; bad input names its field."""

from __future__ import annotations

import math

import pytest
import requests
import torch

from conftest import hf_model, make_engine, prompt_ids

LABELS = [5, 900, 2041]


@pytest.fixture(scope="module")
def engine(tiny_chat_model):
    engine = make_engine(tiny_chat_model)
    yield engine
    engine.shutdown()


@torch.inference_mode()
def hf_next(model, ids: list[int]) -> torch.Tensor:
    """The next-token log-softmax after `ids`, float64."""
    return torch.log_softmax(model(torch.tensor([ids])).logits[0, -1].double(), -1)


def expected(model, prompts: list[list[int]], apply_softmax: bool) -> list[list[float]]:
    rows = []
    for ids in prompts:
        logprobs = hf_next(model, ids)[LABELS]
        rows.append((torch.softmax(logprobs, -1) if apply_softmax else logprobs.exp()).tolist())
    return rows


def close(got: list[list[float]], want: list[list[float]]) -> bool:
    return len(got) == len(want) and all(
        len(g) == len(w)
        and all(math.isclose(a, b, rel_tol=1e-3, abs_tol=1e-6) for a, b in zip(g, w))
        for g, w in zip(got, want)
    )


def test_label_probabilities_match_transformers_cold_and_warm(engine, tiny_chat_model):
    model = hf_model(tiny_chat_model)
    query, items = prompt_ids(1, 40), [prompt_ids(2, 3), prompt_ids(3, 9), []]
    prompts = [query + item for item in items]
    before = engine.get_stats()
    for softmax in (False, True):  # the second call finds every prompt cached
        scores = engine.score(query=query, items=items, label_token_ids=LABELS,
                              apply_softmax=softmax)  # fmt: skip
        assert close(scores, expected(model, prompts, softmax)), scores
        if softmax:
            assert all(abs(sum(row) - 1) < 1e-9 for row in scores)
    stats = engine.get_stats()
    # the query's 40 tokens are computed once (in-batch dedupe), then every prompt is a hit
    computed = stats["prefill_tokens_computed"] - before["prefill_tokens_computed"]
    assert computed < 40 + 3 + 9 + 3 * 16
    first = engine.score(query=query, items=items[:1], label_token_ids=LABELS)
    assert close(first, engine.score(query=query, items=items[:1], label_token_ids=LABELS))
    reversed_ = engine.score(query=query, items=items[:2], label_token_ids=LABELS, item_first=True)
    assert close(reversed_, expected(model, [i + query for i in items[:2]], False))
    engine.check_integrity()


def test_text_joins_before_tokenizing(engine):
    query, items = "The capital of France is", [" Paris", " a city", ""]
    scores = engine.score(query=query, items=items, label_token_ids=LABELS)
    ids = [engine.tokenizer.encode(query + item) for item in items]
    assert close(scores, engine.score(query=ids[0][:0], items=ids, label_token_ids=LABELS))
    single = engine.score(query=query, items=" Paris", label_token_ids=LABELS)  # one item
    assert close(single, scores[:1])
    flipped = engine.score(
        query=" is big", items=["Paris"], label_token_ids=LABELS, item_first=True
    )
    assert close(flipped, engine.score(query="Paris is big", items=[""], label_token_ids=LABELS))


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"query": "a", "items": ["b"]}, "label_token_ids"),
        ({"query": "a", "items": ["b"], "label_token_ids": []}, "label_token_ids"),
        ({"query": "a", "items": ["b"], "label_token_ids": [10**9]}, "label_token_ids"),
        ({"query": "a", "items": [], "label_token_ids": [1]}, "items"),
        ({"query": "a", "items": [[1, 2]], "label_token_ids": [1]}, "query and items"),
        ({"query": [1], "items": ["b"], "label_token_ids": [1]}, "query and items"),
        ({"query": "a", "items": ["b"] * 2049, "label_token_ids": [1]}, "items"),
        ({"query": "", "items": [""], "label_token_ids": [1]}, "items"),
        ({"query": "a", "items": ["b"], "label_token_ids": [1], "item_first": 1}, "item_first"),
    ],
)
def test_bad_input_names_the_parameter(engine, kwargs, field):
    with pytest.raises(ValueError, match=f"^{field}"):
        engine.score(**kwargs)


def test_v1_score_over_http(server, tiny_chat_model):
    query, items = prompt_ids(6, 20), [prompt_ids(7, 4), prompt_ids(8, 5)]
    body = {"query": query, "items": items, "label_token_ids": LABELS, "apply_softmax": True}
    answer = requests.post(server.url + "/v1/score", json=body).json()
    assert answer["object"] == "scoring" and len(answer["scores"]) == 2
    assert close(
        answer["scores"], expected(hf_model(tiny_chat_model), [query + i for i in items], True)
    )
    assert answer["usage"]["prompt_tokens"] == 49
    text = {"query": "Is the sky blue?", "items": [" Yes", " No"], "label_token_ids": LABELS}
    assert len(requests.post(server.url + "/v1/score", json=text).json()["scores"]) == 2
    for bad, param in [
        ({"query": "a", "items": ["b"]}, "label_token_ids"),
        (
            {"query": "a", "items": ["b"], "label_token_ids": [1], "apply_softmax": "yes"},
            "apply_softmax",
        ),
        ({"query": "a", "items": ["b"], "label_token_ids": [1], "n": 2}, "n"),
        ({"query": "a", "items": "b", "label_token_ids": [1], "model": "other"}, "model"),
    ]:
        got = requests.post(server.url + "/v1/score", json=bad)
        assert got.status_code in (400, 404) and got.json()["error"]["param"] == param, got.text


def test_a_batch_of_score_lines(openai_client, server):
    """OpenAI's Batch API with endpoint /v1/score: each line answered as /v1/score answers it,
    a bad line in the error file."""
    from test_server_batches import line, records, upload, wait_ended

    bodies = [{"query": prompt_ids(9, 30), "items": [prompt_ids(i, 4)], "label_token_ids": LABELS}
              for i in range(2)]  # fmt: skip
    lines = [line(f"s{i}", body, "/v1/score") for i, body in enumerate(bodies)]
    lines.append(line("bad", {"query": "a", "items": ["b"]}, "/v1/score"))
    batch = openai_client.batches.create(input_file_id=upload(openai_client, lines).id,
                                         endpoint="/v1/score", completion_window="24h")  # fmt: skip
    batch = wait_ended(openai_client, batch.id)
    assert (batch.request_counts.completed, batch.request_counts.failed) == (2, 1)
    outputs = records(openai_client, batch.output_file_id)
    for i, body in enumerate(bodies):
        direct = requests.post(server.url + "/v1/score", json=body).json()
        assert close(outputs[f"s{i}"]["response"]["body"]["scores"], direct["scores"])
    error = records(openai_client, batch.error_file_id)["bad"]["response"]
    assert error["status_code"] == 400 and error["body"]["error"]["param"] == "label_token_ids"


def test_engine_rerank_judges_pairs_in_order(engine, tiny_chat_model):
    from test_rerank import judged

    from radixserve.client.generative_rerank import DEFAULT_INSTRUCT

    pairs = [["Where is Paris?", "In France."], ["What is red?", "A colour."]]
    outputs = engine.rerank(pairs)
    model = hf_model(tiny_chat_model)
    for (query, doc), out in zip(pairs, outputs):
        want = judged(model, engine.tokenizer, DEFAULT_INSTRUCT, query, doc)
        assert abs(out["embedding"] - want) < 1e-5 and out["meta_info"]["prompt_tokens"] > 0
    for bad in ([], [["only a query"]], [["q", ""]], "q"):
        with pytest.raises(ValueError, match="^prompt"):
            engine.rerank(bad)


def test_engine_rerank_on_templates_without_a_system_turn(engine):
    """Gemma's and Mistral's templates refuse a system turn: its text leads the user turn;
    a template that refuses every chat is a ValueError naming the documents."""
    template = engine.tokenizer.chat_template
    no_system = (
        "{% for m in messages %}{% if m['role'] == 'system' %}"
        "{{ raise_exception('System role not supported') }}{% endif %}"
        "<u>{{ m['content'] }}</u>{% endfor %}<a>"
    )
    try:
        engine.tokenizer.chat_template = no_system
        (judged,) = engine.rerank([["Where is Paris?", "In France."]])
        assert judged["meta_info"]["prompt_tokens"] > 0 and 0 < judged["embedding"] < 1
        engine.tokenizer.chat_template = "{{ raise_exception('no chats here') }}"
        with pytest.raises(ValueError, match="^documents could not be judged"):
            engine.rerank([["Where is Paris?", "In France."]])
    finally:
        engine.tokenizer.chat_template = template
