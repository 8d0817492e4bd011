"""The primitives a program is written in, with SGLang's names and arguments."""

from __future__ import annotations

from typing import Any

from radixserve.client.engine import Engine
from radixserve.frontend_lang.backends import Backend
from radixserve.frontend_lang.choices import ChoicesSamplingMethod, token_length_normalized
from radixserve.frontend_lang.ir import (
    Expr,
    ExprList,
    Gen,
    RoleBegin,
    RoleEnd,
    Select,
    SeparateReasoning,
    to_expr,
)
from radixserve.frontend_lang.program import resolve_backend
from radixserve.frontend_lang.sampling import GenParams, resolve_dtype
from radixserve.frontend_lang.select import check_choices
from radixserve.reasoning import reasoning_parser_names


def gen(
    name: str | None = None,
    max_tokens: int | None = None,
    min_tokens: int | None = None,
    n: int | None = None,
    stop: str | list[str] | None = None,
    stop_token_ids: list[int] | None = None,
    stop_regex: str | list[str] | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    min_p: float | None = None,
    frequency_penalty: float | None = None,
    presence_penalty: float | None = None,
    ignore_eos: bool | None = None,
    return_logprob: bool | None = None,
    logprob_start_len: int | None = None,
    top_logprobs_num: int | None = None,
    return_text_in_logprobs: bool | None = None,
    dtype: type | str | None = None,
    choices: list[str] | None = None,
    choices_method: ChoicesSamplingMethod | None = None,
    regex: str | None = None,
    json_schema: str | dict | None = None,
    priority: int | None = None,
    session_id: str | None = None,
    retention: dict | None = None,
) -> Expr:
    """Generate into variable `name`; unset options inherit the run's. With `choices` this is
    `select`; `dtype`, `regex` and `json_schema` constrain the output. `session_id` with
    `retention={"ttl_s": s}` keeps the call's prompt + output cached while the agent pauses."""
    if choices is not None:
        return select(name, choices, temperature or 0.0, choices_method or token_length_normalized)
    options = dict(locals())
    for key in ("name", "dtype", "choices", "choices_method"):
        options.pop(key)
    return _typed_gen(name, GenParams(**options), dtype)


def _typed_gen(name: str | None, params: GenParams, dtype: type | str | None) -> Gen:
    from radixserve.frontend_lang.sampling import DTYPE_REGEX

    resolved = resolve_dtype(dtype)
    constraints = [k for k in ("regex", "json_schema") if getattr(params, k) is not None]
    if resolved is not None:
        constraints.append("dtype")
        params.regex = DTYPE_REGEX[resolved]
    if len(constraints) > 1:
        raise ValueError(f"gen takes at most one of regex, json_schema, dtype; got {constraints}")
    return Gen(name, params, resolved)


def gen_int(
    name: str | None = None,
    max_tokens: int | None = None,
    n: int | None = None,
    stop: str | list[str] | None = None,
    stop_token_ids: list[int] | None = None,
    stop_regex: str | list[str] | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    min_p: float | None = None,
    frequency_penalty: float | None = None,
    presence_penalty: float | None = None,
    ignore_eos: bool | None = None,
    return_logprob: bool | None = None,
    logprob_start_len: int | None = None,
    top_logprobs_num: int | None = None,
    return_text_in_logprobs: bool | None = None,
) -> Expr:
    """gen constrained to an integer (regex -?\\d+); the variable is an int."""
    return gen(**locals(), dtype=int)


def gen_string(
    name: str | None = None,
    max_tokens: int | None = None,
    n: int | None = None,
    stop: str | list[str] | None = None,
    stop_token_ids: list[int] | None = None,
    stop_regex: str | list[str] | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    min_p: float | None = None,
    frequency_penalty: float | None = None,
    presence_penalty: float | None = None,
    ignore_eos: bool | None = None,
    return_logprob: bool | None = None,
    logprob_start_len: int | None = None,
    top_logprobs_num: int | None = None,
    return_text_in_logprobs: bool | None = None,
) -> Expr:
    """gen constrained to a double-quoted string, as SGLang's (the quotes are kept)."""
    return gen(**locals(), dtype=str)


def select(
    name: str | None = None,
    choices: list[str] | None = None,
    temperature: float = 0.0,
    choices_method: ChoicesSamplingMethod = token_length_normalized,
) -> Expr:
    """Append whichever of `choices` the model scores best (see select.py)."""
    check_choices(choices)
    if temperature > 1e-5:
        raise ValueError(f"select supports only temperature=0 (greedy); got {temperature}")
    if not isinstance(choices_method, ChoicesSamplingMethod):
        raise TypeError(f"choices_method must be a ChoicesSamplingMethod; got {choices_method!r}")
    return Select(name, list(choices), temperature, choices_method)


# ---- roles -------------------------------------------------------------------------------


def _role_common(name: str, expr: Expr | str | None = None) -> ExprList:
    inner = [] if expr is None else [to_expr(expr)]
    return ExprList([RoleBegin(name), *inner, RoleEnd(name)])


def system(expr: Expr | str | None = None) -> ExprList:
    return _role_common("system", expr)


def user(expr: Expr | str | None = None) -> ExprList:
    return _role_common("user", expr)


def assistant(expr: Expr | str | None = None) -> ExprList:
    return _role_common("assistant", expr)


def system_begin() -> Expr:
    return RoleBegin("system")


def system_end() -> Expr:
    return RoleEnd("system")


def user_begin() -> Expr:
    return RoleBegin("user")


def user_end() -> Expr:
    return RoleEnd("user")


def assistant_begin() -> Expr:
    return RoleBegin("assistant")


def assistant_end() -> Expr:
    return RoleEnd("assistant")


# ---- backend helpers ---------------------------------------------------------------------


def flush_cache(backend: Backend | Engine | None = None) -> bool:
    return resolve_backend(backend).flush_cache()


def get_server_info(backend: Backend | Engine | None = None) -> dict[str, Any]:
    return resolve_backend(backend).get_server_info()


def separate_reasoning(expr: Any = None, model_type: str | None = None) -> Expr:
    """SGLang's `separate_reasoning(gen("x"), model_type="deepseek-r1")`: after `expr` runs,
    `s["x"]` is its content and `s["x_reasoning_content"]` its reasoning, split in
    `model_type`'s format (the `--reasoning-parser` names); the state's text keeps the
    content."""
    if model_type is None or model_type not in reasoning_parser_names():
        raise ValueError(
            f"separate_reasoning: model_type must be one of {', '.join(reasoning_parser_names())}"
            f"; got {model_type!r}"
        )
    inner = None if expr is None else to_expr(expr)
    return ExprList([*([inner] if inner is not None else []), SeparateReasoning(inner, model_type)])
