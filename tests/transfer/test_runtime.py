"""The runtime both nodes share: its pure heartbeat schedule and liveness rule, decode's pure
proof that a silent peer's process is gone, and a close that leaves nothing behind, also after a
construction that failed half-way."""

from __future__ import annotations

import os
import socket
import threading

import numpy as np
import pytest
import zmq

from dsa_bridge.transfer.backends.base import BackendError
from dsa_bridge.transfer.counters import Counters
from dsa_bridge.transfer.decode import DecodeNode
from dsa_bridge.transfer.handshake import HandshakeError
from dsa_bridge.transfer.launcher.drivers import count_mismatches, fill_request
from dsa_bridge.transfer.liveness import (
    DEAD_PEER_GRACE_S,
    SLOW_TICK_MS,
    TICKS_PER_HEARTBEAT,
    ControlLink,
    Liveness,
)
from dsa_bridge.transfer.node_runtime import NodeRuntime
from dsa_bridge.transfer.prefill import PrefillNode
from dsa_bridge.transfer.request import KVPoll

from .fake_backend import FakeBackend
from .helpers import SMALL_CONFIG, decode_node, ended, make_pool, prefill_node, wait_for


def test_the_first_heartbeat_is_due_at_once_then_once_per_interval():
    live = Liveness(heartbeat_s=0.5, peer_timeout_s=5.0)
    assert live.heartbeat_due(100.0)
    assert not live.heartbeat_due(100.0)
    assert not live.heartbeat_due(100.49)
    assert live.heartbeat_due(100.5)
    assert live.next_heartbeat == 101.0


def test_a_late_tick_schedules_the_next_heartbeat_from_itself():
    live = Liveness(heartbeat_s=0.5, peer_timeout_s=5.0)
    assert live.heartbeat_due(10.0)
    assert live.heartbeat_due(12.0)  # the tick came 1.5 s late: one heartbeat, not four
    assert not live.heartbeat_due(12.4)
    assert live.heartbeat_due(12.5)


def test_a_peer_is_silent_only_beyond_the_timeout():
    live = Liveness(heartbeat_s=0.5, peer_timeout_s=5.0)
    assert not live.silent(last_seen=10.0, now=10.0)
    assert not live.silent(last_seen=10.0, now=15.0)
    assert live.silent(last_seen=10.0, now=15.001)
    assert not live.silent(last_seen=20.0, now=15.0)  # heard from after ``now`` was taken


def test_a_node_whose_engine_needs_no_progress_ticks_by_its_heartbeat():
    """Mooncake's engine runs its own threads: decode's tick is only its heartbeats and
    deadlines, so it ticks a few times a heartbeat (each wake-up costs CPU), never less often
    than every SLOW_TICK_MS nor more often than the engine's own tick; NIXL's passive side needs
    ``progress`` at its engine's tick whatever the heartbeat."""
    assert SLOW_TICK_MS == 50 and TICKS_PER_HEARTBEAT == 5
    assert Liveness(heartbeat_s=0.5, peer_timeout_s=5.0).tick_ms(10, needs_progress=False) == 50
    assert Liveness(heartbeat_s=30.0, peer_timeout_s=90.0).tick_ms(10, needs_progress=False) == 50
    assert Liveness(heartbeat_s=0.1, peer_timeout_s=6.0).tick_ms(10, needs_progress=False) == 20
    assert Liveness(heartbeat_s=0.02, peer_timeout_s=1.0).tick_ms(10, needs_progress=False) == 10
    assert Liveness(heartbeat_s=0.5, peer_timeout_s=5.0).tick_ms(2, needs_progress=True) == 2
    assert Liveness(heartbeat_s=30.0, peer_timeout_s=90.0).tick_ms(2, needs_progress=True) == 2


def test_a_link_down_for_the_grace_proves_the_process_gone_once():
    link = ControlLink()
    assert link.up and not link.proves_gone(100.0)
    link.disconnected(100.0)
    link.disconnected(100.5)  # a later event keeps the first time
    assert not link.up and not link.proves_gone(100.0 + DEAD_PEER_GRACE_S - 0.001)
    assert link.proves_gone(100.0 + DEAD_PEER_GRACE_S) and link.proven_gone
    assert not link.proves_gone(200.0)  # once
    link.reset()  # the peer answered a new handshake
    assert link.up and not link.proven_gone


def test_a_reconnect_within_the_grace_proves_nothing():
    link = ControlLink()
    link.disconnected(100.0)
    link.connected()
    assert link.up and not link.proves_gone(100.0 + 10 * DEAD_PEER_GRACE_S)


def _open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def _threads() -> set[threading.Thread]:
    return set(threading.enumerate())


def _native_threads() -> int:
    """OS threads of this process. An earlier node's thread may still be exiting when a test takes
    its baseline (joined in Python, not yet gone from /proc): a leak shows as more threads than the
    baseline, never fewer, so the tests compare with <=."""
    return len(os.listdir("/proc/self/task"))


@pytest.fixture
def taken_port():
    """A port something else already listens on."""
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    yield holder.getsockname()[1]
    holder.close()


def test_a_prefill_that_cannot_listen_leaves_no_socket_thread_or_registration(taken_port):
    pool = make_pool()
    PrefillNode(make_pool(), FakeBackend()).close()  # the process's one-time ZMQ setup, before
    fds, threads, native = _open_fds(), _threads(), _native_threads()
    backend = FakeBackend()
    with pytest.raises(OSError, match=f"cannot listen on 127.0.0.1:{taken_port}"):
        PrefillNode(pool, backend, listen=f"127.0.0.1:{taken_port}")
    assert backend.closed
    assert _threads() == threads
    wait_for(lambda: _native_threads() <= native, 5.0, "ZMQ's I/O threads ended")
    wait_for(lambda: _open_fds() <= fds, 5.0, "the sockets closed")  # the peer side closes async


