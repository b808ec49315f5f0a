"""What the engines read of the machine and the process they start in.

The RDMA devices and ports of this machine (from sysfs), the network interface that holds an IPv4
address (from the kernel's interface list), and ``env_defaults``: the environment variables an
engine reads at start-up, set for that start-up only. Both engine backends use them to choose
their transport and to keep their listeners on the host's interface. ``mooncake_port_warning``:
whether a port someone fixed lies where a Mooncake engine on this host may take it.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import struct
import threading
from array import array as byte_array
from collections.abc import Iterator
from pathlib import Path

_RDMA_SYSFS = Path("/sys/class/infiniband")
MOONCAKE_PORTS = (15000, 17000)  # Mooncake's listeners' random ports unless MC_*_RPC_PORT say
_ENV_LOCK = threading.Lock()
_SIOCGIFCONF = 0x8912
_IFREQ_BYTES = 40  # struct ifreq on 64-bit Linux: a 16-byte name, then a 24-byte union


def mooncake_port_ranges(env=os.environ) -> list[tuple[int, int]]:
    """Where a Mooncake engine's listeners may bind (bounds included): its default range, then
    the one ``MC_MIN_RPC_PORT``/``MC_MAX_RPC_PORT`` set in ``env`` (the default where unset)."""
    return [MOONCAKE_PORTS, (int(env.get("MC_MIN_RPC_PORT", MOONCAKE_PORTS[0])),
                             int(env.get("MC_MAX_RPC_PORT", MOONCAKE_PORTS[1])))]


def mooncake_port_warning(what: str, port: int, env=os.environ) -> str | None:
    """A warning naming ``what`` when ``port`` lies in Mooncake's listener range
    (``mooncake_port_ranges``), else None: a Mooncake engine of any process on the host binds
    random ports there, and can take this one in the moment it is free, while its owner
    restarts (which then cannot bind it)."""
    inside = [(low, high) for low, high in mooncake_port_ranges(env) if port and low <= port <= high]
    if not inside:
        return None
    low, high = inside[-1]  # the environment's range where it holds the port
    return (f"{what}: port {port} lies in Mooncake's listener range {low}-{high} "
            "(MC_MIN_RPC_PORT-MC_MAX_RPC_PORT), where a Mooncake engine on this host may take it "
            "while its owner restarts; choose a port outside it")


def rdma_devices(device_filter: str = "") -> list[str]:
    """The RDMA devices of this machine (all, or those named in a comma-separated filter)."""
    try:
        found = sorted(entry.name for entry in _RDMA_SYSFS.iterdir())
    except OSError:
        return []
    wanted = {name for name in device_filter.split(",") if name}
    return [name for name in found if not wanted or name in wanted]


def rdma_ports() -> list[str]:
    """Every port of every RDMA device, named as UCX names them: ``mlx5_0:1``."""
    ports = []
    for device in rdma_devices():
        try:
            ports += [f"{device}:{port}" for port in sorted((_RDMA_SYSFS / device / "ports").iterdir())]
        except OSError:
            continue
    return ports


def interface_of(address: str) -> str | None:
    """The network interface that holds the IPv4 ``address`` (primary or secondary), or None."""
    buf = byte_array("B", bytes(_IFREQ_BYTES * 256))
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        request = struct.pack("iL", len(buf), buf.buffer_info()[0])
        filled = struct.unpack("iL", fcntl.ioctl(sock.fileno(), _SIOCGIFCONF, request))[0]
    table = buf.tobytes()[:filled]
    for offset in range(0, len(table), _IFREQ_BYTES):
        entry = table[offset : offset + _IFREQ_BYTES]
        if socket.inet_ntoa(entry[20:24]) == address:  # sockaddr_in: family, port, then the address
            return entry[:16].split(b"\0", 1)[0].decode().split(":", 1)[0]  # "eth0:1" is an alias
    return None


@contextlib.contextmanager
def env_defaults(defaults: dict[str, str]) -> Iterator[dict[str, str]]:
    """Set the variables the user has not set, for the duration of an engine's start-up only.

    Engines read their environment when they start; restoring it afterwards keeps one backend's
    defaults (e.g. ``UCX_NET_DEVICES=lo`` for a loopback host) from leaking into the next one.
    Yields the effective value of every variable in ``defaults``.
    """
    with _ENV_LOCK:
        added = [key for key in defaults if key not in os.environ]
        for key in added:
            os.environ[key] = defaults[key]
        try:
            yield {key: os.environ[key] for key in defaults}
        finally:
            for key in added:
                os.environ.pop(key, None)
