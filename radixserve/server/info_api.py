"""Info and health routes: SGLang's /model_info and /server_info, /health (and vLLM's /ping),
/health_generate, /get_load (sglang-router's load poll), vLLM's /version, /metrics, and the
admin /check_integrity."""

from __future__ import annotations

import asyncio
import time
from dataclasses import asdict

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST

import radixserve
from radixserve.client.client import EngineDeadError
from radixserve.client.request_builder import GenerateArgs
from radixserve.config import redact_secrets
from radixserve.server.errors import error_response
from radixserve.server.state import ServerState, state_of

HEALTH_TIMEOUT_S = 5.0
HEALTH_GENERATE_TIMEOUT_S = 20.0


def register_info_routes(app: web.Application) -> None:
    for path in ("/get_model_info", "/model_info"):
        app.router.add_get(path, model_info)
    for path in ("/server_info", "/get_server_info"):
        app.router.add_get(path, server_info)
    for path in ("/health", "/ping"):  # /ping: vLLM's (and SageMaker's) probe
        app.router.add_get(path, health)
    app.router.add_post("/ping", health)
    app.router.add_get("/version", version)
    app.router.add_get("/health_generate", health_generate)
    app.router.add_get("/get_load", get_load)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/check_integrity", check_integrity)


def model_paths(state: ServerState) -> dict[str, str]:
    """SGLang's `model_path` and `tokenizer_path`, which sglang-router reads from server info."""
    tokenizer_path = state.client.info.get("tokenizer_path") or state.model_path
    return {"model_path": state.model_path, "tokenizer_path": tokenizer_path}


async def model_info(request: web.Request) -> web.Response:
    state = state_of(request)
    info = state.client.info
    return web.json_response({
        **model_paths(state),
        "is_generation": not state.builder.is_embedding,
        "preferred_sampling_params": None,
        "weight_version": "default",
        "has_image_understanding": False,
        "has_audio_understanding": False,
        "model_type": info.get("architecture"),
        "architectures": [info.get("architecture")],
        "served_model_name": state.served_model_name,
    })  # fmt: skip


async def server_info(request: web.Request) -> web.Response:
    state = state_of(request)
    stats = await state.client.call("get_stats")
    return web.json_response({
        **redact_secrets(state.engine_args),
        **redact_secrets(asdict(state.config)),
        **model_paths(state),
        "served_model_name": state.served_model_name,
        "engine": redact_secrets(state.client.info),
        "num_active_requests": state.client.num_active,
        "stats": stats,
    })  # fmt: skip


async def health(request: web.Request) -> web.Response:
    """200 while the engine core answers (its body names what runs degraded, if anything);
    503 at once when it is gone."""
    state = state_of(request)
    if state.client.dead:
        reason = state.client.dead_reason
        return web.Response(status=503, text=f"engine core is not running: {reason}\n")
    try:
        stats = await state.client.call("get_stats", timeout_s=HEALTH_TIMEOUT_S)
    except (asyncio.TimeoutError, RuntimeError):
        return web.Response(status=503, text="engine core not responding\n")
    return web.Response(text=health_text(stats))


def health_text(stats: dict) -> str:
    """A healthy /health's body: empty, or what runs degraded while it keeps serving (the
    host tier backing off after a write error)."""
    backoff = stats.get("hicache_write_backoff_s", 0)
    if not backoff:
        return ""
    error = stats.get("hicache_last_write_error", "")
    return (
        f"degraded: hicache writes off for {backoff:.0f} s after {error}; serving from the pool\n"
    )


async def version(request: web.Request) -> web.Response:
    """vLLM's GET /version."""
    return web.json_response({"version": radixserve.__version__})


async def get_load(request: web.Request) -> web.Response:
    """SGLang's GET /get_load, which sglang-router polls for its load-aware policies
    (power_of_two): one entry per data-parallel rank (one here). `num_reqs` counts running
    and waiting requests; `num_tokens` the KV tokens the running ones hold plus the prompts
    waiting (`num_pending_tokens`)."""
    stats = await state_of(request).client.call("get_stats")
    page = stats["page_size"]
    held = stats["pool_capacity_pages"] - stats["pool_free_pages"] - stats["tree_evictable_pages"]
    waiting = stats["num_waiting_tokens"]
    return web.json_response([{
        "dp_rank": 0,
        "num_reqs": stats["num_running_reqs"] + stats["num_waiting_reqs"],
        "num_waiting_reqs": stats["num_waiting_reqs"],
        "num_tokens": held * page + waiting,
        "num_pending_tokens": waiting,
        "ts_tic": time.perf_counter(),
    }])  # fmt: skip


async def health_generate(request: web.Request) -> web.Response:
    """Generates one token, or embeds one on an --is-embedding server (counted against the
    queue limit, like any request)."""
    state = state_of(request)
    embed = state.builder.is_embedding
    args = GenerateArgs(input_ids=[0], sampling_params={"max_new_tokens": 0 if embed else 1})
    specs, _ = state.builder.build(args, embed=embed)
    try:
        await asyncio.wait_for(state.run(state.open(specs)), HEALTH_GENERATE_TIMEOUT_S)
    except asyncio.TimeoutError:
        return web.Response(status=503, text="generation timed out\n")
    return web.Response(text="")


async def check_integrity(request: web.Request) -> web.Response:
    """Admin check (soak tests): every KV page is free, owned by the radix tree, or held by a
    running request. 200 with the pool's counts, or 500 naming what broke."""
    state = state_of(request)
    try:
        await state.client.check_integrity()
    except EngineDeadError:
        raise
    except RuntimeError as exc:
        return error_response(500, f"integrity check failed: {exc}")
    stats = await state.client.stats()
    keys = ("pool_capacity_pages", "pool_free_pages", "tree_pages", "num_running_reqs",
            "num_waiting_reqs")  # fmt: skip
    return web.json_response({"ok": True, **{k: stats[k] for k in keys}})


async def metrics(request: web.Request) -> web.Response:
    state = state_of(request)
    body = state.metrics.render(await state.client.call("get_stats"))
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})
