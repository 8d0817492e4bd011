"""The aiohttp application: middlewares, SGLang's native API (/generate, /abort_request,
/flush_cache), and every other API's routes registered from its own module."""

from __future__ import annotations

import asyncio
import json
import logging
import math
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from radixserve.client.client import EngineBusyError, EngineDeadError
from radixserve.client.output import LogprobCursor, format_output
from radixserve.client.request_builder import GENERATE_ARG_NAMES, GenerateArgs, salted_namespace
from radixserve.client.result import ResultStream
from radixserve.server import dashboard, openai_api
from radixserve.server.anthropic_api import anthropic_error_middleware, register_anthropic_routes
from radixserve.server.auth import auth_middleware, install_key_throttle
from radixserve.server.batch_api import register_batch_routes
from radixserve.server.cache_api import register_cache_routes
from radixserve.server.classify_api import register_classify_routes
from radixserve.server.conversations_api import register_conversation_routes
from radixserve.server.drain import DRAIN_KEY, Drain
from radixserve.server.embeddings_api import register_embedding_routes
from radixserve.server.errors import BadRequest, error_response
from radixserve.server.info_api import register_info_routes
from radixserve.server.limits import body_size_middleware, max_body_bytes
from radixserve.server.lora_api import register_lora_routes
from radixserve.server.ollama_api import ollama_error_middleware, register_ollama_routes
from radixserve.server.request_fields import is_same_value
from radixserve.server.request_guard import browser_guard_middleware
from radixserve.server.rerank_api import register_rerank_routes
from radixserve.server.responses_api import register_responses_routes
from radixserve.server.score_api import register_score_routes
from radixserve.server.session_api import register_session_routes, remember, session_prompt
from radixserve.server.state import STATE_KEY, ServerState, read_json, state_of
from radixserve.server.tenants import namespaces_shown

logger = logging.getLogger(__name__)

ANSWER_FIELDS = ("stream", "return_text_in_logprobs", "return_prompt_token_ids")
"""/generate's fields on how to answer (the fields of `Answer`, in order)."""
GENERATE_FIELDS = GENERATE_ARG_NAMES | set(ANSWER_FIELDS)
FLUSH_TIMEOUT_MAX_S = 300.0
"""Longest `/flush_cache?timeout=` wait: a client holds its connection at most this long."""
FLUSH_RETRY_S = 0.05
"""How often a waiting flush asks the core again."""
GENERATE_NO_OP_VALUES = {"log_metrics": True}
"""Fields accepted at their SGLang default only; sglang-router writes them into every body.
(Other unknown fields are accepted while null, false or empty.)"""
GENERATE_IGNORED_TYPES = {"routing_key": str, "no_logs": bool}
"""SGLang fields that change nothing on one worker, accepted at any value of their type:
`routing_key` picks a data-parallel rank (one engine has one; a router reads it first),
`no_logs` keeps a request out of the logs (no request's content is ever logged here)."""


# ---- middlewares -------------------------------------------------------------------------


@web.middleware
async def error_middleware(request: web.Request, handler):
    try:
        return await handler(request)
    except BadRequest as exc:
        headers = {"Retry-After": "1"} if exc.status == 503 else None
        return error_response(exc.status, str(exc), exc.param, headers)
    except EngineBusyError as exc:
        return error_response(503, str(exc), headers={"Retry-After": "1"})
    except EngineDeadError as exc:
        return error_response(503, f"engine core is not running: {exc}")
    except ValueError as exc:
        return error_response(400, str(exc))
    except web.HTTPRequestEntityTooLarge as exc:
        return error_response(413, exc.text or "request body too large", param="body")
    except web.HTTPException as exc:
        if exc.status >= 400:
            return error_response(exc.status, exc.reason)
        raise
    except (ConnectionResetError, asyncio.CancelledError):
        raise
    except Exception:
        logger.exception("internal error on %s", request.path)
        return error_response(500, "internal server error")


# ---- native API --------------------------------------------------------------------------


