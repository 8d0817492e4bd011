"""Ollama's response bodies: /api/chat and /api/generate objects (one per NDJSON line when
streamed, the last with `done: true` and the timings in nanoseconds), and the model entries
of /api/tags and /api/show."""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from gguf import LlamaFileType

from radixserve.client.result import RequestResult
from radixserve.model.gguf_file import GGUFFile
from radixserve.model.source import ModelLoadError, resolve_model
from radixserve.server.openai_response import Delta, TokenLogprob, logprob_item
from radixserve.server.tool_calls import ToolCall

LLAMA_FILE_TYPES = {t.value: t.name.removeprefix("MOSTLY_") for t in LlamaFileType}
"""llama.cpp's `general.file_type` numbers -> the names Ollama shows (Q4_K_M, F16, ...)."""


def created_at(seconds: float | None = None) -> str:
    """Ollama's timestamps: RFC 3339 in UTC."""
    moment = datetime.fromtimestamp(time.time() if seconds is None else seconds, timezone.utc)
    return moment.isoformat().replace("+00:00", "Z")


def tool_call(call: ToolCall) -> dict[str, Any]:
    """A call as Ollama writes it: the arguments as an object, not a JSON string."""
    arguments = json.loads(call.arguments or "{}")
    return {
        "id": call.id,
        "function": {"index": call.index, "name": call.name, "arguments": arguments},
    }


def logprob_entries(logprobs: list[TokenLogprob]) -> list[dict[str, Any]]:
    """Ollama's `logprobs`: each token's text, logprob, UTF-8 bytes and top alternatives."""
    entries = []
    for entry in logprobs:
        item = logprob_item(entry.token, entry.logprob or 0.0)
        if entry.top:
            item["top_logprobs"] = [logprob_item(token, value) for token, value in entry.top]
        entries.append(item)
    return entries


@dataclass
class Timings:
    """When a request started, produced its first token and ended (perf_counter seconds)."""

    start: float = field(default_factory=time.perf_counter)
    first_token: float | None = None

    def seen(self, result: RequestResult) -> None:
        if self.first_token is None and result.output_ids:
            self.first_token = time.perf_counter()

    def fields(self, result: RequestResult) -> dict[str, int]:
        """The final object's counts and durations (nanoseconds)."""
        end = result.finish_time or time.perf_counter()
        first = self.first_token or end
        return {
            "total_duration": _ns(end - self.start),
            "load_duration": 0,  # the model is loaded before the server is ready
            "prompt_eval_count": result.prompt_len,
            "prompt_eval_duration": _ns(first - self.start),
            "eval_count": len(result.output_ids),
            "eval_duration": _ns(end - first),
        }


def _ns(seconds: float) -> int:
    return max(int(seconds * 1e9), 0)


@dataclass
class OllamaShape:
    """Builds one request's objects: `chat` (/api/chat: a `message`) or /api/generate (a
    `response`, and the `context` token ids at the end)."""

    model: str
    chat: bool
    with_logprobs: bool = False

    def head(self) -> dict[str, Any]:
        return {"model": self.model, "created_at": created_at()}

    def chunk(self, delta: Delta) -> dict[str, Any]:
        """A streamed object: what is new, done false."""
        return self.head() | self._content(delta) | {"done": False}

    def final(
        self, delta: Delta | None, result: RequestResult, timings: Timings, done_reason: str
    ) -> dict[str, Any]:
        """The last object (the whole answer when not streamed: `delta` holds it all)."""
        body = self.head() | self._content(delta or Delta("", [], None))
        body |= {"done": True, "done_reason": done_reason} | timings.fields(result)
        if not self.chat:
            body["context"] = list(result.spec.input_ids) + result.output_ids
        return body

    def loaded(self) -> dict[str, Any]:
        """The answer to a request with nothing to generate from: Ollama's model load."""
        content = (
            {"message": {"role": "assistant", "content": ""}} if self.chat else {"response": ""}
        )
        return self.head() | content | {"done": True, "done_reason": "load"}

    def _content(self, delta: Delta) -> dict[str, Any]:
        extra: dict[str, Any] = {}
        if delta.reasoning:
            extra["thinking"] = delta.reasoning
        if self.chat:
            message = {"role": "assistant", "content": delta.text} | extra
            if delta.tool_calls:
                message["tool_calls"] = [tool_call(call) for call in delta.tool_calls]
            body: dict[str, Any] = {"message": message}
        else:
            body = {"response": delta.text} | extra
        if self.with_logprobs and delta.logprobs:
            body["logprobs"] = logprob_entries(delta.logprobs)
        return body


# ---- models ------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelFacts:
    """What /api/tags and /api/show say of the served model."""

    path: str
    format: str  # "gguf", "safetensors" (an HF folder), "builtin" (a built-in config)
    architecture: str
    quantization: str
    parameter_size: str
    size: int
    modified: float

    @classmethod
    def read(cls, model: str | None, architecture: str, quantization: str) -> ModelFacts:
        """The facts of `model` (the serve argument: None for the default GGUF): its files'
        size on disk and when they last changed; a GGUF's file type and size label."""
        try:
            source = resolve_model(model)
        except (ModelLoadError, OSError):
            source = None
        path = source.path if source is not None else None
        kind = {"hf": "safetensors"}.get(source.kind, source.kind) if source else "builtin"
        size, modified, label = 0, 0.0, ""
        try:
            files = [path] if path is not None and path.is_file() else []
            if path is not None and path.is_dir():
                files = [p for p in path.rglob("*") if p.is_file()]
            size = sum(f.stat().st_size for f in files)
            modified = max((f.stat().st_mtime for f in files), default=0.0)
            if kind == "gguf" and path is not None:
                fields = GGUFFile(path).fields
                label = str(fields.get("general.size_label") or "")
                file_type = fields.get("general.file_type")
                if isinstance(file_type, int) and file_type in LLAMA_FILE_TYPES:
                    quantization = LLAMA_FILE_TYPES[file_type]
        except (OSError, ValueError):
            pass
        return cls(str(path or model), kind, architecture, quantization, label, size, modified)

    @property
    def family(self) -> str:
        return self.architecture.lower().removesuffix("forcausallm") or "unknown"

    def details(self) -> dict[str, Any]:
        return {
            "parent_model": "",
            "format": self.format,
            "family": self.family,
            "families": [self.family],
            "parameter_size": self.parameter_size,
            "quantization_level": self.quantization,
        }

    def entry(self, name: str) -> dict[str, Any]:
        """An /api/tags entry; the digest names the model's path, not its bytes."""
        digest = hashlib.sha256(f"{name}\0{self.path}".encode()).hexdigest()
        return {
            "name": name,
            "model": name,
            "modified_at": created_at(self.modified),
            "size": self.size,
            "digest": digest,
            "details": self.details(),
        }
