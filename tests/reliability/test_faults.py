"""Faults a real cluster produces, each injected into real node processes with a deadline.

A prefill or decode process killed mid-transfer, a peer that accepts connections and never
answers, a decode node frozen with SIGSTOP under a prefill's write, an engine whose writes fail
every Nth call, and requests aborted on either side while their write is still landing. Every
affected request must end Failed with a reason, every unaffected one byte-exact, nothing may
hang, pages of a request are never released while a write into them can still land, and every
process the test started must be gone at the end.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import threading

import numpy as np
import pytest
import zmq

from dsa_bridge.transfer import protocol
from dsa_bridge.transfer.backends import BACKENDS, create_backend
from dsa_bridge.transfer.backends.base import BackendError
from dsa_bridge.transfer.decode import DecodeNode
from dsa_bridge.transfer.handshake import HandshakeError, pool_buffers
from dsa_bridge.transfer.launcher.drivers import (
    count_mismatches,
    fill_request,
    reset_pages,
    sentinel_intact,
    serve_prefill,
)
from dsa_bridge.transfer.prefill import PrefillNode
from dsa_bridge.transfer.request import KVPoll
from tests.faulty import DELAY_ENV, EVERY_ENV, HALF_LANDED, WRITES_ATTEMPTED, FaultyBackend

from ..transfer.fake_backend import FakeBackend
from ..transfer.helpers import wait_for
from .helpers import (
    DEEPSEEK,
    buffer_matches,
    buffer_untouched,
    fence_state,
    make_pool,
    settled,
)
from .netns import loopback_hosts
from .procs import Hang, decode, gone, listening, prefill, summary

CATEGORY = "faults injected"
LO = loopback_hosts(1)[0]
NODE = ("--pool-tokens", str(64 * 48), "--request-timeout", "120")
FIRST, LAST = DEEPSEEK.layer_ids[0], DEEPSEEK.layer_ids[-1]
PAGE_BYTES = (DEEPSEEK.kv_page_bytes + DEEPSEEK.index_page_bytes) * DEEPSEEK.num_layers
# The prefill's write timeout where a frozen decode node never finishes a write: that write must
# time out and every other must not. The others move at most 24 MB each, well under a second even
# at a load average of 16 on 2 cores; the rest is the margin for load (2 s was within its reach).
WRITE_TIMEOUT_S = 5.0
# How long decode holds the pages of a request whose failed write may still land, from the report.
# The test looks at every request every few milliseconds: it sees each failure long before that.
IN_FLIGHT_GRACE_S = 3.0


def request_pages(count: int, per_request: int, start: int = 1) -> list[np.ndarray]:
    return [np.arange(start + i * per_request, start + (i + 1) * per_request)
            for i in range(count)]


def verified_bytes(pool, receivers_pages) -> tuple[int, int]:
    """(bytes verified, bytes that differ) over successful requests."""
    verified = lost = 0
    for receiver, pages in receivers_pages:
        if receiver.poll() == KVPoll.Success:
            verified += pages.size * PAGE_BYTES
            lost += count_mismatches(pool, receiver.room, pages)
    return verified, lost


@pytest.mark.parametrize("backend", BACKENDS)
def test_prefill_killed_mid_transfer(backend, procs, ledger):
    victim = prefill(procs, LO, backend, *NODE, "--chunk-pages", "1", name="victim",
                     env={DELAY_ENV: "150"})
    other = prefill(procs, LO, backend, *NODE, name="other")
    listening(procs, victim, other)
    with DecodeNode(make_pool(), create_backend(backend), [victim.endpoint, other.endpoint],
                    peer_timeout_s=2.0, request_timeout_s=90.0) as node:
        requests = []
        for room, pages in enumerate(request_pages(8, 5)):
            receiver = node.receiver(room, prefill=(victim, other)[room % 2].endpoint)
            receiver.init(pages)
            requests.append((receiver, pages))
        on_victim = [r for r, _ in requests[0::2]]
        wait_for(lambda: any(r.chunks for r in on_victim), 60, "a chunk from the victim")
        victim.kill()
        wait_for(lambda: settled(*(r for r, _ in requests)), 30, "every request settled")
        failed = [r for r in on_victim if r.poll() == KVPoll.Failed]
        verified, lost = verified_bytes(node.pool, requests)
        ledger.record(tried=1, ok=len(requests) - len(failed), failed=len(failed),
                      bytes_verified=verified, bytes_lost=lost)
        assert failed, "the kill came after the victim's requests had finished"
        assert all("unreachable" in str(r.failure_exception()) for r in failed)
        assert all(r.poll() == KVPoll.Success for r, _ in requests[1::2]) and lost == 0
        wait_for(lambda: all(r.can_release() for r in failed), 10, "failed pages released")
        late = node.receiver(100, prefill=other.endpoint)  # the decode node keeps serving
        late.init(np.arange(41, 45))
        wait_for(lambda: settled(late), 60, "a request after the kill")
        assert late.poll() == KVPoll.Success
        assert count_mismatches(node.pool, 100, np.arange(41, 45)) == 0
    assert gone(victim.pid)


@pytest.mark.parametrize("backend", BACKENDS)
def test_decode_killed_mid_transfer(backend, procs, ledger):
    capacity = 24
    node_opts = ("--pool-tokens", str(64 * capacity), "--peer-timeout", "2", "--request-timeout",
                 "120")
    server = prefill(procs, LO, backend, *node_opts, "--chunk-pages", "2",
                     env={DELAY_ENV: "100"})
    listening(procs, server)
    victim = decode(procs, LO, backend, server.endpoint, "--pool-tokens", str(64 * 48),
                    "--requests", "64", "--max-tokens", "512", "--concurrency", "4", name="victim")
    with DecodeNode(make_pool(), create_backend(backend), server.endpoint,
                    peer_timeout_s=5.0, request_timeout_s=120.0) as node:
        requests = []
        for room, pages in enumerate(request_pages(3, 6), start=1000):
            receiver = node.receiver(room)
            receiver.init(pages)
            requests.append((receiver, pages))
        wait_for(lambda: "[decode] " in victim.output() and any(r.chunks for r, _ in requests),
                 90, "both decode nodes receiving")
        wait_for(lambda: settled(*(r for r, _ in requests)), 90, "the survivor's requests")
        # the victim's requests finish together (one engine write) and it then checks their bytes
        # before it asks for more: killed in the delay of a write of its own, not in such a gap
        writes = server.output().count(HALF_LANDED)
        wait_for(lambda: server.output().count(HALF_LANDED) > writes, 90, "a write to the victim")
        victim.kill()
        verified, lost = verified_bytes(node.pool, requests)
        # the whole prefill pool: only servable once the victim's pages were freed
        whole = node.receiver(50)
        whole.init(np.arange(1, capacity + 1))
        wait_for(lambda: settled(whole), 90, "a request as large as the prefill pool")
        requests.append((whole, np.arange(1, capacity + 1)))
        more_verified, more_lost = verified_bytes(node.pool, requests[-1:])
        verified, lost = verified + more_verified, lost + more_lost
    assert server.stop() == 0
    counters, log = server.counters(), server.output()
    ledger.record(tried=1, ok=len(requests), failed=counters["requests_failed"],
                  bytes_verified=verified, bytes_lost=lost)
    assert all(r.poll() == KVPoll.Success for r, _ in requests), [r.state.reason for r, _ in requests]
    assert lost == 0
    assert counters["requests_failed"] >= 1, log[-3000:]
    # its requests failed, by an engine error or when the node was dropped as unreachable
    assert "engine write failed" in log or f"decode decode-{victim.pid} silent for" in log
    assert gone(victim.pid)


class SilentListener:
    """A raw TCP listener that accepts connections and never sends a byte."""

    def __init__(self):
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.sock.settimeout(0.1)
        self.port = self.sock.getsockname()[1]
        self.accepted: list[socket.socket] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                self.accepted.append(self.sock.accept()[0])
            except TimeoutError:
                continue

    def hang_up(self) -> None:
        """Close the connections accepted so far (the listener keeps listening)."""
        for conn in self.accepted:
            conn.close()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.sock.close()
        self.hang_up()


@pytest.fixture
def silent():
    listener = SilentListener()
    yield listener
    listener.close()


@pytest.mark.parametrize("backend", BACKENDS)
def test_decode_handshake_with_a_silent_peer_times_out(backend, silent, ledger):
    engine = create_backend(backend)
    with pytest.raises(HandshakeError, match="did not answer within 2s"):
        DecodeNode(make_pool(pages=4), engine, f"127.0.0.1:{silent.port}", handshake_timeout_s=2)
    ledger.record(tried=1, failed=1)
    assert silent.accepted, "the decode node never connected"
    with pytest.raises(BackendError, match="backend is closed"):  # the node closed its engine
        engine.register([])


def rogue_request(endpoint: str, engine_session: str, room: int, pages: list[int]):
    """A decode node that pairs with an engine session of its choosing and asks for ``room``;
    returns prefill's ChunkDone report for the room."""
    hello = protocol.Hello(protocol.PROTOCOL_VERSION, "rogue", "mooncake", DEEPSEEK.to_dict(),
                           DEEPSEEK.layout_hash(), engine_session.encode(),
                           pool_buffers(make_pool(pages=8)),
                           list(DEEPSEEK.index_layer_ids))
    context = zmq.Context()
    sock = context.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(f"tcp://{endpoint}")
        sock.send(protocol.encode(hello))
        assert sock.poll(10_000) and protocol.decode(sock.recv()).ok
        sock.send(protocol.encode(protocol.RequestPages(room, pages, 64 * len(pages))))
        while True:
            if not sock.poll(20_000):
                raise Hang("no report for the rogue's room within 20s")
            message = protocol.decode(sock.recv())
            if isinstance(message, protocol.ChunkDone):
                return message
    finally:
        sock.close(0)
        context.term()


