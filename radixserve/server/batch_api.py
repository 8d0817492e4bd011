"""OpenAI's Batch API, as SGLang serves it: upload a JSONL file of requests, run it as a
batch, read back the results (what batch_store.py keeps, and its bounds).

    POST   /v1/files                 multipart: purpose=batch, file=<JSONL>   -> file object
    GET    /v1/files/{id}            the file object;  /v1/files/{id}/content: its bytes
    DELETE /v1/files/{id}
    POST   /v1/batches               {input_file_id, endpoint, completion_window, metadata?}
    GET    /v1/batches, /v1/batches/{id}             POST /v1/batches/{id}/cancel

A batch runs on the server's event loop, BATCH_CONCURRENCY requests at a time, each line's
body through the endpoint's own path (openai_api.complete_body, non-streamed; /v1/embeddings
lines on an --is-embedding server: embeddings_api.embeddings_body; /v1/score and /v1/rerank
lines: their routes' score_api.score_body and rerank_api.sglang_rerank_body). Lines that
answered 200 go to the output file, the others (their status and error body) to the error
file, as OpenAI's: {"id", "custom_id", "response": {"status_code", "request_id", "body"},
"error"}. Cancelling stops new lines; those running finish.
"""

from __future__ import annotations

import asyncio
import email.parser
import email.policy
import json
import logging
import time
import uuid
from typing import Any

from aiohttp import web

from radixserve.client.client import EngineBusyError
from radixserve.server.batch_store import Batch, BatchStore, Line
from radixserve.server.body_routes import BodyRunner
from radixserve.server.embeddings_api import embeddings_body
from radixserve.server.errors import BadRequest, error_body
from radixserve.server.openai_api import complete_body
from radixserve.server.rerank_api import sglang_rerank_body
from radixserve.server.responses_store import Owner, owner_of
from radixserve.server.score_api import score_body
from radixserve.server.state import ServerState, read_json, state_of
from radixserve.server.tenants import SALT_HEADER

logger = logging.getLogger(__name__)

BATCH_CONCURRENCY = 16
"""Requests of one batch in flight at once (the engine batches them)."""
BUSY_RETRY_S = 0.5
"""How long a line waits when the server's queue is full before it tries again."""
BATCHES_KEY = web.AppKey("batches", BatchStore)
TASKS_KEY = web.AppKey("batch_tasks", set)


def register_batch_routes(app: web.Application) -> None:
    app[BATCHES_KEY] = BatchStore()
    app[TASKS_KEY] = set()
    app.on_shutdown.append(_stop_batches)
    app.router.add_post("/v1/files", upload_file)
    app.router.add_get("/v1/files/{file_id}", retrieve_file)
    app.router.add_get("/v1/files/{file_id}/content", file_content)
    app.router.add_delete("/v1/files/{file_id}", delete_file)
    app.router.add_post("/v1/batches", create_batch)
    app.router.add_get("/v1/batches", list_batches)
    app.router.add_get("/v1/batches/{batch_id}", retrieve_batch)
    app.router.add_post("/v1/batches/{batch_id}/cancel", cancel_batch)


async def _stop_batches(app: web.Application) -> None:
    """The server stops: running batches end with it (their lines are aborted)."""
    tasks = list(app[TASKS_KEY])
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def _owner(request: web.Request) -> Owner:
    return owner_of(request, request.headers.get(SALT_HEADER))


# ---- files -------------------------------------------------------------------------------


async def upload_file(request: web.Request) -> web.Response:
    if request.content_type != "multipart/form-data":
        raise BadRequest("upload a file as multipart/form-data (purpose, file)", "Content-Type")
    fields = parse_form(request.headers["Content-Type"], await request.read())
    unknown = set(fields) - {"purpose", "file"}
    if unknown:
        raise BadRequest(f"{sorted(unknown)[0]} is not a field of /v1/files", "file")
    purpose = (fields.get("purpose") or (None, b""))[1].decode("utf-8", "replace")
    if purpose != "batch":
        raise BadRequest(f'purpose must be "batch"; got {purpose[:40]!r}', param="purpose")
    if "file" not in fields:
        raise BadRequest("file is missing", param="file")
    filename, data = fields["file"]
    stored = request.app[BATCHES_KEY].add_file(
        _owner(request), (filename or "upload.jsonl")[:256], purpose, data
    )
    return web.json_response(stored.to_dict())


def parse_form(content_type: str, body: bytes) -> dict[str, tuple[str | None, bytes]]:
    """A multipart/form-data body's fields: name -> (filename, bytes)."""
    head = f"Content-Type: {content_type}\r\n\r\n".encode("latin-1", "replace")
    message = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(head + body)
    if not message.is_multipart():
        raise BadRequest("the multipart body could not be read", param="file")
    fields = {}
    for part in message.iter_parts():
        name = part.get_param("name", header="content-disposition")
        if isinstance(name, str):
            fields[name] = (part.get_filename(), part.get_payload(decode=True) or b"")
    return fields


async def retrieve_file(request: web.Request) -> web.Response:
    store = request.app[BATCHES_KEY]
    return web.json_response(store.file(_owner(request), request.match_info["file_id"]).to_dict())


async def file_content(request: web.Request) -> web.Response:
    stored = request.app[BATCHES_KEY].file(_owner(request), request.match_info["file_id"])
    return web.Response(body=stored.data, content_type="application/jsonl")


async def delete_file(request: web.Request) -> web.Response:
    store, file_id, owner = request.app[BATCHES_KEY], request.match_info["file_id"], _owner(request)
    store.file(owner, file_id)  # 404 unless the caller's
    store.files.pop((owner, file_id))
    return web.json_response({"id": file_id, "object": "file", "deleted": True})


