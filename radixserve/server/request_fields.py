"""The check every JSON API here makes of a request object's fields: unknown ones are a 400
naming the field (its path, quoted), values that change nothing are let through."""

from __future__ import annotations

from typing import Any

from radixserve.server.errors import BadRequest


def check_fields(
    body: dict,
    known: set[str],
    no_op_values: dict[str, tuple[Any, ...]] | None = None,
    where: str = "",
    of: str = "",
) -> None:
    """Rejects a field that is not `known`, unless it is null or one of the values that
    change nothing here (`no_op_values`, compared with their type: 1 is not true). The
    message starts with the field's name, quoted (an empty name still shows); in a nested
    object (`where`: its path, e.g. messages[0]) the name is the path, messages[0].foo,
    quoted too, and `of` says what the object is ("a text block")."""
    for key, value in body.items():
        if value is None or key in known:
            continue
        if any(is_same_value(value, ok) for ok in (no_op_values or {}).get(key, ())):
            continue
        name = f"{where}.{key}" if where else key
        known_here = key in (no_op_values or {})
        reason = "is not supported by this server" if known_here else "is not a known field"
        reason += f" of {of}" if of and not known_here else ""
        raise BadRequest(f"{name!r} {reason}; got {value!r}"[:160], param=name)


def is_same_value(value: Any, expected: Any) -> bool:
    """Equal and of the same type: 1 is not true, 0 is not false."""
    return type(value) is type(expected) and value == expected