def test_prefill_write_to_a_silent_engine_peer_times_out(silent, ledger):
    """Mooncake: a decode node whose engine session is a port that accepts and never answers.
    The write times out and the request fails with a reason that says its pages may still be
    written. Mooncake's own handshake with it would stall every write of the engine for 60 s
    (hard-coded); the backend's probe runs first and holds nothing, so the good decode node's
    request meanwhile is expected to succeed (a failure with a reason would still be no hang),
    and the node serves as well after the silent peer hangs up."""
    stop = threading.Event()
    with PrefillNode(make_pool(), create_backend("mooncake"), write_timeout_s=2.0) as node:
        thread = threading.Thread(target=serve_prefill, args=(node, stop), daemon=True)
        thread.start()
        try:
            report = rogue_request(node.endpoint, f"127.0.0.1:{silent.port}", 7, [1, 2])
            assert not report.ok and report.in_flight and "not done after 2" in report.reason
            with DecodeNode(make_pool(), create_backend("mooncake"), node.endpoint) as good:
                stalled = good.receiver(8)
                stalled.init([3, 4])
                wait_for(lambda: settled(stalled), 30, "a request during the stall")
                assert stalled.poll() == KVPoll.Success or "engine write failed" in stalled.state.reason
                silent.hang_up()
                receiver = good.receiver(9)
                receiver.init([5, 6, 7])
                wait_for(lambda: settled(receiver), 60, "a request after the silent peer left")
                assert receiver.poll() == KVPoll.Success, receiver.state.reason
                assert count_mismatches(good.pool, 9, np.array([5, 6, 7])) == 0
        finally:
            stop.set()
            thread.join(10)
        failed = node.counters.snapshot()["requests_failed"]
    ledger.record(tried=1, ok=3 - failed, failed=failed,
                  bytes_verified=(3 + 2 * (stalled.poll() == KVPoll.Success)) * PAGE_BYTES)


