"""Prefill and decode node logic, in one process over an in-process memmove engine.

These drive the request state machine, the handshake checks and every bad-request path fast;
the same paths run over real engines in real processes in tests/integration."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from dsa_bridge.transfer import protocol
from dsa_bridge.transfer.decode import DecodeNode
from dsa_bridge.transfer.handshake import HandshakeError
from dsa_bridge.transfer.launcher.drivers import count_mismatches, fill_request, sentinel_intact
from dsa_bridge.transfer.prefill import PrefillNode
from dsa_bridge.transfer.request import KVPoll

from .fake_backend import FakeBackend
from .helpers import SMALL_CONFIG, aux_tensors, infos, make_pool, wait_for


def transfer(prefill, decode, room, src_pages, dst_pages, chunks=1):
    fill_request(prefill.pool, room, np.asarray(src_pages))
    receiver = decode.receiver(room)
    receiver.init(dst_pages, num_tokens=len(dst_pages) * 64)
    sender = prefill.sender(room)
    sender.init(len(src_pages))
    for chunk in np.array_split(np.asarray(src_pages), chunks):
        sender.send(chunk)
    wait_for(lambda: receiver.poll() in (KVPoll.Success, KVPoll.Failed), what="request end")
    return sender, receiver


def test_every_byte_of_every_layer_arrives(nodes):
    prefill, decode = nodes()
    src, dst = [9, 3, 4, 5, 17], [2, 11, 12, 13, 1]
    sender, receiver = transfer(prefill, decode, 1, src, dst)
    assert receiver.poll() == KVPoll.Success, receiver.failure_exception()
    wait_for(lambda: sender.poll() == KVPoll.Success)
    assert count_mismatches(decode.pool, 1, np.array(dst)) == 0
    untouched = np.setdiff1d(np.arange(1, decode.pool.num_kv_pages), dst)
    assert sentinel_intact(decode.pool, untouched)
    layout = decode.pool.layout
    assert receiver.nbytes == 5 * (layout.kv_page_bytes + layout.index_page_bytes) * 4
    runs = 3  # 9 | 3,4,5 -> 11,12,13 | 17
    assert receiver.descriptors == runs * layout.num_layers * 2
    assert prefill.counters.snapshot()["bytes"] == receiver.nbytes
    assert receiver.can_release()


def test_chunked_send_and_sender_created_after_decode_request(nodes):
    prefill, decode = nodes()
    dst = list(range(1, 21))
    receiver = decode.receiver(5)
    receiver.init(dst)
    item = wait_for(lambda: not prefill.incoming.empty() and prefill.incoming.get())
    assert (item.room, item.num_pages) == (5, 20)
    src = np.arange(30, 10, -1)
    fill_request(prefill.pool, 5, src)
    sender = prefill.sender(5)
    assert sender.poll() == KVPoll.WaitingForInput
    sender.init(20)
    for chunk in np.array_split(src, 4):
        sender.send(chunk)
    wait_for(lambda: receiver.poll() == KVPoll.Success)
    assert receiver.chunks == 4
    assert count_mismatches(decode.pool, 5, np.array(dst)) == 0


def test_concurrent_requests(nodes):
    prefill, decode = nodes()
    receivers = []
    for room in range(6):
        src = np.arange(1 + room * 5, 6 + room * 5)[::-1].copy()
        dst = np.arange(1 + room * 3, 4 + room * 3)
        fill_request(prefill.pool, room, src[:3])
        receiver = decode.receiver(room)
        receiver.init(dst)
        sender = prefill.sender(room)
        sender.init(3)
        sender.send(src[:3])
        receivers.append((receiver, dst))
    for receiver, dst in receivers:
        wait_for(lambda r=receiver: r.poll() == KVPoll.Success)
        assert count_mismatches(decode.pool, receiver.room, dst) == 0


MISMATCHES = [
    ("page size", dict(page_size=32), "page_size"),
    ("kv dtype / item_len", dict(kv_dtype="bf16"), "kv_dtype|kv_row_bytes|kv_page_bytes"),
    ("indexer geometry", dict(config={**SMALL_CONFIG, "index_head_dim": 256}), "index"),
    ("kv lora rank", dict(config={**SMALL_CONFIG, "kv_lora_rank": 256}), "kv_lora_rank|kv_row"),
]


@pytest.mark.parametrize("label, change, field", MISMATCHES, ids=[m[0] for m in MISMATCHES])
def test_handshake_mismatch_is_refused_naming_the_field(label, change, field):
    config = change.pop("config", None)
    decode_pool = make_pool(config, size=64 * 8, sentinel=True, **change)
    prefill_engine = FakeBackend()
    with PrefillNode(make_pool(), prefill_engine) as prefill:
        with pytest.raises(HandshakeError, match=f"layout mismatch: ({field})"):
            DecodeNode(decode_pool, FakeBackend(), prefill.endpoint)
        wait_for(lambda: prefill.counters.snapshot()["handshakes_refused"] == 1)
        assert prefill.refusals and "layout mismatch" in prefill.refusals[0]
        assert prefill_engine.writes == 0
    assert sentinel_intact(decode_pool, np.arange(1, decode_pool.num_kv_pages))


def test_protocol_version_mismatch(monkeypatch):
    with PrefillNode(make_pool(), FakeBackend()) as prefill:
        monkeypatch.setattr(protocol, "PROTOCOL_VERSION", 99)
        with pytest.raises(HandshakeError, match="protocol version: peer 99 != local 3"):
            DecodeNode(make_pool(), FakeBackend(), prefill.endpoint)


def test_backend_mismatch():
    other = FakeBackend()
    other.name = "nixl"
    with PrefillNode(make_pool(), FakeBackend()) as prefill:
        with pytest.raises(HandshakeError, match="backend: peer 'nixl' != local 'mooncake'"):
            DecodeNode(make_pool(), other, prefill.endpoint)


def test_no_prefill_listening_times_out():
    with pytest.raises(HandshakeError, match="did not answer within 1s"):
        DecodeNode(make_pool(), FakeBackend(), "127.0.0.1:9", handshake_timeout_s=1.0)


@pytest.mark.parametrize("pages, message", [
    ([0, 1], "page 0 is padding"),
    ([1, 25], "beyond the registered 25 pages"),
    ([2, 2], "more than once"),
    ([], "is empty"),
])
def test_decode_refuses_bad_pages_locally(nodes, pages, message):
    _, decode = nodes()
    with pytest.raises(ValueError, match=message):
        decode.receiver(1).init(pages)


def raw_request(decode, room, pages):
    """Bypass the receiver's own checks, as a misbehaving decode node would."""
    receiver = decode.receiver(room)
    receiver.page_ids = np.asarray(pages)
    receiver.state.advance(KVPoll.WaitingForInput, 0.0)
    decode._loop.send(decode.peers[0].socket, protocol.RequestPages(room, pages, 64))
    return receiver


