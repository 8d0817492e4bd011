"""The aiohttp application: middlewares, SGLang's native API, health and server info."""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
from dataclasses import asdict
from typing import Any

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

from radixserve.config import ServerConfig
from radixserve.engine.output import format_output
from radixserve.engine.request import Req
from radixserve.engine.request_builder import GenerateArgs
from radixserve.server import openai_api
from radixserve.server.errors import BadRequest, error_response
from radixserve.server.state import ServerState, read_json, state_of

logger = logging.getLogger(__name__)

OPEN_PATHS = ("/health", "/metrics")
"""The only paths served without the API key: probes and scrapers carry none. Not
/health_generate: it runs a generation on the GPU."""
GENERATE_FIELDS = {
    "text", "input_ids", "sampling_params", "return_logprob", "logprob_start_len",
    "top_logprobs_num", "return_text_in_logprobs", "rid", "stream", "cache_salt",
}  # fmt: skip


# ---- middlewares -------------------------------------------------------------------------


@web.middleware
async def error_middleware(request: web.Request, handler):
    try:
        return await handler(request)
    except BadRequest as exc:
        headers = {"Retry-After": "1"} if exc.status == 503 else None
        return error_response(exc.status, str(exc), exc.param, headers)
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


@web.middleware
async def auth_middleware(request: web.Request, handler):
    key = state_of(request).config.api_key
    if key and request.path not in OPEN_PATHS:
        if not api_key_matches(request.headers.get("Authorization", ""), key):
            return error_response(401, "missing or invalid API key", param="Authorization")
    return await handler(request)


def api_key_matches(authorization: str, key: str) -> bool:
    """Whether the Authorization header is `Bearer <key>`, compared in constant time so the
    answer's timing tells nothing about how much of a guess was right."""
    given = authorization.encode("utf-8", "surrogateescape")
    return hmac.compare_digest(given, f"Bearer {key}".encode())


@web.middleware
async def body_size_middleware(request: web.Request, handler):
    """A body whose Content-Length is over the limit is a 413 before any of it is read;
    a chunked body (no Content-Length) is bounded by aiohttp's client_max_size as it is read."""
    limit = max_body_bytes(state_of(request).config)
    length = request.content_length
    if length is not None and length > limit:
        message = f"request body is {length} bytes; the limit is {limit} bytes (--max-body-mb)"
        response = error_response(413, message, param="body")
        response.force_close()  # the body stays unread: do not keep the connection
        return response
    return await handler(request)


def max_body_bytes(config: ServerConfig) -> int:
    return int(config.max_body_mb * (1 << 20))


# ---- native API --------------------------------------------------------------------------


def parse_generate(body: Any) -> tuple[GenerateArgs, bool, bool]:
    """SGLang's /generate body -> (args, stream, return_text_in_logprobs)."""
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object", param="body")
    for key, value in body.items():
        if key not in GENERATE_FIELDS and value not in (None, False, [], {}, ""):
            raise BadRequest(f"{key} is not supported by this server", param=key)
    stream = body.get("stream") or False
    with_text = body.get("return_text_in_logprobs") or False
    for name, value in (("stream", stream), ("return_text_in_logprobs", with_text)):
        if not isinstance(value, bool):
            raise BadRequest(f"{name} must be a boolean; got {value!r}", param=name)
    args = GenerateArgs(
        text=body.get("text"),
        input_ids=body.get("input_ids"),
        sampling_params=body.get("sampling_params"),
        return_logprob=body.get("return_logprob") or False,
        logprob_start_len=body.get("logprob_start_len"),
        top_logprobs_num=body.get("top_logprobs_num"),
        rid=body.get("rid"),
        cache_salt=body.get("cache_salt"),
    )
    return args, stream, with_text


async def generate(request: web.Request) -> web.StreamResponse:
    state = state_of(request)
    args, stream, with_text = parse_generate(await read_json(request))
    reqs, batched = state.builder.build(args)
    state.check_capacity(len(reqs))
    if stream:
        return await _stream_generate(request, state, reqs, with_text)
    done = await asyncio.gather(*(state.run(r) for r in reqs))
    outputs = [format_output(r, state.tokenizer, with_text) for r in done]
    return web.json_response(outputs if batched or len(outputs) > 1 else outputs[0])


