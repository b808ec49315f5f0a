"""Which addresses each engine listens on, started for one host in its own process.

Every TCP socket in LISTEN state that the peer process owns is read from /proc after the peer has
served a write (so listeners an engine opens lazily count too). NIXL's only listener is UCX's TCP
connection listener (the NIXL listener thread is off), bound to the host's interface. Mooncake
0.3.13 cannot be bound at all: see test_mooncake_listens_on_every_interface. Every engine setting
the caller exported is cleared first (an exported ``UCX_NET_DEVICES=lo`` would bind UCX to
loopback whatever the host): the backend's own choice is what these tests look at.
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
from collections.abc import Iterator

import numpy as np
import pytest

from dsa_bridge.plugin.descriptors import raw_region
from dsa_bridge.transfer.backends import create_backend
from dsa_bridge.transfer.backends.environment import interface_of

from ..conftest import clear_engine_environment, require_engine
from .helpers import KV_PAGE
from .peer import Peer, start_peer
from .sockets import TcpSocket, listeners

U64 = np.uint64


@pytest.fixture(autouse=True)
def engine_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    """The backend's defaults only, in this process and in the peers it spawns (they inherit it)."""
    clear_engine_environment(monkeypatch)


def global_ipv4() -> str | None:
    """A non-loopback IPv4 address of this machine, as iproute2 reports it (None if it has none)."""
    try:
        out = subprocess.run(["ip", "-4", "-o", "addr", "show", "scope", "global"], capture_output=True,
                             text=True, timeout=10, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    for line in out.splitlines():
        fields = line.split()
        if "inet" in fields:
            return fields[fields.index("inet") + 1].split("/")[0]
    return None


@contextlib.contextmanager
def served_peer(backend: str, host: str, env: dict[str, str] | None = None
                ) -> Iterator[tuple[Peer, list[TcpSocket]]]:
    """A peer started for ``host`` that took one write, and its listeners (the peer still up)."""
    require_engine(backend)
    peer = start_peer(backend, 1 << 20, lifetime_s=60, env=env, host=host)
    local = None
    try:
        local = create_backend(backend, host=host)
        source = np.ones(KV_PAGE, dtype=np.uint8)
        local.register([raw_region(source.ctypes.data, source.nbytes)])
        handle = local.connect(peer.metadata)
        local.write(handle, np.array([source.ctypes.data], U64), np.array([peer.addr], U64),
                    np.array([KV_PAGE], U64), timeout_s=30)
        assert peer.ask("read", 0, 4) == b"\x01" * 4, "the write did not land"
        yield peer, listeners(peer.process.pid)
    finally:
        if local is not None:
            local.close()
        assert peer.stop() == 0


HOSTS = [pytest.param("127.0.0.1", id="loopback"),
         pytest.param(global_ipv4(), id="global address",
                      marks=pytest.mark.skipif(global_ipv4() is None,
                                               reason="this machine has no global IPv4 address"))]


@pytest.mark.parametrize("host", HOSTS)
def test_nixl_listens_only_on_the_configured_address(host: str) -> None:
    """The backend sets UCX_NET_DEVICES to the interface holding ``host`` (the caller's value is
    cleared by ``engine_environment``): UCX's TCP listener binds its address and nothing else
    (before, a non-loopback host also got a listener on 127.0.0.1)."""
    with served_peer("nixl", host) as (_, found):
        pass
    assert found, "UCX opened no TCP listener (is UCX's tcp transport gone?)"
    assert [(s.family, s.local) for s in found] == [("tcp", host)] * len(found), found


def test_the_interface_of_an_address() -> None:
    assert interface_of("127.0.0.1") == "lo"
    assert interface_of("203.0.113.77") is None  # TEST-NET-3: held by no interface here
    address = global_ipv4()
    if address is not None:
        out = subprocess.run(["ip", "-4", "-o", "addr", "show", "to", address], capture_output=True,
                             text=True, timeout=10, check=True).stdout
        assert interface_of(address) == out.split()[1]


MC_PORTS = (16420, 16519)  # narrowed with MC_MIN_RPC_PORT / MC_MAX_RPC_PORT (default 15000-17000)


@pytest.mark.slow
def test_mooncake_listens_on_every_interface() -> None:
    """KNOWN EXCEPTION, recorded exactly: Mooncake 0.3.13 has no setting that binds its listeners.

    Its two listeners are the P2P handshake (RPC) socket, bound by ``findAvailableTcpPort`` to
    INADDR_ANY, and the TCP transport's data socket, bound by ``TcpContext`` to ``[::]`` with
    IPV6_V6ONLY off, so it takes IPv4 connections on every interface too. ``MC_TCP_BIND_ADDRESS``
    only names the address advertised through a metadata server (unused with P2PHANDSHAKE). Only
    the port range can be set, and it holds for both. Should a later Mooncake bind them, this test
    fails: then bind them in MooncakeBackend and make this test assert it.
    """
    env = {"MC_MIN_RPC_PORT": str(MC_PORTS[0]), "MC_MAX_RPC_PORT": str(MC_PORTS[1])}
    with served_peer("mooncake", "127.0.0.1", env) as (peer, found):
        assert sorted((s.family, s.local) for s in found) == [("tcp", "0.0.0.0"), ("tcp6", "::")], found
        handshake, data = sorted(found, key=lambda s: s.family)
        assert handshake.local_port == int(peer.metadata.decode().rsplit(":", 1)[1])
        assert all(MC_PORTS[0] <= s.local_port <= MC_PORTS[1] for s in found), found
        with socket.create_connection(("127.0.0.1", data.local_port), timeout=5):
            pass  # dual-stack: the [::] socket takes IPv4 connections
