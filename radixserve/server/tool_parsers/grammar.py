"""Forced-call grammars: a family's call format around each tool's JSON-schema arguments,
built from xgrammar's grammar pieces and handed on as one EBNF constraint."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from radixserve.sampling.grammar import LOOSE_STRING_CHAR, STRICT_STRING_CHAR

Tool = dict[str, Any]


def _xgr():
    import xgrammar  # imported on first use, as in sampling/grammar.py

    return xgrammar


def text(value: str) -> Any:
    """A grammar of exactly `value`."""
    return _xgr().Grammar.from_ebnf(f"root ::= {json.dumps(value, ensure_ascii=False)}")


def rule(ebnf_body: str) -> Any:
    """A grammar of one EBNF expression (xgrammar's syntax)."""
    return _xgr().Grammar.from_ebnf(f"root ::= {ebnf_body}")


def json_value(schema: dict[str, Any]) -> Any:
    """Compact JSON of `schema` (no free whitespace, as every JSON constraint here)."""
    return _xgr().Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)


def concat(*parts: Any) -> Any:
    return _xgr().Grammar.concat(*parts)


def union(parts: list[Any]) -> Any:
    return parts[0] if len(parts) == 1 else _xgr().Grammar.union(*parts)


def forced_ebnf(tools: list[Tool], name: str | None, call: Callable[[dict], Any]) -> str:
    """One call of any of `tools` (or just the one named), each written by `call(function)`,
    as EBNF; strings inside JSON exclude raw control characters (see sampling/grammar.py)."""
    functions = [t["function"] for t in tools if name in (None, t["function"]["name"])]
    grammar = union([call(function) for function in functions])
    return str(grammar).replace(LOOSE_STRING_CHAR, STRICT_STRING_CHAR)
