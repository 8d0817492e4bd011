"""Reranking (SGLang's `/v1/rerank`, vLLM's Jina / Cohere-style `/rerank` and `/v2/rerank`):
each document's relevance to a query, by one of three kinds of model:

- a generating model (Qwen3-Reranker, or any chat model): each pair is judged yes or no by the
  model's chat template, the relevance is P(yes) / (P(yes) + P(no)) (generative_rerank.py);
- with `--is-embedding`, a cross-encoder: a sequence classifier with one output
  (`*ForSequenceClassification`, `num_labels` 1, e.g. a reranker converted to a score head):
  each (query, document) pair is one prompt, the tokenizer's pair encoding (as vLLM's and
  SGLang's cross-encoders), and the relevance is the sigmoid of the head's output;
- with `--is-embedding`, an embedding model (a bi-encoder): the query and every document are
  embedded in one batch, the relevance is the cosine of the query's embedding with the
  document's.

A pair's query prefix is the same tokens for every document, so the radix tree computes it
once (a judged chat's or a cross-encoder's prompts share it; an embedding model's query is one
request).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from radixserve.client.embedding import embed_args, embedding_vector
from radixserve.client.generative_rerank import check_instruct, judge_args, judged_logit
from radixserve.client.request_builder import GenerateArgs
from radixserve.client.result import RequestResult
from radixserve.client.scoring import sigmoid
from radixserve.sampling.params import is_int

MAX_DOCUMENTS = 2048
"""Most documents one call may rank (as many inputs as one embeddings call)."""
RERANK_NEEDS = (
    "Reranking needs a generating model, a cross-encoder (a sequence classifier with one "
    "output) or an embedding model"
)


@dataclass
class Ranked:
    """One document's relevance, its index in the request's `documents` and the request that
    computed it (a pair's, or the document's own embedding's)."""

    index: int
    score: float
    result: RequestResult


def rerank_mode(is_embedding: bool, num_labels: int | None) -> str:
    """ "generative", "cross-encoder" or "embedding": how this model ranks; ValueError where
    it cannot (a classifier with several outputs)."""
    if not is_embedding:
        return "generative"
    if num_labels is None:
        return "embedding"
    if num_labels != 1:
        raise ValueError(f"{RERANK_NEEDS}; this classifier has {num_labels} outputs: /classify")
    return "cross-encoder"


def check_documents(query: Any, documents: Any) -> list[str]:
    """A non-empty query string and 1..MAX_DOCUMENTS non-empty document strings."""
    if not isinstance(query, str) or not query.strip():
        raise ValueError(f"query must be a non-empty string; got {query!r}"[:200])
    ok = isinstance(documents, list) and 0 < len(documents) <= MAX_DOCUMENTS
    if not ok or not all(isinstance(d, str) and d.strip() for d in documents):
        raise ValueError(
            f"documents must be a list of 1 to {MAX_DOCUMENTS} non-empty strings; "
            f"got {documents!r}"[:200]
        )
    return documents


def check_top_n(value: Any, count: int) -> int:
    """How many of `count` ranked documents to return: all for None or 0 (vLLM's default)."""
    if value is None or (is_int(value) and value == 0):
        return count
    if not is_int(value) or value < 0:
        raise ValueError(f"top_n must be an int >= 1; got {value!r}"[:200])
    return min(value, count)


def check_text_pairs(text_1: Any, text_2: Any) -> tuple[list[str], list[str]]:
    """vLLM's /score `text_1` and `text_2` (each a string or a list of them): one text_1 for
    every text_2, or as many of each, paired in order."""
    firsts = [text_1] if isinstance(text_1, str) else text_1
    seconds = [text_2] if isinstance(text_2, str) else text_2
    for name, texts in (("text_1", firsts), ("text_2", seconds)):
        ok = isinstance(texts, list) and 0 < len(texts) <= MAX_DOCUMENTS
        if not ok or not all(isinstance(t, str) and t.strip() for t in texts):
            raise ValueError(
                f"{name} must be a non-empty string or a list of 1 to {MAX_DOCUMENTS} of them"
            )
    if len(firsts) not in (1, len(seconds)):
        raise ValueError(
            f"text_1 has {len(firsts)} texts for {len(seconds)} in text_2: give one, or as many"
        )
    return firsts, seconds


def rerank_args(
    mode: str,
    tokenizer,
    queries: list[str],
    documents: list[str],
    instruct: str | None = None,
    **fields: Any,
) -> GenerateArgs:
    """The requests that score each document against its query (`queries`: one for every
    document, or one each): one judged chat per document (generative, for the `instruct`
    task), one pair prompt per document (cross-encoder), or the queries then the documents
    (embedding model). `fields`: further GenerateArgs fields (cache_salt, lora_path,
    priority, truncate_prompt_tokens)."""
    pairs = list(zip(queries * len(documents) if len(queries) == 1 else queries, documents))
    if mode == "generative":
        return judge_args(tokenizer, check_instruct(instruct), pairs, **fields)
    if instruct is not None:
        raise ValueError(f"instruct: a {mode} model ranks without a task instruction")
    if mode == "cross-encoder":
        prompts = [tokenizer(query, doc)["input_ids"] for query, doc in pairs]
    else:
        prompts = [tokenizer.encode(text) for text in [*queries, *documents]]
    return embed_args(input_ids=prompts, **fields)


def relevances(mode: str, results: list[RequestResult], num_queries: int = 1) -> list[Ranked]:
    """Every document's relevance to its query, in document order (rerank_args' results)."""
    if mode == "generative":
        docs = results
        scores = [sigmoid(judged_logit(r)) for r in docs]
    elif mode == "cross-encoder":
        docs = results
        scores = [sigmoid(float(embedding_vector(r, normalize=False)[0])) for r in docs]
    else:
        queries = [embedding_vector(r) for r in results[:num_queries]]
        docs = results[num_queries:]
        pick = (lambda i: queries[0]) if num_queries == 1 else (lambda i: queries[i])
        scores = [float(np.dot(pick(i), embedding_vector(r))) for i, r in enumerate(docs)]
    return [Ranked(i, score, doc) for i, (score, doc) in enumerate(zip(scores, docs))]


def ranked(mode: str, results: list[RequestResult]) -> list[Ranked]:
    """Every document's relevance to the one query, most relevant first (ties in order)."""
    return sorted(relevances(mode, results), key=lambda item: -item.score)