@dataclass
class Answer:
    """How /generate answers, beside the request itself."""

    stream: bool = False
    with_text: bool = False  # return_text_in_logprobs: each logprob entry with its token's text
    prompt_ids: bool = False  # return_prompt_token_ids: the prompt's token ids in every output


def parse_generate(body: Any) -> tuple[GenerateArgs, Answer]:
    """SGLang's /generate body -> (the request's args, how to answer)."""
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object", param="body")
    for key, value in body.items():
        if key in GENERATE_FIELDS or value in (None, False, [], {}, ""):
            continue
        if (kind := GENERATE_IGNORED_TYPES.get(key)) is not None:
            if not isinstance(value, kind):
                message = f"{key} must be a {kind.__name__}; got {value!r}"
                raise BadRequest(message[:200], param=key)
            continue
        if key not in GENERATE_NO_OP_VALUES or not is_same_value(value, GENERATE_NO_OP_VALUES[key]):
            raise BadRequest(f"{key} is not supported by this server", param=key)
    flags = [body.get(name) or False for name in ANSWER_FIELDS]
    for name, value in zip(ANSWER_FIELDS, flags):
        if not isinstance(value, bool):
            raise BadRequest(f"{name} must be a boolean; got {value!r}"[:200], param=name)
    args = GenerateArgs.from_fields(body, return_logprob=body.get("return_logprob") or False)
    return args, Answer(*flags)


async def generate(request: web.Request) -> web.StreamResponse:
    state = state_of(request)
    body = await read_json(request)
    session = body.pop("session_params", None) if isinstance(body, dict) else None
    args, answer = parse_generate(body)
    where = None
    if session is not None:  # SGLang's sessions: the prompt follows the session's sequence
        args, where = await session_prompt(state, args, session)
    specs, batched = await state.off_loop(state.builder.build, args)
    if where is not None and len(specs) != 1:
        raise BadRequest("session_params takes one output: n must be 1", param="session_params")
    results = state.open(specs)
    async with results:  # leaving before the requests end (client gone, failure) aborts them
        if answer.stream:
            response = await _stream_generate(request, state, results, answer)
        else:
            await state.run(results)
    if where is not None:
        remember(state, where, results.results)
    if answer.stream:
        return response
    done = results.results
    outputs = [format_output(r, answer.with_text, prompt_ids=answer.prompt_ids) for r in done]
    return web.json_response(outputs if batched or len(outputs) > 1 else outputs[0])


async def _stream_generate(request, state: ServerState, results: ResultStream, answer: Answer):
    """SGLang's SSE: cumulative text per chunk, logprobs new since the last chunk; an engine
    failure ends the stream with an error event."""
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    cursors = [LogprobCursor() for _ in results.results]
    try:
        async with aclosing(state.iterate(results)) as updates:
            async for index, result in updates:
                if not (result.output_ids or result.finished):
                    continue
                chunk = format_output(result, answer.with_text, cursors[index], answer.prompt_ids)
                if len(cursors) > 1:
                    chunk["index"] = index
                await response.write(_sse(chunk))
    except EngineDeadError as exc:
        error = {"message": f"engine core is not running: {exc}", "code": 503}
        await response.write(_sse({"error": error | {"type": "ServiceUnavailableError"}}))
    await response.write(b"data: [DONE]\n\n")
    return response


def _sse(body: Any) -> bytes:
    return f"data: {json.dumps(body)}\n\n".encode()


async def abort_request(request: web.Request) -> web.Response:
    """Aborts the request `rid`, or with `abort_all` every request (SGLang's body; an empty
    rid without it aborts nothing), of the caller's namespace: the body's `cache_salt` and
    `extra_key` (as the requests were sent with), else X-Cache-Salt, else the default one
    (admin: all)."""
    body = await read_json(request)
    body = body if isinstance(body, dict) else {}
    rid = body.get("rid", "")
    try:
        salt = salted_namespace(body.get("cache_salt"), body.get("extra_key"))
    except ValueError as exc:
        raise BadRequest(str(exc), param=str(exc).split()[0]) from None
    abort_all = body.get("abort_all", False)
    if not isinstance(rid, str):
        raise BadRequest("rid must be a string", param="rid")
    if not isinstance(abort_all, bool):
        raise BadRequest("abort_all must be true or false", param="abort_all")
    namespaces = [salt] if salt is not None else namespaces_shown(request)
    client = state_of(request).client
    if abort_all:
        client.abort_all(namespaces)
    elif rid:
        client.abort_rid(rid, namespaces)
    return web.json_response({"success": True})


