"""ProgramState (the `s` a program writes to) and ProgramStateGroup (what `s.fork(n)` gives)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import contextmanager
from typing import Any

from radixserve.frontend_lang.executor import Executor
from radixserve.frontend_lang.ir import Expr, RoleBegin, RoleEnd, VarScopeBegin, VarScopeEnd
from radixserve.frontend_lang.ir import to_expr as _to_expr
from radixserve.frontend_lang.streaming import iter_text, iter_var, iter_var_chunks

JOIN_MODES = ("gather_variable", "concate_and_append")
GroupAppend = Expr | str | Callable[[int], Expr | str] | list[Expr | str] | tuple


def _reject_position_ids_offset(method: str, position_ids_offset: list[int] | None) -> None:
    """SGLang takes this argument and never uses it; saying so beats ignoring it silently."""
    if position_ids_offset is not None:
        raise NotImplementedError(
            f"{method}(position_ids_offset=...): forks continue at their parent's positions "
            f"(SGLang's interpreter ignores this argument too)"
        )


class ProgramState:
    """`s += expr` appends; `s["name"]` reads a variable, waiting until it is set;
    `s["name"] = value` sets one."""

    def __init__(self, executor: Executor):
        self.executor = executor
        self.ret_value: Any = None

    def __iadd__(self, other: Expr | str) -> ProgramState:
        self.executor.submit(_to_expr(other))
        return self

    # ---- reading -------------------------------------------------------------------------

    def __getitem__(self, name: str) -> Any:
        return self.get_var(name)

    def __setitem__(self, name: str, value: Any) -> None:
        self.set_var(name, value)

    def __contains__(self, name: str) -> bool:
        self.sync()
        return name in self.executor.variables

    def get_var(self, name: str) -> Any:
        self.sync()
        if name not in self.executor.variables:
            raise KeyError(f"variable {name!r} is not set; set: {sorted(self.executor.variables)}")
        return self.executor.variables[name]

    def set_var(self, name: str, value: Any) -> None:
        """Sets variable `name` after everything appended so far has run."""
        self.sync()
        self.executor.set_var(name, value)

    def get_meta_info(self, name: str) -> Any:
        """What the backend reported for variable `name` (logprobs, cached_tokens, ...)."""
        self.get_var(name)
        return self.executor.meta_info.get(name)

    def text(self) -> str:
        self.sync()
        return self.executor.text

    def messages(self) -> list[dict[str, str]]:
        self.sync()
        return list(self.executor.messages)

    def sync(self) -> None:
        self.executor.sync()

    def error(self) -> BaseException | None:
        worker = self.executor.worker
        return None if worker is None else worker.error

    # ---- roles and scopes ----------------------------------------------------------------

    def system(self, expr: Expr | str | None = None):
        return self._role_common("system", expr)

    def user(self, expr: Expr | str | None = None):
        return self._role_common("user", expr)

    def assistant(self, expr: Expr | str | None = None):
        return self._role_common("assistant", expr)

    def _role_common(self, name: str, expr: Expr | str | None = None):
        """`s.user("hi")` appends the whole turn (and returns it); `with s.user():` wraps a
        block."""
        if expr is not None:
            turn = RoleBegin(name) + _to_expr(expr) + RoleEnd(name)
            self.executor.submit(turn)
            return turn
        return self._scope(RoleBegin(name), RoleEnd(name))

    def var_scope(self, name: str):
        """`with s.var_scope("x"):` stores the text appended inside the block in `x`."""
        return self._scope(VarScopeBegin(name), VarScopeEnd(name))

    @contextmanager
    def _scope(self, begin: Expr, end: Expr):
        self.executor.submit(begin)
        yield
        self.executor.submit(end)

    # ---- fork ----------------------------------------------------------------------------

    def fork(
        self, size: int = 1, position_ids_offset: list[int] | None = None
    ) -> ProgramStateGroup:
        """`size` copies that continue from here concurrently; the prefix is cached once."""
        _reject_position_ids_offset("fork", position_ids_offset)
        if not isinstance(size, int) or size < 1:
            raise ValueError(f"fork size must be an int >= 1; got {size!r}")
        children = [ProgramState(e) for e in self.executor.fork(size)]
        return ProgramStateGroup(children, self)

    @contextmanager
    def copy(self, position_ids_offset: list[int] | None = None):
        """`with s.copy() as c:` a fork(1) joined on exit."""
        _reject_position_ids_offset("copy", position_ids_offset)
        group = self.fork(1)
        try:
            yield group[0]
        finally:
            group.join()

    # ---- streaming -----------------------------------------------------------------------

    def text_iter(self, var_name: str | None = None) -> Iterator[str]:
        """Text as it is generated, in pieces (stream=True); else the whole text once."""
        if not self.executor.stream:
            yield self.text() if var_name is None else str(self.get_var(var_name))
            return
        pieces = iter_text(self.executor) if var_name is None else iter_var(self.executor, var_name)
        yield from pieces
        self.sync()

    async def text_async_iter(
        self, var_name: str | None = None, return_meta_data: bool = False
    ) -> AsyncIterator[Any]:
        """text_iter for asyncio; with return_meta_data and a variable, (piece, meta_info)
        pairs, one per streamed chunk, each meta with only that chunk's logprobs (SGLang's)."""
        loop = asyncio.get_running_loop()
        if return_meta_data and var_name is not None:
            pieces = iter_var_chunks(self.executor, var_name)
        else:
            pieces = self.text_iter(var_name)
        done = object()
        while (piece := await loop.run_in_executor(None, next, pieces, done)) is not done:
            yield piece

    def __repr__(self) -> str:
        return f"ProgramState({self.text()!r})"


class ProgramStateGroup:
    """The states of a fork. `group += expr` appends to every child; `lambda i: expr`, or a
    list with one expression per child, appends a different one to each."""

    def __init__(self, states: list[ProgramState], src_state: ProgramState | None = None):
        self.states = states
        self.src_state = src_state

    def __iadd__(self, other: GroupAppend) -> ProgramStateGroup:
        if isinstance(other, (list, tuple)) and len(other) != len(self.states):
            raise ValueError(f"appending {len(other)} expressions to {len(self.states)} forks")
        for i, state in enumerate(self.states):
            if callable(other):
                state += other(i)
            else:
                state += other[i] if isinstance(other, (list, tuple)) else other
        return self

    def __getitem__(self, i: int) -> ProgramState:
        return self.states[i]

    def __setitem__(self, i: int, value: ProgramState) -> None:
        if value is not self.states[i]:  # `forks[i] += x` assigns the same state back
            raise TypeError("a fork's states cannot be replaced")

    def __len__(self) -> int:
        return len(self.states)

    def __iter__(self) -> Iterator[ProgramState]:
        return iter(self.states)

    def join(self, mode: str = "gather_variable") -> None:
        """gather_variable: variables new in the children come back to the parent as lists
        (one entry per child); concate_and_append: each child's new text is appended."""
        if mode not in JOIN_MODES:
            raise ValueError(f"join mode must be one of {JOIN_MODES}; got {mode!r}")
        if self.src_state is None:
            raise ValueError("join needs the state the group was forked from (src_state)")
        for state in self.states:
            state.sync()
        if mode == "gather_variable":
            self._gather_variables()
        else:
            for state in self.states:
                ex = state.executor
                self.src_state += ex.text[ex.fork_start_text_pos :]
        for state in self.states:
            state.executor.close()

    def _gather_variables(self) -> None:
        parent = self.src_state.executor
        parent.sync()
        children = [state.executor for state in self.states]
        names = set().union(*(child.set_since_fork for child in children))
        for name in sorted(names):  # a name reused from an earlier fork level is replaced
            parent.variables[name] = [child.variables.get(name) for child in children]
            parent.meta_info[name] = [child.meta_info.get(name) for child in children]
