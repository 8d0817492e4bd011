"""Embedding routes of an `--is-embedding` server (client/embedding.py says what an embedding
is): SGLang's POST /encode, OpenAI's POST /v1/embeddings, Ollama's POST /api/embed and its
older POST /api/embeddings. A generating server answers them 400 naming the flag, as an
embedding server answers the generation routes.

Every input is one request: prompts go through the prefix cache like chat turns (a shared
instruction or document prefix is computed once), X-Cache-Salt / cache_salt keep tenants'
prefixes apart, LoRA adapters are named by `model` (OpenAI, Ollama) or `lora_path` (/encode).
"""

from __future__ import annotations

import time
from typing import Any

from aiohttp import web

from radixserve.client.embedding import (
    check_dimensions,
    embed_args,
    embedding_vector,
    encode_output,
    openai_embedding,
)
from radixserve.client.request_builder import EMBEDDINGS_NEED_THE_FLAG, GenerateArgs, renamed
from radixserve.client.result import RequestResult
from radixserve.sampling.params import is_token_ids
from radixserve.server.body_routes import json_route
from radixserve.server.choice_trackers import aborted
from radixserve.server.errors import BadRequest
from radixserve.server.lora_api import check_model_name
from radixserve.server.ollama_protocol import DEFAULT_TAG, required_model
from radixserve.server.openai_protocol import check_bool, check_object
from radixserve.server.request_fields import check_fields
from radixserve.server.responses_options import optional_str
from radixserve.server.state import ServerState, read_json, state_of
from radixserve.server.tenants import SALT_HEADER, check_salt

MAX_INPUTS = 2048
"""Most inputs one embeddings call may carry (OpenAI's limit)."""
ENCODE_FIELDS = {"text", "input_ids", "rid", "cache_salt", "extra_key", "lora_path", "priority"}
INPUT_NAMES = {"input_ids": "input", "prompt": "input", "text": "input", "n": "input"}
"""Core validation messages' names for the prompt, as OpenAI's and Ollama's bodies call it."""
OPENAI_FIELDS = {
    "input", "model", "encoding_format", "dimensions", "user", "truncate_prompt_tokens",
    "add_special_tokens", "priority", "request_id", "cache_salt", "normalize",
}  # fmt: skip
OLLAMA_FIELDS = {"model", "input", "truncate", "options", "keep_alive", "dimensions", "cache_salt"}
OLLAMA_LEGACY_FIELDS = {"model", "prompt", "options", "keep_alive", "cache_salt"}


def register_embedding_routes(app: web.Application) -> None:
    app.router.add_post("/encode", encode)
    app.router.add_post("/v1/embeddings", json_route(embeddings_body))
    app.router.add_post("/api/embed", ollama_embed)
    app.router.add_post("/api/embeddings", ollama_embeddings)


async def encode(request: web.Request) -> web.Response:
    """SGLang's /encode: `text` or `input_ids` (one prompt or a list) -> {"embedding",
    "meta_info"} per prompt (a list for a list)."""
    body = check_object(await read_json(request))
    return await encode_response(state_of(request), body)


async def encode_response(state: ServerState, body: dict) -> web.Response:
    """/encode's answer to a parsed body (SGLang's /classify bodies answer the same)."""
    check_fields(body, ENCODE_FIELDS)
    args = embed_args(**{name: body.get(name) for name in ENCODE_FIELDS})
    results, batched = await run_to_end(state, args, {})
    scores = state.client.info.get("num_labels") is not None  # a classifier: raw, as SGLang's
    outputs = [encode_output(result, normalize=not scores) for result in results]
    return web.json_response(outputs if batched else outputs[0])


