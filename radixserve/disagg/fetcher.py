"""The decode side of the bootstrap protocol: pull one room's pages, or tell a room to go.

`fetch_room` returns only pages that all came whole and authentic, in the count the prompt
needs: a peer that cannot prove the secret, a page whose MAC, index or size is wrong, or a
missing DONE ends it with KVTransferError before any page is handed on (so none ever reaches
the radix tree). A BUSY prefill worker is retried until the deadline. A `FetchCancel` set
while the fetch runs closes its connection (the prefill side drops the room); set before, the
fetch tells the prefill side to drop the room instead.
"""

from __future__ import annotations

import hmac
import secrets
import socket
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, replace

from radixserve.disagg.auth import resolve_peer
from radixserve.disagg.protocol import (
    BUSY,
    CHALLENGE,
    CHALLENGED,
    DONE,
    DROP,
    ERROR,
    FETCH,
    FRAME,
    MAX_ERROR_BYTES,
    NONCE_BYTES,
    PAGE,
    PROOF,
    Hello,
    KVTransferError,
    KVTransferTimeout,
    PeerBusy,
    Session,
    recv_exactly,
)

BUSY_RETRY_S = (0.02, 0.5)
"""The first and the longest pause before asking a busy prefill worker again."""
DROP_TIMEOUT_S = 2.0
"""Seconds a cancelled fetch spends telling the prefill side to drop its room."""


@dataclass
class FetchRequest:
    """One room to pull: where from, and what the prompt says its pages must be."""

    host: str
    port: int
    room: int
    page_tokens: Sequence[Sequence[int]]  # the token ids of each whole page of the prompt
    page_nbytes: int


class FetchCancel:
    """Set from any thread to abandon a fetch (its request was aborted)."""

    def __init__(self):
        self._event = threading.Event()
        self._conn: socket.socket | None = None  # the fetch's connection, while it has one
        self._lock = threading.Lock()

    @property
    def cancelled(self) -> bool:
        return self._event.is_set()

    def cancel(self) -> None:
        with self._lock:
            self._event.set()
            _shutdown(self._conn)  # wakes the fetch's blocking read

    def attach(self, conn: socket.socket | None) -> None:
        """`conn` is the fetch's connection now (None: it has none)."""
        with self._lock:
            self._conn = conn
            if self._event.is_set():
                _shutdown(conn)


def _shutdown(conn: socket.socket | None) -> None:
    if conn is None:
        return
    try:
        conn.shutdown(socket.SHUT_RDWR)
    except OSError:  # not connected (any more)
        pass


def fetch_room(
    req: FetchRequest, key: bytes, timeout_s: float, cancel: FetchCancel | None = None
) -> list[bytes]:
    """Room `req.room`'s pages, each checked; `key`: the secret (b"": none, loopback peers
    only). Raises KVTransferTimeout / KVTransferError with the detail (for the log)."""
    cancel = cancel or FetchCancel()
    deadline = time.monotonic() + timeout_s
    try:
        address = resolve_peer(req.host, req.port, loopback_only=not key)
        if cancel.cancelled:
            return _exchange(req, address, key, deadline, cancel, DROP)
        try:
            return _exchange(req, address, key, deadline, cancel, FETCH)
        except (KVTransferError, OSError):
            if not cancel.cancelled:
                raise
        _tell_drop(req, address, key)
        raise KVTransferError(f"bootstrap_room {req.room}: fetch cancelled")
    except ValueError as exc:  # a non-loopback peer without a secret
        raise KVTransferError(f"bootstrap_room {req.room}: {exc}") from exc
    except TimeoutError as exc:
        raise KVTransferTimeout(f"bootstrap_room {req.room}: no KV in {timeout_s} s") from exc
    except OSError as exc:
        raise KVTransferError(f"bootstrap_room {req.room}: {req.host}:{req.port}: {exc}") from exc


def _tell_drop(req: FetchRequest, address: tuple, key: bytes) -> None:
    """Best effort: asks the prefill side to drop a room whose fetch was cancelled midway
    (it may have gone before the prefill side saw the connection close)."""
    try:
        _exchange(req, address, key, time.monotonic() + DROP_TIMEOUT_S, FetchCancel(), DROP)
    except (KVTransferError, OSError):
        pass


