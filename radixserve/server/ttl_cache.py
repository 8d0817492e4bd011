"""TtlCache: an async call's result reused for a while, so that clients polling an expensive
read (a walk of the whole radix tree on the core thread) cost the core at most one call per
key per `ttl_s`, however many of them poll and however fast.

    get(key, fetch):  fresh entry -> its result | call in flight -> wait for it (one call)
                      | none or stale -> fetch(), stored with the time it started
    failures are not kept; at most `max_entries` keys, the least recently used dropped

TtlStore: values kept for a while within a count and a byte budget (stored responses),
shared fairly between groups of keys (tenants) when a bound needs room.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Hashable
from typing import Any


class TtlCache:
    """Results of `fetch()` per key, reused for `ttl_s` seconds; concurrent callers of one
    key share one call."""

    def __init__(
        self,
        ttl_s: float,
        max_entries: int = 64,
        clock: Callable[[], float] = time.monotonic,
    ):
        if ttl_s <= 0 or max_entries < 1:
            raise ValueError(f"ttl_s must be > 0 and max_entries >= 1; got {ttl_s}, {max_entries}")
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self.clock = clock
        self.num_fetches = 0
        self._entries: OrderedDict[Hashable, tuple[float, asyncio.Future]] = OrderedDict()

    async def get(self, key: Hashable, fetch: Callable[[], Awaitable[Any]]) -> Any:
        """The key's result, fetched now only when none is fresh or in flight."""
        now = self.clock()
        entry = self._entries.get(key)
        if entry is None or (entry[1].done() and now - entry[0] >= self.ttl_s):
            entry = (now, asyncio.ensure_future(self._fetch(key, fetch)))
            self._entries[key] = entry
            while len(self._entries) > self.max_entries:
                self._entries.popitem(last=False)
        self._entries.move_to_end(key)
        return await asyncio.shield(entry[1])

    async def _fetch(self, key: Hashable, fetch: Callable[[], Awaitable[Any]]) -> Any:
        self.num_fetches += 1
        try:
            return await fetch()
        except BaseException:
            self._entries.pop(key, None)  # a failure is not kept: the next caller retries
            raise

    def __len__(self) -> int:
        return len(self._entries)


class TtlStore:
    """Values kept for `ttl_s` seconds within `max_entries` and `max_bytes` (each value's
    size given by its owner). When a bound is reached the oldest value of the group
    (`group_of(key)`: a tenant) holding the most of that bound goes first, so one group
    alone may fill the store but every other group that stores takes its share back.
    Expiry is checked lazily: on `get`, and from the oldest end on every `put`.

        put(key, value, num_bytes): replaces any old value; drops expired, then as above,
                                    until both bounds hold (False: the value alone is larger
                                    than max_bytes, and is not kept)
        get(key) -> value | None    (None: absent or expired)      pop(key) -> value | None
    """

    def __init__(
        self,
        ttl_s: float,
        max_entries: int,
        max_bytes: int,
        clock: Callable[[], float] = time.monotonic,
        group_of: Callable[[Hashable], Hashable] = lambda key: None,
    ):
        if ttl_s <= 0 or max_entries < 1 or max_bytes < 1:
            raise ValueError(
                "ttl_s must be > 0, max_entries and max_bytes >= 1; "
                f"got {ttl_s}, {max_entries}, {max_bytes}"
            )
        self.ttl_s = ttl_s
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.clock = clock
        self.group_of = group_of
        self.num_bytes = 0
        self._entries: OrderedDict[Hashable, tuple[float, int, Any]] = OrderedDict()
        self._groups: dict[Hashable, OrderedDict[Hashable, None]] = {}  # oldest key first
        self._group_bytes: dict[Hashable, int] = {}

    def put(self, key: Hashable, value: Any, num_bytes: int) -> bool:
        self.pop(key)
        if num_bytes > self.max_bytes:
            return False
        self._drop_expired()
        group = self.group_of(key)  # on a tie the newcomer's own group gives way
        while len(self._entries) >= self.max_entries:
            self._drop_oldest_of(
                max(self._groups, key=lambda g: (len(self._groups[g]), g == group))
            )
        while self.num_bytes + num_bytes > self.max_bytes:
            self._drop_oldest_of(
                max(self._group_bytes, key=lambda g: (self._group_bytes[g], g == group))
            )
        self._entries[key] = (self.clock(), num_bytes, value)
        self._groups.setdefault(group, OrderedDict())[key] = None
        self._group_bytes[group] = self._group_bytes.get(group, 0) + num_bytes
        self.num_bytes += num_bytes
        return True

    def _drop_oldest_of(self, group: Hashable) -> None:
        self._drop(next(iter(self._groups[group])))

    def get(self, key: Hashable) -> Any:
        entry = self._entries.get(key)
        if entry is None:
            return None
        if self.clock() - entry[0] >= self.ttl_s:
            self._drop(key)
            return None
        return entry[2]

    def pop(self, key: Hashable) -> Any:
        value = self.get(key)
        if key in self._entries:
            self._drop(key)
        return value

    def _drop_expired(self) -> None:
        now = self.clock()
        while self._entries:
            key, (stored, _, _) = next(iter(self._entries.items()))
            if now - stored < self.ttl_s:
                return
            self._drop(key)

    def _drop(self, key: Hashable) -> None:
        _, num_bytes, _ = self._entries.pop(key)
        self.num_bytes -= num_bytes
        group = self.group_of(key)
        keys = self._groups[group]
        del keys[key]
        self._group_bytes[group] -= num_bytes
        if not keys:
            del self._groups[group], self._group_bytes[group]

    def __len__(self) -> int:
        return len(self._entries)
