"""OpenAI's Responses API: POST /v1/responses (plain and streamed), GET and DELETE
/v1/responses/{id}, GET /v1/responses/{id}/input_items, as the `openai` SDK and the OpenAI
Agents SDK send them.

A body is checked (responses_protocol.py); with `previous_response_id` the stored chain's
items (responses_store.py, the caller's own only) come before this turn's input; the items
become chat messages (responses_items.py) rendered by the same chat template, tools prompt
and tool-call parser as chat completions (chat_prompt.py); one request runs, its output read
by the same trackers (openai_api.py); responses_output.py shapes the Response object and the
stream's events. A completed or incomplete response is stored unless `store: false`.

Errors are OpenAI's shape (errors.py) with the field in `param`: 400 for bad input, 404 for a
response id (or `previous_response_id`) the caller has not stored, 503 for an aborted
request; a stream that fails once started ends with `response.failed`.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass
from functools import partial
from typing import Any

from aiohttp import web

from radixserve.client.client import EngineDeadError
from radixserve.client.request_builder import GenerateArgs
from radixserve.client.result import RequestResult, ResultStream
from radixserve.engine.protocol import RequestSpec
from radixserve.server.chat_prompt import render_chat
from radixserve.server.choice_trackers import ChoiceTracker, aborted, chat_tracker
from radixserve.server.conversations_api import append_items, conversation_items
from radixserve.server.errors import BadRequest
from radixserve.server.openai_api import check_model_name, with_default_max_tokens
from radixserve.server.reasoning import reasoning_sampling
from radixserve.server.responses_items import chat_messages, check_list_query, item_page
from radixserve.server.responses_output import (
    Event,
    OutputItems,
    ResponseShape,
    error_event,
    status_of,
    usage,
)
from radixserve.server.responses_protocol import ResponsesRequest, parse_responses_request
from radixserve.server.responses_store import Owner, ResponseStore, StoredResponse, owner_of
from radixserve.server.state import STATE_KEY, ServerState, read_json, state_of
from radixserve.server.tenants import SALT_HEADER

logger = logging.getLogger(__name__)

STORE_KEY = web.AppKey("responses_store", ResponseStore)
CORE_NAMES = {
    "max_new_tokens": "max_output_tokens",
    "sampling_seed": "seed",
    "input_ids": "prompt token ids",
}
"""SamplingParams' names in core validation messages, as a Responses body calls them."""
SSE_HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}


def register_responses_routes(app: web.Application) -> None:
    """The routes, and the store they share (bounded by the server's config)."""
    app[STORE_KEY] = ResponseStore.from_config(app[STATE_KEY].config)
    app.router.add_post("/v1/responses", create_response)
    app.router.add_get("/v1/responses/{response_id}", retrieve_response)
    app.router.add_delete("/v1/responses/{response_id}", delete_response)
    app.router.add_get("/v1/responses/{response_id}/input_items", list_input_items)


# ---- one response in flight --------------------------------------------------------------


@dataclass
class ResponseRun:
    """One Responses request in flight: what its Response object is built from."""

    parsed: ResponsesRequest
    owner: Owner
    history: list[dict[str, Any]]  # the chain's items before this turn's input
    tracker: ChoiceTracker
    shape: ResponseShape
    items: OutputItems
    count_tokens: Callable[[str], list[int]]  # the reasoning's tokens, for its usage
    app: web.Application | None = None  # where a `conversation` lives

    @property
    def result(self) -> RequestResult:
        return self.tracker.result

    def final(self, finish: str) -> dict[str, Any]:
        """The finished Response object; an aborted request raises (503 unless it says)."""
        if finish == "abort" or self.result.unanswered:
            raise aborted(self.result)
        status, incomplete = status_of(finish)
        reasoning = self.items.reasoning_text
        num_reasoning = len(self.count_tokens(reasoning)) if reasoning else 0
        used = usage(self.result, num_reasoning)
        return self.shape.response(status, self.items.items, used, incomplete)

    def failed(self, message: str) -> dict[str, Any]:
        return self.shape.response("failed", self.items.items, error=error_event(message))

    def save(self, store: ResponseStore, response: dict[str, Any]) -> None:
        """Stores the response (`store`), and adds this turn to its `conversation`."""
        if self.parsed.conversation and self.app is not None:
            turn = [*self.parsed.input_items, *self.items.items]
            if not append_items(self.app, self.owner, self.parsed.conversation, turn):
                logger.warning("conversation %s could not take response %s's items",
                               self.parsed.conversation, response["id"])  # fmt: skip
        if not self.parsed.store:
            return
        inputs = self.parsed.input_items
        history = [*self.history, *inputs, *self.items.items]
        store.put(self.owner, StoredResponse(response, inputs, history))


