"""What OpenAI's Batch API keeps: uploaded and result files, and batches.

Files (`/v1/files`) are kept in memory within MAX_FILES, MAX_FILES_BYTES and FILE_TTL_S
(ttl_cache.py's `TtlStore`: the oldest of the owner holding the most go first). Batches are
kept while they run and, once ended, within MAX_BATCHES (the oldest ended first). Both
belong to their owner (responses_store.py's `owner_of`: the key presented and the
namespace), under (owner, id): another caller finds nothing (404).

A batch's input file is JSONL, one request a line, checked when the batch is created:

    {"custom_id": "...", "method": "POST", "url": "<the batch's endpoint>", "body": {...}}

custom_ids unique, at most MAX_BATCH_LINES lines.
"""

from __future__ import annotations

import json
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from radixserve.server.errors import BadRequest
from radixserve.server.responses_store import Owner
from radixserve.server.ttl_cache import TtlStore

FILE_TTL_S = 24 * 3600.0
MAX_FILES = 1000
MAX_FILES_BYTES = 256 << 20
MAX_BATCHES = 100
MAX_RUNNING_BATCHES = 4
MAX_BATCH_LINES = 50_000
ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/score",
             "/v1/rerank")  # fmt: skip


@dataclass
class StoredFile:
    """An uploaded or result file: its OpenAI file object and its bytes."""

    id: str
    filename: str
    purpose: str
    data: bytes
    created_at: int = field(default_factory=lambda: int(time.time()))

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id, "object": "file", "bytes": len(self.data),
            "created_at": self.created_at, "filename": self.filename, "purpose": self.purpose,
        }  # fmt: skip


@dataclass
class Line:
    custom_id: str
    body: dict[str, Any]


@dataclass
class Batch:
    """A batch and its progress, as OpenAI's batch object reports it."""

    id: str
    endpoint: str
    input_file_id: str
    completion_window: str
    metadata: dict[str, str] | None
    lines: list[Line]
    status: str = "in_progress"
    created_at: int = field(default_factory=lambda: int(time.time()))
    in_progress_at: int | None = None
    completed_at: int | None = None
    cancelled_at: int | None = None
    output_file_id: str | None = None
    error_file_id: str | None = None
    completed: int = 0
    failed: int = 0

    @property
    def ended(self) -> bool:
        return self.status in ("completed", "failed", "cancelled")

    def to_dict(self) -> dict[str, Any]:
        return {
            "id": self.id, "object": "batch", "endpoint": self.endpoint, "errors": None,
            "input_file_id": self.input_file_id, "completion_window": self.completion_window,
            "status": self.status, "output_file_id": self.output_file_id,
            "error_file_id": self.error_file_id, "created_at": self.created_at,
            "in_progress_at": self.in_progress_at, "expires_at": None,
            "completed_at": self.completed_at, "failed_at": None, "expired_at": None,
            "cancelling_at": None, "cancelled_at": self.cancelled_at,
            "request_counts": {"total": len(self.lines), "completed": self.completed,
                               "failed": self.failed},
            "metadata": self.metadata,
        }  # fmt: skip