class FreezeAtWrite(FaultyBackend):
    """Freezes (SIGSTOP) a decode process right before the prefill's ``at``-th write."""

    def __init__(self, inner, at: int):
        super().__init__(inner)
        self.at = at
        self.pid = 0
        self.frozen = threading.Event()

    def write(self, peer, src, dst, length, *, timeout_s):
        if self.writes + 1 == self.at:
            os.kill(self.pid, signal.SIGSTOP)
            self.frozen.set()
        super().write(peer, src, dst, length, timeout_s=timeout_s)


@pytest.mark.parametrize("backend", BACKENDS)
def test_write_into_a_frozen_decode_times_out(backend, procs, ledger, monkeypatch):
    """The decode node is frozen (after one served request, its engine connected) right before
    the prefill's next write into it: the write times out, that request fails, and a second
    decode node is served meanwhile. NIXL runs UCX over TCP here, as between two hosts: over CMA
    (its choice between processes of one host) it writes a stopped process's memory without the
    process's help, and only the heartbeats notice the freeze."""
    if backend == "nixl":
        monkeypatch.setenv("UCX_TLS", "tcp")  # read by this process's agent and the children's
    at = 2
    engine = FreezeAtWrite(create_backend(backend), at=at)
    stop = threading.Event()
    with PrefillNode(make_pool(), engine, write_timeout_s=WRITE_TIMEOUT_S, peer_timeout_s=60.0) as node:
        thread = threading.Thread(target=serve_prefill, args=(node, stop), daemon=True)
        thread.start()
        try:
            victim = decode(procs, LO, backend, node.endpoint, *NODE, "--requests", "3",
                            "--concurrency", "1", "--max-tokens", "256", name="victim")
            engine.pid = victim.pid
            wait_for(lambda: node.counters.snapshot()["engine_failures"] == 1, 60,
                     "the write into the frozen decode timed out")
            assert engine.frozen.is_set() and node.counters.snapshot()["requests_ok"] == at - 1
            survivor = decode(procs, LO, backend, node.endpoint, *NODE, "--requests", "4",
                              "--max-tokens", "512", name="survivor")
            result = summary(procs, survivor, 120)
            victim.kill()
        finally:
            stop.set()
            thread.join(10)
        counters = node.counters.snapshot()
    ledger.record(tried=1, ok=counters["requests_ok"], failed=counters["requests_failed"],
                  bytes_verified=result["bytes_verified"], bytes_lost=result["bytes_mismatched"])
    assert result["ok"] and result["requests_ok"] == 4, result["failures"]
    assert counters["requests_failed"] == 1 and counters["requests_ok"] == at - 1 + 4
    assert gone(victim.pid)