def store_of(request: web.Request) -> ResponseStore:
    return request.app[STORE_KEY]


# ---- handlers ----------------------------------------------------------------------------


async def create_response(request: web.Request) -> web.StreamResponse:
    state, store = state_of(request), store_of(request)
    body = await read_json(request)
    parsed = parse_responses_request(body, state.tool_parser, request.headers.get(SALT_HEADER))
    lora_path = check_model_name(state, parsed.model)  # a LoRA adapter's name runs it
    owner = owner_of(request, parsed.cache_salt)
    history = previous_history(store, owner, parsed.previous_response_id)
    if parsed.conversation:
        history = conversation_items(request.app, owner, parsed.conversation)
    ids = await state.off_loop(render_prompt, state, parsed, history)
    parsed.sampling = reasoning_sampling(state.reasoning_format, parsed.reasoning, parsed.sampling)
    stream = state.open(build_specs(state, parsed, ids, lora_path))
    [result] = stream.results
    async with stream:  # leaving before the request ends (client gone, failure) aborts it
        run = ResponseRun(
            parsed=parsed,
            owner=owner,
            history=history,
            tracker=_tracker(state, parsed, result),
            shape=ResponseShape(lora_path or state.served_model_name, parsed.echo()),
            items=OutputItems(parsed.sealed_reasoning),
            count_tokens=partial(state.tokenizer.encode, add_special_tokens=False),
            app=request.app,
        )
        if parsed.stream:
            return await stream_response(request, state, run, stream)
        await state.run(stream)
    delta = run.tracker.next_delta()  # the whole output: the request has finished
    if delta is not None:
        run.items.add(delta)
    run.items.close()
    response = run.final(delta.finish_reason if delta is not None else "abort")
    run.save(store, response)
    return web.json_response(response)


async def retrieve_response(request: web.Request) -> web.Response:
    check_list_query(request.query, set())
    return web.json_response(_stored(request).response)


async def delete_response(request: web.Request) -> web.Response:
    check_list_query(request.query, set())  # as retrieve_response: refused, not ignored
    response_id = request.match_info["response_id"]
    owner = owner_of(request, request.headers.get(SALT_HEADER))
    if not store_of(request).delete(owner, response_id):
        raise _not_found(response_id)
    return web.json_response({"id": response_id, "object": "response.deleted", "deleted": True})


async def list_input_items(request: web.Request) -> web.Response:
    """A stored response's input items, paged by `after` (an item id) and `limit`."""
    page = item_page(_stored(request).input_items, request.query, "this response's input")
    return web.json_response(page)


def _stored(request: web.Request) -> StoredResponse:
    """The caller's stored response named in the path (the namespace from X-Cache-Salt)."""
    response_id = request.match_info["response_id"]
    owner = owner_of(request, request.headers.get(SALT_HEADER))
    record = store_of(request).get(owner, response_id)
    if record is None:
        raise _not_found(response_id)
    return record


def _not_found(response_id: str, param: str = "response_id") -> BadRequest:
    noun = "Previous response" if param == "previous_response_id" else "Response"
    return BadRequest(f"{noun} with id {response_id!r} not found.", param=param, status=404)


# ---- requests ----------------------------------------------------------------------------


def previous_history(
    store: ResponseStore, owner: Owner, response_id: str | None
) -> list[dict[str, Any]]:
    """The items a chained request continues (none without `previous_response_id`)."""
    if response_id is None:
        return []
    record = store.get(owner, response_id)
    if record is None:
        raise _not_found(response_id, param="previous_response_id")
    return record.history


