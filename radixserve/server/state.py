"""What every HTTP handler shares: the engine client, request builder, tokenizer, metrics."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

from aiohttp import web

from radixserve.client.client import EngineClient
from radixserve.client.request_builder import GenerateArgs, RequestBuilder, renamed
from radixserve.client.result import RequestResult, ResultStream
from radixserve.config import ServerConfig
from radixserve.engine.protocol import RequestSpec
from radixserve.reasoning import ReasoningFormat
from radixserve.server.completion_template import CompletionTemplate
from radixserve.server.errors import BadRequest
from radixserve.server.metrics import ServerMetrics
from radixserve.server.sessions import SessionStore
from radixserve.server.tool_parsers import DEFAULT_TOOL_PARSER

T = TypeVar("T")
TOKENIZER_THREADS = 2


@dataclass
class ServerState:
    client: EngineClient
    builder: RequestBuilder
    tokenizer: Any
    config: ServerConfig
    engine_args: dict[str, Any]
    model_path: str
    served_model_name: str
    max_running_requests: int
    metrics: ServerMetrics
    tool_parser: str = DEFAULT_TOOL_PARSER
    """The tool-call format (tool_parsers/): `--tool-call-parser`, or the chat template's."""
    reasoning_format: ReasoningFormat | None = None
    """`--reasoning-parser`'s format (radixserve/reasoning/); None: outputs are not split."""
    completion_template: CompletionTemplate | None = None
    """Fill-in-the-middle format of a completion's `suffix` (completion_template.py)."""
    sessions: SessionStore = field(default_factory=SessionStore)
    """SGLang's sessions (/open_session, /generate's session_params)."""
    tokenizer_pool: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(TOKENIZER_THREADS, "radixserve-tokenize")
    )

    @property
    def max_active(self) -> int:
        """Requests allowed at once: the running batch plus the queue."""
        return self.max_running_requests + self.config.max_queued_requests

    async def off_loop(self, fn: Callable[..., T], *args: Any) -> T:
        """Runs tokenization or template rendering off the event loop, so that one huge
        prompt never stalls the other streams."""
        return await asyncio.get_running_loop().run_in_executor(self.tokenizer_pool, fn, *args)

    def build_one(self, args: GenerateArgs, names: dict[str, str]) -> list[RequestSpec]:
        """The specs of `args`' one prompt; a core validation error is a 400 whose message
        calls the fields as the API does (`names`: SamplingParams' name -> the API's)."""
        try:
            return self.builder.build(args)[0]
        except ValueError as exc:
            raise BadRequest(renamed(str(exc), names)) from exc

    def open(self, specs: list[RequestSpec]) -> ResultStream:
        """Submits `specs` now: capacity check and registration happen together (a burst can
        not exceed the limit); 503 when full or when the engine core is gone."""
        return ResultStream(self.client, specs, self.tokenizer, self.max_active)

    async def iterate(self, stream: ResultStream) -> AsyncIterator[tuple[int, RequestResult]]:
        """(index, result) as each request changes, with its metrics recorded; leaving early
        (client gone, error) aborts the unfinished requests."""
        for result in stream.results:
            self.metrics.on_start(result)
        try:
            async with stream:
                async for index, result in stream:
                    stream.settle(result)
                    self.metrics.on_update(result)
                    if result.finished:
                        self.metrics.on_finish(result)
                    yield index, result
        finally:
            for result in stream.results:
                self.metrics.on_finish(result)

    async def run(self, stream: ResultStream) -> list[RequestResult]:
        """Runs every request of `stream` to the end; cancelling aborts them."""
        async for _ in self.iterate(stream):
            pass
        return stream.results


JSON_OFF_LOOP_BYTES = 1 << 20
"""Bodies larger than this are parsed on a worker thread: a 32 MiB list of ids takes a
second to parse, which on the event loop would stall every stream and /health."""


async def read_json(request: web.Request) -> Any:
    """The body as JSON (400 naming `body` when it is not), parsed off the event loop when
    it is large."""
    raw = await request.read()
    try:
        if len(raw) > JSON_OFF_LOOP_BYTES:
            return await asyncio.to_thread(json.loads, raw)
        return json.loads(raw)
    except (ValueError, RecursionError) as exc:  # ValueError: also ints past 4300 digits
        raise BadRequest(f"request body is not valid JSON: {exc}", param="body") from exc


STATE_KEY = web.AppKey("state", ServerState)


def state_of(request: web.Request) -> ServerState:
    return request.app[STATE_KEY]
