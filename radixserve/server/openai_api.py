"""OpenAI-compatible endpoints (/v1/models, /v1/completions, /v1/chat/completions) and
vLLM's /tokenize and /detokenize, on top of the same core client as SGLang's /generate.

Choices where OpenAI and vLLM leave room:
- `max_tokens` absent: generate up to the context length (vLLM), i.e. context - prompt.
- An aborted request (core exit, /abort_request, shutdown) ends its choice with
  finish_reason "abort" (vLLM's value), streamed or not; the text so far is kept.
- `echo` (completions) prepends the prompt text; with `logprobs` it also returns the
  prompt's logprobs (the first one null), as OpenAI does.
- Streams are deltas; text that may still change (half a UTF-8 character, a tail that may
  start a stop string) is held back until it settles, so the chunks add up to the
  non-streamed text.
- With tools (and tool_choice not "none"), a chat choice's text is split into content and
  tool calls (tool_calls.py); a choice that made a call and stopped ends in "tool_calls".
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import aclosing
from typing import Any

from aiohttp import web

from radixserve.engine.output import output_text
from radixserve.engine.request import Req
from radixserve.engine.request_builder import GenerateArgs
from radixserve.server.chat_prompt import render_chat
from radixserve.server.errors import BadRequest
from radixserve.server.openai_protocol import (
    MIN_LOGPROB,
    TOKENIZE_FIELDS,
    Delta,
    OpenAIRequest,
    ResponseShape,
    TokenLogprob,
    bad_request,
    check_bool,
    check_fields,
    check_messages,
    check_model,
    check_object,
    check_template_kwargs,
    parse_request,
    usage,
)
from radixserve.server.state import ServerState, read_json, state_of
from radixserve.server.tool_calls import ToolCallParser, tool_names

logger = logging.getLogger(__name__)


def register_openai_routes(app: web.Application) -> None:
    app.router.add_get("/v1/models", list_models)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    app.router.add_post("/tokenize", tokenize)
    app.router.add_post("/detokenize", detokenize)


# ---- handlers ----------------------------------------------------------------------------


async def list_models(request: web.Request) -> web.Response:
    state = state_of(request)
    card = {
        "id": state.served_model_name,
        "object": "model",
        "created": int(time.time()),
        "owned_by": "radixserve",
        "root": state.model_path,
        "max_model_len": state.client.info["context_length"],
    }
    return web.json_response({"object": "list", "data": [card]})


async def completions(request: web.Request) -> web.StreamResponse:
    return await _complete(request, chat=False)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _complete(request, chat=True)


async def _complete(request: web.Request, chat: bool) -> web.StreamResponse:
    state = state_of(request)
    parsed = parse_request(await read_json(request), chat)
    check_model_name(state, parsed.model)
    ids = prompt_ids(state, parsed)
    reqs = build_reqs(state, parsed, ids)
    state.check_capacity(len(reqs))
    trackers = choice_trackers(state, parsed, ids, reqs)
    shape = ResponseShape(parsed, state.served_model_name)
    if parsed.stream:
        return await stream_response(request, state, shape, trackers, parsed)
    await run_all(state, reqs)
    deltas = [tracker.next_delta() for tracker in trackers]
    return web.json_response(shape.response(deltas, usage(reqs, parsed.n)))


async def tokenize(request: web.Request) -> web.Response:
    state = state_of(request)
    body = check_object(await read_json(request))
    check_fields(body, TOKENIZE_FIELDS)
    check_model_name(state, check_model(body))
    tokens = tokenize_body(state.tokenizer, body)
    max_len = state.client.info["context_length"]
    return web.json_response({"tokens": tokens, "count": len(tokens), "max_model_len": max_len})


async def detokenize(request: web.Request) -> web.Response:
    state = state_of(request)
    body = check_object(await read_json(request))
    check_fields(body, {"model", "tokens"})
    check_model_name(state, check_model(body))
    tokens = body.get("tokens")
    try:
        state.builder.check_ids(tokens)
    except ValueError as exc:
        vocab = state.builder.vocab_size
        raise bad_request(f"tokens must be a list of token ids in [0, {vocab})", "tokens") from exc
    return web.json_response({"prompt": state.tokenizer.decode(tokens)})


# ---- requests ----------------------------------------------------------------------------


def check_model_name(state: ServerState, model: str | None) -> None:
    """A request may name the served model or none; any other name is a 404."""
    if model is not None and model != state.served_model_name:
        raise BadRequest(
            f"model {model!r} does not exist; this server serves {state.served_model_name!r}",
            param="model",
            status=404,
        )


def prompt_ids(state: ServerState, parsed: OpenAIRequest) -> list[list[int]]:
    """Token ids per prompt: the chat template's rendering, or the completion prompts."""
    tokenizer = state.tokenizer
    if parsed.chat:
        text = render_chat(tokenizer, parsed.messages, parsed.template_kwargs, parsed.offered_tools)
        return [tokenizer.encode(text, add_special_tokens=False)]
    return [tokenizer.encode(p) if isinstance(p, str) else list(p) for p in parsed.prompt]


