"""Ports a test chooses for its processes: free, below the kernel's ephemeral range and outside
Mooncake's listener range, so that no socket bound meanwhile by a library's own choice (gloo, the
engines and HTTP clients on port 0; a Mooncake engine on a random port of
``MC_MIN_RPC_PORT``..``MC_MAX_RPC_PORT``, 15000-17000 by default; another test's processes) can
take one between the choice and its use. (The likely cause of a CI failure: a restarted
prefill's bootstrap port, in Mooncake's range, never answered again while another test's engines
were starting.)

Each test process of a parallel run (pytest-xdist's ``gwN`` of ``PYTEST_XDIST_WORKER_COUNT``)
chooses in its own share of those ports, and never hands out a port it chose recently: two tests
running at once cannot both choose a port before either binds it (a rank's bootstrap server and
another test's gloo store on one port made the bootstrap server's PUTs time out in a fresh clone).
"""

from __future__ import annotations

import collections
import os
import random
import socket
from collections.abc import Sequence
from pathlib import Path

from dsa_bridge.transfer.backends.environment import mooncake_port_ranges

RECENT = 256  # ports this process handed out last, not handed out again
_recent: collections.deque[int] = collections.deque(maxlen=RECENT)


def mooncake_ports(env: dict | os._Environ = os.environ) -> list[range]:
    """The ports a Mooncake engine may listen on (``mooncake_port_ranges``: its default range,
    and the one ``env`` sets; a test may narrow it for its own processes)."""
    return [range(low, high + 1) for low, high in mooncake_port_ranges(env)]


def candidate_ports(ephemeral_low: int, avoided: list[range]) -> list[int]:
    """The ports of ``[ephemeral_low // 2, ephemeral_low)`` in none of the ``avoided`` ranges."""
    return [port for port in range(ephemeral_low // 2, ephemeral_low)
            if not any(port in each for each in avoided)]


def port_share(ports: Sequence[int], worker: str, workers: int) -> Sequence[int]:
    """The ports of ``ports`` that test process ``worker`` (``gwN``, or "" alone) of ``workers``
    chooses from: its own slice, disjoint from every other process's."""
    index = int(worker[2:]) if worker.startswith("gw") else 0
    span = len(ports) // max(workers, 1)
    return ports[index * span:(index + 1) * span]


def own_share() -> Sequence[int]:
    """This test process's share (``port_share``) of the ports below this machine's ephemeral
    range and outside Mooncake's (``candidate_ports``)."""
    ephemeral = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    return port_share(candidate_ports(ephemeral, mooncake_ports()),
                      os.environ.get("PYTEST_XDIST_WORKER", ""),
                      int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))


def free_port() -> int:
    """A port free now on 127.0.0.1, chosen at random in this test process's share
    (``own_share``), and not one it handed out recently."""
    share = own_share()
    if not share:
        raise RuntimeError("no ports to choose from: the ephemeral range starts too low")
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
    raise RuntimeError(f"no free port in this process's {len(share)} after 1000 tries")
