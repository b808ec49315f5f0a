"""End-to-end checksums in the nodes, in one process over the in-process memmove engine: prefill
sends each chunk's page checksums, decode verifies its own pages off the control thread before a
request turns Success, and a byte flipped after the write fails the request naming layer, cache
and page. The same over real engines in real processes: tests/integration/test_ops.py."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from dsa_bridge.transfer import checksum
from dsa_bridge.transfer.decode import DecodeNode, verify
from dsa_bridge.transfer.launcher.drivers import count_mismatches, fill_request
from dsa_bridge.transfer.prefill import PrefillNode
from dsa_bridge.transfer.request import KVPoll
from tests.faulty import FaultyBackend

from .fake_backend import FakeBackend
from .helpers import make_pool, wait_for

BUFFERS = 8  # 4 layers x (kv, index)


@pytest.fixture
def nodes():
    made = []

    def build(*, prefill_checksums=True, decode_checksums=True, flip_every=0, delay_s=0.0):
        engine = FakeBackend()
        if flip_every or delay_s:
            engine = FaultyBackend(engine, flip_every=flip_every, delay_s=delay_s)
        prefill = PrefillNode(make_pool(), engine, peer_timeout_s=2.0, heartbeat_s=0.1,
                              checksums=prefill_checksums)
        made.append(prefill)
        decode = DecodeNode(make_pool(size=64 * 24, sentinel=True), FakeBackend(), prefill.endpoint,
                            peer_timeout_s=2.0, heartbeat_s=0.1, checksums=decode_checksums)
        made.append(decode)
        return prefill, decode

    yield build
    for node in reversed(made):
        node.close()


def start(prefill, decode, room, src, dst, chunks=1):
    src, dst = np.asarray(src), np.asarray(dst)
    fill_request(prefill.pool, room, src)
    receiver = decode.receiver(room)
    receiver.init(dst, num_tokens=dst.size * 64)
    sender = prefill.sender(room)
    sender.init(src.size)
    for chunk in np.array_split(src, chunks):
        sender.send(chunk)
    return sender, receiver


def settle(receiver):
    wait_for(lambda: receiver.poll() in (KVPoll.Success, KVPoll.Failed), what="request end")
    return receiver


def test_checksummed_request_verifies_every_page_of_every_buffer(nodes):
    prefill, decode = nodes()
    _, receiver = start(prefill, decode, 1, [9, 3, 4, 5, 17], [2, 11, 12, 13, 1], chunks=2)
    assert settle(receiver).poll() == KVPoll.Success, receiver.failure_exception()
    assert count_mismatches(decode.pool, 1, np.array([2, 11, 12, 13, 1])) == 0
    assert receiver.checksums_verified == 5 * BUFFERS
    assert decode.counters.snapshot()["checksums_verified"] == 5 * BUFFERS
    wait_for(lambda: prefill.counters.snapshot()["checksums_computed"] == 5 * BUFFERS)
    assert decode.counters.snapshot()["checksum_seconds"] > 0
    assert prefill.counters.snapshot()["checksum_seconds"] > 0


def test_a_byte_flipped_after_the_write_fails_the_request_naming_layer_cache_and_page(nodes):
    prefill, decode = nodes(flip_every=1)
    _, receiver = start(prefill, decode, 2, [6], [9])
    assert settle(receiver).poll() == KVPoll.Failed
    # the fault flips the last byte of the middle descriptor: of 8 one-page descriptors (layers
    # 0-3, kv then index), the 5th: layer 2's kv page
    assert str(receiver.failure_exception()) == (
        "room 2: checksum mismatch: layer 2 kv cache, page 9 (page 0 of the request); 1 of 8 "
        "checksums of the chunk differ")
    assert decode.pool.page_view(2, "kv")[9, -1] != prefill.pool.page_view(2, "kv")[6, -1]
    assert decode.counters.snapshot()["failures"] == {"checksum": 1}
    assert decode.counters.snapshot()["requests_ok"] == 0
    wait_for(receiver.can_release, 2.0, "pages of a failed last chunk released")


def test_a_mismatch_in_an_early_chunk_holds_the_pages_until_prefill_confirms(nodes):
    prefill, decode = nodes(flip_every=2, delay_s=0.3)  # the abort arrives during chunk 3's write
    # chunks queued together go out in one engine write: each is sent once the one before is
    # written (chunk 1) or landing (chunk 2), so that each has its own write and chunk 2's is
    # the one flipped
    src, dst = np.arange(1, 13), np.arange(5, 17)
    fill_request(prefill.pool, 3, src)
    receiver = decode.receiver(3)
    receiver.init(dst, num_tokens=dst.size * 64)
    wait_for(lambda: 3 in prefill._requests.requests, what="decode's pages at prefill")
    sender = prefill.sender(3)
    sender.init(src.size)
    first, second, third = np.array_split(src, 3)
    sender.send(first)
    wait_for(lambda: sender.busy == 0, what="chunk 1 written")
    sender.send(second)
    wait_for(prefill.backend.in_flight.is_set, what="chunk 2 landing")
    sender.send(third)
    assert settle(receiver).poll() == KVPoll.Failed
    reason = str(receiver.failure_exception())
    assert "checksum mismatch: layer 2 kv cache, page 12 (page 7 of the request)" in reason, reason
    wait_for(receiver.can_release, 10.0, "release once prefill answered the abort")
    wait_for(lambda: sender.poll() == KVPoll.Failed)
    assert "aborted by decode: checksum mismatch" in str(sender.failure_exception())
    assert prefill.counters.snapshot()["failures"] == {"checksum": 1}


def test_decode_refuses_a_prefill_that_sends_no_checksums(nodes):
    prefill, decode = nodes(prefill_checksums=False)
    _, receiver = start(prefill, decode, 4, [1, 2], [3, 4])
    assert settle(receiver).poll() == KVPoll.Failed
    assert "prefill sent no checksums (is it running with --checksums?)" in str(
        receiver.failure_exception())


def test_a_decode_without_checksums_ignores_them(nodes):
    prefill, decode = nodes(decode_checksums=False)
    _, receiver = start(prefill, decode, 5, [1, 2], [3, 4])
    assert settle(receiver).poll() == KVPoll.Success
    assert decode.counters.snapshot()["checksums_verified"] == 0
    wait_for(lambda: prefill.counters.snapshot()["checksums_computed"] == 2 * BUFFERS)


def test_checksums_can_be_switched_between_requests(nodes):
    prefill, decode = nodes(prefill_checksums=False, decode_checksums=False)
    assert settle(start(prefill, decode, 6, [1], [2])[1]).poll() == KVPoll.Success
    prefill.checksums = decode.checksums = True
    assert settle(start(prefill, decode, 7, [3], [4])[1]).poll() == KVPoll.Success
    assert decode.counters.snapshot()["checksums_verified"] == BUFFERS


def test_verification_runs_off_the_control_thread_and_holds_the_request_in_transferring(
        nodes, monkeypatch):
    prefill, decode = nodes()
    release, threads = threading.Event(), []
    real = checksum.verify_chunk

    def slow_verify(*args, **kwargs):
        threads.append(threading.current_thread().name)
        assert release.wait(10)
        return real(*args, **kwargs)

    monkeypatch.setattr(verify.checksum, "verify_chunk", slow_verify)
    _, receiver = start(prefill, decode, 8, [1, 2, 3], [4, 5, 6], chunks=3)
    wait_for(lambda: receiver.chunks == 3, what="every chunk reported")
    assert receiver.poll() == KVPoll.Transferring
    assert decode.peers[0].alive  # heartbeats keep flowing meanwhile
    release.set()
    assert settle(receiver).poll() == KVPoll.Success
    assert threads == [f"{decode.name}-verifier"] * 3


def test_a_chunk_too_large_for_its_checksums_fails_before_the_write(nodes, monkeypatch):
    monkeypatch.setattr(checksum, "MAX_CHECKSUM_BYTES", 8 * BUFFERS * 2)
    prefill, decode = nodes()
    _, receiver = start(prefill, decode, 9, [1, 2, 3], [4, 5, 6])
    assert settle(receiver).poll() == KVPoll.Failed
    assert "send chunks of at most 2 pages" in str(receiver.failure_exception())
    assert prefill.counters.snapshot()["bytes"] == 0