def _exchange(
    req: FetchRequest, address: tuple, key: bytes, deadline: float, cancel: FetchCancel, op: bytes
) -> list[bytes]:
    """HELLO, the handshake, then the pages (FETCH) or an acknowledgement (DROP); a busy
    prefill worker is asked again until the deadline."""
    pause = BUSY_RETRY_S[0]
    while True:
        try:
            return _connect_once(req, address, key, deadline, cancel, op)
        except PeerBusy:
            if cancel.cancelled and op == FETCH:
                raise
            if time.monotonic() + pause > deadline:
                raise KVTransferTimeout(f"bootstrap_room {req.room}: peer busy") from None
            time.sleep(pause)
            pause = min(2 * pause, BUSY_RETRY_S[1])


def _connect_once(
    req: FetchRequest, address: tuple, key: bytes, deadline: float, cancel: FetchCancel, op: bytes
) -> list[bytes]:
    nonce = secrets.token_bytes(NONCE_BYTES)
    num_pages = len(req.page_tokens) if op == FETCH else 0
    hello = Hello(op, bool(key), req.room, req.page_nbytes, num_pages, nonce)
    family, sockaddr = address
    with socket.socket(family, socket.SOCK_STREAM) as conn:
        conn.settimeout(_left(deadline))
        conn.connect(sockaddr)
        if op == FETCH:  # a DROP is short and is what a cancel asks for
            cancel.attach(conn)
        try:
            session = _handshake(conn, key, hello, deadline)
            if op == DROP:  # acknowledged by an empty DONE once the room is gone
                return _read_pages(conn, session, replace(req, page_tokens=[]), deadline)
            return _read_pages(conn, session, req, deadline)
        finally:
            cancel.attach(None)


def _handshake(conn: socket.socket, key: bytes, hello: Hello, deadline: float) -> Session:
    """Sends the HELLO, checks the prefill side's proof on our nonce, then proves ourselves
    on its nonce."""
    try:
        conn.sendall(hello.pack())
        kind = recv_exactly(conn, 1, deadline)
    except (KVTransferError, ConnectionResetError, BrokenPipeError):  # refused: a full pool
        raise PeerBusy("the prefill worker closed the connection at once") from None
    if kind == BUSY:
        raise PeerBusy("the prefill worker's bootstrap port is busy")
    if kind == ERROR:
        _raise_error(conn, deadline)
    if kind != CHALLENGED:
        raise KVTransferError(f"unexpected answer {kind!r} to a HELLO")
    _, nonce_p, proof = CHALLENGE.unpack(kind + recv_exactly(conn, CHALLENGE.size - 1, deadline))
    session = Session(key, hello, nonce_p)
    if not session.check(proof, b"prefill"):
        raise KVTransferError("the prefill worker could not prove the disaggregation secret")
    conn.sendall(PROOF.pack(session.mac(b"decode")))
    return session


def _read_pages(
    conn: socket.socket, session: Session, req: FetchRequest, deadline: float
) -> list[bytes]:
    """The room's pages; each frame's kind, index and size checked before its payload is
    read, each page's MAC after; DONE's MAC vouches that none is missing."""
    num_pages = len(req.page_tokens)
    pages: list[bytes] = []
    while True:
        kind, index, nbytes, mac = FRAME.unpack(recv_exactly(conn, FRAME.size, deadline))
        if kind == ERROR and nbytes <= MAX_ERROR_BYTES:
            raise KVTransferError(_text(recv_exactly(conn, nbytes, deadline)))
        if kind == DONE and nbytes == 0 and len(pages) == num_pages:
            if not hmac.compare_digest(mac, session.done_mac(num_pages)):
                raise KVTransferError("the DONE frame's MAC does not check out")
            return pages
        if kind != PAGE or index != len(pages) or index >= num_pages or nbytes != req.page_nbytes:
            raise KVTransferError(
                f"unexpected frame {kind!r} #{index} of {nbytes} bytes after {len(pages)} of "
                f"{num_pages} pages of {req.page_nbytes} bytes"
            )
        payload = recv_exactly(conn, nbytes, deadline)
        expected = session.page_mac(index, req.page_tokens[index], payload)
        if not hmac.compare_digest(mac, expected):
            raise KVTransferError(f"KV page {index}: bad MAC (forged, corrupt or another prompt)")
        pages.append(payload)


def _raise_error(conn: socket.socket, deadline: float) -> None:
    """Reads the rest of an ERROR frame whose kind byte was read; raises with its text."""
    _, _, nbytes, _ = FRAME.unpack(ERROR + recv_exactly(conn, FRAME.size - 1, deadline))
    if nbytes > MAX_ERROR_BYTES:
        raise KVTransferError(f"an ERROR frame of {nbytes} bytes")
    raise KVTransferError(_text(recv_exactly(conn, nbytes, deadline)))


def _text(data: bytes) -> str:
    return "the prefill worker says: " + data.decode("utf-8", "replace")


def _left(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("deadline passed")
    return left
