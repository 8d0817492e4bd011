"""Ollama's API, as SGLang serves it, for the Ollama CLI (`OLLAMA_HOST=http://127.0.0.1:30000
ollama run MODEL`), the `ollama` Python library and the agent tools built on them:
GET/HEAD / (the CLI's heartbeat), GET /api/version, GET /api/tags, GET /api/ps, POST /api/show,
POST /api/chat and POST /api/generate.

A chat (or generate) body is checked by ollama_protocol.py, rendered by the model's chat
template as chat completions are (chat_prompt.py), run as one request, and its output read by
the same trackers (reasoning split off by `--reasoning-parser` into `thinking`, tool calls
found by tool_calls.py); ollama_response.py shapes the objects. Streams are NDJSON (Ollama's
default: `stream` is true unless the body says false), one object per line, the last with
`done: true`, `done_reason` ("stop" or "length") and the timings.

Errors on these paths are Ollama's `{"error": "message"}` with the same HTTP status as
elsewhere (400 naming the field, 401, 404 for an unknown model, 503); a stream that fails
once started ends with an `{"error": ...}` line.
"""

from __future__ import annotations

import asyncio
import json
import logging
from contextlib import aclosing
from typing import Any

from aiohttp import web

import radixserve
from radixserve.client.client import EngineDeadError
from radixserve.client.request_builder import GenerateArgs
from radixserve.client.result import RequestResult, ResultStream
from radixserve.server.chat_prompt import render_chat
from radixserve.server.choice_trackers import ChoiceTracker, aborted, chat_tracker
from radixserve.server.completion_template import fim_prompt
from radixserve.server.errors import BadRequest
from radixserve.server.lora_api import adapter_names, check_model_name
from radixserve.server.ollama_protocol import DEFAULT_TAG, OllamaRequest, parse_ollama_request
from radixserve.server.ollama_response import ModelFacts, OllamaShape, Timings
from radixserve.server.openai_api import with_default_max_tokens
from radixserve.server.reasoning import reasoning_sampling
from radixserve.server.state import ServerState, read_json, state_of
from radixserve.server.tenants import SALT_HEADER

logger = logging.getLogger(__name__)

API_PREFIX = "/api/"
ROOT_TEXT = "Ollama is running"
"""What GET / answers: the Ollama CLI checks for a server this way."""
CORE_NAMES = {
    "max_new_tokens": "options.num_predict",
    "temperature": "options.temperature",
    "top_p": "options.top_p",
    "top_k": "options.top_k",
    "min_p": "options.min_p",
    "repetition_penalty": "options.repeat_penalty",
    "presence_penalty": "options.presence_penalty",
    "frequency_penalty": "options.frequency_penalty",
    "sampling_seed": "options.seed",
    "stop": "options.stop",
    "input_ids": "prompt token ids",
}
"""SamplingParams' names in core validation messages, as an Ollama body calls them."""
NEVER = "9999-12-31T23:59:59Z"
"""/api/ps's `expires_at`: the model stays loaded until the server stops."""
FACTS_KEY = web.AppKey("ollama_model_facts", ModelFacts)
NDJSON = "application/x-ndjson"


def register_ollama_routes(app: web.Application) -> None:
    app.router.add_get("/", root)  # HEAD too (aiohttp adds it to every GET route)
    app.router.add_get("/api/version", api_version)
    app.router.add_get("/api/tags", tags)
    app.router.add_get("/api/ps", running)
    app.router.add_post("/api/show", show)
    app.router.add_post("/api/chat", chat)
    app.router.add_post("/api/generate", generate)


@web.middleware
async def ollama_error_middleware(request: web.Request, handler):
    """On the /api/ paths, rewrites the server's JSON errors (OpenAI's shape) into Ollama's
    `{"error": message}`, keeping the status; the message starts with the field it names."""
    response = await handler(request)
    if not request.path.startswith(API_PREFIX) or response.status < 400:
        return response
    if not isinstance(response, web.Response) or response.content_type != "application/json":
        return response
    error = json.loads(response.body).get("error")
    if not isinstance(error, dict):
        return response
    message, param = str(error.get("message", response.reason)), error.get("param")
    if param and not message.startswith((param, repr(param))):  # the field first, as Anthropic's
        message = f"{param}: {message}"
    headers = {k: v for k, v in response.headers.items() if k == "Retry-After"}
    rewritten = web.json_response({"error": message}, status=response.status, headers=headers)
    if not response.keep_alive:
        rewritten.force_close()
    return rewritten


