"""SglFunction: what `@function` makes of `def program(s, ...)`; `.run` and `.run_batch`,
with SGLang's signatures: run-level sampling defaults are keyword arguments with SGLang's
defaults, and every other keyword argument of `run` goes to the program."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterator
from dataclasses import fields
from typing import Any

from radixserve.client.engine import Engine
from radixserve.frontend_lang.backends import Backend, as_backend
from radixserve.frontend_lang.global_config import global_config
from radixserve.frontend_lang.interpreter import run_program, run_program_batch
from radixserve.frontend_lang.sampling import GenParams
from radixserve.frontend_lang.state import ProgramState
from radixserve.frontend_lang.tracing import cache_program

RUN_NAMES = {"max_tokens": "max_new_tokens"}
"""run()'s and run_batch()'s keyword for a GenParams option, where SGLang's name differs."""


def set_default_backend(backend: Backend | Engine) -> None:
    """The backend programs use when run() is not given one (an Engine is wrapped)."""
    global_config.default_backend = as_backend(backend)


def get_default_backend() -> Backend | None:
    backend = global_config.default_backend
    return None if backend is None else as_backend(backend)


def resolve_backend(backend: Backend | Engine | None) -> Backend:
    if backend is not None:
        return as_backend(backend)
    if global_config.default_backend is None:
        raise ValueError("no backend: pass backend=... or call set_default_backend(...) first")
    return as_backend(global_config.default_backend)


def run_defaults(options: dict[str, Any]) -> GenParams:
    """GenParams from run()'s or run_batch()'s keywords (`options`: its locals); an option
    the call does not take (min_tokens; session_id in run_batch) stays unset."""
    names = (f.name for f in fields(GenParams))
    return GenParams(**{name: options.get(RUN_NAMES.get(name, name)) for name in names})


class SglFunction:
    """A frontend program; calling it runs it."""

    def __init__(
        self,
        func: Callable,
        num_api_spec_tokens: int | None = None,
        bind_arguments: dict[str, Any] | None = None,
    ):
        _check_num_api_spec_tokens(num_api_spec_tokens)
        params = list(inspect.signature(func).parameters.values())
        if not params:
            raise TypeError(f"{func.__name__} must take the program state `s` as its first arg")
        self.func = func
        self.num_api_spec_tokens = num_api_spec_tokens
        self.bind_arguments = dict(bind_arguments or {})
        self.arg_names = [p.name for p in params[1:]]
        self.arg_defaults = tuple(p.default for p in params[1:] if p.default is not p.empty)
        functools.update_wrapper(self, func)

    def bind(self, **kwargs: Any) -> SglFunction:
        """A copy with some arguments fixed."""
        unknown = sorted(set(kwargs) - set(self.arg_names))
        if unknown:
            raise TypeError(f"bind: {self.func.__name__} has no arguments {unknown}")
        return SglFunction(self.func, bind_arguments=self.bind_arguments | kwargs)

    def run(
        self,
        *args: Any,
        max_new_tokens: int = 128,
        n: int = 1,
        stop: str | list[str] | None = None,
        stop_token_ids: list[int] | None = None,
        stop_regex: str | list[str] | None = None,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = -1,
        min_p: float = 0.0,
        frequency_penalty: float = 0.0,
        presence_penalty: float = 0.0,
        ignore_eos: bool = False,
        return_logprob: bool | None = None,
        logprob_start_len: int | None = None,
        top_logprobs_num: int | None = None,
        return_text_in_logprobs: bool | None = None,
        stream: bool = False,
        backend: Backend | Engine | None = None,
        use_thread: bool = True,
        priority: int | None = None,
        session_id: str | None = None,
        retention: dict | None = None,
        **kwargs: Any,
    ) -> ProgramState:
        """Runs the program once with the run-level sampling defaults; other keyword arguments
        are the program's. `use_thread` is accepted for SGLang's signature: programs here run
        eagerly on the calling thread (stream=True: on a worker thread) either way."""
        defaults = run_defaults(locals())
        return run_program(self.func, resolve_backend(backend), args,
                           self.bind_arguments | kwargs, defaults, stream)  # fmt: skip

    def run_batch(
        self,
        batch_kwargs: list[dict[str, Any]] | list[list[Any]],
        *,
        max_new_tokens: int = 128,
        n: int = 1,
        stop: str | list[str] | None = None,
        stop_token_ids: list[int] | None = None,
        stop_regex: str | list[str] | None = None,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = -1,
        min_p: float = 0.0,
        frequency_penalty: float = 0.0,
        presence_penalty: float = 0.0,
        ignore_eos: bool = False,
        return_logprob: bool | None = None,
        logprob_start_len: int | None = None,
        top_logprobs_num: int | None = None,
        return_text_in_logprobs: bool | None = None,
        backend: Backend | Engine | None = None,
        num_threads: int | str = "auto",
        priority: int | None = None,
        progress_bar: bool = False,
        generator_style: bool = False,
    ) -> list[ProgramState] | Iterator[ProgramState]:
        """Runs the program once per item (a dict of arguments, or a list of positional
        ones), all at once; results in input order."""
        defaults = run_defaults(locals())
        batch = [self.bind_arguments | self._as_kwargs(item) for item in _as_list(batch_kwargs)]
        if not batch:
            return []
        return run_program_batch(self.func, resolve_backend(backend), batch, defaults,
                                 num_threads, progress_bar, generator_style)  # fmt: skip

    def trace(self, *, backend: Backend | Engine | None = None, **kwargs: Any):
        raise NotImplementedError(
            "trace: radixserve does not build SGLang's IR graph of a program; programs run "
            "eagerly, and run_batch / cache() find the constant prefix to precache themselves"
        )

    def cache(self, backend: Backend | Engine | None = None) -> None:
        """Prefills the program's constant prefix (its text before the first model call, or
        before it uses an argument) into the radix cache, if longer than SGLang's 64 chars."""
        cache_program(self.func, resolve_backend(backend), self.arg_names, self.bind_arguments)

    def __call__(self, *args: Any, **kwargs: Any) -> ProgramState:
        return self.run(*args, **kwargs)

    def _as_kwargs(self, item: dict[str, Any] | list[Any] | tuple) -> dict[str, Any]:
        if isinstance(item, dict):
            return item
        num_required = len(self.arg_names) - len(self.arg_defaults)
        if isinstance(item, (list, tuple)) and num_required <= len(item) <= len(self.arg_names):
            return dict(zip(self.arg_names, item))
        raise TypeError(
            f"run_batch item {item!r} does not match {self.func.__name__}'s arguments "
            f"{self.arg_names}: give a dict of them or a list of positional values"
        )


def _as_list(batch_kwargs: Any) -> list:
    if not isinstance(batch_kwargs, (list, tuple)):
        raise TypeError("run_batch takes a list of program arguments (dicts or lists) first")
    return list(batch_kwargs)


def _check_num_api_spec_tokens(num_api_spec_tokens: int | None) -> None:
    if num_api_spec_tokens is not None:
        raise NotImplementedError(
            "num_api_spec_tokens: API speculative execution (for OpenAI-style backends) is "
            "not supported; radixserve runs programs on its own engine"
        )


def function(func: Callable | None = None, num_api_spec_tokens: int | None = None):
    """`@function` (or `@function()`): makes `def program(s, ...)` a runnable program."""
    _check_num_api_spec_tokens(num_api_spec_tokens)
    if func is None:
        return lambda f: SglFunction(f, num_api_spec_tokens=num_api_spec_tokens)
    return SglFunction(func, num_api_spec_tokens=num_api_spec_tokens)
