"""`radixserve serve`: start the engine core process, then the HTTP server (joining
--router-url once it listens); on SIGTERM leave the router and drain (server/drain.py)."""

from __future__ import annotations

import asyncio
import logging
import signal
import threading
from typing import Any

from radixserve.client.client import EngineDeadError
from radixserve.client.core_client import MultiprocessClient
from radixserve.client.request_builder import RequestBuilder
from radixserve.config import SchedulerConfig, ServerConfig, split_engine_kwargs
from radixserve.config.server import check_resolves
from radixserve.fleet.register import RouterMembership, WorkerRegistration
from radixserve.model.tokenizer import import_tokenizer_library, open_tokenizer, tokenizer_source
from radixserve.reasoning import reasoning_format
from radixserve.server.app import ServerState, build_app
from radixserve.server.completion_template import check_template_name, resolve_completion_template
from radixserve.server.drain import DRAIN_KEY
from radixserve.server.http_runner import serve_app
from radixserve.server.limits import runner_options
from radixserve.server.metrics import ServerMetrics
from radixserve.server.tool_parsers import resolve_tool_parser, tool_format

logger = logging.getLogger(__name__)
DEAD_CORE_EXIT_S = 1.0
"""After the engine core dies, the server answers 503 for this long, then exits non-zero so
that a supervisor restarts it (in-flight requests have been failed already)."""
DEAD_CORE_EXIT_CODE = 1


def serve(engine_args: dict[str, Any], config: ServerConfig) -> int:
    """Runs the server until SIGTERM or SIGINT; returns the process exit code."""
    logging.basicConfig(
        level=config.log_level.upper(), format="%(levelname)s %(name)s: %(message)s"
    )
    try:  # a bad name fails before the model loads
        check_server_names(config)
    except ValueError as exc:
        raise SystemExit(f"radixserve serve: {exc}") from None
    import_tokenizer_library()  # needed here anyway; a forked core inherits it
    client = MultiprocessClient(engine_args, config.log_level)
    try:
        client.launch()
    except ValueError as exc:  # a bad $RADIXSERVE_CORE_START_METHOD
        raise SystemExit(f"radixserve serve: {exc}") from None
    early = EarlyTokenizer(engine_args.get("model"))  # after the fork: this process's thread
    try:
        try:
            info = client.wait_ready()
        except EngineDeadError as exc:  # the core's traceback, if any, is in the log above
            raise SystemExit(f"radixserve serve: {exc}") from None
        tokenizer = early.result(info["tokenizer_path"], info["vocab_size"])
        info["core_start"]["tokenizer_opened_early"] = tokenizer is not None  # /server_info
        return asyncio.run(_serve(client, info, engine_args, config, tokenizer))
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # already stopping: finish closing
        client.close()


def check_server_names(config: ServerConfig) -> None:
    """What ServerConfig.verify cannot check by itself: --tool-call-parser and
    --reasoning-parser are formats we know, --host resolves. ValueError naming the flag."""
    if config.tool_call_parser is not None:
        tool_format(config.tool_call_parser)
    if config.reasoning_parser is not None:
        reasoning_format(config.reasoning_parser)
    check_template_name(config.completion_template)
    check_resolves(config.host, config.port, "--host")


class EarlyTokenizer:
    """The model's tokenizer, opened in a thread while the engine core loads the weights (the
    core opens its own, so otherwise this process opened it only after the core was ready:
    ~1.3 s of an 8B GGUF's start, docs/performance.md). Used only if it is the one the core
    reports (same path and vocabulary size); a model it cannot open is the core's to report."""

    def __init__(self, model: str | None):
        self._opened: tuple[int, Any] | None = None
        self._thread = threading.Thread(
            target=self._open, args=(model,), name="early-tokenizer", daemon=True
        )
        self._thread.start()

    def _open(self, model: str | None) -> None:
        try:
            path, vocab_size, name = tokenizer_source(model)
            self._opened = vocab_size, open_tokenizer(path, vocab_size, name)
        except Exception as exc:  # noqa: BLE001 - the core's load reports the real error
            logger.debug("tokenizer not opened early: %s", exc)

    def result(self, path: str | None, vocab_size: int) -> Any | None:
        """The early tokenizer if the core's is the same (`path`, `vocab_size`), else None."""
        self._thread.join()
        if self._opened is None:
            return None
        early_vocab, tokenizer = self._opened
        same = str(tokenizer.name_or_path) == str(path) and early_vocab == vocab_size
        return tokenizer if same else None