def build_reqs(state: ServerState, parsed: OpenAIRequest, ids: list[list[int]]) -> list[Req]:
    """n requests per prompt, in choice order (prompt p, sample i -> index p*n + i)."""
    logprobs = parsed.logprobs is not None
    args = GenerateArgs(
        input_ids=ids,
        sampling_params=[with_default_max_tokens(state, parsed.sampling, len(p)) for p in ids],
        return_logprob=logprobs,
        logprob_start_len=0 if parsed.echo and logprobs else None,
        top_logprobs_num=parsed.logprobs,
        cache_salt=parsed.cache_salt,
    )
    try:
        return state.builder.build(args)[0]
    except ValueError as exc:
        raise ValueError(parsed.openai_message(str(exc))) from exc


def with_default_max_tokens(state: ServerState, sampling: dict, prompt_len: int) -> dict:
    """Without max_tokens, a request may fill the context (and the KV pool), as in vLLM."""
    if "max_new_tokens" in sampling:
        return sampling
    builder = state.builder
    room = min(builder.context_length, builder.capacity_tokens) - prompt_len
    return sampling | {"max_new_tokens": max(room, 0)}


def choice_trackers(
    state: ServerState, parsed: OpenAIRequest, ids: list[list[int]], reqs: list[Req]
) -> list[ChoiceTracker]:
    """One tracker per choice; with `echo`, each starts with its prompt's text; with tools
    offered, each splits its text into content and tool calls."""
    if parsed.offered_tools:
        names = tool_names(parsed.tools)
        return [ToolCallTracker(req, state.tokenizer, names) for req in reqs]
    echoes = [""] * len(ids)
    if parsed.echo:
        echoes = [p if isinstance(p, str) else state.tokenizer.decode(p) for p in parsed.prompt]
    return [ChoiceTracker(r, state.tokenizer, echoes[i // parsed.n]) for i, r in enumerate(reqs)]


def tokenize_body(tokenizer, body: dict) -> list[int]:
    """/tokenize: a prompt (special tokens added) or messages (rendered, none added)."""
    prompt, messages = body.get("prompt"), body.get("messages")
    if (prompt is None) == (messages is None):
        raise bad_request("provide exactly one of prompt or messages", "prompt")
    if prompt is not None:
        if not isinstance(prompt, str):
            raise bad_request(f"prompt must be a string; got {prompt!r}", "prompt")
        add_special = check_bool(body, "add_special_tokens", True)
        return tokenizer.encode(prompt, add_special_tokens=add_special)
    kwargs = check_template_kwargs(body.get("chat_template_kwargs")) | {
        "add_generation_prompt": check_bool(body, "add_generation_prompt", True)
    }
    text = render_chat(tokenizer, check_messages(messages), kwargs)
    return tokenizer.encode(text, add_special_tokens=check_bool(body, "add_special_tokens"))


# ---- running -----------------------------------------------------------------------------


async def run_all(state: ServerState, reqs: list[Req]) -> None:
    """Runs `reqs` to the end; cancelling the caller aborts them."""
    async with aclosing(merged_updates(state, reqs)) as updates:
        async for _ in updates:
            pass


async def merged_updates(state: ServerState, reqs: list[Req]) -> AsyncIterator[int]:
    """Runs all `reqs` at once, yielding the index of each one that changed."""
    queue: asyncio.Queue[int | BaseException | None] = asyncio.Queue()
    tasks = [asyncio.create_task(_pump(state, req, i, queue)) for i, req in enumerate(reqs)]
    try:
        num_running = len(tasks)
        while num_running:
            item = await queue.get()
            if isinstance(item, BaseException):
                raise item
            if item is None:
                num_running -= 1
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()  # aborts the requests still running
        await asyncio.gather(*tasks, return_exceptions=True)


async def _pump(state: ServerState, req: Req, index: int, queue: asyncio.Queue) -> None:
    try:
        async with aclosing(state.stream(req)) as updates:
            async for _ in updates:
                queue.put_nowait(index)
    except Exception as exc:  # handed to the consumer, which raises it
        queue.put_nowait(exc)
    finally:
        queue.put_nowait(None)


async def stream_response(
    request: web.Request,
    state: ServerState,
    shape: ResponseShape,
    trackers: list[ChoiceTracker],
    parsed: OpenAIRequest,
) -> web.StreamResponse:
    """Server-sent events: role chunks (chat), deltas, usage (if asked), then [DONE]."""
    response = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    await response.prepare(request)

    async def send(body: dict[str, Any]) -> None:
        await response.write(f"data: {json.dumps(body)}\n\n".encode())

    if shape.chat:
        for index in range(len(trackers)):
            await send(shape.role_chunk(index))
    await _send_deltas(state, shape, trackers, send)
    if parsed.include_usage:
        await send(shape.usage_chunk(usage([t.req for t in trackers], parsed.n)))
    await response.write(b"data: [DONE]\n\n")
    return response


async def _send_deltas(
    state: ServerState,
    shape: ResponseShape,
    trackers: list[ChoiceTracker],
    send: Callable[[dict[str, Any]], Awaitable[None]],
) -> None:
    """Streams each choice's deltas; an internal error becomes an error event."""
    try:
        async with aclosing(merged_updates(state, [t.req for t in trackers])) as updates:
            async for index in updates:
                delta = trackers[index].next_delta()
                if delta is not None:
                    await send(shape.chunk(index, delta))
    except (ConnectionResetError, asyncio.CancelledError):
        raise
    except Exception:
        logger.exception("internal error while streaming %s", shape.id)
        message = "internal server error"
        error = {"message": message, "type": "InternalServerError", "param": None, "code": 500}
        await send({"error": error})


# ---- choices -----------------------------------------------------------------------------


class ChoiceTracker:
    """Turns one Req's cumulative output into OpenAI deltas: new text, logprobs, finish."""

    def __init__(self, req: Req, tokenizer, echo_text: str = ""):
        self.req = req
        self.tokenizer = tokenizer
        self.pending_text = echo_text  # sent with the first delta
        self.echo_logprobs = req.wants_input_logprobs
        self.sent_text = ""
        self.num_sent_logprobs = 0
        self.text_offset = 0
        self.finished = False

    def next_delta(self) -> Delta | None:
        """What is new since the last call; None when nothing is."""
        if self.finished:
            return None
        text = self._new_text()
        logprobs = self._new_logprobs() if self.req.logprob is not None else []
        finish = finish_reason(self.req)
        self.finished = finish is not None
        if not text and not logprobs and finish is None:
            return None
        return Delta(text, logprobs, finish)

    def _new_text(self) -> str:
        text = output_text(self.req, self.tokenizer)
        new = text[len(self.sent_text) :]
        if new:
            self.sent_text = text
        new, self.pending_text = self.pending_text + new, ""
        return new

    def _new_logprobs(self) -> list[TokenLogprob]:
        req = self.req
        inputs, input_tops = req.input_logprobs, req.input_top_logprobs
        if self.echo_logprobs and not inputs and len(req.input_ids) == 1:
            # The core scores no position of a one-token prompt, not even the first (None).
            inputs, input_tops = [(None, req.input_ids[0])], [None]
        values, tops = inputs + req.output_logprobs, input_tops + req.output_top_logprobs
        start, self.num_sent_logprobs = self.num_sent_logprobs, len(values)
        return [self._entry(v, t, top) for (v, t), top in zip(values[start:], tops[start:])]

    def _entry(self, value: float | None, token_id: int, top) -> TokenLogprob:
        token = self.tokenizer.decode([token_id])
        offset, self.text_offset = self.text_offset, self.text_offset + len(token)
        top = None if top is None else [(self.tokenizer.decode([t]), _floor(v)) for v, t in top]
        return TokenLogprob(token, None if value is None else _floor(value), top, offset)


class ToolCallTracker(ChoiceTracker):
    """A chat choice that may call tools: its deltas carry content and complete tool calls."""

    def __init__(self, req: Req, tokenizer, names: list[str]):
        super().__init__(req, tokenizer)
        self.parser = ToolCallParser(names)

    def next_delta(self) -> Delta | None:
        delta = super().next_delta()
        if delta is None:
            return None
        parsed = self.parser.feed(delta.text, final=delta.finish_reason is not None)
        finish = delta.finish_reason
        if finish == "stop" and self.parser.num_calls:
            finish = "tool_calls"
        if not parsed.content and not parsed.calls and not delta.logprobs and finish is None:
            return None
        return Delta(parsed.content, delta.logprobs, finish, parsed.calls)


def _floor(logprob: float) -> float:
    return max(logprob, MIN_LOGPROB)


def finish_reason(req: Req) -> str | None:
    """OpenAI's finish_reason: "stop", "length", or vLLM's "abort"; None while running."""
    return None if req.finish_reason is None else req.finish_reason.get("type", "abort")
