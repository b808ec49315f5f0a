"""The decode node's fence, in one process over the in-process engine (real ZMQ sockets).

A prefill marked dead while its write is held inside the engine: the request fails at once, its
pages stay quarantined until the prefill is proven unable to write (its answer to a new
handshake, which waits for that write; its process gone; or the configured bound, counted as an
expiry), and the prefill comes back. The same with real engines in real processes, a prefill
frozen with SIGSTOP: tests/reliability/test_fence_processes.py."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest

from dsa_bridge.transfer import metrics
from dsa_bridge.transfer.backends.base import BackendError
from dsa_bridge.transfer.decode import DecodeNode
from dsa_bridge.transfer.launcher.drivers import count_mismatches, fill_request, sentinel_intact
from dsa_bridge.transfer.prefill import PrefillNode
from dsa_bridge.transfer.request import KVPoll
from tests.transfer.fake_backend import FakeBackend
from tests.transfer.helpers import make_pool, wait_for

PAGES = np.array([3, 4, 5, 6])


class GateBackend(FakeBackend):
    """Holds every write inside the engine until ``gate`` opens (as a frozen prefill would hold
    it); ``fail`` makes the held write fail afterwards, with its bytes "possibly landing"."""

    def __init__(self):
        super().__init__()
        self.gate = threading.Event()
        self.entered = threading.Event()
        self.fail = False

    def write(self, peer, src, dst, length, *, timeout_s):
        self.entered.set()
        if not self.gate.wait(30):
            raise BackendError(self.name, "write", "gate never opened", peer=peer)
        if self.fail:
            raise BackendError(self.name, "write", "failed after the gate", peer=peer, code=-1)
        super().write(peer, src, dst, length, timeout_s=timeout_s)


@pytest.fixture
def pair():
    """A gated prefill node and a decode node; the gate is opened and both closed afterwards."""
    made = []

    def build(**decode_kw):
        engine = GateBackend()
        prefill = PrefillNode(make_pool(), engine, peer_timeout_s=5.0, heartbeat_s=0.1)
        made.append((engine, prefill))
        decode = DecodeNode(make_pool(size=64 * 24, sentinel=True), FakeBackend(), prefill.endpoint,
                            peer_timeout_s=1.0, heartbeat_s=0.1, **decode_kw)
        made.append((None, decode))
        return engine, prefill, decode

    yield build
    for engine, _ in made:  # held writes end before their target closes
        if engine is not None:
            engine.gate.set()
    for _, node in reversed(made):
        node.close()


def send_request(prefill, decode, room: int):
    """A request of PAGES, its pages filled, announced by decode and sent by prefill."""
    fill_request(prefill.pool, room, PAGES)
    receiver = decode.receiver(room)
    receiver.init(PAGES)
    sender = prefill.sender(room)
    sender.init(PAGES.size)
    sender.send(PAGES)
    return receiver, sender


def start_write(engine, prefill, decode, room: int):
    """A request whose write is held inside the prefill's engine."""
    receiver, sender = send_request(prefill, decode, room)
    wait_for(engine.entered.is_set, what="the write inside the engine")
    return receiver, sender


def transfer_whole(prefill, decode, room: int, what: str) -> None:
    """One request of PAGES from ``prefill`` into ``decode``, byte-exact."""
    receiver, _ = send_request(prefill, decode, room)
    wait_for(lambda: receiver.poll() == KVPoll.Success, what=what)
    assert count_mismatches(decode.pool, room, PAGES) == 0


def mark_dead(decode):
    """What the tick does when the prefill has been silent for the peer timeout."""
    with decode._lock:
        decode._peer_dead_locked(decode.peers[0], time.monotonic())


def counters(decode) -> dict:
    return decode.counters.snapshot()


def scrape(node) -> dict[str, float]:
    """The decode node's metrics, by name without the prefix (one sample each)."""
    return {family.samples[0].name.removeprefix("dsa_bridge_"): family.samples[0].value
            for family in metrics.NodeCollector(node, "decode").collect() if family.samples}