def writes_attempted(server) -> int:
    """How many engine writes a stopped fault-injecting prefill attempted (logged at its close)."""
    found = re.findall(rf"{WRITES_ATTEMPTED}: (\d+)", server.output())
    assert found, f"{server.name} logged no write count:\n{server.output()[-3000:]}"
    return int(found[-1])


@pytest.mark.parametrize("backend", BACKENDS)
def test_engine_write_failing_every_third_call(backend, procs, ledger):
    """The prefill's engine fails every third write, half of it written. Its writer batches the
    chunks queued for one decode node into one write, so how many writes 12 requests take depends
    on timing: the requests go in 9 waves (each settled before the next: at least 9 writes, so at
    least 3 failures), 3 waves with a second, 3-page request beside the 1-page one, and the
    failures are counted against the writes the prefill really attempted."""
    server = prefill(procs, LO, backend, *NODE, "--chunk-pages", "1", env={EVERY_ENV: "3"})
    listening(procs, server)
    singles, triples = request_pages(9, 1), request_pages(3, 3, start=20)
    with DecodeNode(make_pool(), create_backend(backend), server.endpoint,
                    in_flight_grace_s=IN_FLIGHT_GRACE_S) as node:
        requests = []
        held_at_failure = {}  # room -> were its pages held when it was first seen Failed?

        def watch(wave) -> bool:
            for receiver, _ in wave:
                if receiver.poll() == KVPoll.Failed and receiver.room not in held_at_failure:
                    held_at_failure[receiver.room] = not receiver.can_release()
            return settled(*(r for r, _ in wave))

        for i, pages in enumerate(singles):
            wave = [(node.receiver(i), pages)]
            if i % 3 == 0:
                wave.append((node.receiver(len(singles) + i // 3), triples[i // 3]))
            for receiver, wave_pages in wave:
                receiver.init(wave_pages)
            requests += wave
            wait_for(lambda wave=wave: watch(wave), 90, f"wave {i} settled",
                     detail=lambda wave=wave: "; ".join(fence_state(r) for r, _ in wave))
        failed = [(r, p) for r, p in requests if r.poll() == KVPoll.Failed]
        verified, lost = verified_bytes(node.pool, requests)
        reasons = {r.room: str(r.failure_exception()) for r, _ in failed}
        assert all(held_at_failure[r.room] for r, _ in failed), \
            f"failed pages were released at once: {held_at_failure}"
        assert all("injected failure" in reason for reason in reasons.values()), reasons
        # part of each failed write landed, yet its requests are Failed and their pages held; a
        # write that batched two requests' chunks may have landed only in the first one's pages
        assert any(buffer_matches(node.pool, r.room, p[:1], FIRST, "kv") for r, p in failed), \
            f"no failed request's first page holds its bytes; failed: {reasons}"
        # released once the grace has run from the last report (seconds ago): 12 s of margin
        wait_for(lambda: all(r.can_release() for r, _ in failed), IN_FLIGHT_GRACE_S + 12,
                 "pages after the grace",
                 detail=lambda: "; ".join(fence_state(r) for r, _ in failed if not r.can_release()))
    assert server.stop() == 0
    counters, attempted = server.counters(), writes_attempted(server)
    ledger.record(tried=counters["engine_failures"], ok=len(requests) - len(failed),
                  failed=len(failed), bytes_verified=verified, bytes_lost=lost)
    # every third write attempted failed, and each failed write failed the requests it batched:
    # the writes the reasons name are exactly those
    failed_writes = {int(re.search(r"injected failure \(write (\d+)", reason)[1])
                     for reason in reasons.values()}
    seen = (f"{attempted} writes attempted, failed writes named {sorted(failed_writes)}, "
            f"counters {counters}, reasons {reasons}")
    assert attempted >= len(singles), seen  # one write at least per wave
    assert failed_writes == set(range(3, attempted + 1, 3)), seen
    assert counters["engine_failures"] == attempted // 3, seen
    assert counters["requests_ok"] == len(requests) - len(failed) and lost == 0, seen


@pytest.mark.parametrize("backend", BACKENDS)
def test_decode_abort_while_the_write_is_landing(backend, procs, ledger):
    """Decode aborts a request whose write has landed half (the other half is 2.5 s away) and a
    second one queued behind it: neither's pages are released before prefill confirms (by proof,
    never by the quarantine's bound), by then the first write has fully landed and the second
    never started; afterwards nothing lands in them, and the next request in the same pages sees
    only its own bytes. Prefill may confirm the queued one at once (no write of it started: it
    may not even have a sender yet), so only the landing one is certainly still held after the
    abort."""
    server = prefill(procs, LO, backend, *NODE, env={DELAY_ENV: "2500"})
    listening(procs, server)
    landing_pages, queued_pages = np.arange(1, 5), np.arange(5, 8)
    with DecodeNode(make_pool(), create_backend(backend), server.endpoint,
                    in_flight_grace_s=120.0) as node:
        landing, queued = node.receiver(1), node.receiver(2)
        landing.init(landing_pages)
        wait_for(lambda: buffer_matches(node.pool, 1, landing_pages, FIRST, "kv"), 60,
                 "the first half of the write")
        queued.init(queued_pages)
        assert buffer_untouched(node.pool, landing_pages, LAST, "index")  # still in flight
        landing.abort("client went away")
        queued.abort("client went away")
        assert landing.poll() == queued.poll() == KVPoll.Failed
        assert not landing.can_release()  # its write is in flight for 2.5 s more
        wait_for(lambda: landing.can_release() and queued.can_release(), 30,
                 "prefill's confirmation", detail=lambda: f"{fence_state(landing)}; {fence_state(queued)}")
        assert not landing.fence.expired and not queued.fence.expired  # released by proof
        assert count_mismatches(node.pool, 1, landing_pages) == 0  # landed before the release
        assert sentinel_intact(node.pool, queued_pages)  # never written
        reset_pages(node.pool, landing_pages)
        wait_for(lambda: server.output().count("aborted by decode") >= 2, 10, "prefill's log")
        assert sentinel_intact(node.pool, landing_pages)  # nothing landed after the release
        node.forget(landing)
        node.forget(queued)
        reuse = node.receiver(3)
        reuse.init(landing_pages)
        wait_for(lambda: settled(reuse), 60, "a request reusing the pages")
        assert reuse.poll() == KVPoll.Success
        lost = count_mismatches(node.pool, 3, landing_pages)
    ledger.record(tried=2, ok=1, failed=2, bytes_verified=4 * PAGE_BYTES, bytes_lost=lost)
    assert lost == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_prefill_abort_while_the_write_is_landing(backend, ledger):
    """Prefill aborts a request whose write has landed half: decode hears of it only once the
    write has returned, so its pages are never released while bytes can still land in them."""
    engine = FaultyBackend(create_backend(backend), delay_s=1.5)
    pages = np.arange(10, 14)
    with (PrefillNode(make_pool(), engine) as prefill_node,
          DecodeNode(make_pool(), create_backend(backend), prefill_node.endpoint) as node):
        fill_request(prefill_node.pool, 1, pages)
        receiver = node.receiver(1)
        receiver.init(pages)
        sender = prefill_node.sender(1)
        sender.init(pages.size)
        sender.send(pages)
        wait_for(engine.in_flight.is_set, 30, "the first half of the write")
        sender.abort("evicted by the scheduler")
        assert sender.poll() == KVPoll.Failed and not sender.can_release()
        assert receiver.poll() != KVPoll.Failed  # not told before the write returned
        wait_for(lambda: receiver.poll() == KVPoll.Failed, 30, "decode told of the abort")
        assert receiver.can_release() and sender.can_release()
        assert "evicted by the scheduler" in str(receiver.failure_exception())
        assert count_mismatches(node.pool, 1, pages) == 0  # everything landed before
        reset_pages(node.pool, pages)
        node.forget(receiver)
        fill_request(prefill_node.pool, 2, pages)
        reuse = node.receiver(2)
        reuse.init(pages)
        later = prefill_node.sender(2)
        later.init(pages.size)
        later.send(pages)
        wait_for(lambda: settled(reuse), 30, "a request reusing the pages")
        assert reuse.poll() == KVPoll.Success
        lost = count_mismatches(node.pool, 2, pages)
    ledger.record(tried=1, ok=1, failed=1, bytes_verified=4 * PAGE_BYTES, bytes_lost=lost)
    assert lost == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_failed_chunk_keeps_the_pages_held_when_later_chunks_are_skipped(backend, ledger):
    """All three chunks are queued before decode's pages arrive; the first fails with half its
    bytes written and the other two are skipped. Decode must still hold the pages (the failed
    write may keep landing), not release them because the last skipped chunk wrote nothing."""
    engine = FaultyBackend(create_backend(backend), fail_every=1)
    pages = np.arange(1, 7)
    with (PrefillNode(make_pool(), engine) as prefill_node,
          DecodeNode(make_pool(), create_backend(backend), prefill_node.endpoint,
                     in_flight_grace_s=60.0) as node):
        fill_request(prefill_node.pool, 1, pages)
        sender = prefill_node.sender(1)
        sender.init(pages.size)
        for chunk in np.array_split(pages, 3):
            sender.send(chunk)
        receiver = node.receiver(1)
        receiver.init(pages)
        wait_for(lambda: settled(receiver), 30, "the failure report")
        assert receiver.poll() == KVPoll.Failed and "injected failure" in receiver.state.reason
        assert engine.writes == 1 and buffer_matches(node.pool, 1, pages[:1], FIRST, "kv")
        assert not receiver.can_release(), "pages released while the failed write may land"
    ledger.record(tried=1, failed=1)


def test_a_room_whose_decode_node_died_fails_as_soon_as_prefill_takes_it_up(ledger):
    """The decode node dies while its room waits on ``incoming`` for the application (say, for
    free pages): the sender made afterwards fails at once, so its pages are not held until the
    request timeout."""
    with PrefillNode(make_pool(), FakeBackend(), peer_timeout_s=1.0, heartbeat_s=0.1,
                     request_timeout_s=120.0) as node:
        decode_node = DecodeNode(make_pool(), FakeBackend(), node.endpoint, heartbeat_s=0.1)
        decode_node.receiver(4).init([1, 2])
        incoming = node.incoming.get(timeout=10)
        decode_node.close()
        wait_for(lambda: not node.peers(), 10, "the dead decode node dropped")
        sender = node.sender(incoming.room)
        ledger.record(tried=1, failed=1)
        assert sender.poll() == KVPoll.Failed and "unreachable" in sender.state.reason
        assert sender.can_release()
