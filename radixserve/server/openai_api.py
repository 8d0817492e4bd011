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
  tool calls in the `--tool-call-parser` format (tool_parsers/), streamed as argument
  fragments; a choice that made a call and stopped ends in "tool_calls".
- With `--reasoning-parser`, a chat choice's reasoning is split out first (server/reasoning.py)
  into `reasoning_content`, streamed too; tool calls are read from the content only.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from contextlib import aclosing
from dataclasses import replace
from typing import Any

from aiohttp import web

from radixserve.client.client import EngineDeadError
from radixserve.client.request_builder import GenerateArgs
from radixserve.client.result import RequestResult, ResultStream
from radixserve.engine.protocol import RequestSpec
from radixserve.server.chat_messages import check_messages, check_template_kwargs
from radixserve.server.chat_prompt import render_chat
from radixserve.server.choice_trackers import ChoiceTracker, ToolCallTracker
from radixserve.server.completion_template import fim_prompt
from radixserve.server.lora_api import check_model_name, model_cards
from radixserve.server.openai_protocol import (
    NO_OP_VALUES,
    TOKENIZE_FIELDS,
    OpenAIRequest,
    bad_request,
    check_bool,
    check_model,
    check_object,
    parse_request,
)
from radixserve.server.openai_response import Delta, ResponseShape, prompt_logprobs, usage
from radixserve.server.reasoning import choice_reasoning_parser, reasoning_sampling
from radixserve.server.request_fields import check_fields
from radixserve.server.state import ServerState, read_json, state_of
from radixserve.server.tenants import SALT_HEADER
from radixserve.server.tool_calls import ToolCallParser, tool_names, tool_schemas

logger = logging.getLogger(__name__)


def register_openai_routes(app: web.Application) -> None:
    app.router.add_get("/v1/models", list_models)
    app.router.add_get("/v1/models/{model}", retrieve_model)
    app.router.add_post("/v1/completions", completions)
    app.router.add_post("/v1/chat/completions", chat_completions)
    for prefix in ("", "/v1"):  # SGLang serves both
        app.router.add_post(prefix + "/tokenize", tokenize)
        app.router.add_post(prefix + "/detokenize", detokenize)


# ---- handlers ----------------------------------------------------------------------------


async def list_models(request: web.Request) -> web.Response:
    return web.json_response({"object": "list", "data": model_cards(state_of(request))})


async def retrieve_model(request: web.Request) -> web.Response:
    """OpenAI's GET /v1/models/{model}: its card, or a 404 naming what is served."""
    state = state_of(request)
    name = request.match_info["model"]
    check_model_name(state, name)  # 404 unless it is the model or an adapter
    return web.json_response(next(card for card in model_cards(state) if card["id"] == name))


async def completions(request: web.Request) -> web.StreamResponse:
    return await _complete(request, chat=False)


async def chat_completions(request: web.Request) -> web.StreamResponse:
    return await _complete(request, chat=True)


async def _complete(request: web.Request, chat: bool) -> web.StreamResponse:
    state = state_of(request)
    salt = request.headers.get(SALT_HEADER)
    answer = await _run_completion(state, await read_json(request), chat, salt, request)
    return answer if isinstance(answer, web.StreamResponse) else web.json_response(answer)


async def complete_body(
    state: ServerState, body: Any, chat: bool, salt: str | None = None
) -> dict[str, Any]:
    """A non-streamed /v1/completions (chat=False) or /v1/chat/completions body's response
    body in namespace `salt` (as an X-Cache-Salt header would name it; the batch API's lines
    run through here); bad input raises BadRequest."""
    if isinstance(body, dict) and body.get("stream") is not None and body["stream"] is not False:
        raise bad_request("stream must be false here", param="stream")
    return await _run_completion(state, body, chat, salt)