def test_a_silent_prefills_pages_wait_for_its_new_handshake(pair):
    engine, prefill, decode = pair()
    receiver, sender = start_write(engine, prefill, decode, 1)
    mark_dead(decode)
    assert receiver.poll() == KVPoll.Failed and "unreachable" in receiver.state.reason
    assert decode.held_pages() == decode.quarantined_pages() == PAGES.size
    assert counters(decode)["quarantines"] == 1 and counters(decode)["pages_quarantined"] == 4
    assert scrape(decode) | {"pages_quarantined": 4, "pages_held": 4, "quarantines_total": 1,
                             "quarantined_pages_total": 4} == scrape(decode)
    # decode re-handshakes at once; prefill drops the old session's rooms but answers only
    # once the held write is over: meanwhile nothing is released, new requests fail fast
    wait_for(lambda: sender.poll() == KVPoll.Failed, what="prefill dropping the old session")
    assert "re-handshaked" in sender.state.reason
    time.sleep(1.5)  # longer than the 1 s after which the pages used to be released
    assert not receiver.can_release() and not decode.peers[0].alive
    early = decode.receiver(2)
    early.init([10])
    assert early.poll() == KVPoll.Failed and "unreachable" in early.state.reason
    assert early.can_release()  # nothing was asked of the dead prefill
    engine.gate.set()  # the write completes, then prefill answers the new Hello
    wait_for(receiver.can_release, what="the quarantine lifted by the new handshake")
    assert decode.peers[0].alive and decode.peers[0].epoch >= 1
    assert count_mismatches(decode.pool, 1, PAGES) == 0  # the late write landed before release
    assert decode.held_pages() == decode.quarantined_pages() == 0
    c = counters(decode)
    assert c["peer_recoveries"] == 1 and c["quarantine_expiries"] == 0
    assert scrape(decode) | {"pages_quarantined": 0, "peer_recoveries_total": 1,
                             "quarantine_expiries_total": 0} == scrape(decode)
    decode.forget(receiver)
    # after recovery the same pages serve a new request, and nothing else lands in them
    transfer_whole(prefill, decode, 3, "a request after recovery")
    others = np.setdiff1d(np.arange(1, decode.pool.num_kv_pages), np.concatenate([PAGES, [10]]))
    assert sentinel_intact(decode.pool, others)


def test_a_failed_write_of_the_old_session_is_named_in_the_answer(pair):
    """The held write fails (its bytes may still land): prefill's answer names the room, and
    decode holds its pages for the engine's grace after recovery."""
    engine, prefill, decode = pair(in_flight_grace_s=1.0)
    engine.fail = True
    receiver, _ = start_write(engine, prefill, decode, 1)
    mark_dead(decode)
    engine.gate.set()
    wait_for(lambda: decode.peers[0].alive, what="recovery")
    recovered = time.monotonic()
    assert not receiver.can_release()  # named in the answer: the engine grace runs
    wait_for(receiver.can_release, what="the engine grace")
    assert time.monotonic() - recovered >= 0.9
    assert counters(decode)["quarantine_expiries"] == 0


def test_the_quarantine_bound_releases_and_counts_an_expiry(pair):
    engine, prefill, decode = pair(quarantine_timeout_s=1.0)
    receiver, _ = start_write(engine, prefill, decode, 1)
    mark_dead(decode)
    assert not receiver.can_release()
    wait_for(receiver.can_release, timeout_s=10, what="the bound")
    assert time.monotonic() - receiver.state.finished_at >= 1.0
    c = counters(decode)
    assert (c["quarantines"], c["quarantine_expiries"], c["pages_expired"]) == (1, 1, 4)
    assert scrape(decode) | {"quarantine_expiries_total": 1, "expired_pages_total": 4} == scrape(decode)
    assert decode.quarantined_pages() == 0