@pytest.mark.parametrize("pages, message", [
    ([0, 1], "page 0 is padding"),
    ([1, 999], "beyond the registered 25 pages"),
    ([3, 3], "more than once"),
])
def test_prefill_checks_decode_pages_against_its_announced_buffers(nodes, pages, message):
    prefill, decode = nodes()
    receiver = raw_request(decode, 1, pages)
    wait_for(lambda: receiver.poll() == KVPoll.Failed)
    assert message in str(receiver.failure_exception())
    assert prefill.backend.writes == 0
    sender, good = transfer(prefill, decode, 2, [4], [4])  # the nodes keep serving
    assert good.poll() == KVPoll.Success


def test_page_count_mismatch_fails_both_sides(nodes):
    prefill, decode = nodes()
    receiver = decode.receiver(1)
    receiver.init([1, 2, 3])
    sender = prefill.sender(1)
    sender.init(4)
    wait_for(lambda: receiver.poll() == KVPoll.Failed)
    assert "page count mismatch" in str(receiver.failure_exception())
    assert sender.poll() == KVPoll.Failed
    assert prefill.backend.writes == 0


def test_chunk_beyond_the_request_fails(nodes):
    prefill, decode = nodes()
    receiver = decode.receiver(1)
    receiver.init([1, 2])
    sender = prefill.sender(1)
    sender.init(2)
    sender.send([5, 6, 7])
    wait_for(lambda: receiver.poll() == KVPoll.Failed)
    assert "does not fit" in str(receiver.failure_exception())


