"""Sequence classifiers and reward models served with --is-embedding (`*ForSequenceClassification`
checkpoints: a `score` head over the last token's hidden state, computed in the core):
POST /classify and /v1/classify, in either of the two shapes peers give them.

- SGLang's (a body with `text` or `input_ids`, as /encode): {"embedding": the head's raw
  outputs, "meta_info"} per prompt; a reward model's one output is its reward.
- vLLM's (a body with `input`): {"id", "object": "list", "created", "model", "data": [{"index",
  "label", "probs", "num_classes"}], "usage"}; probs are the softmax of the outputs (the
  sigmoid of a one-output head), the label the most probable one's name (id2label).
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import numpy as np
from aiohttp import web

from radixserve.client.embedding import embedding_vector
from radixserve.client.scoring import sigmoid, softmax
from radixserve.server.embeddings_api import encode_response, run_openai_inputs
from radixserve.server.errors import BadRequest
from radixserve.server.lora_api import check_model_name
from radixserve.server.openai_protocol import check_object
from radixserve.server.request_fields import check_fields
from radixserve.server.responses_options import optional_str
from radixserve.server.state import read_json, state_of
from radixserve.server.tenants import SALT_HEADER

VLLM_FIELDS = {"input", "model", "user", "truncate_prompt_tokens", "add_special_tokens",
               "priority", "cache_salt"}  # fmt: skip


def register_classify_routes(app: web.Application) -> None:
    app.router.add_post("/classify", classify)
    app.router.add_post("/v1/classify", classify)


async def classify(request: web.Request) -> web.Response:
    """SGLang's shape (text / input_ids) or vLLM's (input); refused unless the model is a
    sequence classifier."""
    state = state_of(request)
    num_labels = state.client.info.get("num_labels")
    if num_labels is None and state.builder.is_embedding:
        raise BadRequest(
            "The model is not a sequence classifier (a *ForSequenceClassification "
            "checkpoint): use /encode or /v1/embeddings"
        )
    body = check_object(await read_json(request))
    if "input" not in body:
        return await encode_response(state, body)  # SGLang's shape
    check_fields(body, VLLM_FIELDS)
    lora_path = check_model_name(state, optional_str(body, "model"))
    results = await run_openai_inputs(state, body, request.headers.get(SALT_HEADER), lora_path)
    labels = state.client.info.get("labels")
    data = [_item(i, embedding_vector(r, normalize=False), labels) for i, r in enumerate(results)]
    tokens = sum(r.prompt_len for r in results)
    return web.json_response({
        "id": "classify-" + uuid.uuid4().hex,
        "object": "list",
        "created": int(time.time()),
        "model": lora_path or state.served_model_name,
        "data": data,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0},
    })  # fmt: skip


def class_probs(scores: np.ndarray) -> np.ndarray:
    """vLLM's default activation of a classifier's outputs: softmax; sigmoid for one."""
    values = [float(v) for v in scores]
    return np.array([sigmoid(values[0])] if len(values) == 1 else softmax(values))


def _item(index: int, scores: np.ndarray, labels: list[str] | None) -> dict[str, Any]:
    probs = class_probs(scores)
    best = int(probs.argmax())
    label = labels[best] if labels and best < len(labels) else f"LABEL_{best}"
    return {"index": index, "label": label, "probs": probs.tolist(), "num_classes": len(probs)}
