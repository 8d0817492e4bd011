"""BootstrapServer: a prefill worker's bootstrap port, serving its rooms to decode workers.

    accept thread ── slot free? ── no ──> BUSY, close (the decode side retries)
                         │ yes
                         v
    handler pool (max_connections threads): HELLO, CHALLENGE, PROOF, each read within
    handshake_timeout_s ── the peer cannot prove the secret: ERROR, close (no room touched)
                         │ proven
                         v
    DROP: forget the room | FETCH: wait for the room (dropped if the peer leaves), send its
    pages, each MACed, then DONE; every send within send_timeout_s

An idle or slow connection holds a slot for at most handshake_timeout_s before it proves
anything; a full pool refuses new connections at once and never stops the accept thread.
"""

from __future__ import annotations

import logging
import secrets
import select
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from radixserve.disagg.protocol import (
    BUSY,
    CHALLENGE,
    CHALLENGED,
    DONE,
    DROP,
    FRAME,
    HELLO,
    NONCE_BYTES,
    PAGE,
    PROOF,
    Hello,
    KVTransferError,
    Session,
    recv_exactly,
    send_error,
)
from radixserve.disagg.rooms import Room, RoomStore

logger = logging.getLogger(__name__)
MAX_CONNECTIONS = 64
"""Connections served at once by one bootstrap port (a decode worker opens up to 16)."""
HANDSHAKE_TIMEOUT_S = 5.0
"""Seconds a new connection has to send its HELLO and PROOF."""
ACCEPT_RETRY_S = 0.05
"""Pause of the accept thread after a failed accept (say, out of file descriptors)."""


class BootstrapServer:
    """Serves `rooms` on a port; `key`: the shared secret (b"" when none is configured)."""

    def __init__(
        self,
        rooms: RoomStore,
        key: bytes,
        wait_timeout_s: float,
        max_connections: int = MAX_CONNECTIONS,
        handshake_timeout_s: float = HANDSHAKE_TIMEOUT_S,
    ):
        self.rooms = rooms
        self.key = key
        self.wait_timeout_s = wait_timeout_s
        self.handshake_timeout_s = handshake_timeout_s
        self._slots = threading.BoundedSemaphore(max_connections)
        self._handlers = ThreadPoolExecutor(max_connections, thread_name_prefix="kv-bootstrap")
        self._listener: socket.socket | None = None
        self._closed = threading.Event()
        self.num_refused = 0  # connections turned away with BUSY
        self._last_warning = 0.0

    def listen(self, host: str, port: int) -> int:
        """Binds host:port (a free port when 0), starts accepting; returns the port."""
        self._listener = socket.create_server((host, port))
        threading.Thread(target=self._accept, daemon=True, name="kv-bootstrap-accept").start()
        return self.port

    @property
    def port(self) -> int | None:
        return None if self._listener is None else self._listener.getsockname()[1]

    def close(self) -> None:
        self._closed.set()
        self.rooms.close()
        if self._listener is not None:
            self._listener.close()
        self._handlers.shutdown(wait=False, cancel_futures=True)

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError as exc:
                if self._closed.is_set():
                    return
                if time.monotonic() - self._last_warning > 1.0:  # say so, not 20 times a second
                    self._last_warning = time.monotonic()
                    logger.warning("bootstrap port: accept failed: %s", exc)
                time.sleep(ACCEPT_RETRY_S)
                continue
            if not self._slots.acquire(blocking=False):
                self.num_refused += 1
                _refuse(conn)
                continue
            try:
                self._handlers.submit(self._serve, conn)
            except RuntimeError:  # shut down meanwhile
                self._slots.release()
                conn.close()

    def _serve(self, conn: socket.socket) -> None:
        try:
            with conn:
                self._answer(conn)
        except (OSError, KVTransferError) as exc:  # the peer left or lied: nothing to undo
            logger.debug("bootstrap port: connection ended: %s", exc)
        finally:
            self._slots.release()

    def _answer(self, conn: socket.socket) -> None:
        deadline = time.monotonic() + self.handshake_timeout_s  # for HELLO and PROOF together
        hello = Hello.unpack(recv_exactly(conn, HELLO.size, deadline))
        if hello.authenticated != bool(self.key):
            needs = "needs" if self.key else "has no"
            return send_error(conn, f"this prefill worker {needs} --disaggregation-secret-file")
        session = self._handshake(conn, hello, deadline)
        if session is None:
            return
        if hello.op == DROP:
            self.rooms.drop(hello.room)
            return conn.sendall(FRAME.pack(DONE, 0, 0, session.done_mac(0)))
        conn.settimeout(self.wait_timeout_s)  # bounds every send to a stalled reader
        room = self.rooms.take(hello.room, self.wait_timeout_s, lambda: _peer_gone(conn))
        problem = _mismatch(room, hello, self.wait_timeout_s)
        if problem is not None:
            return send_error(conn, problem)
        for index, (tokens, page) in enumerate(zip(room.page_tokens, room.pages)):
            mac = session.page_mac(index, tokens, page)
            conn.sendall(FRAME.pack(PAGE, index, len(page), mac) + page)
        conn.sendall(FRAME.pack(DONE, 0, 0, session.done_mac(len(room.pages))))

    def _handshake(self, conn: socket.socket, hello: Hello, deadline: float) -> Session | None:
        """Proves this side to the peer, then checks the peer's proof; None: it failed."""
        nonce = secrets.token_bytes(NONCE_BYTES)
        session = Session(self.key, hello, nonce)
        conn.sendall(CHALLENGE.pack(CHALLENGED, nonce, session.mac(b"prefill")))
        (proof,) = PROOF.unpack(recv_exactly(conn, PROOF.size, deadline))
        if not session.check(proof, b"decode"):
            logger.warning("bootstrap port: a peer failed to prove the disaggregation secret")
            send_error(conn, "authentication failed")
            return None
        return session


def _mismatch(room: Room | None, hello: Hello, wait_timeout_s: float) -> str | None:
    """Why `room` cannot answer `hello`, if it cannot."""
    if room is None:
        return f"KV of bootstrap_room {hello.room} not ready after {wait_timeout_s} s"
    if room.error is not None:
        return room.error
    if len(room.pages) != hello.num_pages:
        return f"{len(room.pages)} KV pages here, {hello.num_pages} expected there"
    if any(len(p) != hello.page_nbytes for p in room.pages):
        return f"page size mismatch: {len(room.pages[0])} bytes here, {hello.page_nbytes} there"
    return None


def _peer_gone(conn: socket.socket) -> bool:
    """Whether the peer closed (or broke protocol by sending more) while its fetch waits."""
    poller = select.poll()  # not select(): no limit on the descriptor's number
    poller.register(conn, select.POLLIN | select.POLLHUP | select.POLLERR)
    return bool(poller.poll(0))


def _refuse(conn: socket.socket) -> None:
    """BUSY, then close, never blocking the accept thread; a HELLO already there is read
    first, so that the close is a FIN the peer can read BUSY before, not a reset."""
    try:
        conn.setblocking(False)
        conn.recv(HELLO.size)
    except OSError:
        pass
    try:
        conn.send(BUSY)
    except OSError:
        pass
    finally:
        conn.close()