def render_prompt(
    state: ServerState, parsed: ResponsesRequest, history: list[dict[str, Any]]
) -> list[int]:
    """The prompt's token ids: instructions, the chain's items, this turn's input; with
    `truncation: "auto"`, without the oldest items when they would not fit (OpenAI's rule:
    the conversation loses its beginning, the instructions stay)."""
    items = [*history, *parsed.input_items]
    ids = _render_items(state, parsed, items)
    if parsed.truncation != "auto":
        return ids
    builder = state.builder
    room = parsed.sampling.get("max_new_tokens") or 1
    limit = min(builder.context_length, builder.capacity_tokens) - room
    if len(ids) <= limit:
        return ids
    low, high = 1, len(items) - 1  # the fewest leading items dropped that make it fit
    best = None
    while low <= high:
        middle = (low + high) // 2
        fitted = _render_items(state, parsed, items[_item_boundary(items, middle) :])
        if len(fitted) <= limit:
            best, high = fitted, middle - 1
        else:
            low = middle + 1
    return best if best is not None else _render_items(state, parsed, items[-1:])


def _item_boundary(items: list[dict[str, Any]], cut: int) -> int:
    """`cut`, moved past the items that would start the kept part dangling: results of calls
    dropped before them, and reasoning of a dropped turn."""
    while cut < len(items) - 1 and items[cut]["type"] in ("function_call_output", "reasoning"):
        cut += 1
    return cut


def _render_items(
    state: ServerState, parsed: ResponsesRequest, items: list[dict[str, Any]]
) -> list[int]:
    system = [{"role": "system", "content": parsed.instructions}] if parsed.instructions else []
    messages = system + chat_messages(items)
    if not messages:
        raise BadRequest("input has no message, call or call output to answer", param="input")
    text = render_chat(
        state.tokenizer,
        messages,
        parsed.template_kwargs,
        parsed.offered_tools,
        tool_parser=state.tool_parser,
        param="input",
    )
    return state.tokenizer.encode(text, add_special_tokens=False)


def build_specs(
    state: ServerState, parsed: ResponsesRequest, ids: list[int], lora_path: str | None = None
) -> list[RequestSpec]:
    args = GenerateArgs(
        input_ids=[ids],
        sampling_params=[with_default_max_tokens(state, parsed.sampling, len(ids))],
        cache_salt=parsed.cache_salt,
        lora_path=lora_path,
        **parsed.options,
    )
    return state.build_one(args, CORE_NAMES)


def _tracker(state: ServerState, parsed: ResponsesRequest, result: RequestResult) -> ChoiceTracker:
    return chat_tracker(result, state.tokenizer, state.reasoning_format, parsed.reasoning,
                        parsed.offered_tools, state.tool_parser, parsed.stream,
                        single_call=not parsed.parallel_tool_calls)  # fmt: skip


# ---- streaming ---------------------------------------------------------------------------


async def stream_response(
    request: web.Request, state: ServerState, run: ResponseRun, stream: ResultStream
) -> web.StreamResponse:
    """The SDK's event sequence (responses_output.py), ending in response.completed,
    response.incomplete or response.failed."""
    response = web.StreamResponse(headers=SSE_HEADERS)
    await response.prepare(request)

    async def send(event: Event) -> None:
        numbered = run.shape.event(event)
        await response.write(
            f"event: {numbered['type']}\ndata: {json.dumps(numbered)}\n\n".encode()
        )

    started = run.shape.response("in_progress", [])
    await send({"type": "response.created", "response": started})
    await send({"type": "response.in_progress", "response": started})
    finish = await _send_items(state, run, stream, send)
    if finish is None:
        return response  # response.failed was sent
    for event in run.items.close():
        await send(event)
    try:
        final = run.final(finish)
    except BadRequest as exc:
        await send({"type": "response.failed", "response": run.failed(str(exc))})
        return response
    await send({"type": f"response.{final['status']}", "response": final})
    run.save(store_of(request), final)
    return response


async def _send_items(
    state: ServerState,
    run: ResponseRun,
    stream: ResultStream,
    send: Callable[[Event], Awaitable[None]],
) -> str | None:
    """Streams the output items' events; returns the finish, or None after response.failed
    (engine gone, internal error)."""
    finish = None
    try:
        async with aclosing(state.iterate(stream)) as updates:
            async for _ in updates:
                delta = run.tracker.next_delta()
                if delta is not None:
                    finish = delta.finish_reason or finish
                    for event in run.items.add(delta):
                        await send(event)
    except (ConnectionResetError, asyncio.CancelledError):
        raise
    except EngineDeadError as exc:
        message = f"engine core is not running: {exc}"
        await send({"type": "response.failed", "response": run.failed(message)})
        return None
    except Exception:
        logger.exception("internal error while streaming %s", run.shape.id)
        await send({"type": "response.failed", "response": run.failed("internal server error")})
        return None
    return finish or "abort"