# ---- models ------------------------------------------------------------------------------


async def root(request: web.Request) -> web.Response:
    return web.Response(text=ROOT_TEXT)


async def api_version(request: web.Request) -> web.Response:
    return web.json_response({"version": radixserve.__version__})


async def tags(request: web.Request) -> web.Response:
    """The served model and its LoRA adapters (each an adapter of the same files)."""
    state = state_of(request)
    facts = await model_facts(request)
    names = [state.served_model_name, *adapter_names(state)]
    return web.json_response({"models": [facts.entry(name) for name in names]})


async def running(request: web.Request) -> web.Response:
    """`ollama ps`: the model (and its adapters) loaded, for as long as the server runs."""
    state = state_of(request)
    facts = await model_facts(request)
    names = [state.served_model_name, *adapter_names(state)]
    context = state.client.info["context_length"]
    models = [facts.entry(name) | {"expires_at": NEVER, "size_vram": 0,
                                   "context_length": context} for name in names]  # fmt: skip
    return web.json_response({"models": models})


async def show(request: web.Request) -> web.Response:
    """The model's details, chat template, context length and capabilities."""
    state = state_of(request)
    body = await read_json(request)
    name = (body.get("model") or body.get("name")) if isinstance(body, dict) else None
    if not isinstance(name, str):
        raise BadRequest(f"model is required: a model name; got {name!r}", param="model")
    check_model_name(state, name.removesuffix(DEFAULT_TAG))
    facts = await model_facts(request)
    capabilities = capabilities_of(state)
    context_key = f"{facts.family}.context_length"
    return web.json_response(
        {
            "modelfile": "",
            "parameters": "",
            "template": getattr(state.tokenizer, "chat_template", None) or "",
            "details": facts.details(),
            "model_info": {
                "general.architecture": facts.family,
                context_key: state.client.info["context_length"],
                f"{facts.family}.embedding_length": state.client.info["hidden_size"],
            },
            "capabilities": capabilities,
            "modified_at": facts.entry(name)["modified_at"],
        }
    )


def capabilities_of(state: ServerState) -> list[str]:
    """Ollama's capability names: an --is-embedding server embeds only; a generating one
    completes, calls tools, fills in the middle ("insert") with a FIM format, and thinks with
    a --reasoning-parser."""
    if state.builder.is_embedding:
        return ["embedding"]
    insert = ["insert"] if state.completion_template is not None else []
    return ["completion", "tools", *insert] + (["thinking"] if state.reasoning_format else [])


async def model_facts(request: web.Request) -> ModelFacts:
    """The served model's facts, read from disk once (off the event loop)."""
    facts = request.app.get(FACTS_KEY)
    if facts is None:
        state = state_of(request)
        quantization = state.engine_args.get("quantization") or "auto"
        if quantization == "auto":  # a GGUF's own type, else the weights' dtype
            quantization = state.client.info.get("dtype", "")
        architecture = state.client.info.get("architecture") or ""
        model = state.engine_args.get("model")
        facts = await asyncio.to_thread(ModelFacts.read, model, architecture, quantization)
        request.app[FACTS_KEY] = facts
    return facts


# ---- chat and generate -------------------------------------------------------------------


async def chat(request: web.Request) -> web.StreamResponse:
    return await _respond(request, chat=True)


async def generate(request: web.Request) -> web.StreamResponse:
    return await _respond(request, chat=False)


async def _respond(request: web.Request, chat: bool) -> web.StreamResponse:
    state = state_of(request)
    parsed = parse_ollama_request(await read_json(request), chat, request.headers.get(SALT_HEADER))
    lora_path = check_model_name(state, parsed.model.removesuffix(DEFAULT_TAG))
    if parsed.think and state.reasoning_format is None:
        message = "think: this model does not think: the server runs without --reasoning-parser"
        raise BadRequest(message, param="think")
    shape = OllamaShape(parsed.model, chat, parsed.logprobs is not None)
    if parsed.loads_only:
        return _answer(shape.loaded(), parsed.stream)
    ids = await state.off_loop(prompt_ids, state, parsed)
    stream = state.open(build_specs(state, parsed, ids, lora_path))
    [result] = stream.results
    async with stream:  # leaving before the request ends (client gone, failure) aborts it
        tracker = _tracker(state, parsed, result)
        if parsed.stream:
            return await _stream(request, state, shape, tracker, stream)
        timings = Timings()
        async with aclosing(state.iterate(stream)) as updates:
            async for _ in updates:
                timings.seen(result)
    delta = tracker.next_delta()  # the whole output: the request has finished
    return web.json_response(shape.final(delta, result, timings, _done_reason(result)))


