"""GenParams: a gen's sampling, logprob and request options in the frontend's names
(max_tokens, ...), merged over the run's defaults and turned into the native `/generate`
payload."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

from radixserve.client.request_builder import GENERATE_ARG_NAMES

# Regexes for gen(dtype=...). SGLang's REGEX_INT/FLOAT allow trailing spaces and stop on
# them; these match exactly the value, so the text converts without stripping.
DTYPE_REGEX = {
    int: r"-?\d+",
    float: r"-?\d+(\.\d+)?",
    bool: r"(True|False)",
    str: r"\"[\w\d\s]*\"",
}
DTYPE_NAMES = {"int": int, "float": float, "bool": bool, "str": str}

# Frontend name -> wire (`sampling_params`) name.
WIRE_NAMES = {"max_tokens": "max_new_tokens", "min_tokens": "min_new_tokens"}
TOP_LEVEL_FIELDS = GENERATE_ARG_NAMES | {"return_text_in_logprobs"}
"""/generate's own fields (logprob and request options: priority, session_id, retention...);
a GenParams option named like one is sent as it, the others inside `sampling_params`."""


@dataclass
class GenParams:
    """Options of one gen; None means "inherit the run's default"."""

    max_tokens: int | None = None
    min_tokens: int | None = None
    n: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    stop_regex: str | list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    ignore_eos: bool | None = None
    regex: str | None = None
    json_schema: str | dict | None = None
    return_logprob: bool | None = None
    logprob_start_len: int | None = None
    top_logprobs_num: int | None = None
    return_text_in_logprobs: bool | None = None
    priority: int | None = None
    session_id: str | None = None
    retention: dict | None = None

    def merged_over(self, defaults: GenParams) -> GenParams:
        """These options, with unset ones taken from `defaults`."""
        own = {f.name: getattr(self, f.name) for f in fields(self)}
        return replace(defaults, **{k: v for k, v in own.items() if v is not None})

    def with_stop(self, extra: tuple[str, ...]) -> GenParams:
        """Adds stop strings (the chat template's end-of-turn marker)."""
        if not extra:
            return self
        stop = [] if self.stop is None else [self.stop] if isinstance(self.stop, str) else self.stop
        return replace(self, stop=[*stop, *[s for s in extra if s not in stop]])

    def sampling_params(self) -> dict[str, Any]:
        """The wire `sampling_params`: set options only, under their native names."""
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if value is not None and f.name not in TOP_LEVEL_FIELDS:
                out[WIRE_NAMES.get(f.name, f.name)] = value
        return out

    def payload_options(self) -> dict[str, Any]:
        """The payload's top-level fields that are set: logprob and request options."""
        own = (f.name for f in fields(self) if f.name in TOP_LEVEL_FIELDS)
        return {k: getattr(self, k) for k in own if getattr(self, k) is not None}


def resolve_dtype(dtype: type | str | None) -> type | None:
    """Accepts int/float/bool/str or their names, as SGLang does."""
    if dtype is None:
        return None
    resolved = DTYPE_NAMES.get(dtype, dtype) if isinstance(dtype, str) else dtype
    if resolved not in DTYPE_REGEX:
        raise ValueError(f"dtype must be one of int, float, bool, str; got {dtype!r}")
    return resolved


def convert_value(text: str, dtype: type | None, name: str | None) -> Any:
    """The variable's value: the text, or the number/bool it spells for a typed gen."""
    if dtype is None or dtype is str:
        return text
    try:
        if dtype is bool:
            return {"True": True, "False": False}[text.strip()]
        return dtype(text.strip())
    except (KeyError, ValueError):
        raise ValueError(
            f"gen {name!r} (dtype={dtype.__name__}) produced {text!r}, which is not a "
            f"{dtype.__name__}; raise max_tokens"
        ) from None