async def embeddings_body(state: ServerState, body: Any, salt_header: str | None) -> dict:
    """OpenAI's embeddings (the Batch API's lines run through here too): `input` a string, a
    list of strings, a list of token ids or a list of such lists; `encoding_format` float or
    base64; `dimensions` (matryoshka truncation); vLLM's truncate_prompt_tokens,
    add_special_tokens, priority, request_id, normalize. `salt_header`: the namespace the
    caller's X-Cache-Salt (or batch owner) names."""
    body = check_object(body)
    check_fields(body, OPENAI_FIELDS)
    check_embedding_server(state)
    lora_path = check_model_name(state, optional_str(body, "model"))
    fmt = body.get("encoding_format") or "float"
    if fmt not in ("float", "base64"):
        raise BadRequest(f"encoding_format must be 'float' or 'base64'; got {fmt!r}"[:200],
                         param="encoding_format")  # fmt: skip
    dims = _dimensions(state, body.get("dimensions"))
    normalize = check_bool(body, "normalize", True)
    results = await run_openai_inputs(state, body, salt_header, lora_path)
    data = [openai_embedding(embedding_vector(r, dims, normalize), i, fmt)
            for i, r in enumerate(results)]  # fmt: skip
    tokens = sum(r.prompt_len for r in results)
    usage = {"prompt_tokens": tokens, "total_tokens": tokens}
    model = lora_path or state.served_model_name
    return {"object": "list", "data": data, "model": model, "usage": usage}


async def run_openai_inputs(
    state: ServerState, body: dict, salt_header: str | None, lora_path: str | None
) -> list[RequestResult]:
    """An OpenAI-shaped body's `input` run to the end (/v1/embeddings, vLLM's /classify)
    with the adapter its `model` named: `user`, vLLM's `add_special_tokens`, `request_id`,
    `priority`, `truncate_prompt_tokens`, and `cache_salt` / `salt_header`."""
    optional_str(body, "user")
    special = check_bool(body, "add_special_tokens", True)
    lists = await token_lists(state, body.get("input"), "input", special)
    salt = check_salt(body.get("cache_salt"), salt_header)
    args = embed_args(input_ids=lists, rid=_rids(body.get("request_id"), len(lists)),
                      cache_salt=salt, lora_path=lora_path, priority=body.get("priority"),
                      truncate_prompt_tokens=body.get("truncate_prompt_tokens"))  # fmt: skip
    results, _ = await run_to_end(state, args, INPUT_NAMES)
    return results


async def ollama_embed(request: web.Request) -> web.Response:
    """Ollama's /api/embed: `input` a string or a list of strings -> `embeddings`, normalized;
    `truncate` (default true) cuts an input to the context instead of refusing it."""
    start = time.perf_counter()
    state = state_of(request)
    body = check_object(await read_json(request))
    check_fields(body, OLLAMA_FIELDS)
    check_embedding_server(state)
    model, lora_path = _ollama_model(state, body)
    dims = _dimensions(state, body.get("dimensions"))
    _options(body)
    value = body.get("input")
    texts = [value] if isinstance(value, str) else value
    if not isinstance(texts, list) or not all(isinstance(t, str) for t in texts):
        raise BadRequest("input must be a string or a list of strings", param="input")
    lists = await token_lists(state, texts, "input", True) if texts else []
    if check_bool(body, "truncate", True):
        lists = [ids[: state.builder.context_length - 1] for ids in lists]
    salt = check_salt(body.get("cache_salt"), request.headers.get(SALT_HEADER))
    results: list[RequestResult] = []
    if lists:
        args = embed_args(input_ids=lists, cache_salt=salt, lora_path=lora_path)
        results, _ = await run_to_end(state, args, INPUT_NAMES)
    return web.json_response({
        "model": model,
        "embeddings": [embedding_vector(r, dims).tolist() for r in results],
        "total_duration": int((time.perf_counter() - start) * 1e9),
        "load_duration": 0,
        "prompt_eval_count": sum(r.prompt_len for r in results),
    })  # fmt: skip