def _answer(body: dict[str, Any], stream: bool) -> web.Response:
    if stream:
        return web.Response(text=json.dumps(body) + "\n", content_type=NDJSON)
    return web.json_response(body)


def prompt_ids(state: ServerState, parsed: OllamaRequest) -> list[int]:
    """The prompt's token ids: the chat rendered by the model's template; for generate the
    prompt (with `system`) as one user turn, or as is when `raw` or when the model has no
    chat template, after the `context` ids."""
    tokenizer = state.tokenizer
    if parsed.chat:
        tools = parsed.tools or None
        text = render_chat(
            tokenizer, parsed.messages, parsed.template_kwargs, tools, state.tool_parser
        )
        return tokenizer.encode(text, add_special_tokens=False)
    fresh = not parsed.context  # special tokens (BOS) start a sequence, not its continuation
    if parsed.suffix:
        text = fim_prompt(state.completion_template, parsed.prompt, parsed.suffix)
        return parsed.context + tokenizer.encode(text, add_special_tokens=fresh)
    if parsed.raw or tokenizer.chat_template is None:
        text = (
            parsed.prompt
            if parsed.raw or not parsed.system
            else (f"{parsed.system}\n\n{parsed.prompt}")
        )
        return parsed.context + tokenizer.encode(text, add_special_tokens=fresh)
    messages = [{"role": "user", "content": parsed.prompt}]
    if parsed.system is not None:
        messages.insert(0, {"role": "system", "content": parsed.system})
    text = render_chat(tokenizer, messages, parsed.template_kwargs, param="prompt")
    return parsed.context + tokenizer.encode(text, add_special_tokens=False)


def build_specs(state: ServerState, parsed: OllamaRequest, ids: list[int], lora_path=None):
    sampling = reasoning_sampling(state.reasoning_format, parsed.reasoning, parsed.sampling)
    args = GenerateArgs(
        input_ids=[ids],
        sampling_params=[with_default_max_tokens(state, sampling, len(ids))],
        return_logprob=parsed.logprobs is not None,
        top_logprobs_num=parsed.logprobs,
        cache_salt=parsed.cache_salt,
        lora_path=lora_path,
        **parsed.options,
    )
    return state.build_one(args, CORE_NAMES)


def _tracker(state: ServerState, parsed: OllamaRequest, result: RequestResult) -> ChoiceTracker:
    return chat_tracker(result, state.tokenizer, state.reasoning_format, parsed.reasoning,
                        parsed.tools, state.tool_parser, parsed.stream)  # fmt: skip


def _done_reason(result: RequestResult) -> str:
    """Ollama's done_reason ("stop" or "length"); an aborted request is an error."""
    if result.unanswered:
        raise aborted(result)
    return "length" if result.finish_reason.kind == "length" else "stop"


async def _stream(
    request: web.Request,
    state: ServerState,
    shape: OllamaShape,
    tracker: ChoiceTracker,
    stream: ResultStream,
) -> web.StreamResponse:
    """NDJSON: an object per delta, then the final one (or an error line)."""
    response = web.StreamResponse(headers={"Content-Type": NDJSON, "Cache-Control": "no-cache"})
    await response.prepare(request)

    async def send(body: dict[str, Any]) -> None:
        await response.write(json.dumps(body).encode() + b"\n")

    [result] = stream.results
    timings = Timings()
    try:
        async with aclosing(state.iterate(stream)) as updates:
            async for _ in updates:
                timings.seen(result)
                delta = tracker.next_delta()
                if delta is not None and (
                    delta.text or delta.reasoning or delta.tool_calls or delta.logprobs
                ):
                    await send(shape.chunk(delta))
        await send(shape.final(None, result, timings, _done_reason(result)))
    except (ConnectionResetError, asyncio.CancelledError):
        raise
    except BadRequest as exc:  # aborted
        await send({"error": str(exc)})
    except EngineDeadError as exc:
        await send({"error": f"engine core is not running: {exc}"})
    except Exception:
        logger.exception("internal error while streaming an Ollama response")
        await send({"error": "internal server error"})
    return response