def make_state(client, info, engine_args, config: ServerConfig, tokenizer=None) -> ServerState:
    """The server's state around a ready core; `tokenizer`: the core's, if already open."""
    if tokenizer is None:
        tokenizer = open_tokenizer(info["tokenizer_path"], info["vocab_size"], info["model_name"])
    max_running = engine_args.get("max_running_requests", SchedulerConfig.max_running_requests)
    builder = RequestBuilder(
        tokenizer,
        info["vocab_size"],
        info["context_length"],
        info["capacity_tokens"],
        max_outputs=max_running + config.max_queued_requests,
        enable_priority=engine_args.get("enable_priority_scheduling", False),
        disaggregation_mode=split_engine_kwargs(None, engine_args)[4].mode,
        lora_adapters=info.get("lora_adapters"),
        is_embedding=engine_args.get("is_embedding", False),
    )
    model_path = engine_args.get("model") or info["model_name"]
    return ServerState(
        client=client,
        builder=builder,
        tokenizer=tokenizer,
        config=config,
        engine_args=engine_args,
        model_path=str(model_path),
        served_model_name=config.served_model_name or info["model_name"],
        max_running_requests=max_running,
        metrics=ServerMetrics(),
        tool_parser=_tool_parser(config, tokenizer),
        reasoning_format=(
            None if config.reasoning_parser is None else reasoning_format(config.reasoning_parser)
        ),
        completion_template=resolve_completion_template(config.completion_template, tokenizer),
    )


def _tool_parser(config: ServerConfig, tokenizer) -> str:
    """--tool-call-parser, or the format the chat template names (logged), or the default."""
    template = tokenizer.chat_template
    name = resolve_tool_parser(config.tool_call_parser, None if template is None else str(template))
    if config.tool_call_parser is None:
        logger.info("tool-call parser: %s (from the chat template or the default)", name)
    return name


async def _serve(
    client: MultiprocessClient, info, engine_args, config: ServerConfig, tokenizer=None
) -> int:
    loop = asyncio.get_running_loop()
    client.attach(loop)
    state = make_state(client, info, engine_args, config, tokenizer)
    stop = asyncio.Event()
    client.on_dead.append(lambda reason: _exit_soon(loop, stop, reason))
    app = build_app(state)
    membership = _membership(config, engine_args)
    leave = membership.leave if membership else None
    await serve_app(
        app,
        config.host,
        config.port,
        "radixserve",
        lambda: app[DRAIN_KEY].run(client, config.drain_timeout, leave),
        stop,
        limits=runner_options(config),
        on_start=membership.start if membership else None,
        listen_while_draining=True,
    )
    return DEAD_CORE_EXIT_CODE if client.dead else 0


def _membership(config: ServerConfig, engine_args: dict[str, Any]) -> RouterMembership | None:
    """This worker's place in --router-url's fleet, or None without one."""
    if config.router_url is None:
        return None
    disaggregation = split_engine_kwargs(None, engine_args)[4]
    registration = WorkerRegistration.from_config(
        config, disaggregation.mode, disaggregation.disaggregation_bootstrap_port
    )
    return RouterMembership(registration)


def _exit_soon(loop: asyncio.AbstractEventLoop, stop: asyncio.Event, reason: str) -> None:
    logger.error("%s; exiting in %.0f s", reason, DEAD_CORE_EXIT_S)
    loop.call_later(DEAD_CORE_EXIT_S, stop.set)
