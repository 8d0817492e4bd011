"""What `ss -ltn` shows for one process, read from /proc (no external tool): the TCP
addresses its sockets listen on, to check that a server binds loopback only."""

from __future__ import annotations

import ipaddress
import os
import socket


def listening_addresses(pid: int) -> set[tuple[str, int]]:
    """(address, port) of every listening TCP socket (IPv4 and IPv6) that process `pid` holds."""
    inodes = _socket_inodes(pid)
    found = set()
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        try:
            with open(f"/proc/{pid}/net/{table}") as f:
                rows = [line.split() for line in f.readlines()[1:]]
        except OSError:
            continue
        for row in rows:
            local, state, inode = row[1], row[3], row[9]
            if state == "0A" and inode in inodes:  # 0A: TCP_LISTEN
                hex_ip, hex_port = local.split(":")
                found.add((_address(hex_ip, family), int(hex_port, 16)))
    return found


def process_tree(pid: int) -> list[int]:
    """`pid` and all its descendants (a server, its core process, their children)."""
    found, stack = [], [pid]
    while stack:
        current = stack.pop()
        found.append(current)
        try:
            tasks = os.listdir(f"/proc/{current}/task")
        except OSError:  # exited
            continue
        for task in tasks:
            try:
                with open(f"/proc/{current}/task/{task}/children") as f:
                    stack.extend(int(child) for child in f.read().split())
            except OSError:
                continue
    return found


def is_loopback(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    mapped = getattr(ip, "ipv4_mapped", None)
    return (mapped or ip).is_loopback


def _socket_inodes(pid: int) -> set[str]:
    inodes = set()
    folder = f"/proc/{pid}/fd"
    for fd in os.listdir(folder):
        try:
            link = os.readlink(os.path.join(folder, fd))
        except OSError:  # closed meanwhile
            continue
        if link.startswith("socket:["):
            inodes.add(link[len("socket:[") : -1])
    return inodes


def _address(hex_ip: str, family: int) -> str:
    raw = bytes.fromhex(hex_ip)  # 32-bit words in host (little-endian) order
    raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return socket.inet_ntop(family, raw)
