"""Routes whose work is a function of the parsed JSON body (`BodyRunner`), so that the Batch
API can run its lines through the same functions: the handler that runs one."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from aiohttp import web

from radixserve.server.state import ServerState, read_json, state_of
from radixserve.server.tenants import SALT_HEADER

BodyRunner = Callable[[ServerState, Any, "str | None"], Awaitable[Any]]
"""(state, body, the caller's X-Cache-Salt) -> the answer's body."""


def json_route(run_body: BodyRunner) -> Callable[[web.Request], Awaitable[web.Response]]:
    """The POST handler that reads the JSON body, runs `run_body` and answers it as JSON."""

    async def handler(request: web.Request) -> web.Response:
        body = await read_json(request)
        answer = await run_body(state_of(request), body, request.headers.get(SALT_HEADER))
        return web.json_response(answer)

    return handler