def test_duplicate_room(nodes):
    prefill, decode = nodes()
    decode.receiver(1)
    with pytest.raises(ValueError, match="room 1 already has a receiver"):
        decode.receiver(1)
    prefill.sender(9)
    with pytest.raises(ValueError, match="room 9 already has a sender"):
        prefill.sender(9)


def test_duplicate_room_from_the_wire_fails_the_room_and_writes_nothing(nodes):
    prefill, decode = nodes()
    first = decode.receiver(1)
    first.init([1, 2])
    wait_for(lambda: not prefill.incoming.empty())
    decode._loop.send(decode.peers[0].socket, protocol.RequestPages(1, [3, 4], 64))
    # the same decode node announced room 1 twice: it no longer knows which pages it meant, so
    # prefill fails the room (and, with no sender yet, tells decode at once)
    wait_for(lambda: first.poll() == KVPoll.Failed, what="the duplicate's refusal")
    assert "duplicate room 1" in str(first.failure_exception())
    fill_request(prefill.pool, 1, np.array([7, 8]))
    sender = prefill.sender(1)
    sender.init(2)
    sender.send([7, 8])
    # the refusal of the duplicate reaches decode as a failure of room 1 at most once, and the
    # prefill never wrote into the duplicate's pages
    wait_for(lambda: first.poll() in (KVPoll.Success, KVPoll.Failed))
    assert sentinel_intact(decode.pool, np.array([3, 4]))


def test_unknown_room_report_is_dropped_and_counted(nodes):
    prefill, decode = nodes()
    peer = next(iter(prefill._sessions.peers.values()))
    prefill._loop.send(prefill._socket, protocol.ChunkDone(12345, 0, ok=True, last=True),
                       peer.identity)
    wait_for(lambda: decode._loop.bad_messages == 1)
    assert "unknown room 12345" in decode._loop.last_error


def test_engine_failure_fails_the_request_and_holds_its_pages(nodes):
    prefill, decode = nodes(fail_every=1, in_flight_grace_s=30.0)
    sender, receiver = transfer(prefill, decode, 1, [1, 2], [1, 2])
    assert receiver.poll() == KVPoll.Failed
    assert "engine write failed" in str(receiver.failure_exception())
    assert not receiver.can_release()  # a failed write may still land: pages held
    assert prefill.counters.snapshot()["engine_failures"] == 1
    ok_sender, ok_receiver = transfer(prefill, decode, 2, [3], [3])  # fails too: every write
    assert ok_receiver.poll() == KVPoll.Failed


def test_decode_abort_is_confirmed_before_pages_are_released(nodes):
    prefill, decode = nodes(in_flight_grace_s=30.0)
    receiver = decode.receiver(1)
    receiver.init([1, 2])
    wait_for(lambda: not prefill.incoming.empty())
    receiver.abort("client went away")
    assert receiver.poll() == KVPoll.Failed
    wait_for(receiver.can_release, what="prefill's confirmation")
    sender = prefill.sender(1)  # made after decode gave the request up: fails at once
    assert sender.poll() == KVPoll.Failed
    assert "aborted by decode: client went away" in str(sender.failure_exception())


def test_pages_from_a_decode_prefill_dropped_as_silent_fail_both_sides_at_once(nodes):
    """Prefill dropped the decode node as silent (a frozen decode, resumed), while decode still
    counts prefill alive: decode's next pages are refused at once, naming why, and prefill's
    sender for that room fails at once too, instead of both waiting out their timeouts; decode
    re-handshakes at once (not after a silence of its peer timeout), and serves the next one."""
    prefill, decode = nodes(heartbeat_s=30.0, peer_timeout_s=60.0)  # decode beats too slowly
    wait_for(lambda: prefill.peers() == [], 10, "prefill dropping decode")
    receiver = decode.receiver(1)
    receiver.init([1, 2])
    wait_for(lambda: receiver.poll() == KVPoll.Failed, 5, "decode's refusal")
    assert "dropped this decode node as silent" in str(receiver.failure_exception())
    wait_for(receiver.can_release, 5, "the re-handshake's answer")  # nothing was written
    sender = prefill.sender(1)
    assert sender.poll() == KVPoll.Failed
    assert "dropped this decode node as silent" in str(sender.failure_exception())
    wait_for(lambda: decode.counters.snapshot()["peer_recoveries"] == 1, 5, "the re-handshake")
    sender, receiver = transfer(prefill, decode, 2, [3, 4], [5, 6])
    assert receiver.poll() == KVPoll.Success, receiver.failure_exception()
    assert count_mismatches(decode.pool, 2, np.array([5, 6])) == 0


