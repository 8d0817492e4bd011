"""Output constraints: `response_format`, vLLM's and SGLang's `regex` / `json_schema` /
`ebnf` extras, vLLM's `structured_outputs`, and a forced tool call, turned into
SamplingParams' grammar field.

A request carries one constraint at most; a second one is rejected, naming it.
"""

from __future__ import annotations

import json
from typing import Any, NamedTuple

from radixserve.sampling.grammar import check_grammar
from radixserve.server.errors import BadRequest
from radixserve.server.tool_calls import ToolChoice
from radixserve.server.tool_parsers import DEFAULT_TOOL_PARSER, tool_format

CONSTRAINT_FIELDS = ("regex", "json_schema", "ebnf")
"""vLLM's and SGLang's output constraints, copied into SamplingParams under the same name."""
JSON_SCHEMA_KEYS = {"name", "description", "schema", "strict"}


class Constraint(NamedTuple):
    """An output constraint: the request field it came from, SamplingParams' kind, its spec."""

    param: str
    kind: str
    spec: str | dict[str, Any]


def output_constraint(
    body: dict,
    tools: list[dict[str, Any]],
    tool_choice: ToolChoice,
    tool_parser: str = DEFAULT_TOOL_PARSER,
) -> Constraint | None:
    """The request's one output constraint, if any (a forced call in `tool_parser`'s format)."""
    given = [check_response_format(body.get("response_format"))]
    given.append(check_structured_outputs(body.get("structured_outputs")))
    given += [Constraint(k, k, body[k]) for k in CONSTRAINT_FIELDS if body.get(k) is not None]
    given.append(forced_call_constraint(tools, tool_choice, tool_parser))
    given = [constraint for constraint in given if constraint is not None]
    if len(given) > 1:
        first, second = given[0].param, given[1].param
        raise BadRequest(
            f"{second} cannot be combined with {first}: one constraint at most", param=second
        )
    return given[0] if given else None


def check_response_format(value: Any) -> Constraint | None:
    """`response_format`: text (none), json_object (any object), json_schema (its schema) or
    SGLang's structural_tag (its structures and triggers, or xgrammar's `format`)."""
    value = {k: v for k, v in value.items() if v is not None} if isinstance(value, dict) else value
    if value is None or value == {"type": "text"}:
        return None
    if value == {"type": "json_object"}:
        return Constraint("response_format", "json_schema", {"type": "object"})
    if isinstance(value, dict) and value.get("type") == "json_schema" and len(value) == 2:
        schema = _json_schema_format(value.get("json_schema"))
        if schema is not None:
            return Constraint("response_format", "json_schema", _checked_schema(schema))
    if isinstance(value, dict) and value.get("type") == "structural_tag":
        try:
            check_grammar("structural_tag", json.dumps(value))
        except ValueError as exc:
            raise BadRequest(f"response_format: {exc}"[:300], param="response_format") from exc
        return Constraint("response_format", "structural_tag", value)
    raise BadRequest(
        "response_format must be {'type': 'text'}, {'type': 'json_object'}, {'type': "
        "'json_schema', 'json_schema': {'name': str, 'schema': object, 'strict': bool}} or "
        "{'type': 'structural_tag', 'structures': [...], 'triggers': [...]}; "
        f"got {str(value)[:80]}",
        param="response_format",
    )


STRUCTURED_OUTPUTS = {"json", "regex", "choice", "grammar", "structural_tag", "json_object"}
"""vLLM's `structured_outputs` kinds (one per request; `whitespace_pattern` only as null)."""


def check_structured_outputs(value: Any) -> Constraint | None:
    """vLLM's `structured_outputs`: {"json" | "regex" | "choice" | "grammar" |
    "structural_tag" | "json_object": ...}, one kind given."""
    if value is None:
        return None
    given = {k: v for k, v in value.items() if v is not None} if isinstance(value, dict) else None
    if given == {"json_object": False}:
        return None
    if given is None or len(given) != 1 or not set(given) <= STRUCTURED_OUTPUTS:
        raise BadRequest(
            "structured_outputs must give one of json, regex, choice, grammar, structural_tag, "
            f"json_object; got {str(value)[:80]}",
            param="structured_outputs",
        )
    ((kind, spec),) = given.items()
    if kind == "json_object" and spec is True:
        kind, spec = "json", {"type": "object"}
    if kind == "choice":
        ok = isinstance(spec, list) and spec and all(isinstance(c, str) for c in spec)
        if not ok:
            raise BadRequest("structured_outputs.choice must be a non-empty list of strings",
                             param="structured_outputs")  # fmt: skip
        literals = (json.dumps(c, ensure_ascii=False) for c in spec)
        kind, spec = "grammar", "root ::= " + " | ".join(literals)
    ours = {"json": "json_schema", "regex": "regex", "grammar": "ebnf"}.get(kind, kind)
    if not isinstance(spec, (str, dict)) or (isinstance(spec, dict) and ours in ("regex", "ebnf")):
        raise BadRequest(f"structured_outputs.{kind} has the wrong type; got {str(spec)[:80]}",
                         param="structured_outputs")  # fmt: skip
    text = spec if isinstance(spec, str) else json.dumps(spec)
    try:
        check_grammar(ours, text)
    except ValueError as exc:
        raise BadRequest(f"structured_outputs: {exc}"[:300], param="structured_outputs") from exc
    return Constraint("structured_outputs", ours, spec)


def _json_schema_format(value: Any) -> dict[str, Any] | None:
    """`response_format.json_schema`'s schema, or None if the object is malformed."""
    if not isinstance(value, dict) or set(value) - JSON_SCHEMA_KEYS:
        return None
    name, schema, strict = value.get("name"), value.get("schema"), value.get("strict")
    if not isinstance(name, str) or not isinstance(schema, dict):
        return None
    return schema if strict is None or isinstance(strict, bool) else None


def _checked_schema(schema: dict[str, Any], param: str = "response_format") -> dict[str, Any]:
    try:
        check_grammar("json_schema", json.dumps(schema))
    except ValueError as exc:
        raise BadRequest(f"{param} has an unusable JSON schema: {exc}", param=param) from exc
    return schema


def forced_call_constraint(
    tools: list[dict[str, Any]], tool_choice: ToolChoice, tool_parser: str = DEFAULT_TOOL_PARSER
) -> Constraint | None:
    """tool_choice "required" or a named function: the output is one call, written in the
    format of `tool_parser` (qwen25: one bare JSON object)."""
    if not tool_choice.forced:
        return None
    try:
        kind, spec = tool_format(tool_parser).forced(tools, tool_choice.name)
    except (RuntimeError, ValueError) as exc:  # xgrammar rejects a tool's schema
        raise BadRequest(f"tools have an unusable JSON schema: {exc}", param="tools") from exc
    if kind == "json_schema":
        return Constraint("tool_choice", kind, _checked_schema(spec, param="tools"))
    try:
        check_grammar(kind, spec)
    except ValueError as exc:
        raise BadRequest(f"tools have an unusable JSON schema: {exc}", param="tools") from exc
    return Constraint("tool_choice", kind, spec)
