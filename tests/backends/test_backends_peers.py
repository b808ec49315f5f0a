"""Peers coming and going: ``disconnect`` leaves no connection behind, a process may end right
after one, and Mooncake's first contact with an engine endpoint that never answers no longer
stalls the engine's other peers."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from itertools import pairwise
from pathlib import Path

import numpy as np
import pytest

from dsa_bridge.plugin.descriptors import raw_region
from dsa_bridge.transfer.backends import create_backend, nixl
from dsa_bridge.transfer.backends.base import BackendError, TransferTimeout

from ..conftest import require_engine
from .helpers import KV_PAGE, Local
from .peer import SENTINEL, Peer, start_peer
from .sockets import TcpSocket, listeners, tcp_sockets

U64 = np.uint64
ROOT = Path(__file__).resolve().parents[2]
LANE_SPREAD = 16  # entries per write: enough for Mooncake to use all its TCP lanes to the peer


def spread_write(local: Local, peer: Peer, handle: str, *, timeout_s: float = 10) -> None:
    offsets = np.arange(LANE_SPREAD, dtype=U64) * U64(KV_PAGE)
    local.backend.write(handle, local.base + offsets, peer.addr + offsets,
                        np.full(LANE_SPREAD, KV_PAGE, dtype=U64), timeout_s=timeout_s)


def sockets_to(ports: set[int]) -> list[TcpSocket]:
    """This process's TCP sockets whose remote end is one of ``ports`` on this host."""
    return [s for s in tcp_sockets(os.getpid()) if s.remote_port in ports and s.state != "LISTEN"]


def wait_for(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"{what} not seen within {timeout_s} s")
        time.sleep(0.02)


@pytest.mark.slow
@pytest.mark.parametrize("how", ["stopped", "killed"])
def test_disconnect_closes_every_connection_to_a_departed_peer(local, victim, how: str) -> None:
    """Mooncake keeps its TCP lanes to a departed peer in CLOSE-WAIT (4 here) until it next uses
    them; ``disconnect`` closes them all. NIXL/UCX closes its own; ``disconnect`` must not leave
    any either. Either way, a write to the forgotten peer is then refused."""
    handle = local.backend.connect(victim.metadata)
    spread_write(local, victim, handle)
    ports = {s.local_port for s in listeners(victim.process.pid)}
    assert ports, "the peer listens on nothing"
    assert sockets_to(ports), "the write left no connection to the peer"
    if how == "stopped":
        assert victim.stop() == 0
    else:
        victim.signal(signal.SIGKILL)
        victim.process.join(5)
    if local.backend.name == "mooncake":
        half_closed = wait_for(lambda: [s for s in sockets_to(ports) if s.state == "CLOSE_WAIT"],
                               5, "a connection in CLOSE-WAIT")
        assert len(half_closed) == len(sockets_to(ports)), sockets_to(ports)
    local.backend.disconnect(handle)

    def all_closed() -> bool:
        local.backend.progress()  # UCX handles a closed connection when driven, as nodes do
        return not sockets_to(ports)

    wait_for(all_closed, 10, f"every connection to ports {sorted(ports)} closed")
    with pytest.raises(BackendError, match="unknown peer"):
        spread_write(local, victim, handle, timeout_s=2)


def test_nixl_wakes_its_worker_threads_five_times_after_a_disconnect(local, peer,
                                                                     monkeypatch) -> None:
    """A departed peer's connections on NIXL's worker threads close only when each worker is
    next driven: ``disconnect`` posts a wake, and ``progress()`` four more, 50 ms apart (a
    thread that the machine's load kept asleep through one gets the next)."""
    if local.backend.name != "nixl":
        pytest.skip("NIXL's worker threads")
    wake = local.backend._wake
    posts = []
    monkeypatch.setattr(wake, "post", lambda backend: posts.append(time.monotonic()))
    local.backend.disconnect(local.backend.connect(peer.metadata))
    assert len(posts) == 1
    deadline = time.monotonic() + 5
    while len(posts) < nixl.WAKE_REPEATS and time.monotonic() < deadline:
        local.backend.progress()
        time.sleep(0.005)
    for _ in range(20):  # no more after that
        local.backend.progress()
    assert len(posts) == nixl.WAKE_REPEATS
    assert min(b - a for a, b in pairwise(posts)) >= 0.9 * nixl.WAKE_GAP_S  # recorded a bit late
    unthreaded = create_backend("nixl", backend_params={"num_threads": "0"})
    assert unthreaded._wake is None  # nothing to wake
    unthreaded.close()


