"""The PD transfer's shared secret (`--disaggregation-secret-file`) and who may talk without one.

With a secret, both sides of every transfer prove they hold it (protocol.py) and every page is
MACed with it: a decode worker inserts only pages from a prefill worker of its fleet, whatever
host a request names. Without one, a prefill worker's bootstrap port binds loopback only and a
decode worker fetches from loopback peers only: the MACs then detect corruption, not forgery.
"""

from __future__ import annotations

import ipaddress
import os
import secrets
import socket
import stat

SECRET_MIN_BYTES = 16


def load_secret(path: str) -> bytes:
    """The secret in `path` (surrounding whitespace dropped); raises ValueError naming the
    flag when the file is missing, too short, or open to group or others."""
    flag = f"--disaggregation-secret-file {path}"
    try:
        with open(path, "rb") as f:
            mode = os.fstat(f.fileno()).st_mode
            secret = f.read(4096).strip()
    except OSError as exc:
        raise ValueError(f"{flag}: cannot read it: {exc.strerror}") from exc
    if mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ValueError(f"{flag}: open to group or others (mode {mode & 0o777:o}); chmod 600 it")
    if len(secret) < SECRET_MIN_BYTES:
        raise ValueError(f"{flag}: a secret has at least {SECRET_MIN_BYTES} bytes")
    return secret


def write_secret_file(path: str) -> None:
    """Creates `path` (it must not exist) with a fresh random secret, mode 0600."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32) + "\n")


def resolve_peer(host: str, port: int, loopback_only: bool) -> tuple:
    """The socket address to connect to for host:port, resolved once (so that the address
    checked is the address used); raises OSError, or ValueError for a non-loopback peer when
    `loopback_only`."""
    family, _, _, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    if loopback_only and not ipaddress.ip_address(address[0]).is_loopback:
        raise ValueError(
            f"bootstrap_host {host} is not loopback: a decode worker without "
            "--disaggregation-secret-file fetches KV from loopback peers only"
        )
    return family, address
