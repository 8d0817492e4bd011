"""The Responses API's option fields, checked: `conversation`, `include`, `reasoning`,
`metadata` (also the Conversations API's) and optional strings."""

from __future__ import annotations

from typing import Any

from radixserve.server.errors import BadRequest

INCLUDE_REASONING = "reasoning.encrypted_content"
REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")
MAX_METADATA_PAIRS = 16
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512


def check_conversation(value: Any) -> str | None:
    """`conversation`: its id, as a string or {"id": str}."""
    if value is None:
        return None
    conversation_id = value.get("id") if isinstance(value, dict) and len(value) == 1 else value
    if not isinstance(conversation_id, str) or not conversation_id:
        raise BadRequest(f"conversation must be an id or {{'id': str}}; got {value!r}"[:160],
                         param="conversation")  # fmt: skip
    return conversation_id


def check_include(value: Any) -> bool:
    """`include`: [] or ["reasoning.encrypted_content"] (whether reasoning items carry it)."""
    if value is None or value == []:
        return False
    if not isinstance(value, list) or any(item != INCLUDE_REASONING for item in value):
        raise BadRequest(
            f"include may name only {INCLUDE_REASONING!r} on this server; got {value!r}"[:200],
            param="include",
        )
    return True


def check_reasoning(value: Any, template_kwargs: dict[str, Any]) -> str | None:
    """`reasoning` {"effort", "summary"}: the effort (None: not given), put into
    `template_kwargs` ("none": enable_thinking false; else reasoning_effort)."""
    if value is None:
        return None
    if not isinstance(value, dict) or set(value) - {"effort", "summary", "generate_summary"}:
        raise BadRequest(
            f"reasoning must be an object with effort and summary; got {value!r}"[:160],
            param="reasoning",
        )
    effort = value.get("effort")
    if effort is None:
        return None
    if effort not in REASONING_EFFORTS:
        raise BadRequest(
            f"reasoning.effort must be one of {', '.join(REASONING_EFFORTS)}; got {effort!r}",
            param="reasoning.effort",
        )
    if effort == "none":
        template_kwargs.setdefault("enable_thinking", False)
    else:
        template_kwargs.setdefault("reasoning_effort", effort)
    return effort


def optional_str(body: dict, name: str) -> str | None:
    value = body.get(name)
    if value is not None and not isinstance(value, str):
        raise BadRequest(f"{name} must be a string; got {value!r}"[:160], param=name)
    return value


def check_metadata(value: Any) -> dict[str, str]:
    """At most 16 pairs of strings, keys up to 64 characters, values up to 512 (OpenAI's)."""
    if value is None:
        return {}
    if (
        not isinstance(value, dict)
        or len(value) > MAX_METADATA_PAIRS
        or not all(isinstance(k, str) and len(k) <= MAX_METADATA_KEY_CHARS for k in value)
        or not all(
            isinstance(v, str) and len(v) <= MAX_METADATA_VALUE_CHARS for v in value.values()
        )
    ):
        raise BadRequest(
            f"metadata must be an object of at most {MAX_METADATA_PAIRS} string pairs (keys up "
            f"to {MAX_METADATA_KEY_CHARS} characters, values up to {MAX_METADATA_VALUE_CHARS}); "
            f"got {value!r}"[:240],
            param="metadata",
        )
    return value