def test_a_prefill_whose_process_is_gone_releases_its_pages(pair):
    """The control connection closes and every reconnect is refused: proof the process (and its
    engine) is gone, after DEAD_PEER_GRACE_S, long before the bound."""
    _, prefill, decode = pair()
    receiver = decode.receiver(1)
    receiver.init(PAGES)
    wait_for(lambda: not prefill.incoming.empty(), what="the request at prefill")
    prefill.close()
    wait_for(lambda: receiver.poll() == KVPoll.Failed, what="the peer timeout")
    assert "unreachable" in receiver.state.reason
    wait_for(receiver.can_release, timeout_s=10, what="the proof")
    c = counters(decode)
    assert (c["quarantines"], c["quarantine_expiries"], c["peer_recoveries"]) == (1, 0, 0)
    assert decode.peers[0].proven_gone


@pytest.mark.parametrize("bad", [0, -1.0, float("nan")])
def test_the_bound_must_be_positive(bad):
    with pytest.raises(ValueError, match="quarantine_timeout_s must be > 0"):
        DecodeNode(make_pool(), FakeBackend(), "127.0.0.1:1", quarantine_timeout_s=bad)


def test_a_prefill_restarted_on_the_same_port_is_handshaken_again(pair):
    """The old prefill closes (its rooms' pages proven free), a new one listens on its port: the
    reconnect brings one Hello, the new node answers, and requests succeed again."""
    _, prefill, decode = pair()
    port = prefill.endpoint.rsplit(":", 1)[1]
    receiver = decode.receiver(1)
    receiver.init(PAGES)
    wait_for(lambda: not prefill.incoming.empty(), what="the request at prefill")
    prefill.close()
    wait_for(receiver.can_release, timeout_s=10, what="the proof that the old process is gone")
    dead = decode.receiver(2)
    dead.init([10])
    assert dead.poll() == KVPoll.Failed and "unreachable" in dead.state.reason
    with PrefillNode(make_pool(), FakeBackend(), listen=f"127.0.0.1:{port}", heartbeat_s=0.1) as new:
        wait_for(lambda: decode.peers[0].alive, what="the new handshake")
        assert new.counters.snapshot()["handshakes_ok"] == 1
        transfer_whole(new, decode, 3, "a request to the new node")
        assert new._loop.bad_messages <= 1  # at most a heartbeat that preceded the Hello
    assert decode.counters.snapshot()["peer_recoveries"] == 1


@pytest.mark.slow
def test_a_decode_the_prefill_dropped_comes_back_within_its_peer_timeout():
    """Decode silent past prefill's peer timeout (as a frozen decode is): prefill drops it and
    stops its heartbeats; decode's next request is refused as unpaired (or, hearing nothing,
    decode marks the prefill dead first), and decode re-handshakes at once. A request made
    meanwhile fails with a reason; the next one succeeds, with no new node."""
    prefill = PrefillNode(make_pool(), FakeBackend(), peer_timeout_s=1.0, heartbeat_s=0.1)
    decode = DecodeNode(make_pool(size=64 * 24, sentinel=True), FakeBackend(), prefill.endpoint,
                        peer_timeout_s=2.0, heartbeat_s=0.1)
    try:
        with decode._lock:  # decode sends no heartbeat for a while
            decode._liveness.next_heartbeat = time.monotonic() + 1000.0
        wait_for(lambda: not prefill.peers(), 10, "prefill dropping the silent decode")
        with decode._lock:
            decode._liveness.next_heartbeat = 0.0
        outcomes = []
        for room in range(1, 6):
            fill_request(prefill.pool, room, PAGES)
            receiver = decode.receiver(room)
            receiver.init(PAGES)
            sender = prefill.sender(room)
            sender.init(PAGES.size)
            sender.send(PAGES)
            wait_for(lambda r=receiver: r.poll() in (KVPoll.Success, KVPoll.Failed), 30, f"room {room}")
            outcomes.append((receiver.poll(), receiver.state.reason))
            if receiver.poll() == KVPoll.Success:
                break
            time.sleep(0.5)
        assert outcomes[-1][0] == KVPoll.Success, outcomes
        assert all("unreachable" in reason or "unpaired" in reason
                   for status, reason in outcomes[:-1]), outcomes
        assert counters(decode)["peer_recoveries"] == 1
        assert count_mismatches(decode.pool, room, PAGES) == 0
    finally:
        prefill.close()
        decode.close()
