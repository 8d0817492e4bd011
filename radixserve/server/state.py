"""What every HTTP handler shares: the core client, request builder, tokenizer, metrics."""

from __future__ import annotations

import json
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from radixserve.config import ServerConfig
from radixserve.engine.request import Req
from radixserve.engine.request_builder import RequestBuilder
from radixserve.server.core_client import CoreClient
from radixserve.server.errors import BadRequest
from radixserve.server.metrics import ServerMetrics


@dataclass
class ServerState:
    client: CoreClient
    builder: RequestBuilder
    tokenizer: Any
    config: ServerConfig
    engine_args: dict[str, Any]
    model_path: str
    served_model_name: str
    max_running_requests: int
    metrics: ServerMetrics

    def check_capacity(self, num_new: int = 1) -> None:
        """503 when `num_new` more requests would exceed running + queued limits."""
        limit = self.max_running_requests + self.config.max_queued_requests
        if self.client.num_active + num_new > limit:
            raise BadRequest("too many queued requests; retry later", status=503)

    async def stream(self, req: Req):
        """Runs `req` on the core, yielding it after each update; records its metrics."""
        self.metrics.on_start(req)
        try:
            async with aclosing(self.client.stream(req)) as updates:
                async for state in updates:
                    self.metrics.on_update(req)
                    yield state
        finally:
            self.metrics.on_finish(req)

    async def run(self, req: Req) -> Req:
        """Runs `req` to the end (recording its metrics); cancelling aborts it."""
        async for _ in self.stream(req):
            pass
        return req


async def read_json(request: web.Request) -> Any:
    try:
        return json.loads(await request.read())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BadRequest(f"request body is not valid JSON: {exc}", param="body") from exc


def state_of(request: web.Request) -> ServerState:
    return request.app["state"]
