"""HF transformers baseline server for `radixserve bench compare`: the part of SGLang's native
API the bench client uses, served by plain `model.generate` on static batches, or by
transformers' continuous batching (`--batching continuous`, see hf_continuous.py).

    python -m radixserve_bench.hf_server [--model M] [--port P] [--max-batch-size 16]

POST /generate   {"input_ids" | "text", "sampling_params": {"temperature": 0, "max_new_tokens",
                 "ignore_eos"}, "stream"}; greedy only, one prompt per request
GET  /health, GET /server_info, POST /flush_cache (static: nothing to flush; continuous:
     transformers offers no flush of its shared blocks, so it flushes nothing either)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import sys
import time
from dataclasses import asdict, dataclass
from importlib.metadata import version
from typing import Any

from aiohttp import web

from radixserve.cli_args import add_dataclass_args, field_names
from radixserve.client.detokenizer import IncrementalDetokenizer
from radixserve.server.errors import BadRequest, error_response
from radixserve.server.http_runner import serve_app
from radixserve.server.state import read_json
from radixserve_bench.hf_batcher import HFModel, HFRequest, StaticBatcher, Step, load_hf_model
from radixserve_bench.hf_continuous import ContinuousBatcher, ContinuousConfig

GENERATE_FIELDS = {"text", "input_ids", "sampling_params", "stream"}
# Greedy decoding takes the argmax, which top_p / top_k / min_p always keep: they are no-ops.
SAMPLING_FIELDS = {"temperature", "max_new_tokens", "ignore_eos", "top_p", "top_k", "min_p"}


@dataclass
class HFServerConfig:
    """The HF baseline server."""

    model: str | None = None
    """HF folder or .gguf file (the same values as radixserve's); default: SmolLM2."""
    host: str = "127.0.0.1"
    """Address to listen on."""
    port: int = 30000
    """Port to listen on."""
    max_batch_size: int = 16
    """Most requests in one `model.generate` call."""
    batch_wait_ms: float = 10.0
    """How long a batch waits for more requests after its first one."""
    dtype: str = "auto"
    """auto (float32 on CPU, bfloat16 on CUDA) | float32 | bfloat16."""
    device: str = "auto"
    """auto (cuda when available, else cpu) | cpu | cuda."""
    batching: str = "static"
    """static (one `model.generate` per batch) | continuous (transformers'
    `init_continuous_batching`: paged cache, prefix sharing; --max-batch-size caps a step)."""
    cb_page_size: int = 64
    """continuous: tokens per cache block (transformers' default 256)."""
    cb_num_blocks: int = 512
    """continuous: cache blocks (transformers sizes them from GPU memory, none here)."""
    cb_max_batch_tokens: int = 2048
    """continuous: most tokens in one step (radixserve's chunked prefill size)."""
    cb_scheduler: str = "fifo"
    """continuous: fifo | prefill_first."""


@dataclass
class HFServer:
    hf: HFModel
    batcher: StaticBatcher | ContinuousBatcher
    config: HFServerConfig


SERVER = web.AppKey("server", HFServer)


# ---- request parsing ---------------------------------------------------------------------


def parse_generate(body: Any, hf: HFModel) -> tuple[HFRequest, bool]:
    """SGLang's /generate body -> (request, stream); a BadRequest names the field at fault."""
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object", param="body")
    for key, value in body.items():
        if key not in GENERATE_FIELDS and value not in (None, False, [], {}, ""):
            raise BadRequest(f"{key} is not supported by the HF baseline", param=key)
    stream = body.get("stream") or False
    if not isinstance(stream, bool):
        raise BadRequest(f"stream must be a boolean; got {stream!r}", param="stream")
    prompt = prompt_ids(body, hf)
    max_new_tokens, ignore_eos = parse_sampling(body.get("sampling_params") or {})
    if len(prompt) + max_new_tokens > hf.context_length:
        raise BadRequest(
            f"max_new_tokens: prompt ({len(prompt)}) plus max_new_tokens ({max_new_tokens}) "
            f"exceed the context length {hf.context_length}",
            param="sampling_params.max_new_tokens",
        )
    loop = asyncio.get_running_loop()
    return HFRequest(prompt, max_new_tokens, ignore_eos, loop), stream


def prompt_ids(body: dict[str, Any], hf: HFModel) -> list[int]:
    text, ids = body.get("text"), body.get("input_ids")
    if (text is None) == (ids is None):
        raise BadRequest("send exactly one of input_ids and text", param="input_ids")
    if text is not None:
        if not isinstance(text, str) or not text:
            raise BadRequest("text must be one non-empty string", param="text")
        return hf.tokenizer.encode(text)
    ok = isinstance(ids, list) and ids and all(_is_token(t, hf.vocab_size) for t in ids)
    if not ok:
        raise BadRequest(
            f"input_ids must be one non-empty list of token ids in [0, {hf.vocab_size})",
            param="input_ids",
        )
    return ids


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_token(value: Any, vocab_size: int) -> bool:
    return _is_int(value) and 0 <= value < vocab_size


def parse_sampling(params: Any) -> tuple[int, bool]:
    """(max_new_tokens, ignore_eos); anything but greedy decoding is refused."""
    if not isinstance(params, dict):
        raise BadRequest("sampling_params must be a JSON object", param="sampling_params")
    for key, value in params.items():
        if key not in SAMPLING_FIELDS and value is not None:
            name = f"sampling_params.{key}"
            raise BadRequest(f"{name} is not supported by the HF baseline", param=name)
    if params.get("temperature") != 0:
        raise BadRequest(
            "sampling_params.temperature must be 0: the HF baseline decodes greedily only "
            f"(got {params.get('temperature')!r}; SGLang's default is 1.0)",
            param="sampling_params.temperature",
        )
    max_new_tokens = params.get("max_new_tokens", 128)
    if not _is_int(max_new_tokens) or max_new_tokens < 1:
        name = "sampling_params.max_new_tokens"
        raise BadRequest(f"{name} must be an integer >= 1; got {max_new_tokens!r}", param=name)
    ignore_eos = params.get("ignore_eos") or False
    if not isinstance(ignore_eos, bool):
        name = "sampling_params.ignore_eos"
        raise BadRequest(f"{name} must be a boolean; got {ignore_eos!r}", param=name)
    return max_new_tokens, ignore_eos


# ---- answers -----------------------------------------------------------------------------


class Answer:
    """The client's side of one request: the Steps heard so far, as SGLang's output dict."""

    def __init__(self, req: HFRequest, tokenizer):
        self.req, self.tokenizer = req, tokenizer
        self.output_ids: list[int] = []
        self.finish_reason: dict[str, Any] | None = None
        self.detokenizer = IncrementalDetokenizer(tokenizer)
        self.arrival = time.perf_counter()

    async def next(self, *, coalesce: bool = True) -> None:
        """Waits for the next step, then (coalesce) takes every step already queued behind it."""
        self._take(await self.req.steps.get())
        while coalesce and self.finish_reason is None and not self.req.steps.empty():
            self._take(self.req.steps.get_nowait())

    def _take(self, step: Step) -> None:
        if step.token is not None:
            self.output_ids.append(step.token)
        self.finish_reason = step.finish_reason

    @property
    def aborted(self) -> bool:
        return (self.finish_reason or {}).get("type") == "abort"

    def as_dict(self) -> dict[str, Any]:
        if self.finish_reason is None:
            text = self.detokenizer.update(self.output_ids)
        else:
            text = self.tokenizer.decode(self.output_ids, skip_special_tokens=True)
        meta = {
            "prompt_tokens": len(self.req.input_ids),
            "completion_tokens": len(self.output_ids),
            "cached_tokens": self.req.cached_tokens,
            "finish_reason": self.finish_reason,
            "e2e_latency": time.perf_counter() - self.arrival,
        }
        return {"text": text, "output_ids": list(self.output_ids), "meta_info": meta}


async def generate(request: web.Request) -> web.StreamResponse:
    server = request.app[SERVER]
    req, stream = parse_generate(await read_json(request), server.hf)
    server.batcher.submit(req)
    answer = Answer(req, server.hf.tokenizer)
    try:
        if stream:
            return await _stream(request, answer)
        while answer.finish_reason is None:
            await answer.next()
        if answer.aborted:
            return error_response(503, answer.finish_reason["message"])
        return web.json_response(answer.as_dict())
    finally:
        req.cancelled = True  # a client gone before its batch started costs nothing


async def _stream(request: web.Request, answer: Answer) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
    await response.prepare(request)
    while answer.finish_reason is None:
        await answer.next(coalesce=False)  # one event per token, however late the loop runs
        event = {"error": answer.finish_reason} if answer.aborted else answer.as_dict()
        await response.write(f"data: {json.dumps(event)}\n\n".encode())
    await response.write(b"data: [DONE]\n\n")
    return response


# ---- info, health, app -------------------------------------------------------------------


async def server_info(request: web.Request) -> web.Response:
    server = request.app[SERVER]
    batcher = server.batcher
    return web.json_response({
        "system": "hf-transformers",
        **asdict(server.config),
        "model": server.hf.name,
        "transformers_version": version("transformers"),
        "batches": {"num_batches": batcher.num_batches, "num_requests": batcher.num_requests},
    })  # fmt: skip


async def health(request: web.Request) -> web.Response:
    if not request.app[SERVER].batcher.alive:
        return web.Response(status=503, text="batch worker stopped\n")
    return web.Response(text="")


async def flush_cache(request: web.Request) -> web.Response:
    return web.Response(text="Cache flushed (the HF baseline keeps none across requests).\n")


@web.middleware
async def error_middleware(request: web.Request, handler):
    try:
        return await handler(request)
    except BadRequest as exc:
        return error_response(exc.status, str(exc), exc.param)


def build_app(server: HFServer) -> web.Application:
    app = web.Application(middlewares=[error_middleware], client_max_size=64 << 20)
    app[SERVER] = server
    app.router.add_post("/generate", generate)
    app.router.add_get("/server_info", server_info)
    app.router.add_get("/health", health)
    app.router.add_route("*", "/flush_cache", flush_cache)
    return app


async def serve(server: HFServer) -> int:
    """Serves until SIGTERM or SIGINT; the running batch then stops at its next step (its
    requests hear an abort)."""
    server.batcher.start()
    host, port = server.config.host, server.config.port
    await serve_app(build_app(server), host, port, "hf-transformers baseline",
                    lambda: asyncio.to_thread(server.batcher.stop))  # fmt: skip
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m radixserve_bench.hf_server", description=__doc__.split("\n\n")[0]
    )
    add_dataclass_args(parser, HFServerConfig, "server")
    args = parser.parse_args(argv)
    config = HFServerConfig(**{name: getattr(args, name) for name in field_names(HFServerConfig)})
    if config.max_batch_size < 1 or config.batch_wait_ms < 0:
        parser.error("--max-batch-size must be >= 1 and --batch-wait-ms >= 0")
    if config.batching not in ("static", "continuous"):
        parser.error(f"--batching must be static or continuous; got {config.batching!r}")
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from transformers.utils.logging import disable_progress_bar

    disable_progress_bar()  # the weight-loading bar would flood a benchmark's server log
    hf = load_hf_model(config.model, config.dtype, config.device)
    return asyncio.run(serve(HFServer(hf, make_batcher(hf, config), config)))


def make_batcher(hf: HFModel, config: HFServerConfig) -> StaticBatcher | ContinuousBatcher:
    """The batcher `--batching` names."""
    if config.batching == "static":
        return StaticBatcher(hf, config.max_batch_size, config.batch_wait_ms / 1000)
    cb = ContinuousConfig(config.cb_page_size, config.cb_num_blocks, config.cb_max_batch_tokens,
                          config.max_batch_size, config.cb_scheduler)  # fmt: skip
    return ContinuousBatcher(hf, cb)


if __name__ == "__main__":
    sys.exit(main())