def test_a_request_failed_while_its_prefill_counted_dead_is_aborted_at_the_re_handshake(made):
    """Decode counts a live prefill dead (a decode frozen past its peer timeout, resumed, reads
    the tick before the queued heartbeats; here prefill simply beats too slowly): a request
    failed then, before its pages were announced, is told to prefill once the re-handshake is
    answered, so that prefill's sender fails at once instead of waiting out its timeout."""
    prefill = PrefillNode(make_pool(), FakeBackend(), heartbeat_s=30.0, peer_timeout_s=60.0)
    made.append(prefill)
    decode = DecodeNode(make_pool(size=64 * 24, sentinel=True), FakeBackend(), prefill.endpoint,
                        heartbeat_s=0.1, peer_timeout_s=1.0)
    made.append(decode)
    sender = prefill.sender(1)
    receiver = decode.receiver(1)  # its pages not yet allocated
    wait_for(lambda: receiver.poll() == KVPoll.Failed, 5, "decode counting prefill dead")
    assert "unreachable" in str(receiver.failure_exception())
    assert receiver.can_release()  # nothing was announced: nothing can be written
    wait_for(lambda: sender.poll() == KVPoll.Failed, 5, "prefill's sender failing",
             detail=lambda: f"it is {sender.poll()!r}; decode re-handshaked "
                            f"{decode.counters.snapshot()['peer_recoveries']} times")
    assert "aborted by decode" in str(sender.failure_exception())
    assert "unreachable" in str(sender.failure_exception())


def test_prefill_abort_reaches_decode(nodes):
    prefill, decode = nodes()
    receiver = decode.receiver(1)
    receiver.init([1, 2])
    sender = prefill.sender(1)
    wait_for(lambda: sender.poll() == KVPoll.WaitingForInput)
    sender.abort("prefill OOM")
    wait_for(lambda: receiver.poll() == KVPoll.Failed)
    assert "prefill OOM" in str(receiver.failure_exception())
    assert receiver.can_release()


def test_dead_prefill_fails_waiting_requests_within_the_peer_timeout(nodes):
    prefill, decode = nodes()
    receiver = decode.receiver(1)
    receiver.init([1, 2])
    prefill.close()
    wait_for(lambda: receiver.poll() == KVPoll.Failed, timeout_s=5.0)
    assert "unreachable" in str(receiver.failure_exception())


def test_request_deadline(nodes):
    prefill, decode = nodes(request_timeout_s=0.3)
    receiver = decode.receiver(1)
    receiver.init([1])
    wait_for(lambda: receiver.poll() == KVPoll.Failed, timeout_s=5.0)
    assert "timed out" in str(receiver.failure_exception())


def test_listen_on_a_busy_port_is_a_clear_error():
    engine = FakeBackend()
    with PrefillNode(make_pool(), FakeBackend()) as first:
        with pytest.raises(OSError, match=f"cannot listen on {first.endpoint}"):
            PrefillNode(make_pool(), engine, listen=first.endpoint)
    assert engine.closed


SIGNAL_FLOOD = """
import queue, signal, threading, time
from dsa_bridge.transfer.prefill import PrefillNode
from tests.transfer.fake_backend import FakeBackend
from tests.transfer.helpers import make_pool

node = PrefillNode(make_pool(), FakeBackend())
signal.signal(signal.SIGUSR1, lambda *_: None)
main, done = threading.main_thread().ident, threading.Event()

def flood():
    while not done.is_set():
        signal.pthread_kill(main, signal.SIGUSR1)
        time.sleep(0.0001)

threading.Thread(target=flood, daemon=True).start()
for _ in range(3000):
    try:
        node.incoming.get(timeout=0.001)
    except queue.Empty:
        pass
done.set()
node.close()
print("served", flush=True)
"""