# ---- batches -----------------------------------------------------------------------------


async def create_batch(request: web.Request) -> web.Response:
    body = await read_json(request)
    if not isinstance(body, dict):
        raise BadRequest("request body must be a JSON object", param="body")
    unknown = set(body) - {"input_file_id", "endpoint", "completion_window", "metadata"}
    if unknown:
        name = sorted(unknown)[0]
        raise BadRequest(f"{name} is not a field of /v1/batches", param=name)
    owner, store = _owner(request), request.app[BATCHES_KEY]
    batch = store.add_batch(owner, body)
    task = asyncio.create_task(run_batch(state_of(request), store, owner, batch))
    request.app[TASKS_KEY].add(task)
    task.add_done_callback(request.app[TASKS_KEY].discard)
    return web.json_response(batch.to_dict())


async def list_batches(request: web.Request) -> web.Response:
    batches = request.app[BATCHES_KEY].batches(_owner(request))
    data = [b.to_dict() for b in batches]
    return web.json_response({"object": "list", "data": data, "has_more": False,
                              "first_id": data[0]["id"] if data else None,
                              "last_id": data[-1]["id"] if data else None})  # fmt: skip


async def retrieve_batch(request: web.Request) -> web.Response:
    store = request.app[BATCHES_KEY]
    return web.json_response(store.batch(_owner(request), request.match_info["batch_id"]).to_dict())


async def cancel_batch(request: web.Request) -> web.Response:
    batch = request.app[BATCHES_KEY].batch(_owner(request), request.match_info["batch_id"])
    if not batch.ended:
        batch.status = "cancelling"
    return web.json_response(batch.to_dict())


async def run_batch(state: ServerState, store: BatchStore, owner: Owner, batch: Batch) -> None:
    """Runs every line (BATCH_CONCURRENCY at once) unless cancelled, then writes the
    output and error files and ends the batch."""
    outputs: list[str | None] = [None] * len(batch.lines)
    errors: list[str | None] = [None] * len(batch.lines)
    queue = iter(enumerate(batch.lines))  # shared by the workers: each line taken once
    run_body = _body_runner(batch.endpoint)

    async def worker() -> None:
        while batch.status == "in_progress" and (item := next(queue, None)) is not None:
            index, line = item
            status, body = await _run_line(state, line, run_body, owner[1])
            record = _record(line, status, body)
            if status == 200:
                outputs[index], batch.completed = record, batch.completed + 1
            else:
                errors[index], batch.failed = record, batch.failed + 1

    try:
        await asyncio.gather(*(worker() for _ in range(BATCH_CONCURRENCY)))
    except Exception:  # a line's failure is its own; this is the runner's
        logger.exception("batch %s failed", batch.id)
    name = batch.id
    for attr, records, suffix in (("output_file_id", outputs, "output"),
                                  ("error_file_id", errors, "errors")):  # fmt: skip
        lines = [r for r in records if r is not None]
        if lines:
            data = ("\n".join(lines) + "\n").encode()
            stored = _try_store(store, owner, f"{name}_{suffix}.jsonl", data)
            setattr(batch, attr, None if stored is None else stored.id)
    now = int(time.time())
    if batch.status == "cancelling":
        batch.status, batch.cancelled_at = "cancelled", now
    else:
        batch.status, batch.completed_at = "completed", now


BODY_RUNNERS: dict[str, BodyRunner] = {
    "/v1/embeddings": embeddings_body,
    "/v1/score": score_body,
    "/v1/rerank": sglang_rerank_body,
}
"""The endpoints whose lines run as their route's body function; the others are completions."""


def _body_runner(endpoint: str) -> BodyRunner:
    """What answers a line's body at `endpoint` (state, body, namespace) -> response body."""
    if endpoint in BODY_RUNNERS:
        return BODY_RUNNERS[endpoint]
    chat = endpoint == "/v1/chat/completions"
    return lambda state, body, salt: complete_body(state, body, chat, salt)


async def _run_line(
    state: ServerState, line: Line, run_body, salt: str | None
) -> tuple[int, dict[str, Any]]:
    """A line's status and body, in the batch owner's namespace (`salt`) unless it names one."""
    if isinstance(line.body, dict) and line.body.get("cache_salt") is not None:
        salt = None  # the line's own namespace
    try:
        while True:
            try:
                return 200, await run_body(state, line.body, salt)
            except EngineBusyError:  # the server's queue is full: wait for room
                await asyncio.sleep(BUSY_RETRY_S)
    except BadRequest as exc:
        return exc.status, error_body(exc.status, str(exc), exc.param)
    except ValueError as exc:
        return 400, error_body(400, str(exc))
    except Exception as exc:  # the engine gone, or a bug: this line fails, the batch goes on
        logger.warning("batch line %s failed: %s", line.custom_id[:64], exc)
        return 500, error_body(500, "internal server error")


def _record(line: Line, status: int, body: dict[str, Any]) -> str:
    response = {"status_code": status, "request_id": "req_" + uuid.uuid4().hex, "body": body}
    return json.dumps({"id": "batch_req_" + uuid.uuid4().hex, "custom_id": line.custom_id,
                       "response": response, "error": None})  # fmt: skip


def _try_store(store: BatchStore, owner: Owner, filename: str, data: bytes):
    try:
        return store.add_file(owner, filename, "batch_output", data)
    except BadRequest:
        logger.warning("a batch's %s did not fit the file store", filename)
        return None