async def _run_completion(state: ServerState, body: Any, chat: bool, salt=None, request=None):
    """The response body, or for a stream (given the `request` to answer) the streamed
    response; `salt`: the X-Cache-Salt header's namespace."""
    parsed = parse_request(body, chat, state.tool_parser, salt)
    lora_path = check_model_name(state, parsed.model)
    if chat:
        parsed.sampling = reasoning_sampling(state.reasoning_format, parsed.reasoning,
                                             parsed.sampling)  # fmt: skip
    ids = await state.off_loop(prompt_ids, state, parsed)
    stream = state.open(build_specs(state, parsed, ids, lora_path))
    async with stream:  # leaving before the requests end (client gone, failure) aborts them
        trackers = choice_trackers(state, parsed, ids, stream.results)
        asked_ids = ids if parsed.token_ids else None
        shape = ResponseShape(parsed, lora_path or state.served_model_name, asked_ids)
        if parsed.stream and request is not None:
            return await stream_response(request, state, shape, trackers, parsed, stream)
        results = await state.run(stream)
    deltas = [with_token_ids(shape, t, t.next_delta()) for t in trackers]
    scored = None
    if parsed.prompt_logprobs is not None:
        scored = await state.off_loop(prompt_logprobs, results, state.tokenizer)
    return shape.response(deltas, usage(results, parsed.n), scored)


def with_token_ids(shape: ResponseShape, tracker: ChoiceTracker, delta: Delta | None):
    """`delta` with the output ids its choice gained since the last one, when asked."""
    if delta is not None and shape.prompt_ids is not None:
        delta.token_ids = tracker.take_token_ids()
    return delta


async def tokenize(request: web.Request) -> web.Response:
    state = state_of(request)
    body = check_object(await read_json(request))
    check_fields(body, TOKENIZE_FIELDS, NO_OP_VALUES)
    check_model_name(state, check_model(body))
    tokens = await state.off_loop(tokenize_body, state.tokenizer, body)
    max_len = state.client.info["context_length"]
    reply = {"tokens": tokens, "count": len(tokens), "max_model_len": max_len}
    return web.json_response(text=await state.off_loop(json.dumps, reply))


async def detokenize(request: web.Request) -> web.Response:
    state = state_of(request)
    body = check_object(await read_json(request))
    check_fields(body, {"model", "tokens"}, NO_OP_VALUES)
    check_model_name(state, check_model(body))
    tokens = body.get("tokens")
    try:
        await state.off_loop(state.builder.check_ids, tokens)
    except ValueError as exc:
        vocab = state.builder.vocab_size
        raise bad_request(f"tokens must be a list of token ids in [0, {vocab})", "tokens") from exc
    return web.json_response({"prompt": await state.off_loop(state.tokenizer.decode, tokens)})


# ---- requests ----------------------------------------------------------------------------


def prompt_ids(state: ServerState, parsed: OpenAIRequest) -> list[list[int]]:
    """Token ids per prompt: the chat template's rendering, or the completion prompts."""
    tokenizer = state.tokenizer
    if parsed.chat:
        tools = parsed.offered_tools
        text = render_chat(
            tokenizer, parsed.messages, parsed.template_kwargs, tools, state.tool_parser
        )
        return [tokenizer.encode(text, add_special_tokens=bool(parsed.add_special_tokens))]
    special = parsed.add_special_tokens is not False  # vLLM's defaults: chat off, prompts on
    if parsed.suffix:  # code completion: the gap between each prompt and the suffix
        texts = [fim_prompt(state.completion_template, p, parsed.suffix) for p in parsed.prompt]
        return [tokenizer.encode(text, add_special_tokens=special) for text in texts]
    return [
        tokenizer.encode(p, add_special_tokens=special) if isinstance(p, str) else list(p)
        for p in parsed.prompt
    ]


def build_specs(
    state: ServerState, parsed: OpenAIRequest, ids: list[list[int]], lora_path: str | None = None
) -> list[RequestSpec]:
    """n requests per prompt, in choice order (prompt p, sample i -> index p*n + i); vLLM's
    prompt_logprobs scores the prompt from position 0 with the larger top-k of the two asked
    (each choice's output entries are cut back to `logprobs` when shown)."""
    logprobs = parsed.logprobs is not None
    scores_prompt = (parsed.echo and logprobs) or parsed.prompt_logprobs is not None
    args = GenerateArgs(
        input_ids=ids,
        sampling_params=[with_default_max_tokens(state, parsed.sampling, len(p)) for p in ids],
        return_logprob=logprobs or parsed.prompt_logprobs is not None,
        logprob_start_len=0 if scores_prompt else None,
        top_logprobs_num=max(parsed.logprobs or 0, parsed.prompt_logprobs or 0),
        cache_salt=parsed.cache_salt,
        lora_path=lora_path,
        **parsed.options,
    )
    specs = state.build_one(args, parsed.core_names)
    if parsed.prompt_logprobs is None:
        return specs
    return [replace(spec, input_ranks=True) for spec in specs]


