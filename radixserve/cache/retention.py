"""Retention pins: cached prefixes kept out of eviction for a while, by name.

A pin holds one radix node (`PrefixCache.pin`: a reference count along the path to the root,
beside the lock count of running requests), so the prefix up to that node stays in the pool
until the pin ends. Pins are named: `session:<id>` for an agent session's last turn (renewed
by each turn, ended when the next turn is admitted: that request then locks what it reads),
`prefix:<name>` for a prefix pinned through `POST /cache/pin`. A name is the namespace's
(cache_salt's): the same name in two namespaces is two pins, so one tenant can neither
replace nor end another's.

    pin ends when:  its TTL passes (`expire`) | it is replaced or unpinned by name
                    | the bound needs room: pinned pages > max_pinned_pages, the oldest pin
                      of the namespace pinning the most tokens first
                    | the count needs room: a new pin past max_pins ends a session pin (the
                      oldest of the namespace with the most pins that has any); with none
                      (all are prefix pins) it ends the oldest prefix pin of the namespace
                      with the most pins if that one holds 2+ more than the new pin's
                      namespace, else the new pin is refused (`pin_room`)
                    | nothing else can progress (`release_oldest`: admission would deadlock)

So tenants share the bounds fairly: one namespace may fill them while alone, but each other
namespace that pins takes its places back until the counts are level.

A pin that ends only stops protecting: its pages go back to plain LRU, nothing is freed.
Eviction reads the node's pin count (`is_evictable` in tree_node.py), so a second KV tier
can later demote pinned pages instead of keeping them, without changing this table.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from radixserve.cache.prefix_cache import PrefixCache

MAX_PIN_NAME_CHARS = 256
"""Longest session id or pinned prefix name: a UUID or a path fits; a key is not a payload."""
SESSION_PREFIX, PREFIX_PREFIX = "session:", "prefix:"


def check_pin_name(value: object, param: str) -> str:
    """`value` if it is a non-empty string of at most MAX_PIN_NAME_CHARS; else ValueError
    naming `param` (session_id, name)."""
    if not isinstance(value, str) or not value:
        raise ValueError(f"{param} must be a non-empty string; got {value!r}")
    if len(value) > MAX_PIN_NAME_CHARS:
        raise ValueError(
            f"{param} must be at most {MAX_PIN_NAME_CHARS} characters; got {len(value)}"
        )
    return value


def session_pin_key(session_id: str) -> str:
    return SESSION_PREFIX + session_id


def prefix_pin_key(name: str) -> str:
    return PREFIX_PREFIX + name


def pin_room(
    pins: Sequence[tuple[str | None, bool]], namespace: str | None, max_pins: int
) -> tuple[bool, int | None]:
    """Whether a new pin in `namespace` may be made beside `pins` ((namespace, is_session),
    oldest first), and the index of the pin it ends to make room (None: none needs to end)."""
    if len(pins) < max_pins:
        return True, None
    counts = Counter(ns for ns, _ in pins)
    with_sessions = {ns for ns, is_session in pins if is_session}
    if with_sessions:
        heaviest = max(with_sessions, key=lambda ns: counts[ns])
        return True, next(i for i, (ns, s) in enumerate(pins) if s and ns == heaviest)
    heaviest = max(counts, key=lambda ns: counts[ns])
    if counts[namespace] < counts[heaviest] - 1:
        return True, next(i for i, (ns, _) in enumerate(pins) if ns == heaviest)
    return False, None


@dataclass
class Pin:
    key: str  # session:<id> | prefix:<name>
    node: object  # the pinned radix node (the deepest of the prefix)
    num_tokens: int  # tokens of the pinned prefix (whole pages)
    namespace: str | None
    pinned_at: float  # when pinned or renewed: the bound lets the oldest go first
    expires_at: float | None  # None: until unpinned

    def describe(self, now: float, page_size: int) -> dict:
        """What `GET /cache/sessions` lists for this pin."""
        kind, _, name = self.key.partition(":")
        remaining = None if self.expires_at is None else max(self.expires_at - now, 0.0)
        return {
            "kind": kind,
            "name": name,
            "namespace": self.namespace,
            "num_tokens": self.num_tokens,
            "num_pages": self.num_tokens // page_size,
            "age_s": now - self.pinned_at,
            "expires_in_s": remaining,
        }


class PinTable:
    """The live pins of one prefix cache, with their TTLs, the bound on pinned pages and the
    bound on their number (pin names come from clients)."""

    def __init__(
        self,
        cache: PrefixCache,
        max_pinned_pages: int,
        clock: Callable[[], float] = time.monotonic,
        max_pins: int = 4096,
    ):
        if max_pinned_pages < 0:
            raise ValueError(f"max_pinned_pages must be >= 0; got {max_pinned_pages}")
        if max_pins < 1:
            raise ValueError(f"max_pins must be >= 1; got {max_pins}")
        self.cache = cache
        self.max_pinned_pages = max_pinned_pages
        self.max_pins = max_pins
        self.clock = clock
        # (namespace, key) -> pin; insertion order = pinned_at order (renewals move)
        self._pins: dict[tuple[str | None, str], Pin] = {}
        self.num_degraded = 0  # pins ended early by a bound or by memory pressure
        self.num_refused = 0  # new pins refused: max_pins prefix pins already live
        self._num_sessions = 0  # live pins whose key is a session's

    def __len__(self) -> int:
        return len(self._pins)

    def __contains__(self, key: str) -> bool:
        """Whether `key` is pinned in the default namespace (tests)."""
        return (None, key) in self._pins

    def pin(
        self,
        key: str,
        token_ids: Sequence[int],
        namespace: str | None = None,
        ttl_s: float | None = None,
    ) -> Pin | None:
        """Pins the cached part of `token_ids` under `key` in `namespace` (replacing its old
        pin there); None if none of it is cached, the bound let it go at once (it alone is
        too large) or the table is full of prefix pins (`is_full`)."""
        self.unpin(key, namespace)
        match = self.cache.match_prefix(token_ids, namespace, max_tokens=len(token_ids))
        if match.num_tokens == 0 or not self.cache.shares_prefixes:
            return None
        if not self._make_room(namespace):
            self.num_refused += 1
            return None
        now = self.clock()
        expires_at = None if ttl_s is None else now + ttl_s
        self.cache.pin(match.node)
        pin = Pin(key, match.node, match.num_tokens, namespace, now, expires_at)
        self._pins[namespace, key] = pin
        self._num_sessions += key.startswith(SESSION_PREFIX)
        self._enforce_bound()
        return self._pins.get((namespace, key))

    def unpin(self, key: str, namespace: str | None = None) -> bool:
        """Ends the pin named `key` in `namespace`; False if there is none."""
        pin = self._pins.pop((namespace, key), None)
        if pin is None:
            return False
        self._num_sessions -= key.startswith(SESSION_PREFIX)
        self.cache.unpin(pin.node)
        return True

    def expire(self) -> int:
        """Ends the pins whose TTL has passed; returns how many."""
        now = self.clock()
        expired = [
            p for p in self._pins.values() if p.expires_at is not None and p.expires_at <= now
        ]
        for pin in expired:
            self.unpin(pin.key, pin.namespace)
        return len(expired)

    def release_oldest(self) -> bool:
        """Ends the oldest pin (memory pressure with nothing else to free); False if none."""
        if not self._pins:
            return False
        oldest = next(iter(self._pins.values()))
        self.unpin(oldest.key, oldest.namespace)
        self.num_degraded += 1
        return True

    def is_full(self, namespace: str | None = None) -> bool:
        """Whether a new pin in `namespace` would be refused (`pin_room`)."""
        return not pin_room(self._kinds(), namespace, self.max_pins)[0]

    def _kinds(self) -> list[tuple[str | None, bool]]:
        return [(p.namespace, p.key.startswith(SESSION_PREFIX)) for p in self._pins.values()]

    def _make_room(self, namespace: str | None) -> bool:
        """Below max_pins, ending one pin if `pin_room` says so; False: refused."""
        room, victim = pin_room(self._kinds(), namespace, self.max_pins)
        if victim is not None:
            pin = list(self._pins.values())[victim]
            self.unpin(pin.key, pin.namespace)
            self.num_degraded += 1
        return room

    def _enforce_bound(self) -> None:
        """Past max_pinned_pages: ends the oldest pin of the namespace pinning the most
        tokens, until within it."""
        while self._pins and self.cache.num_pinned_pages() > self.max_pinned_pages:
            tokens: Counter = Counter()
            for pin in self._pins.values():
                tokens[pin.namespace] += pin.num_tokens
            heaviest = max(tokens, key=lambda ns: tokens[ns])
            pin = next(p for p in self._pins.values() if p.namespace == heaviest)
            self.unpin(pin.key, pin.namespace)
            self.num_degraded += 1

    def clear(self) -> None:
        for namespace, key in list(self._pins):
            self.unpin(key, namespace)

    def describe(self) -> list[dict]:
        """Every live pin, oldest first (`GET /cache/sessions`)."""
        now = self.clock()
        return [pin.describe(now, self.cache.page_size) for pin in self._pins.values()]
