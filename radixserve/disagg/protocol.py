"""The bootstrap port's wire format: fixed-size frames, authenticated both ways.

    decode -> prefill  HELLO      magic "RSK2", op (F fetch | X drop), authenticated (0 | 1),
                                  room u64, page_nbytes u64, num_pages u32, nonce_d (32 bytes)
    prefill -> decode  CHALLENGE  kind "C", nonce_p, MAC("prefill")   | BUSY "B" | ERROR
    decode -> prefill  PROOF      MAC("decode")
    prefill -> decode  PAGE       kind "P", index u32, nbytes u64, MAC("page", index, the
                                  page's token ids, payload), payload
                       ...        exactly num_pages of them, in order
                       DONE       kind "D", MAC("done", num_pages)     | ERROR kind "E", text

Every MAC is HMAC-SHA256 keyed by the shared secret (`auth.py`) over the HELLO, both nonces
and its own fields, so each side proves it holds the secret on a challenge it did not pick,
and a page is bound to its room, its place and its prompt tokens. The receiver of a frame
checks its kind, index and size before it reads a byte of payload. An ERROR's text is
unauthenticated: it is logged, never shown to a client. No pickle: structs and raw bytes.
"""

from __future__ import annotations

import hashlib
import hmac
import socket
import struct
import time
from collections.abc import Sequence
from dataclasses import dataclass

HELLO = struct.Struct("!4sccQQI32s")
CHALLENGE = struct.Struct("!c32s32s")
PROOF = struct.Struct("!32s")
FRAME = struct.Struct("!cIQ32s")
MAGIC = b"RSK2"
FETCH, DROP = b"F", b"X"
PAGE, DONE, ERROR, BUSY, CHALLENGED = b"P", b"D", b"E", b"B", b"C"
NONCE_BYTES = 32
MAX_ERROR_BYTES = 1024
"""An ERROR frame's text at most; a longer one is a protocol violation (never read)."""


class KVTransferError(RuntimeError):
    """The pages did not arrive whole and authentic: a MAC or size mismatch, the peer gone or
    unable to prove the secret, an ERROR."""


class KVTransferTimeout(KVTransferError):
    """The prefill side did not deliver in time."""


class PeerBusy(KVTransferError):
    """The prefill side's connection pool is full: try again shortly."""


@dataclass(frozen=True)
class Hello:
    """What a decode worker asks of a prefill worker's bootstrap port."""

    op: bytes  # FETCH | DROP
    authenticated: bool  # the decode side holds a secret
    room: int
    page_nbytes: int
    num_pages: int
    nonce: bytes

    def pack(self) -> bytes:
        auth = b"1" if self.authenticated else b"0"
        fields = (self.room, self.page_nbytes, self.num_pages, self.nonce)
        return HELLO.pack(MAGIC, self.op, auth, *fields)

    @classmethod
    def unpack(cls, data: bytes) -> Hello:
        magic, op, auth, room, nbytes, num_pages, nonce = HELLO.unpack(data)
        if magic != MAGIC or op not in (FETCH, DROP) or auth not in (b"0", b"1"):
            raise KVTransferError("not a KV transfer HELLO")
        return cls(op, auth == b"1", room, nbytes, num_pages, nonce)


class Session:
    """One connection's MACs: keyed by the secret (b"" without one: then they only detect
    corruption and mismatched prompts, anyone can forge them), bound to its HELLO and both
    nonces."""

    def __init__(self, key: bytes, hello: Hello, nonce_p: bytes):
        self._key = key
        self._transcript = hello.pack() + nonce_p

    def mac(self, label: bytes, *parts: bytes) -> bytes:
        digest = hmac.new(self._key, digestmod=hashlib.sha256)
        for part in (label, self._transcript, *parts):
            digest.update(struct.pack("!Q", len(part)))
            digest.update(part)
        return digest.digest()

    def check(self, mac: bytes, label: bytes, *parts: bytes) -> bool:
        return hmac.compare_digest(mac, self.mac(label, *parts))

    def page_mac(self, index: int, tokens: Sequence[int], payload: bytes) -> bytes:
        return self.mac(b"page", struct.pack("!I", index), token_bytes(tokens), payload)

    def done_mac(self, num_pages: int) -> bytes:
        return self.mac(b"done", struct.pack("!I", num_pages))


def token_bytes(tokens: Sequence[int]) -> bytes:
    """A page's token ids as the MAC covers them (u64 each: any vocabulary fits)."""
    return struct.pack(f"!{len(tokens)}Q", *tokens)


def send_error(conn: socket.socket, message: str) -> None:
    data = message.encode()[:MAX_ERROR_BYTES]
    conn.sendall(FRAME.pack(ERROR, 0, len(data), bytes(32)) + data)


def recv_exactly(conn: socket.socket, num_bytes: int, deadline: float | None = None) -> bytes:
    """`num_bytes` from `conn`, all of them by `deadline` (time.monotonic) when given, so
    that a peer trickling bytes cannot stretch the socket's per-call timeout; raises
    TimeoutError, or KVTransferError when the peer closes first."""
    buf = bytearray()
    while len(buf) < num_bytes:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{len(buf)} of {num_bytes} bytes in time")
            conn.settimeout(left)
        chunk = conn.recv(min(num_bytes - len(buf), 1 << 20))
        if not chunk:
            raise KVTransferError(f"connection closed after {len(buf)} of {num_bytes} bytes")
        buf += chunk
    return bytes(buf)
