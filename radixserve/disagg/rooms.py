"""RoomStore: a prefill worker's published rooms, waiting for their decode worker.

A room holds a prompt's whole KV pages (copies, off the pool) and their token ids, or an error
(its request was aborted). Memory stays bounded three ways: the pages of all rooms together
fit `budget_bytes` (publishing drops the oldest rooms to make space; a room larger than the
whole budget is refused), a room nobody asked for goes after `ttl_s`, and a room its decode
worker gave up on (`drop`) goes at once, or is discarded on arrival when it comes later.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

ROOM_TTL_S = 300.0
"""A published room no decode worker asked for is dropped after this long (its request was
routed elsewhere or aborted)."""
MAX_DROPPED = 4096
"""Rooms remembered as dropped before they were published (oldest forgotten first)."""
POLL_S = 0.1
"""How often a waiting fetch checks that its decode worker is still there."""


@dataclass
class Room:
    """A published room: its pages and their token ids, or why they will never come."""

    created: float
    page_tokens: Sequence[Sequence[int]] = ()
    pages: Sequence[bytes] = ()
    error: str | None = None

    @property
    def nbytes(self) -> int:
        return sum(len(p) for p in self.pages)


class RoomStore:
    """Rooms by number, oldest first, within a byte budget."""

    def __init__(self, budget_bytes: int, ttl_s: float = ROOM_TTL_S):
        self.budget_bytes = budget_bytes
        self.ttl_s = ttl_s
        self._rooms: OrderedDict[int, Room] = OrderedDict()
        self._dropped: OrderedDict[int, float] = OrderedDict()
        self._nbytes = 0
        self._closed = False
        self._changed = threading.Condition()

    def publish(self, room: int, page_tokens: Sequence[Sequence[int]], pages: list[bytes]) -> None:
        """Makes `pages` available under `room`, dropping the oldest rooms to fit the budget."""
        entry = Room(time.monotonic(), page_tokens, pages)
        if entry.nbytes > self.budget_bytes:
            message = f"bootstrap_room {room}: {entry.nbytes} bytes of KV exceed the room budget"
            entry = Room(entry.created, error=message)
        with self._changed:
            if self._dropped.pop(room, None) is not None:
                return  # its decode worker gave up on it already
            self._expire(entry.created)
            self._make_space(entry.nbytes)
            self._put(room, entry)

    def publish_error(self, room: int, message: str) -> None:
        """Room `room`'s pages will never come; a fetch of it gets `message` at once."""
        with self._changed:
            if self._dropped.pop(room, None) is None:
                self._put(room, Room(time.monotonic(), error=message))

    def drop(self, room: int) -> None:
        """Forgets room `room` (its decode worker gave up); remembered as dropped if it has
        not been published yet, so that it is discarded when it comes."""
        with self._changed:
            if self._pop(room) is None:
                self._dropped[room] = time.monotonic()
                while len(self._dropped) > MAX_DROPPED:
                    self._dropped.popitem(last=False)

    def take(self, room: int, timeout_s: float, gone: Callable[[], bool]) -> Room | None:
        """Waits up to `timeout_s` for room `room`, then removes and returns it; None on a
        timeout or a close. Drops the room when `gone()` turns true while waiting."""
        deadline = time.monotonic() + timeout_s
        with self._changed:
            while room not in self._rooms and not self._closed:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                self._changed.wait(min(left, POLL_S))
                if room not in self._rooms and gone():
                    self._dropped[room] = time.monotonic()
                    return None
            return self._pop(room)

    def close(self) -> None:
        """Wakes every waiting fetch (they get nothing)."""
        with self._changed:
            self._closed = True
            self._changed.notify_all()

    def num_rooms(self) -> int:
        """Rooms published and not yet fetched."""
        with self._changed:
            return len(self._rooms)

    def num_bytes(self) -> int:
        """Bytes of KV pages held by those rooms."""
        with self._changed:
            return self._nbytes

    def _put(self, room: int, entry: Room) -> None:
        self._pop(room)
        self._rooms[room] = entry
        self._nbytes += entry.nbytes
        self._changed.notify_all()

    def _pop(self, room: int) -> Room | None:
        entry = self._rooms.pop(room, None)
        if entry is not None:
            self._nbytes -= entry.nbytes
        return entry

    def _make_space(self, nbytes: int) -> None:
        """Turns the oldest rooms into errors until `nbytes` more fit the budget."""
        for room in [r for r, e in self._rooms.items() if e.pages]:
            if self._nbytes + nbytes <= self.budget_bytes:
                return
            created = self._pop(room).created
            self._rooms[room] = Room(created, error="dropped: the room byte budget was full")

    def _expire(self, now: float) -> None:
        for room in [r for r, e in self._rooms.items() if now - e.created >= self.ttl_s]:
            self._pop(room)
        for room in [r for r, t in self._dropped.items() if now - t >= self.ttl_s]:
            del self._dropped[room]
