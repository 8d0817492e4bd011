"""KV page transfer between a prefill and a decode worker, keyed by SGLang's `bootstrap_room`.

The decode side pulls: it connects to the prefill worker's bootstrap port (the router's
`bootstrap_host` / `bootstrap_port`), names the room and the page size it expects, and reads
the room's pages one frame each, every frame checked by its CRC32:

    decode -> prefill   REQUEST  magic "RSKV", room u64, page_nbytes u64
    prefill -> decode   PAGE     kind "P", index u32, crc32 u32, nbytes u64, payload
                        ...      one per prompt page, in order
                        DONE     kind "D"            | ERROR kind "E", message (utf-8)

The prefill side publishes a room's pages (copied out of its pool, so its own pages are
free to go back to its tree at once) and answers a request as soon as they are there, or an
ERROR when they do not come within `wait_timeout_s`. Backends: `tcp` (this) and `fake`
(moves nothing and reports success, for warm-up and tests, as SGLang's does).
"""

from __future__ import annotations

import socket
import struct
import threading
import time
import zlib
from abc import ABC, abstractmethod

REQUEST = struct.Struct("!4sQQ")
FRAME = struct.Struct("!cIIQ")
MAGIC = b"RSKV"
PAGE, DONE, ERROR = b"P", b"D", b"E"
ROOM_TTL_S = 300.0
"""A published room no decode worker asked for is dropped after this long (its request was
routed elsewhere or aborted), so that the prefill side's memory stays bounded."""


class KVTransferError(RuntimeError):
    """The pages did not arrive whole: a checksum or size mismatch, the peer gone, an ERROR."""


class KVTransferTimeout(KVTransferError):
    """The prefill side did not deliver in time."""


class KVTransfer(ABC):
    """One worker's end of the transfer: `publish` on prefill, `fetch` on decode."""

    moves_pages: bool = True  # False: publish ignores its pages (no need to copy them out)

    @property
    def port(self) -> int | None:
        """The bootstrap port served (prefill side, once listening); None otherwise."""
        return None

    @abstractmethod
    def publish(self, room: int, pages: list[bytes]) -> None:
        """Prefill: makes `pages` (a prompt's KV, in order) available to room `room`."""

    def publish_error(self, room: int, message: str) -> None:
        """Prefill: room `room`'s pages will never come (its request was aborted); a decode
        side asking for it gets `message` at once rather than waiting out its timeout."""
        return None

    @abstractmethod
    def fetch(self, host: str, port: int, room: int, page_nbytes: int, timeout_s: float):
        """Decode: room `room`'s pages from the prefill worker at host:port; None when the
        backend moves nothing."""

    @abstractmethod
    def close(self) -> None:
        """Stops serving (prefill side)."""


class FakeKVTransfer(KVTransfer):
    """Moves nothing and reports success."""

    moves_pages = False

    def publish(self, room: int, pages: list[bytes]) -> None:
        return None

    def fetch(self, host: str, port: int, room: int, page_nbytes: int, timeout_s: float):
        return None

    def close(self) -> None:
        return None


