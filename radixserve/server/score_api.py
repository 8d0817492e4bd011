"""SGLang's POST /v1/score (client/scoring.py says what a score is): `query`, `items`,
`label_token_ids`, `apply_softmax`, `item_first`, `model` -> {"scores": one list per item,
"model", "usage", "object": "scoring"}. A generating server scores label tokens, a sequence
classifier with its head; an embedding server refuses it. X-Cache-Salt / `cache_salt` keep
tenants' queries apart, `model` may name a LoRA adapter, `priority` orders the items' requests.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from radixserve.client.scoring import SCORE_NAMES, item_scores, score_args, scores_with_head
from radixserve.server.body_routes import json_route
from radixserve.server.embeddings_api import run_to_end
from radixserve.server.errors import BadRequest
from radixserve.server.lora_api import check_model_name
from radixserve.server.openai_protocol import check_bool, check_object
from radixserve.server.request_fields import check_fields
from radixserve.server.rerank_api import vllm_score_body
from radixserve.server.responses_options import optional_str
from radixserve.server.state import ServerState
from radixserve.server.tenants import check_salt

SCORE_FIELDS = {"query", "items", "label_token_ids", "apply_softmax", "item_first", "model",
                "cache_salt", "priority"}  # fmt: skip


def register_score_routes(app: web.Application) -> None:
    app.router.add_post("/v1/score", json_route(score_body))


async def score_body(state: ServerState, body: Any, salt_header: str | None) -> dict:
    """SGLang's body, or vLLM's (`text_1` / `text_2`: rerank_api.vllm_score_body); the Batch
    API's /v1/score lines run here too."""
    body = check_object(body)
    if "text_1" in body or "text_2" in body:
        return await vllm_score_body(state, body, salt_header)
    check_fields(body, SCORE_FIELDS)
    try:
        head = scores_with_head(state.builder.is_embedding, state.client.info.get("num_labels"))
    except ValueError as exc:
        raise BadRequest(str(exc)) from exc
    lora_path = check_model_name(state, optional_str(body, "model"))
    apply_softmax = check_bool(body, "apply_softmax", False)
    salt = check_salt(body.get("cache_salt"), salt_header)
    try:
        args = score_args(body.get("query"), body.get("items"), body.get("label_token_ids"),
                          body.get("item_first", False), head, cache_salt=salt,
                          lora_path=lora_path, priority=body.get("priority"))  # fmt: skip
    except ValueError as exc:
        raise BadRequest(str(exc)) from exc
    results, _ = await run_to_end(state, args, SCORE_NAMES, embed=head)
    tokens = sum(r.prompt_len for r in results)
    return {
        "scores": [item_scores(r, apply_softmax, head) for r in results],
        "model": lora_path or state.served_model_name,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0},
        "object": "scoring",
    }
