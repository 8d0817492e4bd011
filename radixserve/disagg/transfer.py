"""KV page transfer between a prefill and a decode worker, keyed by SGLang's `bootstrap_room`.

The decode side pulls: it connects to the prefill worker's bootstrap port (the router's
`bootstrap_host` / `bootstrap_port`), the two sides prove to each other that they hold the
fleet's shared secret, and the room's pages come one MACed frame each (protocol.py). The
prefill side publishes a room's pages (copied out of its pool, so its own pages are free to go
back to its tree at once) into a byte-bounded `RoomStore` and answers a fetch as soon as they
are there, or with an ERROR when they do not come within `wait_timeout_s`.

Who may connect: with a secret (`--disaggregation-secret-file`), only peers that prove it,
from anywhere the port is reachable; without one, the bootstrap port binds loopback only and a
decode worker fetches from loopback peers only. Backends: `tcp` (this) and `fake` (moves
nothing and reports success, for warm-up and tests, as SGLang's does).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

from radixserve.disagg.bootstrap_server import MAX_CONNECTIONS, BootstrapServer
from radixserve.disagg.fetcher import FetchCancel, FetchRequest, fetch_room
from radixserve.disagg.protocol import KVTransferError, KVTransferTimeout
from radixserve.disagg.rooms import RoomStore

__all__ = [
    "FakeKVTransfer",
    "FetchCancel",
    "FetchRequest",
    "KVTransfer",
    "KVTransferError",
    "KVTransferTimeout",
    "TcpKVTransfer",
]
DEFAULT_ROOM_BUDGET_BYTES = 4 << 30
"""Published rooms' bytes at most when no budget is configured and no pool sizes it."""


class KVTransfer(ABC):
    """One worker's end of the transfer: `publish` on prefill, `fetch` on decode."""

    moves_pages: bool = True  # False: publish ignores its pages (no need to copy them out)

    @property
    def port(self) -> int | None:
        """The bootstrap port served (prefill side, once listening); None otherwise."""
        return None

    @abstractmethod
    def publish(self, room: int, page_tokens: Sequence[Sequence[int]], pages: list[bytes]) -> None:
        """Prefill: makes `pages` (a prompt's KV, in order; `page_tokens[i]`: page i's token
        ids) available to room `room`."""

    def publish_error(self, room: int, message: str) -> None:
        """Prefill: room `room`'s pages will never come (its request was aborted); a decode
        side asking for it gets `message` at once rather than waiting out its timeout."""
        return None

    @abstractmethod
    def fetch(
        self, req: FetchRequest, timeout_s: float, cancel: FetchCancel | None = None
    ) -> list[bytes] | None:
        """Decode: the room's pages from the prefill worker; None when the backend moves
        nothing. `cancel`, once set, abandons the fetch and has the prefill side drop it."""

    @abstractmethod
    def close(self) -> None:
        """Stops serving (prefill side)."""


class FakeKVTransfer(KVTransfer):
    """Moves nothing and reports success."""

    moves_pages = False

    def publish(self, room: int, page_tokens: Sequence[Sequence[int]], pages: list[bytes]) -> None:
        return None

    def fetch(
        self, req: FetchRequest, timeout_s: float, cancel: FetchCancel | None = None
    ) -> list[bytes] | None:
        return None

    def close(self) -> None:
        return None


class TcpKVTransfer(KVTransfer):
    """Pages over TCP, pulled by the decode side; serves on a port once `listen` is called.
    `secret`: the fleet's shared secret (None: loopback peers only, unauthenticated)."""

    def __init__(
        self,
        wait_timeout_s: float = 30.0,
        secret: bytes | None = None,
        room_budget_bytes: int = DEFAULT_ROOM_BUDGET_BYTES,
        max_connections: int = MAX_CONNECTIONS,
        **server_options,
    ):
        self.key = secret or b""
        self.rooms = RoomStore(room_budget_bytes)
        self.server = BootstrapServer(
            self.rooms, self.key, wait_timeout_s, max_connections, **server_options
        )

    @property
    def wait_timeout_s(self) -> float:
        return self.server.wait_timeout_s

    @wait_timeout_s.setter
    def wait_timeout_s(self, value: float) -> None:
        self.server.wait_timeout_s = value

    # ---- prefill side ----------------------------------------------------------------------

    def listen(self, host: str, port: int) -> int:
        """Starts the bootstrap server; returns the port (a free one when `port` is 0)."""
        return self.server.listen(host, port)

    @property
    def port(self) -> int | None:
        return self.server.port

    def publish(self, room: int, page_tokens: Sequence[Sequence[int]], pages: list[bytes]) -> None:
        self.rooms.publish(room, page_tokens, pages)

    def publish_error(self, room: int, message: str) -> None:
        self.rooms.publish_error(room, message)

    def num_rooms(self) -> int:
        """Rooms published and not yet fetched (bounded by the room budget and ROOM_TTL_S)."""
        return self.rooms.num_rooms()

    def close(self) -> None:
        self.server.close()

    # ---- decode side -----------------------------------------------------------------------

    def fetch(
        self, req: FetchRequest, timeout_s: float, cancel: FetchCancel | None = None
    ) -> list[bytes]:
        """The room's pages, each checked; raises KVTransferTimeout / KVTransferError."""
        return fetch_room(req, self.key, timeout_s, cancel)
