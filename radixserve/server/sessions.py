"""SGLang's sessions: `/open_session`, `/close_session` and /generate's `session_params`.

A session remembers the token sequence (prompt + output) of each request sent in it, under
the request's rid (its meta_info.id). A request with `session_params` {id, rid, offset,
replace, drop_previous_output} gets for prompt that earlier request's sequence (its prompt
alone with drop_previous_output), cut to its first `offset` tokens, then its own tokens: an
agent sends each turn's new text only, and the radix cache serves the rest. Without `rid`
the request starts a new branch of the session from its own tokens; `replace` forgets the
requests that continued `rid` before.

A session belongs to the namespace it was opened in (the body's cache_salt, else the
X-Cache-Salt header): sessions are keyed by (namespace, id), so another tenant can neither
find nor continue it. Bounds: at most `max_sessions` open, at most `max_tokens` tokens
remembered in all (the least recently used requests are forgotten first; continuing a
forgotten rid is a 404), and a session idle for its `timeout` closes.
"""

from __future__ import annotations

import time
import uuid
from array import array
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from radixserve.sampling.params import is_int
from radixserve.server.errors import BadRequest

MAX_SESSIONS = 1024
"""Most sessions open at once (all namespaces); /open_session past it is a 429."""
MAX_SESSION_TOKENS = 1 << 23
"""Most token ids remembered by all sessions together (4 bytes each: 32 MiB)."""
MAX_ID_CHARS = 256
SESSION_PARAMS = {"id", "rid", "offset", "replace", "drop_previous_output"}
OPEN_FIELDS = {"capacity_of_str_len", "session_id", "streaming", "timeout", "cache_salt"}

Key = tuple[str | None, str]  # (namespace, session id)


@dataclass(frozen=True)
class Continuation:
    """What a request continues: its session, and the request (rid) its prompt extends."""

    session: Key
    parent: str | None


@dataclass
class _Turn:
    prompt: array
    output: array
    parent: str | None


@dataclass
class _Session:
    timeout_s: float | None
    last_used: float
    turns: dict[str, _Turn] = field(default_factory=dict)


