"""Executor: a program state's text, variables and roles, and how each expression runs.

Execution is eager: `s += gen(...)` calls the backend and returns when the text is there,
so Python control flow on generated values just works. A top-level program runs in the
calling thread; fork children and streamed programs run on a SerialWorker (`submit` queues,
`sync` waits), so many of them have requests in flight at once.
"""

from __future__ import annotations

import threading
from typing import Any

from radixserve.frontend_lang.backends import Backend
from radixserve.frontend_lang.global_config import global_config
from radixserve.frontend_lang.ir import (
    Expr,
    ExprList,
    Gen,
    RoleBegin,
    RoleEnd,
    Select,
    SeparateReasoning,
    Text,
    VarScopeBegin,
    VarScopeEnd,
)
from radixserve.frontend_lang.sampling import GenParams, convert_value
from radixserve.frontend_lang.select import select_choice
from radixserve.frontend_lang.worker import SerialWorker
from radixserve.reasoning import split_reasoning


def _detokenize_options() -> dict[str, bool]:
    """Sent with every gen, as SGLang's frontend does."""
    return {
        "skip_special_tokens": global_config.skip_special_tokens_in_output,
        "spaces_between_special_tokens": global_config.spaces_between_special_tokens_in_out,
    }


class Executor:
    def __init__(self, backend: Backend, defaults: GenParams, stream: bool = False,
                 worker: bool = False):  # fmt: skip
        self.backend = backend
        self.defaults = defaults
        self.stream = stream
        self.text = ""
        self.variables: dict[str, Any] = {}
        self.meta_info: dict[str, Any] = {}
        self.messages: list[dict[str, str]] = []
        self.cur_role: str | None = None
        self.cur_role_begin_pos = 0
        self.fork_start_text_pos = 0
        self.var_scopes: dict[str, int] = {}
        self.stream_text: dict[str, str] = {}  # raw text of each gen while it streams
        self.stream_chunks: dict[str, list[tuple[str, dict]]] = {}  # (text so far, chunk meta)
        self.done_vars: set[str] = set()
        self.set_since_fork: set[str] = set()  # names this fork child assigned itself
        self.finished = False
        self.changed = threading.Condition()  # notified on every text or variable change
        self.worker = SerialWorker() if worker else None
        self._handlers = {
            Text: lambda e: self._fill(e.value),
            Gen: self._gen,
            Select: self._select,
            RoleBegin: lambda e: self._role_begin(e.role),
            RoleEnd: lambda e: self._role_end(e.role),
            VarScopeBegin: lambda e: self.var_scopes.__setitem__(e.name, len(self.text)),
            VarScopeEnd: self._var_scope_end,
            ExprList: lambda e: [self.execute(item) for item in e.items],
            SeparateReasoning: self._separate_reasoning,
        }

    # ---- scheduling ----------------------------------------------------------------------

    def submit(self, expr: Expr) -> None:
        """Runs `expr` now, or queues it on this state's worker thread."""
        if self.worker is None or self.worker.on_worker_thread():
            self.execute(expr)
        else:
            self.worker.submit(lambda: self.execute(expr))

    def run_task(self, fn) -> None:
        """Runs `fn` where this state's expressions run (the worker thread, if any)."""
        if self.worker is None:
            fn()
        else:
            self.worker.submit(fn)

    def sync(self) -> None:
        """Waits until everything submitted so far has run; re-raises a failure."""
        if self.worker is not None and not self.worker.on_worker_thread():
            self.worker.wait()

    def finish(self) -> None:
        with self.changed:
            self.finished = True
            self.changed.notify_all()

    def close(self) -> None:
        self.finish()
        if self.worker is not None:
            self.worker.close()

    def execute(self, expr: Expr) -> None:
        self._handlers[type(expr)](expr)

    # ---- expressions ---------------------------------------------------------------------

    def _fill(self, text: str) -> None:
        with self.changed:
            self.text += text
            self.changed.notify_all()

    def set_var(self, name: str, value: Any) -> None:
        """Sets a variable (a join gathers it like a generated one); its meta info stays."""
        with self.changed:
            self.variables[name] = value
            self.done_vars.add(name)
            self.set_since_fork.add(name)
            self.changed.notify_all()

    def _set_var(self, name: str | None, value: Any, meta: Any = None) -> None:
        if name is None:
            return
        with self.changed:
            self.meta_info[name] = meta
            self.set_var(name, value)

    def _gen(self, expr: Gen) -> None:
        params = expr.params.merged_over(self.defaults)
        params = params.with_stop(self.backend.chat_template.stop_str)
        sampling = params.sampling_params() | _detokenize_options()
        logprob = params.payload_options()  # logprob fields, priority, session, retention
        if (params.n or 1) > 1:
            self._gen_samples(expr, sampling, logprob)
            return
        base = self.text
        if self.stream:
            out = self._gen_streamed(expr.name, sampling, logprob)
        else:
            out = self.backend.generate(base, sampling, logprob)
        value = convert_value(out["text"], expr.dtype, expr.name)
        with self.changed:
            self.text = base + out["text"]
            self._set_var(expr.name, value, out["meta_info"])

    def _gen_samples(self, expr: Gen, sampling: dict, logprob: dict) -> None:
        """n > 1: the variable is the list of samples; the text is left unchanged, since no
        one sample continues it (fork the state to continue each)."""
        outs = self.backend.generate(self.text, sampling, logprob)
        values = [convert_value(o["text"], expr.dtype, expr.name) for o in outs]
        self._set_var(expr.name, values, [o["meta_info"] for o in outs])

    def _gen_streamed(self, name: str | None, sampling: dict, logprob: dict) -> dict:
        """Streams a gen; the variable's final meta holds every chunk's logprobs."""
        base, out, chunks = self.text, None, []
        for out in self.backend.generate_stream(base, sampling, logprob):
            with self.changed:
                self.text = base + out["text"]
                chunks.append((out["text"], out["meta_info"]))
                if name is not None:
                    self.stream_text[name] = out["text"]
                    self.stream_chunks[name] = chunks
                self.changed.notify_all()
        if out is None:
            raise RuntimeError("the backend's stream ended without an output")
        return {"text": out["text"], "meta_info": merge_stream_meta([m for _, m in chunks])}

    def _select(self, expr: Select) -> None:
        decision = select_choice(self.backend, self.text, expr.choices, expr.method)
        with self.changed:
            self._fill(decision.decision)
            self._set_var(expr.name, decision.decision, decision.meta_info)

    def _role_begin(self, role: str) -> None:
        if self.cur_role is not None:
            raise ValueError(f"nested roles are not allowed: {role!r} inside {self.cur_role!r}")
        template = self.backend.chat_template
        if not self.messages and role != "system" and template.default_system_prompt:
            self._role_begin("system")
            self._fill(template.default_system_prompt)
            self._role_end("system")
        self._fill(template.prefix(role, first=not self.text))
        self.cur_role, self.cur_role_begin_pos = role, len(self.text)

    def _role_end(self, role: str) -> None:
        if self.cur_role != role:
            raise ValueError(f"role {role!r} ends but the open role is {self.cur_role!r}")
        content = self.text[self.cur_role_begin_pos :].lstrip()
        self._fill(self.backend.chat_template.suffix(role))
        self.messages.append({"role": role, "content": content})
        self.cur_role = None

    def _separate_reasoning(self, expr: SeparateReasoning) -> None:
        """Each variable `expr` generated -> its content (also in the text, where the raw
        output ends it) and `<name>_reasoning_content`."""
        for name in _generated_names(expr.expr):
            raw = self.variables.get(name)
            if not isinstance(raw, str):
                continue
            split = split_reasoning(raw, expr.model_type)
            with self.changed:
                if raw and self.text.endswith(raw):
                    self.text = self.text[: len(self.text) - len(raw)] + split.content
                self.set_var(name, split.content)
                self.set_var(f"{name}_reasoning_content", split.reasoning)

    def _var_scope_end(self, expr: VarScopeEnd) -> None:
        if expr.name not in self.var_scopes:
            raise ValueError(f"var_scope {expr.name!r} ends but never began")
        self._set_var(expr.name, self.text[self.var_scopes.pop(expr.name) :])

    # ---- fork ----------------------------------------------------------------------------

    def fork(self, size: int) -> list[Executor]:
        """Commits the shared prefix to the cache once, then copies this state `size` times."""
        self.sync()
        if size > 1 and self.text:
            self.backend.cache_prefix(text=self.text)
        return [self._child() for _ in range(size)]

    def _child(self) -> Executor:
        child = Executor(self.backend, self.defaults, stream=False, worker=True)
        child.text, child.fork_start_text_pos = self.text, len(self.text)
        child.variables, child.meta_info = dict(self.variables), dict(self.meta_info)
        child.messages = list(self.messages)
        child.cur_role, child.cur_role_begin_pos = self.cur_role, self.cur_role_begin_pos
        return child


STREAMED_LIST_KEYS = (
    "input_token_logprobs",
    "output_token_logprobs",
    "input_top_logprobs",
    "output_top_logprobs",
)


def _generated_names(expr: Expr | None) -> list[str]:
    """The variables that gens and selects in `expr` store."""
    if isinstance(expr, (Gen, Select)):
        return [expr.name] if expr.name is not None else []
    if isinstance(expr, ExprList):
        return [name for item in expr.items for name in _generated_names(item)]
    return []


def merge_stream_meta(metas: list[dict]) -> dict:
    """The meta of a whole streamed gen: the last chunk's, with every chunk's logprobs (a
    stream sends each logprob once, in the chunk that produced it)."""
    merged = dict(metas[-1])
    for key in STREAMED_LIST_KEYS:
        if key in merged:
            merged[key] = [entry for meta in metas for entry in meta.get(key, [])]
    return merged
