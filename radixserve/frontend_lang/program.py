"""SglFunction: what `@function` makes of `def program(s, ...)`; `.run` and `.run_batch`."""

from __future__ import annotations

import functools
import inspect
from collections.abc import Callable, Iterator
from dataclasses import fields
from typing import Any

from radixserve.engine.engine import Engine
from radixserve.frontend_lang.backends import Backend, as_backend
from radixserve.frontend_lang.interpreter import run_program, run_program_batch
from radixserve.frontend_lang.sampling import GenParams
from radixserve.frontend_lang.state import ProgramState

# run()'s sampling defaults, in SGLang's names (max_new_tokens, not gen's max_tokens).
RUN_OPTIONS = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens"} | {
    f.name: f.name for f in fields(GenParams) if f.name not in ("max_tokens", "min_tokens")
}

_default_backend: Backend | None = None


def set_default_backend(backend: Backend | Engine) -> None:
    """The backend programs use when run() is not given one (an Engine is wrapped)."""
    global _default_backend
    _default_backend = as_backend(backend)


def get_default_backend() -> Backend | None:
    return _default_backend


def resolve_backend(backend: Backend | Engine | None) -> Backend:
    if backend is not None:
        return as_backend(backend)
    if _default_backend is None:
        raise ValueError("no backend: pass backend=... or call set_default_backend(...) first")
    return _default_backend


class SglFunction:
    """A frontend program; calling it runs it."""

    def __init__(self, func: Callable, bind_arguments: dict[str, Any] | None = None):
        params = list(inspect.signature(func).parameters)
        if not params:
            raise TypeError(f"{func.__name__} must take the program state `s` as its first arg")
        self.func = func
        self.arg_names = params[1:]
        self.bind_arguments = dict(bind_arguments or {})
        functools.update_wrapper(self, func)

    def bind(self, **kwargs: Any) -> SglFunction:
        """A copy with some arguments fixed."""
        return SglFunction(self.func, self.bind_arguments | kwargs)

    def run(self, *args: Any, stream: bool = False, backend: Backend | Engine | None = None,
            use_thread: bool = True, **kwargs: Any) -> ProgramState:  # fmt: skip
        """Runs the program once; keyword arguments are its own, plus run-level sampling
        defaults (max_new_tokens, temperature, stop, ...) unless the program takes that name."""
        defaults, program_kwargs = self._split(kwargs)
        return run_program(self.func, resolve_backend(backend), args,
                           self.bind_arguments | program_kwargs, defaults, stream)  # fmt: skip

    def run_batch(self, batch_kwargs: list[dict[str, Any]], *,
                  backend: Backend | Engine | None = None, num_threads: int | str = "auto",
                  progress_bar: bool = False, generator_style: bool = False,
                  **options: Any) -> list[ProgramState] | Iterator[ProgramState]:  # fmt: skip
        """Runs the program once per kwargs dict, all at once; results in input order."""
        if not isinstance(batch_kwargs, list) or not all(isinstance(k, dict) for k in batch_kwargs):
            raise TypeError("run_batch takes a list of dicts of program arguments (batch_kwargs)")
        defaults, extra = self._split(options)
        if extra:
            raise TypeError(f"run_batch got unexpected keyword arguments: {sorted(extra)}")
        batch = [self.bind_arguments | kwargs for kwargs in batch_kwargs]
        return run_program_batch(self.func, resolve_backend(backend), batch, defaults,
                                 num_threads, progress_bar, generator_style)  # fmt: skip

    def __call__(self, *args: Any, **kwargs: Any) -> ProgramState:
        return self.run(*args, **kwargs)

    def _split(self, kwargs: dict[str, Any]) -> tuple[GenParams, dict[str, Any]]:
        """(run-level sampling defaults, the program's own keyword arguments)."""
        options = {k: v for k, v in kwargs.items() if k in RUN_OPTIONS and k not in self.arg_names}
        program = {k: v for k, v in kwargs.items() if k not in options}
        return GenParams(**{RUN_OPTIONS[k]: v for k, v in options.items()}), program


def function(func: Callable | None = None, *, num_api_spec_tokens: int | None = None):
    """`@function` (or `@function()`): makes `def program(s, ...)` a runnable program."""
    if num_api_spec_tokens is not None:
        raise ValueError("num_api_spec_tokens (API speculative execution) is not supported")
    if func is None:
        return SglFunction
    return SglFunction(func)
