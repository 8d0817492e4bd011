"""The constant prefix a program writes before its first model call, found by running it
against a backend that stops at the first request. run_batch warms the prefix that all
inputs share, once, before fanning out (SGLang's `extract_prefix_by_tracing` + precache).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from radixserve.frontend_lang.backends import Backend, Output
from radixserve.frontend_lang.executor import Executor
from radixserve.frontend_lang.ir import Expr
from radixserve.frontend_lang.roles import ChatTemplate
from radixserve.frontend_lang.sampling import GenParams
from radixserve.frontend_lang.state import ProgramState
from radixserve.token_ids import common_prefix_len

MIN_PRECACHE_TOKENS = 16
"""Shared prefixes shorter than this are not worth a separate warm-up request."""
MIN_CACHE_PROGRAM_CHARS = 64
"""SglFunction.cache() prefills a constant prefix longer than this (SGLang's cache_program)."""


class StopTracing(Exception):
    """Raised at the first model call of a traced program."""


class UnknownArgument(Expr):
    """A program argument whose value tracing does not know (SGLang's SglArgument). Text
    concatenated with it becomes an expression list, whose constant head is appended before
    the executor stops at this expression, which it has no handler for; formatting or
    inspecting it (f-string, str, bool, len, ==) stops the trace at once."""

    def _stop(self, *args: Any, **kwargs: Any):
        raise StopTracing

    __str__ = __format__ = __bool__ = __len__ = __iter__ = __getitem__ = _stop
    __getattr__ = __eq__ = __ne__ = _stop
    __hash__ = object.__hash__


class TracingBackend(Backend):
    """Tokenizer and chat template of a real backend; any request stops the trace."""

    def __init__(self, real: Backend):
        super().__init__()
        self.real = real

    @property
    def chat_template(self) -> ChatTemplate:
        return self.real.chat_template

    @property
    def tokenizer(self):
        return self.real.tokenizer

    def encode(self, text: str) -> list[int]:
        return self.real.encode(text)

    def request(self, payload: dict[str, Any]) -> Output:
        raise StopTracing

    def request_stream(self, payload: dict[str, Any]) -> Iterator[Output]:
        raise StopTracing

    def flush_cache(self) -> bool:
        raise StopTracing

    def get_server_info(self) -> dict[str, Any]:
        raise StopTracing


def constant_prefix(func: Callable, backend: Backend, kwargs: dict, defaults: GenParams) -> str:
    """The text `func(s, **kwargs)` writes before it first needs the model."""
    executor = Executor(TracingBackend(backend), defaults)
    try:
        func(ProgramState(executor), **kwargs)
    except Exception:  # StopTracing, or the program reading a value it never got; the real
        pass  # run reports real errors
    return executor.text


def cache_program(
    func: Callable, backend: Backend, arg_names: list[str], bound: dict[str, Any]
) -> str:
    """Prefills the constant prefix of `func` (its unbound arguments unknown); returns it."""
    kwargs = {name: bound.get(name, UnknownArgument()) for name in arg_names}
    prefix = constant_prefix(func, backend, kwargs, GenParams())
    if len(prefix) > MIN_CACHE_PROGRAM_CHARS:
        backend.cache_prefix(text=prefix)
    return prefix


def precache_shared_prefix(
    func: Callable, backend: Backend, batch_kwargs: list[dict], defaults: GenParams
) -> list[int]:
    """Prefills the token prefix shared by every input's constant prefix; returns it."""
    if len(batch_kwargs) < 2:
        return []
    shared: list[int] | None = None
    for kwargs in batch_kwargs:
        ids = backend.encode(constant_prefix(func, backend, kwargs, defaults))
        shared = ids if shared is None else shared[: common_prefix_len(shared, ids)]
    if len(shared) < MIN_PRECACHE_TOKENS:
        return []
    backend.cache_prefix(input_ids=shared)
    return shared