class SessionStore:
    """The open sessions and the sequences of their requests, within the bounds above."""

    def __init__(
        self,
        max_sessions: int = MAX_SESSIONS,
        max_tokens: int = MAX_SESSION_TOKENS,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.max_sessions = max_sessions
        self.max_tokens = max_tokens
        self.clock = clock
        self.num_tokens = 0
        self._sessions: dict[Key, _Session] = {}
        self._lru: OrderedDict[tuple[Key, str], int] = OrderedDict()  # turn -> its tokens

    def __len__(self) -> int:
        self._expire()
        return len(self._sessions)

    def open(self, namespace: str | None, body: dict[str, Any]) -> str:
        """SGLang's /open_session body -> the session's id (given, or a new one)."""
        unknown = set(body) - OPEN_FIELDS
        if unknown:
            name = sorted(unknown)[0]
            raise BadRequest(f"{name} is not a field of /open_session", param=name)
        capacity = body.get("capacity_of_str_len")
        if capacity is not None and (not is_int(capacity) or capacity < 0):
            raise BadRequest("capacity_of_str_len must be an int >= 0", "capacity_of_str_len")
        if body.get("streaming") not in (None, False):
            raise BadRequest("streaming sessions are not supported: streaming must be false",
                             param="streaming")  # fmt: skip
        timeout = body.get("timeout")
        ok = timeout is None or (_is_number(timeout) and 0 < timeout <= 7 * 86400)
        if not ok:
            raise BadRequest(f"timeout must be seconds in (0, 604800]; got {timeout!r}", "timeout")
        session_id = body.get("session_id")
        session_id = uuid.uuid4().hex if session_id is None else _check_id(session_id, "session_id")
        self._expire()
        key = (namespace, session_id)
        if key in self._sessions:
            raise BadRequest(f"session {session_id!r} is already open", param="session_id")
        if len(self._sessions) >= self.max_sessions:
            message = f"{self.max_sessions} sessions are open: close one first"
            raise BadRequest(message, param="session_id", status=429)
        self._sessions[key] = _Session(timeout, self.clock())
        return session_id

    def close(self, namespace: str | None, session_id: Any) -> bool:
        """Forgets the session; False when the namespace has no such session open."""
        key = (namespace, _check_id(session_id, "session_id"))
        self._expire()
        if key not in self._sessions:
            return False
        self._drop(key)
        return True

    def continue_prompt(
        self, namespace: str | None, params: Any, input_ids: list[int]
    ) -> tuple[list[int], Continuation]:
        """The prompt of a request sent with `session_params` (its own tokens `input_ids`),
        and what it continues."""
        params = _check_params(params)
        key = (namespace, params["id"])
        self._expire()
        session = self._sessions.get(key)
        if session is None:
            raise BadRequest(f"session {params['id']!r} is not open", "session_params.id", 404)
        session.last_used = self.clock()
        rid = params.get("rid")
        if rid is None:
            return list(input_ids), Continuation(key, None)
        turn = session.turns.get(rid)
        if turn is None:
            message = f"request {rid!r} is not in session {params['id']!r} (or was forgotten)"
            raise BadRequest(message, "session_params.rid", 404)
        self._lru.move_to_end((key, rid))
        if params.get("replace"):
            for child in _descendants(session, rid):
                self._forget(key, session, child)
        sequence = turn.prompt if params.get("drop_previous_output") else turn.prompt + turn.output
        offset = params.get("offset")
        return sequence[:offset].tolist() + list(input_ids), Continuation(key, rid)

    def record(self, where: Continuation, rid: str, prompt: list[int], output: list[int]) -> None:
        """Remembers a finished request of the session (a closed session remembers nothing)."""
        session = self._sessions.get(where.session)
        if session is None:
            return
        if rid in session.turns:
            self._forget(where.session, session, rid)
        turn = _Turn(array("i", prompt), array("i", output), where.parent)
        session.turns[rid] = turn
        size = len(turn.prompt) + len(turn.output)
        self._lru[(where.session, rid)] = size
        self.num_tokens += size
        while self.num_tokens > self.max_tokens and self._lru:
            (key, old), _ = next(iter(self._lru.items()))
            self._forget(key, self._sessions[key], old)

    def _forget(self, key: Key, session: _Session, rid: str) -> None:
        session.turns.pop(rid, None)
        self.num_tokens -= self._lru.pop((key, rid), 0)

    def _expire(self) -> None:
        now = self.clock()
        for key, session in list(self._sessions.items()):
            if session.timeout_s is not None and now - session.last_used > session.timeout_s:
                self._drop(key)

    def _drop(self, key: Key) -> None:
        session = self._sessions.pop(key)
        for rid in list(session.turns):
            self._forget(key, session, rid)


def _descendants(session: _Session, rid: str) -> list[str]:
    found, frontier = [], [rid]
    while frontier:
        parent = frontier.pop()
        children = [r for r, turn in session.turns.items() if turn.parent == parent]
        found += children
        frontier += children
    return found


def _check_params(params: Any) -> dict[str, Any]:
    if not isinstance(params, dict) or set(params) - SESSION_PARAMS:
        raise BadRequest(
            "session_params must be an object of id, rid, offset, replace, drop_previous_output;"
            f" got {str(params)[:80]}",
            param="session_params",
        )
    _check_id(params.get("id"), "session_params.id")
    if params.get("rid") is not None:
        _check_id(params["rid"], "session_params.rid")
    offset = params.get("offset")
    if offset is not None and not is_int(offset):
        raise BadRequest(
            f"session_params.offset must be an int; got {offset!r}", "session_params.offset"
        )
    for name in ("replace", "drop_previous_output"):
        if params.get(name) not in (None, True, False):
            raise BadRequest(f"session_params.{name} must be a boolean", f"session_params.{name}")
    return params


def _check_id(value: Any, param: str) -> str:
    if not isinstance(value, str) or not 0 < len(value) <= MAX_ID_CHARS:
        message = f"{param} must be a non-empty string of at most {MAX_ID_CHARS} characters"
        raise BadRequest(message, param=param)
    return value


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)
