"""Where programs run. A backend submits SGLang-native `/generate` payloads; the frontend's
operations (generate, commit a prefix, score token sequences) are built on that one call.

`EngineBackend` wraps an in-process `radixserve.Engine`; `RuntimeEndpoint` (runtime_endpoint.py)
talks to `radixserve serve` over HTTP. Both are safe to call from many threads at once.
"""

from __future__ import annotations

import threading
import weakref
from abc import ABC, abstractmethod
from collections.abc import Iterator
from typing import Any

from radixserve.client.engine import Engine
from radixserve.frontend_lang.roles import ChatTemplate

Output = dict[str, Any]  # {"text", "output_ids", "meta_info"}


class Backend(ABC):
    """The frontend's view of a model server."""

    def __init__(self, chat_template: ChatTemplate | None = None):
        self._chat_template = chat_template
        self._template_lock = threading.Lock()

    # ---- what a backend implements -------------------------------------------------------

    @abstractmethod
    def request(self, payload: dict[str, Any]) -> Output | list[Output]:
        """One native `/generate` call (text or input_ids, sampling_params, logprob fields)."""

    @abstractmethod
    def request_stream(self, payload: dict[str, Any]) -> Iterator[Output]:
        """The same call streamed: cumulative outputs, the last one final."""

    @property
    @abstractmethod
    def tokenizer(self):
        """The model's tokenizer (for chat templates and select's token boundaries)."""

    @abstractmethod
    def flush_cache(self) -> bool: ...

    @abstractmethod
    def get_server_info(self) -> dict[str, Any]: ...

    # ---- what the interpreter uses -------------------------------------------------------

    @property
    def chat_template(self) -> ChatTemplate:
        with self._template_lock:
            if self._chat_template is None:
                self._chat_template = ChatTemplate.from_tokenizer(self.tokenizer)
            return self._chat_template

    def encode(self, text: str) -> list[int]:
        """Token ids exactly as the server tokenizes a `text` prompt."""
        return self.tokenizer.encode(text)

    def generate(self, text: str, sampling_params: dict, logprob: dict) -> Output | list[Output]:
        return self.request({"text": text, "sampling_params": sampling_params, **logprob})

    def generate_stream(self, text: str, sampling_params: dict, logprob: dict) -> Iterator[Output]:
        return self.request_stream({"text": text, "sampling_params": sampling_params, **logprob})

    def cache_prefix(self, text: str | None = None, input_ids: list[int] | None = None) -> Output:
        """Prefills a prefix into the radix cache without generating (max_new_tokens 0)."""
        source = {"text": text} if input_ids is None else {"input_ids": input_ids}
        return self.request({**source, "sampling_params": {"max_new_tokens": 0}})

    def score(self, input_ids: list[list[int]], logprob_start_len: int) -> list[Output]:
        """Prompt logprobs of several sequences in one batched, prefill-only request."""
        return self.request({
            "input_ids": input_ids,
            "sampling_params": {"max_new_tokens": 0},
            "return_logprob": True,
            "logprob_start_len": logprob_start_len,
            "return_text_in_logprobs": True,
        })  # fmt: skip


class EngineBackend(Backend):
    """An in-process Engine. Each calling thread runs `Engine.generate`; its requests join the
    shared scheduler queue and every thread's loop steps the same scheduler under the
    engine's lock, so calls from many threads batch together."""

    def __init__(self, engine: Engine, chat_template: ChatTemplate | None = None):
        super().__init__(chat_template)
        self.engine = engine

    def request(self, payload: dict[str, Any]) -> Output | list[Output]:
        return self.engine.generate(**_engine_kwargs(payload), progress_bar=False)

    def request_stream(self, payload: dict[str, Any]) -> Iterator[Output]:
        return self.engine.generate(**_engine_kwargs(payload), stream=True)

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def flush_cache(self) -> bool:
        return self.engine.flush_cache()

    def get_server_info(self) -> dict[str, Any]:
        return {"model_path": self.engine.model_name, "stats": self.engine.get_stats()}


def _engine_kwargs(payload: dict[str, Any]) -> dict[str, Any]:
    kwargs = dict(payload)
    if "text" in kwargs:
        kwargs["prompt"] = kwargs.pop("text")
    return kwargs


_ENGINE_BACKENDS: weakref.WeakKeyDictionary[Engine, EngineBackend] = weakref.WeakKeyDictionary()
_ENGINE_BACKENDS_LOCK = threading.Lock()


def as_backend(backend: Backend | Engine) -> Backend:
    """Accepts a Backend or a bare Engine (wrapped once, so its chat template is derived once)."""
    if isinstance(backend, Backend):
        return backend
    if isinstance(backend, Engine):
        with _ENGINE_BACKENDS_LOCK:
            if backend not in _ENGINE_BACKENDS:
                _ENGINE_BACKENDS[backend] = EngineBackend(backend)
            return _ENGINE_BACKENDS[backend]
    raise TypeError(
        f"backend must be a radixserve Engine, EngineBackend or RuntimeEndpoint; "
        f"got {type(backend).__name__}"
    )
