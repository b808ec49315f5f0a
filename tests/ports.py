"""Ports a test chooses for its processes: free, and below the kernel's ephemeral range, so that no
socket bound to port 0 meanwhile (gloo, the engines, HTTP clients, another test's processes) can
take one between the choice and its use."""

from __future__ import annotations

import random
import socket
from pathlib import Path


def free_port() -> int:
    """A port free now on 127.0.0.1, chosen at random below the ephemeral range."""
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for _ in range(1000):
        port = random.randrange(low // 2, low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise RuntimeError(f"no free port in [{low // 2}, {low}) after 1000 tries")
