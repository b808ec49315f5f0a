"""Ports a test chooses for its processes: free, and below the kernel's ephemeral range, so that no
socket bound to port 0 meanwhile (gloo, the engines, HTTP clients, another test's processes) can
take one between the choice and its use.

Each test process of a parallel run (pytest-xdist's ``gwN`` of ``PYTEST_XDIST_WORKER_COUNT``)
chooses in its own share of that range, and never hands out a port it chose recently: two tests
running at once cannot both choose a port before either binds it (a rank's bootstrap server and
another test's gloo store on one port made the bootstrap server's PUTs time out in a fresh clone).
"""

from __future__ import annotations

import collections
import os
import random
import socket
from pathlib import Path

RECENT = 256  # ports this process handed out last, not handed out again
_recent: collections.deque[int] = collections.deque(maxlen=RECENT)


def port_share(low: int, high: int, worker: str, workers: int) -> range:
    """The ports of ``[low, high)`` that test process ``worker`` (``gwN``, or "" alone) of
    ``workers`` chooses from."""
    index = int(worker[2:]) if worker.startswith("gw") else 0
    span = (high - low) // max(workers, 1)
    return range(low + index * span, low + (index + 1) * span)


def own_share() -> range:
    """This test process's share of the ports below the ephemeral range (``port_share``)."""
    ephemeral = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    return port_share(ephemeral // 2, ephemeral, os.environ.get("PYTEST_XDIST_WORKER", ""),
                      int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))


def free_port() -> int:
    """A port free now on 127.0.0.1, chosen at random in this test process's share of the ports
    below the ephemeral range (``own_share``), and not one it handed out recently."""
    share = own_share()
    for _ in range(1000):
        port = random.choice(share)
        if port in _recent:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _recent.append(port)
        return port
    raise RuntimeError(f"no free port in [{share.start}, {share.stop}) after 1000 tries")
