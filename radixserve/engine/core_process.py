"""The engine core process: receives requests over a pipe, steps the scheduler, sends deltas.

It never parses HTTP or touches JSON, so the server's event loop and the model's forward
passes do not contend for one GIL. Its loop is engine/core_loop.py's, over a pipe.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import sys
import time
from multiprocessing.connection import Connection, wait
from typing import Any

from radixserve.config import split_engine_kwargs
from radixserve.engine.core import EngineCore
from radixserve.engine.core_loop import CoreLoop
from radixserve.engine.protocol import FromCore, Ready, StartFailed, ToCore
from radixserve.engine.wire import decode_to_core, encode

logger = logging.getLogger(__name__)
IMPORTED_BY_PID = os.getpid()
"""The process that imported the engine: the core itself when spawned, the server process
(whose modules a forked core reuses) when forked."""
HEAVY_MODULES = (
    "torch",
    "torch._dynamo",
    "transformers",
    "transformers.activations",
    "radixserve.engine.core",
)
"""Imports that cost a start seconds of CPU; `core_start` lists those the core made itself."""


def run_forked_core(
    server_end: Connection, conn: Connection, engine_kwargs: dict[str, Any], log_level: str
) -> None:
    """Entry point of a forked core: closes its copy of the server's end of the pipe (or the
    core would never see that end close), then runs as run_core."""
    server_end.close()
    run_core(conn, engine_kwargs, log_level, start_method="fork")


def run_core(
    conn: Connection,
    engine_kwargs: dict[str, Any],
    log_level: str = "warning",
    start_method: str = "spawn",
) -> None:
    """Process entry point: build the core, announce it, serve until the pipe closes."""
    logging.basicConfig(
        level=log_level.upper(), format="%(levelname)s core: %(message)s", force=True
    )
    for sig in (signal.SIGINT, signal.SIGTERM):  # the server process decides when to stop
        signal.signal(sig, signal.SIG_IGN)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    inherited = set(sys.modules) if IMPORTED_BY_PID != os.getpid() else set()
    try:
        core = EngineCore.build(*split_engine_kwargs(None, dict(engine_kwargs)))
    except Exception as exc:  # the caller says why; the traceback stays in this log
        with contextlib.suppress(OSError):
            conn.send_bytes(encode(StartFailed(error=f"{type(exc).__name__}: {exc}")))
        raise
    start = {"start_method": start_method, **start_imports(inherited)}
    start["cpu_s_to_ready"] = time.process_time()  # this process's: a fork's starts at 0
    conn.send_bytes(encode(Ready(info=core_info(core) | {"core_start": start})))
    try:
        CoreLoop(core, PipeTransport(conn)).run()
    finally:
        core.close()


def start_imports(inherited: set[str]) -> dict[str, Any]:
    """What this process imported itself (all of it when spawned; what the server process had
    not, when forked): counts, and which of HEAVY_MODULES."""
    own = set(sys.modules) - inherited
    return {
        "engine_imported_in": "core" if IMPORTED_BY_PID == os.getpid() else "parent",
        "num_modules_imported": len(own),
        "heavy_modules_imported": sorted(own.intersection(HEAVY_MODULES)),
    }


def core_info(core: EngineCore) -> dict[str, Any]:
    pool = core.runner.pool
    return {
        "model_name": core.loaded.name,
        "tokenizer_path": core.tokenizer.name_or_path,  # the default model's, when borrowed
        "architecture": core.loaded.config.architecture,
        "vocab_size": core.loaded.config.vocab_size,
        "hidden_size": core.loaded.config.hidden_size,
        "num_labels": core.loaded.config.num_labels,  # a sequence classifier's; else None
        "labels": class_labels(core.loaded.config.hf_config),
        "context_length": core.context_length,
        "capacity_tokens": pool.capacity_tokens,
        "page_size": pool.page_size,
        "device": str(core.runner.device),
        "dtype": str(pool.dtype).removeprefix("torch."),
        "pid": os.getpid(),
        "lora_adapters": {} if core.runner.lora is None else dict(core.runner.lora.ids),
    }


def class_labels(hf_config: dict[str, Any]) -> list[str] | None:
    """A classifier's label names by index (transformers' id2label), None without them."""
    id2label = hf_config.get("id2label") or {}
    try:
        return [str(id2label[key]) for key in sorted(id2label, key=int)] or None
    except (TypeError, ValueError):
        return None


class PipeTransport:
    """The core's end of the pipe: msgpack-encoded messages both ways. `wake` writes a byte
    to a socket pair that `receive` waits on beside the pipe."""

    def __init__(self, conn: Connection):
        self.conn = conn
        self._closed = False  # the server's end is gone (a send found the pipe broken)
        self._wake_reader, self._wake_writer = socket.socketpair()
        self._wake_reader.setblocking(False)
        self._wake_writer.setblocking(False)

    def receive(self, timeout: float | None) -> list[ToCore] | None:
        if self._closed:
            return None
        try:
            wait([self.conn, self._wake_reader], timeout)
            self._drain_wakes()
            messages = []
            while self.conn.poll(0):
                messages.append(decode_to_core(self.conn.recv_bytes()))
            return messages
        except (EOFError, OSError):
            return None

    def wake(self) -> None:
        try:
            self._wake_writer.send(b"w")
        except BlockingIOError:  # wakes already pending: one is enough
            pass

    def _drain_wakes(self) -> None:
        try:
            while self._wake_reader.recv(4096):
                pass
        except BlockingIOError:
            pass

    def send(self, message: FromCore) -> None:
        """Sends one message; once the server process is gone, the loop ends at its next
        receive (quietly: an orphaned core has no one to report to)."""
        if self._closed:
            return
        try:
            self.conn.send_bytes(encode(message))
        except (BrokenPipeError, ConnectionResetError, EOFError):
            logger.info("the server process is gone; the core stops")
            self._closed = True
