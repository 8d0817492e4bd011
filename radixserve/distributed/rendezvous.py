"""Where tensor-parallel ranks meet, and which interface their collectives use.

    --dist-init-addr host:port  (default 127.0.0.1:0)
      rank 0: listens on host:port itself, before any rank starts (port 0: the kernel picks,
              read back; no free-port-then-bind race), and hands that socket to torch's
              TCPStore (which would otherwise listen on every interface)
      every rank: gloo / nccl bind the interface holding the address this rank reaches
              `host` from (GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME, unless already set), so
              one address names both the rendezvous and the data path; on one machine, and
              by default, that is loopback

A wildcard host is refused (config/parallel.py): the store would listen everywhere, and it
has no authentication.
"""

from __future__ import annotations

import fcntl
import ipaddress
import logging
import os
import socket
import struct

from radixserve.config.parallel import DEFAULT_INIT_ADDR, split_init_addr

FLAG = "--dist-init-addr"
logger = logging.getLogger(__name__)

SIOCGIFADDR = 0x8915  # Linux ioctl: an interface's IPv4 address
IFNAME_ENV = {"gloo": "GLOO_SOCKET_IFNAME", "nccl": "NCCL_SOCKET_IFNAME"}


def listen_for_ranks(init_addr: str | None) -> tuple[socket.socket, str]:
    """Rank 0's listening socket on the host of `init_addr` (default loopback, any free
    port) and the `host:port` the other ranks connect to."""
    host, port = split_init_addr(init_addr or DEFAULT_INIT_ADDR)
    try:
        addresses = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
        family, kind, proto, _, sockaddr = addresses[0]
        sock = socket.socket(family, kind, proto)
    except OSError as exc:
        raise ValueError(f"{FLAG} {init_addr!r}: cannot resolve {host!r} ({exc})") from exc
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(sockaddr)
        sock.listen(128)
    except OSError as exc:
        sock.close()
        raise ValueError(f"{FLAG} {init_addr!r}: cannot listen there ({exc})") from exc
    address, bound_port = sock.getsockname()[:2]  # numeric: every rank dials the same one
    shown = f"[{address}]" if ":" in address else address
    return sock, f"{shown}:{bound_port}"


def bind_collectives_to(host: str, port: int, backend: str) -> None:
    """Points `backend`'s sockets at the interface this process reaches `host` through,
    unless its variable is set already (then the operator chose)."""
    variable = IFNAME_ENV.get(backend)
    if variable is None or os.environ.get(variable):
        return
    try:
        local = local_address_towards(host, port)
        name = interface_of(local)
    except OSError:  # no route to it
        local, name = "no address", None
    if name is None:
        logger.warning(
            "tensor parallel: no interface holds %s (the address towards %s); %s keeps its "
            "default and may listen beyond it: set %s",
            local,
            host,
            backend,
            variable,
        )
        return
    os.environ[variable] = name
    logger.info("tensor parallel: %s on interface %s (%s)", backend, name, local)


def local_address_towards(host: str, port: int) -> str:
    """The source address the kernel picks to reach `host` (no packet is sent)."""
    family, _, _, _, sockaddr = socket.getaddrinfo(host, port or 1, type=socket.SOCK_DGRAM)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as probe:
        probe.connect(sockaddr)
        return probe.getsockname()[0]


def interface_of(address: str) -> str | None:
    """The name of the network interface holding `address`, or None."""
    ip = ipaddress.ip_address(address)
    if ip.version == 6:
        return _ipv6_interface(ip)
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            request = struct.pack("256s", name.encode()[:15])
            try:
                reply = fcntl.ioctl(s.fileno(), SIOCGIFADDR, request)
            except OSError:  # no IPv4 address
                continue
            if socket.inet_ntoa(reply[20:24]) == address:
                return name
    return None


def _ipv6_interface(ip: ipaddress.IPv6Address) -> str | None:
    try:
        with open("/proc/net/if_inet6") as f:
            rows = [line.split() for line in f]
    except OSError:
        return None
    return next((row[5] for row in rows if ipaddress.ip_address(_v6(row[0])) == ip), None)


def _v6(hex32: str) -> str:
    return ":".join(hex32[i : i + 4] for i in range(0, 32, 4))