async def flush_cache(request: web.Request) -> web.Response:
    """Empties the prefix cache once no request runs; SGLang's query `timeout` (seconds,
    default 0, at most FLUSH_TIMEOUT_MAX_S) waits that long for the running ones to end."""
    timeout = _flush_timeout(request.query.get("timeout", "0"))
    deadline = loop_time() + timeout
    client = state_of(request).client
    while not await client.call("flush_cache"):
        if loop_time() >= deadline:
            message = "Cache not flushed: requests are still running.\n"
            return web.Response(status=400, text=message)
        await asyncio.sleep(min(FLUSH_RETRY_S, max(deadline - loop_time(), 0.0)))
    return web.Response(text="Cache flushed.\n")


def _flush_timeout(text: str) -> float:
    try:
        timeout = float(text)
    except ValueError:
        timeout = math.nan
    if not 0 <= timeout <= FLUSH_TIMEOUT_MAX_S:  # (nan fails both)
        message = f"timeout must be seconds in [0, {FLUSH_TIMEOUT_MAX_S:g}]; got {text!r}"
        raise BadRequest(message[:200], param="timeout")
    return timeout


def loop_time() -> float:
    return asyncio.get_running_loop().time()


async def concate_and_append_request(request: web.Request) -> web.Response:
    """Accepts SGLang's parallel-encoding join and does nothing, exactly.

    SGLang's frontend, on `forks.join("concate_and_append")`, has already appended the forks'
    texts to the parent's text when it posts here (and waits forever on any non-200 answer).
    Splicing the forks' KV after the parent's would be approximate: each fork's KV was
    computed at its own positions, attending to the parent's prefix but not to its siblings.
    The parent's next call sends the joined text instead; the radix tree serves the cached
    common prefix and computes the rest exactly, at the right positions. The rids are the
    client's program-state ids, never request ids here, so there is nothing to look up.
    """
    body = await read_json(request)
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object", param="body")
    src_rids = body.get("src_rids")
    if not (isinstance(src_rids, list) and src_rids and all(isinstance(r, str) for r in src_rids)):
        raise BadRequest("src_rids must be a non-empty list of strings", param="src_rids")
    if not isinstance(body.get("dst_rid"), str):
        raise BadRequest("dst_rid must be a string", param="dst_rid")
    return web.json_response({"success": True})


def build_app(state: ServerState) -> web.Application:
    drain = Drain()  # inside the API error middlewares: its 503 in each API's error shape
    app = web.Application(
        middlewares=[
            anthropic_error_middleware,
            ollama_error_middleware,
            drain.middleware,
            error_middleware,
            auth_middleware,
            browser_guard_middleware,
            body_size_middleware,
        ],
        client_max_size=max_body_bytes(state.config),
    )
    app[STATE_KEY] = state
    install_key_throttle(app)
    app[DRAIN_KEY] = drain
    app.router.add_post("/generate", generate)
    app.router.add_post("/abort_request", abort_request)
    app.router.add_post("/flush_cache", flush_cache)  # it changes state: never on a GET
    app.router.add_post("/concate_and_append_request", concate_and_append_request)
    app.router.add_post("/reset_prefix_cache", flush_cache)  # vLLM's name for it
    register_info_routes(app)
    openai_api.register_openai_routes(app)
    register_anthropic_routes(app)
    register_responses_routes(app)
    register_conversation_routes(app)
    register_cache_routes(app)
    register_lora_routes(app)
    register_session_routes(app)
    register_batch_routes(app)
    register_ollama_routes(app)
    register_embedding_routes(app)
    register_classify_routes(app)
    register_score_routes(app)
    register_rerank_routes(app)
    if not state.config.disable_dashboard:
        dashboard.register_dashboard_routes(app)
    return app