@pytest.mark.slow
def test_waiting_on_incoming_with_a_timeout_survives_signals():
    """The launcher's main loop polls ``incoming`` with a timeout while SIGTERM may arrive. On
    CPython 3.11 a ``SimpleQueue.get(timeout)`` that a signal interrupts near its deadline
    recomputes a negative timeout and then blocks forever (a prefill node ignored SIGTERM in CI
    this way); ``incoming`` must keep returning under a flood of signals."""
    root = Path(__file__).resolve().parents[2]
    result = subprocess.run([sys.executable, "-c", SIGNAL_FLOOD], capture_output=True, text=True,
                            timeout=60, stdin=subprocess.DEVNULL, cwd=root)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().endswith("served")


@pytest.fixture
def aux_nodes():
    made = []

    def build(prefill_aux, decode_aux):
        prefill = PrefillNode(make_pool(), FakeBackend(), peer_timeout_s=1.0, heartbeat_s=0.1,
                              aux_buffers=infos(prefill_aux))
        made.append(prefill)
        decode = DecodeNode(make_pool(size=64 * 24, sentinel=True), FakeBackend(), prefill.endpoint,
                            peer_timeout_s=1.0, heartbeat_s=0.1, aux_buffers=infos(decode_aux))
        made.append(decode)
        return prefill, decode

    yield build
    for node in reversed(made):
        node.close()


def test_aux_slots_travel_with_the_last_chunk_and_count_in_the_bytes(aux_nodes):
    src_aux, dst_aux = aux_tensors(8), aux_tensors(6, fill=0xA5)
    prefill, decode = aux_nodes(src_aux, dst_aux)
    src, dst = [9, 3, 4, 5], [2, 11, 12, 13]
    fill_request(prefill.pool, 1, np.asarray(src))
    receiver = decode.receiver(1)
    receiver.init(dst, aux_index=4)
    sender = prefill.sender(1)
    sender.init(len(src), aux_index=7)
    sender.send(src[:2])
    sender.send(src[2:])
    wait_for(lambda: receiver.poll() in (KVPoll.Success, KVPoll.Failed), what="request end")
    assert receiver.poll() == KVPoll.Success, receiver.failure_exception()
    assert count_mismatches(decode.pool, 1, np.array(dst)) == 0
    for a, b in zip(src_aux, dst_aux, strict=True):
        assert np.array_equal(b[4], a[7])
        assert (np.delete(b, 4, axis=0) == 0xA5).all()
    layout = decode.pool.layout
    assert receiver.nbytes == 4 * (layout.kv_page_bytes + layout.index_page_bytes) * 4 + 64 + 512


def test_aux_handshake_refuses_other_counts_or_slot_sizes(aux_nodes):
    with pytest.raises(HandshakeError, match="aux buffers: this side holds 2, the peer 1"):
        aux_nodes(aux_tensors(8), aux_tensors(8)[:1])
    with pytest.raises(HandshakeError, match="aux buffer 0: item_len local 64 != peer 128"):
        aux_nodes(aux_tensors(8), [np.zeros((8, 128), np.uint8), np.zeros((8, 512), np.uint8)])


def test_aux_slots_out_of_range_refused_on_both_sides(aux_nodes):
    prefill, decode = aux_nodes(aux_tensors(8), aux_tensors(6, fill=0xA5))
    with pytest.raises(ValueError, match="aux_index 6 is outside the aux buffers' 6 slots"):
        decode.receiver(1).init([2], aux_index=6)
    with pytest.raises(ValueError, match="aux_index 8 is outside the aux buffers' 8 slots"):
        prefill.sender(2).init(1, aux_index=8)


def test_decode_slot_without_a_prefill_slot_fails_before_any_write(aux_nodes):
    dst_aux = aux_tensors(6, fill=0xA5)
    prefill, decode = aux_nodes(aux_tensors(8), dst_aux)
    receiver = decode.receiver(3)
    receiver.init([2, 3], aux_index=1)
    sender = prefill.sender(3)
    sender.init(2)
    sender.send([5, 6])
    wait_for(lambda: receiver.poll() == KVPoll.Failed, what="request failure")
    assert "decode asked for aux slot 1 but this request has none" in str(receiver.failure_exception())
    assert sentinel_intact(decode.pool, np.arange(1, decode.pool.num_kv_pages))
    assert all((b == 0xA5).all() for b in dst_aux)