class BatchStore:
    """Files and batches by owner (see the module doc)."""

    def __init__(self) -> None:
        self.files = TtlStore(FILE_TTL_S, MAX_FILES, MAX_FILES_BYTES, group_of=lambda k: k[0])
        self._batches: OrderedDict[tuple[Owner, str], Batch] = OrderedDict()

    def add_file(self, owner: Owner, filename: str, purpose: str, data: bytes) -> StoredFile:
        stored = StoredFile("file-" + uuid.uuid4().hex, filename, purpose, data)
        if not self.files.put((owner, stored.id), stored, len(data) + 256):
            message = f"file is larger than the file store ({MAX_FILES_BYTES >> 20} MiB)"
            raise BadRequest(message, param="file", status=413)
        return stored

    def file(self, owner: Owner, file_id: str) -> StoredFile:
        return _found(self.files.get((owner, file_id)), "file", file_id)

    def add_batch(self, owner: Owner, body: dict[str, Any]) -> Batch:
        """A new batch from POST /v1/batches' body, its input file checked."""
        endpoint = body.get("endpoint")
        if endpoint not in ENDPOINTS:
            raise BadRequest(f"endpoint must be one of {', '.join(ENDPOINTS)}", "endpoint")
        window = body.get("completion_window", "24h")
        if window != "24h":
            raise BadRequest('completion_window must be "24h"', param="completion_window")
        metadata = body.get("metadata")
        if metadata is not None and not _is_metadata(metadata):
            raise BadRequest("metadata must map at most 16 strings to strings", "metadata")
        input_file_id = body.get("input_file_id")
        if not isinstance(input_file_id, str):
            raise BadRequest("input_file_id must be a file id", param="input_file_id")
        lines = parse_lines(self.file(owner, input_file_id).data, endpoint)
        running = sum(1 for b in self._batches.values() if not b.ended)
        if running >= MAX_RUNNING_BATCHES:
            message = f"{MAX_RUNNING_BATCHES} batches are running: wait for one to end"
            raise BadRequest(message, param="input_file_id", status=429)
        batch = Batch("batch_" + uuid.uuid4().hex, endpoint, input_file_id, window, metadata,
                      lines, in_progress_at=int(time.time()))  # fmt: skip
        self._batches[(owner, batch.id)] = batch
        ended = [key for key, b in self._batches.items() if b.ended]
        for key in ended[: max(0, len(self._batches) - MAX_BATCHES)]:
            del self._batches[key]
        return batch

    def batch(self, owner: Owner, batch_id: str) -> Batch:
        return _found(self._batches.get((owner, batch_id)), "batch", batch_id)

    def batches(self, owner: Owner) -> list[Batch]:
        """The owner's batches, newest first."""
        return [b for (o, _), b in reversed(self._batches.items()) if o == owner]


def parse_lines(data: bytes, endpoint: str) -> list[Line]:
    """An input file's requests; a malformed one is a 400 naming its line."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:
        raise BadRequest("the input file is not UTF-8 text", param="input_file_id") from None
    lines, seen = [], set()
    for number, raw in enumerate(text.splitlines(), start=1):
        if not raw.strip():
            continue
        if len(lines) >= MAX_BATCH_LINES:
            raise BadRequest(f"the input file has more than {MAX_BATCH_LINES} requests",
                             param="input_file_id")  # fmt: skip
        try:
            request = json.loads(raw)
        except (ValueError, RecursionError):
            request = None
        ok = isinstance(request, dict) and request.get("method") == "POST"
        ok = ok and request.get("url") == endpoint and isinstance(request.get("body"), dict)
        custom_id = request.get("custom_id") if isinstance(request, dict) else None
        if not ok or not isinstance(custom_id, str) or custom_id in seen:
            message = (
                f"line {number} of the input file must be {{'custom_id': <a unique "
                f"string>, 'method': 'POST', 'url': '{endpoint}', 'body': {{...}}}}"
            )
            raise BadRequest(message, param="input_file_id")  # fmt: skip
        seen.add(custom_id)
        lines.append(Line(custom_id, request["body"]))
    if not lines:
        raise BadRequest("the input file holds no request", param="input_file_id")
    return lines


def _found(value: Any, kind: str, item_id: str) -> Any:
    """`value`, or a 404 naming the file or batch the caller has no such one of."""
    if value is None:
        raise BadRequest(f"no {kind} {item_id!r}", param=f"{kind}_id", status=404)
    return value


def _is_metadata(value: Any) -> bool:
    return (
        isinstance(value, dict)
        and len(value) <= 16
        and all(isinstance(k, str) and isinstance(v, str) for k, v in value.items())
    )
