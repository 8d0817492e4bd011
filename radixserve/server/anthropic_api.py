"""Anthropic's Messages API: POST /v1/messages (plain and streamed) and
POST /v1/messages/count_tokens, as the `anthropic` SDK sends them.

A Messages body is checked and turned into chat messages (anthropic_protocol.py), rendered by
the same chat template as chat completions (chat_prompt.py), run as one request, and its
output read by the same trackers (openai_api.py: reasoning split off by `--reasoning-parser`,
settled text, tool calls found by tool_calls.py); anthropic_response.py shapes the result.
The `x-api-key` header carries the API key as well as `Authorization: Bearer` (app.py);
`anthropic-version` is accepted, and its value does not change the answer.

Errors on these paths are Anthropic's `{"type": "error", "error": {"type", "message"}}`
with the same HTTP status as elsewhere (400 naming the field, 401, 404 model, 413, 503);
a stream that fails once started ends with an `error` event.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass

from aiohttp import web

from radixserve.client.client import EngineDeadError
from radixserve.client.request_builder import GenerateArgs
from radixserve.client.result import RequestResult, ResultStream
from radixserve.engine.protocol import RequestSpec
from radixserve.server.anthropic_protocol import MessagesRequest, parse_messages_request
from radixserve.server.anthropic_response import (
    ContentBlocks,
    Event,
    MessageShape,
    PromptTokens,
    error_body,
    stop_reason,
    usage,
)
from radixserve.server.chat_prompt import render_chat
from radixserve.server.choice_trackers import ChoiceTracker, aborted, chat_tracker
from radixserve.server.errors import BadRequest
from radixserve.server.openai_api import check_model_name
from radixserve.server.reasoning import reasoning_sampling
from radixserve.server.state import ServerState, read_json, state_of
from radixserve.server.tenants import SALT_HEADER

logger = logging.getLogger(__name__)

MESSAGES_PATHS = ("/v1/messages", "/v1/messages/count_tokens")
CORE_NAMES = {
    "max_new_tokens": "max_tokens",
    "stop": "stop_sequences",
    "sampling_seed": "seed",
    "input_ids": "prompt token ids",
}
"""SamplingParams' names in core validation messages, as a Messages body calls them."""


def register_anthropic_routes(app: web.Application) -> None:
    app.router.add_post("/v1/messages", create_message)
    app.router.add_post("/v1/messages/count_tokens", count_tokens)


@web.middleware
async def anthropic_error_middleware(request: web.Request, handler):
    """On the Messages paths, rewrites the server's JSON errors (OpenAI's shape, made by the
    inner middlewares) into Anthropic's, keeping the status; the message starts with the
    field it names, as Anthropic's do."""
    response = await handler(request)
    if request.path not in MESSAGES_PATHS or response.status < 400:
        return response
    if not isinstance(response, web.Response) or response.content_type != "application/json":
        return response
    body = json.loads(response.body)
    error = body.get("error") if isinstance(body, dict) else None
    if not isinstance(error, dict):
        return response
    message, param = str(error.get("message", response.reason)), error.get("param")
    if param and not message.startswith((param, repr(param))):  # Anthropic's: the field first
        message = f"{param}: {message}"
    headers = {k: v for k, v in response.headers.items() if k == "Retry-After"}
    rewritten = web.json_response(
        error_body(response.status, message), status=response.status, headers=headers
    )
    if not response.keep_alive:
        rewritten.force_close()
    return rewritten


# ---- handlers ----------------------------------------------------------------------------


@dataclass
class MessageRun:
    """One Messages request in flight: what its response is built from."""

    parsed: MessagesRequest
    prompt: PromptTokens
    tracker: ChoiceTracker
    shape: MessageShape
    blocks: ContentBlocks

    @property
    def result(self) -> RequestResult:
        return self.tracker.result

    def usage(self, started: bool = False) -> dict[str, int]:
        """The usage so far; at the start nothing is generated yet."""
        counts = usage(self.result, self.prompt)
        return counts | {"output_tokens": 0} if started else counts


async def create_message(request: web.Request) -> web.StreamResponse:
    state = state_of(request)
    salt = request.headers.get(SALT_HEADER)
    parsed = parse_messages_request(await read_json(request), False, state.tool_parser, salt)
    lora_path = check_model_name(state, parsed.model)  # a LoRA adapter's name runs it
    if parsed.thinking_given and parsed.reasoning.thinking and state.reasoning_format is None:
        raise BadRequest(
            "thinking requires a server started with --reasoning-parser", param="thinking"
        )
    parsed.sampling = reasoning_sampling(state.reasoning_format, parsed.reasoning, parsed.sampling)
    prompt = await state.off_loop(render_prompt, state, parsed, True)
    stream = state.open(build_specs(state, parsed, prompt.ids, lora_path))
    [result] = stream.results
    async with stream:  # leaving before the request ends (client gone, failure) aborts it
        run = MessageRun(
            parsed=parsed,
            prompt=prompt,
            tracker=_tracker(state, parsed, result),
            shape=MessageShape(lora_path or state.served_model_name),
            blocks=ContentBlocks(),
        )
        if parsed.stream:
            return await stream_message(request, state, run, stream)
        await state.run(stream)
    delta = run.tracker.next_delta()  # the whole output: the request has finished
    run.blocks.add(delta)
    run.blocks.close()
    stop = _stop_or_raise(result, delta.finish_reason)
    return web.json_response(run.shape.message(run.blocks.blocks, stop, run.usage()))