def test_a_decode_whose_handshake_fails_leaves_no_socket_thread_or_registration():
    prefill = PrefillNode(make_pool(), FakeBackend())
    try:
        DecodeNode(make_pool(), FakeBackend(), prefill.endpoint).close()  # one-time setup
        fds, threads, native = _open_fds(), _threads(), _native_threads()
        backend = FakeBackend()
        with pytest.raises(HandshakeError, match="refused the handshake"):
            DecodeNode(make_pool({**SMALL_CONFIG, "kv_lora_rank": 256}), backend, prefill.endpoint)
        assert backend.closed
        assert _threads() == threads
        wait_for(lambda: _native_threads() <= native, 5.0, "ZMQ's I/O threads ended")
        wait_for(lambda: _open_fds() <= fds, 5.0, "the sockets closed")  # the peer side closes async
    finally:
        prefill.close()


class _RefusingBackend(FakeBackend):
    def register(self, regions):
        raise BackendError(self.name, "register", "refused")


def test_a_failed_registration_closes_the_backend_and_makes_no_context():
    backend = _RefusingBackend()
    fds = _open_fds()
    with pytest.raises(BackendError, match="refused"):
        NodeRuntime("n", backend, [], Counters(), on_message=lambda *a: None,
                    on_tick=lambda now: None, heartbeat_s=0.5, peer_timeout_s=5.0)
    assert backend.closed
    assert _open_fds() == fds


@pytest.mark.parametrize(("tick_ms", "needs_progress", "paced", "expected_ms"), [
    (2, True, False, 2), (25, True, False, 25),  # the engine's tick, whatever the node
    (2, True, True, 2),  # a paced node over an engine that needs progress: the engine's still
    (10, False, False, 10),  # prefill over Mooncake: the engine's tick
    (10, False, True, 40),  # decode over Mooncake: paced by its heartbeat (0.2 s / 5)
])
def test_the_loop_ticks_at_the_engines_tick_ms_or_paced_by_the_heartbeat(
        tick_ms, needs_progress, paced, expected_ms):
    """Mooncake's engine runs its own threads (10 ms), NIXL's passive side needs ``progress``
    every few ms (2 ms): a node's ticks follow its engine's ``tick_ms``, never sooner; a node
    whose tick is only its heartbeats and deadlines (``paced``) ticks by its heartbeat where its
    engine needs no progress (``Liveness.tick_ms``)."""
    backend = FakeBackend()
    backend.tick_ms, backend.needs_progress = tick_ms, needs_progress
    ticks = []
    runtime = NodeRuntime("n", backend, [], Counters(), on_message=lambda *a: None,
                          on_tick=ticks.append, heartbeat_s=0.2, peer_timeout_s=5.0, paced=paced)
    assert runtime.tick_ms == expected_ms
    runtime.start([])
    try:
        wait_for(lambda: len(ticks) >= 8, what="eight ticks")
    finally:
        runtime.close()
    gaps = [later - earlier for earlier, later in zip(ticks[:7], ticks[1:8], strict=True)]
    assert min(gaps) >= expected_ms / 1e3 * 0.99
    assert min(gaps) < expected_ms / 1e3 + 0.02  # (on a loaded host a tick may come late, not early)


def test_close_stops_the_loop_then_closes_sockets_and_backend_once():
    backend, counters = FakeBackend(), Counters()
    ticks = []
    runtime = NodeRuntime("n", backend, [], counters, on_message=lambda *a: None,
                          on_tick=ticks.append, heartbeat_s=0.5, peer_timeout_s=5.0)
    sock = runtime.socket(zmq.PAIR, 1024)
    assert sock.getsockopt(zmq.MAXMSGSIZE) == 1024 and sock.getsockopt(zmq.LINGER) == 0
    runtime.start([sock])
    wait_for(lambda: ticks, what="a tick")
    runtime.loop.bad_messages = 3  # what the loop counted: the tick copies it to the counters
    wait_for(lambda: counters.bad_messages == 3, what="counters synced")
    runtime.close()
    assert backend.closed and sock.closed and runtime.context.closed
    assert not any(t.name == "n-control" for t in threading.enumerate())
    backend.closed = False
    runtime.close()
    assert not backend.closed  # the second close does nothing


def test_decode_over_mooncake_ticks_by_its_heartbeat_prefill_and_nixl_at_the_engines_tick(
        engine, made):
    """Real engines: decode over Mooncake ticks by its heartbeat (0.1 s: every 20 ms; an idle
    wake-up costs ~0.1 ms of CPU on our machines), prefill at its engine's tick (it answers held
    handshakes on it); over NIXL both tick at the engine's 2 ms for ``progress``. A request
    still moves every byte."""
    prefill = prefill_node(engine, made)
    decode = decode_node(engine, made, [prefill])
    assert prefill._runtime.tick_ms == {"mooncake": 10, "nixl": 2}[engine]
    assert decode._runtime.tick_ms == {"mooncake": 20, "nixl": 2}[engine]
    pages = np.arange(1, 5)
    fill_request(prefill.pool, 7, pages)
    receiver = decode.receiver(7)
    receiver.init(pages, num_tokens=len(pages) * 64)
    sender = prefill.sender(7)
    sender.init(len(pages))
    sender.send(pages)
    ended(receiver, sender)
    assert receiver.poll() == KVPoll.Success and sender.poll() == KVPoll.Success
    assert count_mismatches(decode.pool, 7, pages) == 0
