"""SGLang's session routes: POST /open_session and /close_session (the store and what a
session does: server/sessions.py)."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

from aiohttp import web

from radixserve.client.request_builder import GenerateArgs, salted_namespace
from radixserve.client.result import RequestResult
from radixserve.server.errors import BadRequest
from radixserve.server.sessions import Continuation
from radixserve.server.state import ServerState, read_json, state_of
from radixserve.server.tenants import SALT_HEADER, check_salt


def namespace_of(request: web.Request, body: dict[str, Any]) -> str | None:
    """The namespace a session call acts in: the body's cache_salt or X-Cache-Salt."""
    return check_salt(body.get("cache_salt"), request.headers.get(SALT_HEADER))


async def open_session(request: web.Request) -> web.Response:
    """SGLang's POST /open_session: the session's id, as a JSON string."""
    body = await read_json(request)
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object", param="body")
    return web.json_response(state_of(request).sessions.open(namespace_of(request, body), body))


async def close_session(request: web.Request) -> web.Response:
    """SGLang's POST /close_session {"session_id"}: 200, or 404 when it is not open."""
    body = await read_json(request)
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object", param="body")
    session_id = body.get("session_id")
    if not state_of(request).sessions.close(namespace_of(request, body), session_id):
        raise BadRequest(f"session {session_id!r} is not open", param="session_id", status=404)
    return web.Response(status=200)


def register_session_routes(app: web.Application) -> None:
    app.router.add_post("/open_session", open_session)
    app.router.add_post("/close_session", close_session)


async def session_prompt(
    state: ServerState, args: GenerateArgs, params: Any
) -> tuple[GenerateArgs, Continuation]:
    """`args` of a /generate sent with `session_params`: one prompt whose tokens follow the
    session's sequence, and what it continues."""
    text, ids = args.text, args.input_ids
    one_text = isinstance(text, str) and ids is None
    one_ids = text is None and isinstance(ids, list) and not (ids and isinstance(ids[0], list))
    if not (one_text or one_ids):
        message = "session_params takes one prompt: a text or one list of input_ids"
        raise BadRequest(message, param="session_params")
    if one_text:
        ids = await state.off_loop(state.builder.tokenizer.encode, text)
    namespace = salted_namespace(args.cache_salt, args.extra_key)
    prompt, where = state.sessions.continue_prompt(namespace, params, ids)
    return replace(args, text=None, input_ids=prompt), where


def remember(state: ServerState, where: Continuation, results: list[RequestResult]) -> None:
    """Records the session's requests that finished (an aborted one is not continued)."""
    for result in results:
        if result.finished and not result.finish_reason.is_abort:
            prompt, output = result.spec.input_ids, result.output_ids
            state.sessions.record(where, result.spec.rid, prompt, output)