@pytest.mark.parametrize("mode", ["close", "exit"])
def test_a_process_ends_cleanly_right_after_a_mooncake_disconnect(mode: str) -> None:
    """A prefill whose decode went silent just before it was stopped disconnects and ends at
    once, with or without ``close()``; the disconnect's reads must not take the process down
    with them (it died of SIGABRT, "terminate called without an active exception", 19 of 20
    times before ``close()`` and an exit hook waited for them)."""
    require_engine("mooncake")
    done = subprocess.run([sys.executable, "-m", "tests.backends.exit_after_disconnect", mode],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert (done.returncode, "terminate called" in done.stderr) == (0, False), done.stderr[-3000:]


def test_a_disconnected_live_peer_can_connect_again(connected) -> None:
    """``disconnect`` of a peer that is still up harms nothing: it is refused until connected
    again, then writes land byte-exact."""
    local, peer, handle = connected
    spread_write(local, peer, handle)
    local.backend.disconnect(handle)
    local.backend.disconnect(handle)  # twice: the second is a no-op
    with pytest.raises(BackendError, match="unknown peer"):
        spread_write(local, peer, handle, timeout_s=2)
    assert peer.ask("fill", SENTINEL) == "ok"
    again = local.backend.connect(peer.metadata)
    assert again == handle
    spread_write(local, peer, again)
    got = np.frombuffer(peer.ask("read", 0, LANE_SPREAD * KV_PAGE + 1), dtype=np.uint8)
    assert np.array_equal(got[:-1], local.source[: LANE_SPREAD * KV_PAGE])
    assert got[-1] == SENTINEL


def test_disconnect_of_unknown_peers_and_after_close_is_ignored(backend_name: str) -> None:
    backend = create_backend(backend_name)
    backend.disconnect("127.0.0.1:1")
    backend.close()
    backend.disconnect("127.0.0.1:1")


@pytest.fixture
def silent_endpoint():
    """A TCP port that accepts connections and never answers (as a frozen or hostile peer)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(16)
    held: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        server.settimeout(0.1)
        while not stop.is_set():
            try:
                held.append(server.accept()[0])
            except TimeoutError:
                continue
            except OSError:
                return

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    yield f"127.0.0.1:{server.getsockname()[1]}"
    stop.set()
    thread.join(5)
    for conn in held:
        conn.close()
    server.close()


@pytest.mark.slow
def test_mooncake_silent_engine_endpoint_does_not_stall_other_peers(silent_endpoint) -> None:
    """Mooncake's own first contact with an endpoint that never answers holds an engine-wide
    lock for 60 s: every write of the engine, even a first one to a healthy peer, used to stall.
    The probe runs first, with the write's deadline, and holds nothing. (NIXL has no such lock:
    test_backends_failures.py.)"""
    require_engine("mooncake")
    cold = start_peer("mooncake", 1 << 20, lifetime_s=60)  # never contacted: its first write
    backend = create_backend("mooncake")
    try:
        source = np.random.default_rng(3).integers(0, 256, LANE_SPREAD * KV_PAGE, dtype=np.uint8)
        backend.register([raw_region(source.ctypes.data, source.nbytes)])
        local = Local(backend, source)
        silent = backend.connect(silent_endpoint.encode())
        outcome: list[object] = []

        def write_to_silent() -> None:
            start = time.monotonic()
            try:
                spread_write(local, cold, silent, timeout_s=3)  # addresses don't matter: never sent
            except BaseException as exc:
                outcome.append(exc)
            outcome.append(time.monotonic() - start)

        stuck = threading.Thread(target=write_to_silent)
        stuck.start()
        time.sleep(0.5)  # the probe is waiting on the silent endpoint now
        spread_write(local, cold, backend.connect(cold.metadata), timeout_s=2)  # not held up
        stuck.join(10)
        assert not stuck.is_alive()
        error, elapsed = outcome
        assert isinstance(error, TransferTimeout) and error.op == "send_probe", error
        # (the margins are for a loaded machine: Mooncake's own stall would be 60 s)
        assert 3 <= elapsed < 6, f"the write to the silent endpoint took {elapsed:.2f} s"
        got = np.frombuffer(cold.ask("read", 0, source.nbytes), dtype=np.uint8)
        assert np.array_equal(got, source), "the healthy peer's bytes differ"
        start = time.monotonic()  # a second write waits on the probe still in flight
        with pytest.raises(TransferTimeout, match="did not answer a probe"):
            spread_write(local, cold, silent, timeout_s=1)
        elapsed = time.monotonic() - start
        assert 1 <= elapsed < 4, f"the second write to the silent endpoint took {elapsed:.2f} s"
    finally:
        backend.close()
        assert cold.stop() == 0