async def count_tokens(request: web.Request) -> web.Response:
    state = state_of(request)
    parsed = parse_messages_request(
        await read_json(request), count_only=True, tool_parser=state.tool_parser
    )
    check_model_name(state, parsed.model)
    prompt = await state.off_loop(render_prompt, state, parsed, False)
    return web.json_response({"input_tokens": len(prompt.ids)})


# ---- requests ----------------------------------------------------------------------------


def render_prompt(state: ServerState, parsed: MessagesRequest, breakpoint: bool) -> PromptTokens:
    """The prompt's token ids and, with `breakpoint`, where its last cache_control ends."""
    tokenizer = state.tokenizer
    text = render_chat(
        tokenizer,
        parsed.messages,
        parsed.template_kwargs,
        parsed.offered_tools,
        tool_parser=state.tool_parser,
    )
    ids = tokenizer.encode(text, add_special_tokens=False)
    if not breakpoint or parsed.breakpoint_messages is None:
        return PromptTokens(ids)
    return PromptTokens(ids, breakpoint_len(state, parsed, ids))


def breakpoint_len(state: ServerState, parsed: MessagesRequest, ids: list[int]) -> int:
    """Tokens of the prompt up to its last cache_control block: the conversation cut there,
    rendered as a closed history, and the part of it the whole prompt starts with."""
    kwargs = parsed.template_kwargs | {
        "add_generation_prompt": False,
        "continue_final_message": False,
    }
    try:
        text = render_chat(
            state.tokenizer,
            parsed.breakpoint_messages,
            kwargs,
            parsed.offered_tools,
            tool_parser=state.tool_parser,
        )
    except (BadRequest, LookupError):  # e.g. a template that needs a user turn: nothing cached
        return 0
    head = state.tokenizer.encode(text, add_special_tokens=False)
    return next((i for i, (a, b) in enumerate(zip(ids, head)) if a != b), min(len(ids), len(head)))


def build_specs(
    state: ServerState, parsed: MessagesRequest, ids: list[int], lora_path: str | None = None
) -> list[RequestSpec]:
    args = GenerateArgs(input_ids=[ids], sampling_params=[parsed.sampling], lora_path=lora_path,
                        cache_salt=parsed.cache_salt, **parsed.options)  # fmt: skip
    return state.build_one(args, CORE_NAMES)


def _tracker(state: ServerState, parsed: MessagesRequest, result: RequestResult) -> ChoiceTracker:
    return chat_tracker(result, state.tokenizer, state.reasoning_format, parsed.reasoning,
                        parsed.offered_tools, state.tool_parser, parsed.stream,
                        single_call=parsed.single_tool_use)  # fmt: skip


def _stop_or_raise(result: RequestResult, finish: str | None) -> tuple[str, str | None]:
    """The message's stop; an aborted request has none in Anthropic's terms: an error."""
    if finish is None or result.unanswered:
        raise aborted(result)
    return stop_reason(result, finish)


# ---- streaming ---------------------------------------------------------------------------


async def stream_message(
    request: web.Request, state: ServerState, run: MessageRun, stream: ResultStream
) -> web.StreamResponse:
    """Anthropic's SSE: message_start (once the cache hit is known), the blocks' events,
    message_delta with the stop reason and usage, message_stop."""
    response = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    await response.prepare(request)

    async def send(event: Event) -> None:
        name, data = event
        await response.write(f"event: {name}\ndata: {json.dumps(data)}\n\n".encode())

    finish = await _send_blocks(state, run, stream, send)
    if finish is None:
        return response  # the error event was sent
    try:
        stop = _stop_or_raise(run.result, finish)
    except BadRequest as exc:
        await send(("error", error_body(exc.status, str(exc))))
        return response
    for event in run.blocks.close():
        await send(event)
    await send(run.shape.delta_event(stop, run.usage()))
    await send(run.shape.stop_event())
    return response


async def _send_blocks(
    state: ServerState,
    run: MessageRun,
    stream: ResultStream,
    send: Callable[[Event], Awaitable[None]],
) -> str | None:
    """Streams message_start and the content events; returns the finish, or None after an
    error event (engine gone, internal error)."""
    started, finish = False, None
    try:
        async with aclosing(state.iterate(stream)) as updates:
            async for _ in updates:
                if not started:
                    started = True
                    await send(run.shape.start_event(run.usage(started=True)))
                delta = run.tracker.next_delta()
                if delta is not None:
                    finish = delta.finish_reason or finish
                    for event in run.blocks.add(delta):
                        await send(event)
    except (ConnectionResetError, asyncio.CancelledError):
        raise
    except EngineDeadError as exc:
        await send(("error", error_body(503, f"engine core is not running: {exc}")))
        return None
    except Exception:
        logger.exception("internal error while streaming %s", run.shape.id)
        await send(("error", error_body(500, "internal server error")))
        return None
    if not started:
        await send(run.shape.start_event(run.usage(started=True)))
    return finish or "abort"
