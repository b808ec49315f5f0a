"""The TCP sockets a process owns, read from /proc: its socket inodes (/proc/PID/fd) joined with
the kernel's tables (/proc/PID/net/tcp and tcp6, the process's network namespace)."""

from __future__ import annotations

import os
import socket
import struct
from dataclasses import dataclass

STATES = {"01": "ESTABLISHED", "02": "SYN_SENT", "06": "TIME_WAIT", "08": "CLOSE_WAIT", "0A": "LISTEN"}


@dataclass(frozen=True)
class TcpSocket:
    family: str  # "tcp" (IPv4) or "tcp6"
    local: str
    local_port: int
    remote: str
    remote_port: int
    state: str  # a name from STATES, or the kernel's hex code


def _address(family: str, text: str) -> tuple[str, int]:
    addr, port = text.split(":")
    raw = bytes.fromhex(addr)
    if family == "tcp":
        return socket.inet_ntop(socket.AF_INET, struct.pack("<I", int.from_bytes(raw, "big"))), int(port, 16)
    words = b"".join(struct.pack("<I", int.from_bytes(raw[i : i + 4], "big")) for i in range(0, 16, 4))
    return socket.inet_ntop(socket.AF_INET6, words), int(port, 16)


def socket_inodes(pid: int) -> set[str]:
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    return inodes


def tcp_sockets(pid: int) -> list[TcpSocket]:
    """Every TCP socket (IPv4 and IPv6) that process ``pid`` holds open."""
    inodes = socket_inodes(pid)
    found = []
    for family in ("tcp", "tcp6"):
        with open(f"/proc/{pid}/net/{family}") as table:
            next(table)
            for line in table:
                fields = line.split()
                if fields[9] not in inodes:
                    continue
                local, local_port = _address(family, fields[1])
                remote, remote_port = _address(family, fields[2])
                found.append(TcpSocket(family, local, local_port, remote, remote_port,
                                       STATES.get(fields[3], fields[3])))
    return found


def listeners(pid: int) -> list[TcpSocket]:
    return sorted((s for s in tcp_sockets(pid) if s.state == "LISTEN"), key=lambda s: s.local_port)