class TcpKVTransfer(KVTransfer):
    """Pages over TCP, pulled by the decode side; serves on `port` once `listen` is called."""

    def __init__(self, wait_timeout_s: float = 30.0):
        self.wait_timeout_s = wait_timeout_s
        self._rooms: dict[int, tuple[float, list[bytes] | str]] = {}  # str: an error
        self._ready = threading.Condition()
        self._listener: socket.socket | None = None

    # ---- prefill side ----------------------------------------------------------------------

    def listen(self, host: str, port: int) -> int:
        """Starts the bootstrap server; returns the port (a free one when `port` is 0)."""
        self._listener = socket.create_server((host, port))
        threading.Thread(target=self._accept, daemon=True, name="kv-bootstrap").start()
        return self._listener.getsockname()[1]

    @property
    def port(self) -> int | None:
        return None if self._listener is None else self._listener.getsockname()[1]

    def publish(self, room: int, pages: list[bytes]) -> None:
        self._put(room, pages)

    def publish_error(self, room: int, message: str) -> None:
        self._put(room, message)

    def _put(self, room: int, pages: list[bytes] | str) -> None:
        with self._ready:
            now = time.monotonic()
            self._rooms = {r: v for r, v in self._rooms.items() if now - v[0] < ROOM_TTL_S}
            self._rooms[room] = (now, pages)
            self._ready.notify_all()

    def num_rooms(self) -> int:
        """Rooms published and not yet fetched (bounded by ROOM_TTL_S)."""
        with self._ready:
            return len(self._rooms)

    def close(self) -> None:
        if self._listener is not None:
            self._listener.close()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:  # closed
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        try:
            with conn:
                self._answer(conn)
        except (OSError, KVTransferError):  # the decode side went away: its request fails there
            return

    def _answer(self, conn: socket.socket) -> None:
        """Reads the request, then sends the room's pages or an ERROR."""
        magic, room, nbytes = REQUEST.unpack(_recv_exactly(conn, REQUEST.size))
        if magic != MAGIC:
            return
        pages = self._take(room)
        if pages is None:
            message = f"KV of bootstrap_room {room} not ready after {self.wait_timeout_s} s"
            return _send_error(conn, message)
        if isinstance(pages, str):
            return _send_error(conn, pages)
        if any(len(p) != nbytes for p in pages):
            size = len(pages[0])
            return _send_error(conn, f"page size mismatch: {size} bytes here, {nbytes} there")
        for index, page in enumerate(pages):
            conn.sendall(FRAME.pack(PAGE, index, zlib.crc32(page), len(page)) + page)
        conn.sendall(FRAME.pack(DONE, 0, 0, 0))

    def _take(self, room: int) -> list[bytes] | str | None:
        """Waits up to wait_timeout_s for room `room`, then removes and returns its pages (or
        its error)."""
        with self._ready:
            if not self._ready.wait_for(lambda: room in self._rooms, self.wait_timeout_s):
                return None
            return self._rooms.pop(room)[1]

    # ---- decode side -----------------------------------------------------------------------

    def fetch(self, host: str, port: int, room: int, page_nbytes: int, timeout_s: float):
        """Room `room`'s pages, each checked; raises KVTransferTimeout / KVTransferError."""
        deadline = time.monotonic() + timeout_s
        try:
            with socket.create_connection((host, port), timeout=timeout_s) as conn:
                conn.sendall(REQUEST.pack(MAGIC, room, page_nbytes))
                return _read_pages(conn, deadline)
        except TimeoutError as exc:
            raise KVTransferTimeout(f"bootstrap_room {room}: no KV in {timeout_s} s") from exc
        except OSError as exc:
            raise KVTransferError(f"bootstrap_room {room}: {host}:{port}: {exc}") from exc


def _read_pages(conn: socket.socket, deadline: float) -> list[bytes]:
    pages: list[bytes] = []
    while True:
        conn.settimeout(max(0.001, deadline - time.monotonic()))
        kind, index, crc, nbytes = FRAME.unpack(_recv_exactly(conn, FRAME.size))
        payload = _recv_exactly(conn, nbytes)
        if kind == DONE:
            return pages
        if kind == ERROR:
            raise KVTransferError(payload.decode("utf-8", "replace"))
        if kind != PAGE or index != len(pages):
            raise KVTransferError(f"unexpected frame {kind!r} #{index} after {len(pages)} pages")
        if zlib.crc32(payload) != crc:
            raise KVTransferError(f"KV page {index}: checksum mismatch")
        pages.append(payload)


def _send_error(conn: socket.socket, message: str) -> None:
    data = message.encode()
    conn.sendall(FRAME.pack(ERROR, 0, 0, len(data)) + data)


def _recv_exactly(conn: socket.socket, num_bytes: int) -> bytes:
    buf = bytearray()
    while len(buf) < num_bytes:
        chunk = conn.recv(min(num_bytes - len(buf), 1 << 20))
        if not chunk:
            raise KVTransferError(f"connection closed after {len(buf)} of {num_bytes} bytes")
        buf += chunk
    return bytes(buf)