async def ollama_embeddings(request: web.Request) -> web.Response:
    """Ollama's older /api/embeddings: one `prompt` -> one `embedding`, not normalized (as
    Ollama's); an empty prompt gives an empty embedding."""
    state = state_of(request)
    body = check_object(await read_json(request))
    check_fields(body, OLLAMA_LEGACY_FIELDS)
    check_embedding_server(state)
    _, lora_path = _ollama_model(state, body)
    _options(body)
    prompt = body.get("prompt") or ""
    if not isinstance(prompt, str):
        raise BadRequest(f"prompt must be a string; got {prompt!r}"[:200], param="prompt")
    if not prompt:
        return web.json_response({"embedding": []})
    salt = check_salt(body.get("cache_salt"), request.headers.get(SALT_HEADER))
    lists = await token_lists(state, prompt, "prompt", True)
    args = embed_args(input_ids=lists, cache_salt=salt, lora_path=lora_path)
    (result,), _ = await run_to_end(state, args, {"input_ids": "prompt", "text": "prompt"})
    return web.json_response({"embedding": embedding_vector(result, normalize=False).tolist()})


# ---- shared ------------------------------------------------------------------------------


async def run_to_end(
    state: ServerState, args: GenerateArgs, names: dict[str, str], embed: bool = True
) -> tuple[list[RequestResult], bool]:
    """Runs the requests of `args` (embedding requests unless `embed` is false) to the end,
    unstreamed; a core validation error is a 400 naming the field as the API does (`names`),
    an aborted request the abort's status."""
    try:
        specs, batched = await state.off_loop(lambda: state.builder.build(args, embed=embed))
    except ValueError as exc:
        raise BadRequest(renamed(str(exc), names)) from exc
    results = await state.run(state.open(specs))
    for result in results:
        if result.unanswered:
            raise aborted(result)
    return results, batched


async def token_lists(state: ServerState, value: Any, name: str, special: bool) -> list[list[int]]:
    """An input (a string, strings, token ids or lists of them) as token lists; text is
    tokenized off the event loop, with the tokenizer's special tokens unless `special` is
    false."""
    if isinstance(value, str) or (value and is_token_ids(value)):
        value = [value]
    if not isinstance(value, list) or not value:
        raise BadRequest(f"{name} must be a non-empty string or list", param=name)
    if len(value) > MAX_INPUTS:
        raise BadRequest(f"{name} has {len(value)} items; at most {MAX_INPUTS}", param=name)
    if not all(isinstance(v, str) for v in value):
        if not all(v and is_token_ids(v) for v in value):
            message = f"{name} must be strings or non-empty lists of token ids, not a mix"
            raise BadRequest(message, param=name)
        return [list(v) for v in value]
    encode = state.tokenizer.encode
    return await state.off_loop(lambda: [encode(t, add_special_tokens=special) for t in value])


def check_embedding_server(state: ServerState) -> None:
    """Embeddings need an --is-embedding server (even for an empty input), and a sequence
    classifier's outputs are scores, not embeddings: /classify (or /encode)."""
    if not state.builder.is_embedding:
        raise BadRequest(EMBEDDINGS_NEED_THE_FLAG)
    num_labels = state.client.info.get("num_labels")
    if num_labels is not None:
        raise BadRequest(
            f"The model is a classifier ({num_labels} labels), not an embedding model: "
            "use /classify or /encode"
        )


def _dimensions(state: ServerState, value: Any) -> int | None:
    try:
        return check_dimensions(value, state.client.info["hidden_size"])
    except ValueError as exc:
        raise BadRequest(str(exc), param="dimensions") from exc


def _rids(value: Any, count: int) -> str | list[str] | None:
    """vLLM's request_id for the call: each input's rid is it, suffixed by the index."""
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise BadRequest(f"request_id must be a non-empty string; got {value!r}"[:200],
                         param="request_id")  # fmt: skip
    return value if count == 1 else [f"{value}-{i}" for i in range(count)]


def _ollama_model(state: ServerState, body: dict) -> tuple[str, str | None]:
    model = required_model(body.get("model"))
    return model, check_model_name(state, model.removesuffix(DEFAULT_TAG))


def _options(body: dict) -> None:
    """Ollama's `options` (they size or sample generation: nothing here) must be an object."""
    options = body.get("options")
    if options is not None and not isinstance(options, dict):
        raise BadRequest("options must be an object", param="options")