async def _stream_generate(request, state: ServerState, reqs: list[Req], with_text: bool):
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, req: Req) -> None:
        async for current in state.stream(req):
            chunk = format_output(current, state.tokenizer, with_text)
            if len(reqs) > 1:
                chunk["index"] = index
            await queue.put(chunk)

    tasks = [asyncio.create_task(pump(i, r)) for i, r in enumerate(reqs)]
    finished = asyncio.gather(*tasks)
    try:
        while not (finished.done() and queue.empty()):
            getter = asyncio.ensure_future(queue.get())
            await asyncio.wait({getter, finished}, return_when=asyncio.FIRST_COMPLETED)
            if getter.done():
                await response.write(f"data: {json.dumps(getter.result())}\n\n".encode())
            else:
                getter.cancel()
        await response.write(b"data: [DONE]\n\n")
    finally:
        for task in tasks:
            task.cancel()  # a disconnected client: the streams abort their requests
    return response


async def abort_request(request: web.Request) -> web.Response:
    body = await read_json(request)
    rid = body.get("rid") if isinstance(body, dict) else None
    if not isinstance(rid, str):
        raise BadRequest("rid must be a string", param="rid")
    state_of(request).client.abort(rid)
    return web.json_response({"success": True})


async def flush_cache(request: web.Request) -> web.Response:
    if await state_of(request).client.call("flush_cache"):
        return web.Response(text="Cache flushed.\n")
    return web.Response(status=400, text="Cache not flushed: requests are still running.\n")


async def concate_and_append_request(request: web.Request) -> web.Response:
    raise BadRequest(
        "concate_and_append_request is not supported: the KV of a finished request was computed "
        "at its own positions and context, so appending it to another request's context cannot "
        "be exact; resend the joined text instead (the radix cache still reuses its prefix)",
        param="src_rids",
    )


# ---- info and health ---------------------------------------------------------------------


async def model_info(request: web.Request) -> web.Response:
    state = state_of(request)
    info = state.client.info
    return web.json_response({
        "model_path": state.model_path,
        "tokenizer_path": info.get("tokenizer_path") or state.model_path,
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": "default",
        "has_image_understanding": False,
        "has_audio_understanding": False,
        "model_type": info.get("architecture"),
        "architectures": [info.get("architecture")],
        "served_model_name": state.served_model_name,
    })  # fmt: skip


async def server_info(request: web.Request) -> web.Response:
    state = state_of(request)
    stats = await state.client.call("get_stats")
    return web.json_response({
        **state.engine_args,
        **{k: v for k, v in asdict(state.config).items() if k != "api_key"},
        "served_model_name": state.served_model_name,
        "engine": state.client.info,
        "num_active_requests": state.client.num_active,
        "stats": stats,
    })  # fmt: skip


async def health(request: web.Request) -> web.Response:
    state = state_of(request)
    try:
        await state.client.call("get_stats", timeout_s=5.0)
    except (asyncio.TimeoutError, RuntimeError):
        return web.Response(status=503, text="engine core not responding\n")
    return web.Response(text="")


async def health_generate(request: web.Request) -> web.Response:
    state = state_of(request)
    req, _ = state.builder.build(GenerateArgs(input_ids=[0], sampling_params={"max_new_tokens": 1}))
    try:
        await asyncio.wait_for(state.run(req[0]), 20.0)
    except asyncio.TimeoutError:
        return web.Response(status=503, text="generation timed out\n")
    return web.Response(text="")


async def metrics(request: web.Request) -> web.Response:
    state = state_of(request)
    body = state.metrics.render(await state.client.call("get_stats"))
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


def build_app(state: ServerState) -> web.Application:
    app = web.Application(
        middlewares=[error_middleware, auth_middleware, body_size_middleware],
        client_max_size=max_body_bytes(state.config),
    )
    app["state"] = state
    app.router.add_post("/generate", generate)
    app.router.add_post("/abort_request", abort_request)
    app.router.add_post("/flush_cache", flush_cache)  # it changes state: never on a GET
    app.router.add_post("/concate_and_append_request", concate_and_append_request)
    for path in ("/get_model_info", "/model_info"):
        app.router.add_get(path, model_info)
    for path in ("/server_info", "/get_server_info"):
        app.router.add_get(path, server_info)
    app.router.add_get("/health", health)
    app.router.add_get("/health_generate", health_generate)
    app.router.add_get("/metrics", metrics)
    openai_api.register_openai_routes(app)
    return app