def with_default_max_tokens(state: ServerState, sampling: dict, prompt_len: int) -> dict:
    """Without max_tokens, a request may fill the context (and the KV pool), as in vLLM."""
    if "max_new_tokens" in sampling:
        return sampling
    builder = state.builder
    room = min(builder.context_length, builder.capacity_tokens) - prompt_len
    return sampling | {"max_new_tokens": max(room, 0)}


def choice_trackers(
    state: ServerState,
    parsed: OpenAIRequest,
    ids: list[list[int]],
    results: list[RequestResult],
) -> list[ChoiceTracker]:
    """One tracker per choice; with `echo`, each starts with its prompt's text; with a
    reasoning parser, each splits off the reasoning; with tools offered, each splits the
    rest into content and tool calls; vLLM's return_tokens_as_token_ids names logprob tokens
    `token_id:N`."""
    fmt = state.reasoning_format if parsed.chat else None
    readers = [choice_reasoning_parser(fmt, parsed.reasoning) for _ in results]
    as_ids = parsed.tokens_as_ids
    if parsed.offered_tools:
        names, schemas = tool_names(parsed.tools), tool_schemas(parsed.tools)
        return [
            ToolCallTracker(r, state.tokenizer, ToolCallParser(names, state.tool_parser, schemas,
                                                               parsed.stream), reader, as_ids,
                            parsed.single_call)
            for r, reader in zip(results, readers)
        ]  # fmt: skip
    echoes = [""] * len(ids)
    if parsed.echo:
        echoes = [p if isinstance(p, str) else state.tokenizer.decode(p) for p in parsed.prompt]
    echo_logprobs = parsed.echo and parsed.logprobs is not None
    return [ChoiceTracker(r, state.tokenizer, echoes[i // parsed.n], readers[i], as_ids,
                          echo_logprobs) for i, r in enumerate(results)]  # fmt: skip


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


async def stream_response(
    request: web.Request,
    state: ServerState,
    shape: ResponseShape,
    trackers: list[ChoiceTracker],
    parsed: OpenAIRequest,
    stream: ResultStream,
) -> web.StreamResponse:
    """Server-sent events: role chunks (chat), deltas, usage (if asked), then [DONE]."""
    response = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"}
    )
    await response.prepare(request)

    async def send(body: dict[str, Any]) -> None:
        await response.write(f"data: {json.dumps(body)}\n\n".encode())

    async def send_chunk(index: int, body: dict[str, Any]) -> None:
        if parsed.continuous_usage:  # vLLM's / SGLang's: the choice's usage so far
            body["usage"] = usage([stream.results[index]], 1)
        await send(body)

    if shape.chat:
        for index in range(len(trackers)):
            await send_chunk(index, shape.role_chunk(index))
    await _send_deltas(state, shape, trackers, stream, send, send_chunk)
    if parsed.include_usage:
        await send(shape.usage_chunk(usage(stream.results, parsed.n)))
    await response.write(b"data: [DONE]\n\n")
    return response


async def _send_deltas(
    state: ServerState,
    shape: ResponseShape,
    trackers: list[ChoiceTracker],
    stream: ResultStream,
    send: Callable[[dict[str, Any]], Awaitable[None]],
    send_chunk: Callable[[int, dict[str, Any]], Awaitable[None]],
) -> None:
    """Streams each choice's deltas (`send_chunk`: a choice's chunk); an engine or internal
    error becomes an error event (`send`)."""
    try:
        async with aclosing(state.iterate(stream)) as updates:
            async for index, _ in updates:
                delta = with_token_ids(shape, trackers[index], trackers[index].next_delta())
                if delta is not None:
                    await send_chunk(index, shape.chunk(index, delta))
    except (ConnectionResetError, asyncio.CancelledError):
        raise
    except EngineDeadError as exc:
        await send(error_event(f"engine core is not running: {exc}", 503))
    except Exception:
        logger.exception("internal error while streaming %s", shape.id)
        await send(error_event("internal server error", 500))


def error_event(message: str, status: int) -> dict[str, Any]:
    """A stream's last event when it cannot go on."""
    kind = "ServiceUnavailableError" if status == 503 else "InternalServerError"
    return {"error": {"message": message, "type": kind, "param": None, "code": status}}
