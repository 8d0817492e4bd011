"""Reranking routes (client/rerank.py says how a document's relevance is computed, by a
generating model, a cross-encoder or an embedding model), in the shapes peers answer them:

- SGLang's POST /v1/rerank: `query`, `documents`, `top_n`, `return_documents` (default true),
  `instruct` (a generating model's task) -> a list of {"score", "document", "index",
  "meta_info"}, most relevant first;
- vLLM's Jina / Cohere-style POST /rerank and /v2/rerank: `query`, `documents`, `top_n`,
  `model`, `truncate_prompt_tokens` -> {"id", "model", "usage", "results": [{"index",
  "document": {"text"}, "relevance_score"}]}, most relevant first;
- vLLM's POST /score (and /v1/score given `text_1`, score_api.py): `text_1`, `text_2` (one
  text_1 for every text_2, or pairs in order) -> {"id", "object": "list", "created",
  "model", "data": [{"index", "object": "score", "score"}], "usage"}, in pair order.

All take `model` (the served model or a LoRA adapter), `cache_salt` (or X-Cache-Salt) and
`priority`; a classifier with several outputs refuses them naming /classify.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from aiohttp import web

from radixserve.client.embedding import request_meta
from radixserve.client.rerank import (
    check_documents,
    check_text_pairs,
    check_top_n,
    ranked,
    relevances,
    rerank_args,
    rerank_mode,
)
from radixserve.client.result import RequestResult
from radixserve.server.body_routes import json_route
from radixserve.server.embeddings_api import run_to_end
from radixserve.server.errors import BadRequest
from radixserve.server.lora_api import check_model_name
from radixserve.server.openai_protocol import check_bool, check_object
from radixserve.server.request_fields import check_fields
from radixserve.server.responses_options import optional_str
from radixserve.server.state import ServerState
from radixserve.server.tenants import check_salt

COMMON_FIELDS = {"query", "documents", "top_n", "model", "cache_salt", "priority",
                 "truncate_prompt_tokens"}  # fmt: skip
SGLANG_FIELDS = COMMON_FIELDS | {"return_documents", "instruct"}
SCORE_FIELDS = COMMON_FIELDS - {"query", "documents", "top_n"} | {"text_1", "text_2", "instruct"}
PROMPT_NAMES = {"input_ids": "documents", "text": "documents", "prompt": "documents",
                "n": "documents", "token_ids_logprob": "documents"}  # fmt: skip
"""Core validation messages' names for a pair's prompt (vLLM's /score: text_2 is a document)."""


def register_rerank_routes(app: web.Application) -> None:
    app.router.add_post("/v1/rerank", json_route(sglang_rerank_body))
    app.router.add_post("/rerank", json_route(vllm_rerank_body))
    app.router.add_post("/v2/rerank", json_route(vllm_rerank_body))
    app.router.add_post("/score", json_route(vllm_score_body))


async def sglang_rerank_body(state: ServerState, body: Any, salt_header: str | None) -> list:
    body = check_object(body)
    check_fields(body, SGLANG_FIELDS)
    with_documents = check_bool(body, "return_documents", True)
    documents, _, order, _ = await _rank(state, body, salt_header)
    answer = []
    for item in order:
        entry: dict[str, Any] = {"score": item.score, "index": item.index}
        if with_documents:
            entry["document"] = documents[item.index]
        entry["meta_info"] = request_meta(item.result)
        answer.append(entry)
    return answer


async def vllm_rerank_body(state: ServerState, body: Any, salt_header: str | None) -> dict:
    body = check_object(body)
    check_fields(body, COMMON_FIELDS)
    documents, results, order, model = await _rank(state, body, salt_header)
    return {
        "id": "rerank-" + uuid.uuid4().hex,
        "model": model,
        "usage": {"total_tokens": sum(r.prompt_len for r in results)},
        "results": [{"index": item.index, "document": {"text": documents[item.index]},
                     "relevance_score": item.score} for item in order],
    }  # fmt: skip


async def _rank(state: ServerState, body: dict, salt_header: str | None):
    """The body's documents, the requests' results, the top_n most relevant and the model."""
    try:
        documents = check_documents(body.get("query"), body.get("documents"))
        top_n = check_top_n(body.get("top_n"), len(documents))
    except ValueError as exc:
        raise BadRequest(str(exc)) from exc
    mode, results, model = await _score_pairs(state, body, salt_header, [body["query"]], documents)
    return documents, results, ranked(mode, results)[:top_n], model


async def vllm_score_body(state: ServerState, body: Any, salt_header: str | None) -> dict:
    """vLLM's /score (and /v1/score with `text_1`): each text_2's relevance to its text_1,
    in pair order."""
    body = check_object(body)
    check_fields(body, SCORE_FIELDS)
    try:
        firsts, seconds = check_text_pairs(body.get("text_1"), body.get("text_2"))
    except ValueError as exc:
        raise BadRequest(str(exc)) from exc
    mode, results, model = await _score_pairs(state, body, salt_header, firsts, seconds)
    tokens = sum(r.prompt_len for r in results)
    return {
        "id": "score-" + uuid.uuid4().hex,
        "object": "list",
        "created": int(time.time()),
        "model": model,
        "data": [{"index": item.index, "object": "score", "score": item.score}
                 for item in relevances(mode, results, len(firsts))],
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0},
    }  # fmt: skip


async def _score_pairs(
    state: ServerState,
    body: dict,
    salt_header: str | None,
    queries: list[str],
    documents: list[str],
) -> tuple[str, list[RequestResult], str]:
    """How the model ranks, the requests' results (client/rerank.py rerank_args) and the
    model's name; `model`, `cache_salt`, `priority`, `truncate_prompt_tokens` from the body."""
    try:
        mode = rerank_mode(state.builder.is_embedding, state.client.info.get("num_labels"))
    except ValueError as exc:
        raise BadRequest(str(exc)) from exc
    lora_path = check_model_name(state, optional_str(body, "model"))
    salt = check_salt(body.get("cache_salt"), salt_header)
    fields = {"cache_salt": salt, "lora_path": lora_path, "priority": body.get("priority"),
              "truncate_prompt_tokens": body.get("truncate_prompt_tokens")}  # fmt: skip
    instruct = body.get("instruct")
    try:
        args = await state.off_loop(
            lambda: rerank_args(mode, state.tokenizer, queries, documents, instruct, **fields)
        )
    except ValueError as exc:
        raise BadRequest(str(exc)) from exc
    results, _ = await run_to_end(state, args, PROMPT_NAMES, embed=mode != "generative")
    return mode, results, lora_path or state.served_model_name
