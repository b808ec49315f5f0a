"""Layer sets over the in-process engine: the uniform/compact pairing matrix and pipeline stages.

A 6-layer model whose layers 2, 4 and 5 share another layer's top-k (their indexer is never
read). Prefill writes, for the layers it holds, every KV buffer and the indexer of every layer
decode holds and reads; what it cannot provide is refused at the handshake, before any write, and
decode's pool is left at its sentinel. A request fed by several prefill nodes (pipeline stages)
succeeds only when every stage's part has arrived, exactly once. The same matrix runs over real
engines in real processes in tests/integration/test_layer_sets_processes.py.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from dsa_bridge.transfer import protocol
from dsa_bridge.transfer.decode import DecodeNode
from dsa_bridge.transfer.handshake import HandshakeError
from dsa_bridge.transfer.launcher.drivers import (
    count_mismatches,
    fill_request,
    request_bytes,
    sentinel_intact,
)
from dsa_bridge.transfer.prefill import PrefillNode
from dsa_bridge.transfer.request import KVPoll

from .fake_backend import FakeBackend
from .helpers import SMALL_CONFIG, make_pool, wait_for

SHARED = {**SMALL_CONFIG, "num_hidden_layers": 6,
          "indexer_types": ["full", "full", "shared", "full", "shared", "shared"]}
PRODUCERS = (0, 1, 3)
SRC, DST = [9, 3, 4, 5], [2, 11, 12, 1]


@pytest.fixture
def closing():
    made = []
    yield made.append
    for node in reversed(made):
        node.close()


def prefill_node(closing, **layout_kw) -> PrefillNode:
    node = PrefillNode(make_pool(SHARED, **layout_kw), FakeBackend(), peer_timeout_s=2.0,
                       heartbeat_s=0.1)
    closing(node)
    return node


def decode_node(closing, endpoints, *, index_reads=None, **layout_kw) -> DecodeNode:
    node = DecodeNode(make_pool(SHARED, size=64 * 16, sentinel=True, **layout_kw), FakeBackend(),
                      endpoints, peer_timeout_s=2.0, heartbeat_s=0.1, index_reads=index_reads)
    closing(node)
    return node


def run(prefills, decode, room, prefill=None):
    """One request: each prefill sends SRC for the room; decode receives into DST."""
    for node in prefills:
        fill_request(node.pool, room, np.array(SRC))
    receiver = decode.receiver(room, prefill)
    receiver.init(DST, num_tokens=len(DST) * 64)
    for node in prefills:
        sender = node.sender(room)
        sender.init(len(SRC))
        sender.send(SRC)
    wait_for(lambda: receiver.poll() in (KVPoll.Success, KVPoll.Failed), what="request end")
    return receiver


def index_layers(keys):
    return [lid for lid, kind in keys if kind == "index"]


# prefill layout, decode layout, decode's indexer reads -> indexer layers sent, or refusal
MATRIX = [
    ("uniform", "uniform", None, tuple(range(6))),
    ("uniform", "uniform", PRODUCERS, PRODUCERS),
    ("uniform", "compact", None, PRODUCERS),
    ("compact", "compact", None, PRODUCERS),
    ("compact", "uniform", PRODUCERS, PRODUCERS),
    ("compact", "uniform", None, "layer 2: decode holds and reads its indexer, but layer 2 holds no "
                                 "indexer in this compact layout \\(it reuses layer 1's\\) on prefill"),
]


@pytest.mark.parametrize("p_layout, d_layout, reads, expected", MATRIX,
                         ids=[f"{p}->{d}{'-reads-producers' if r else ''}" for p, d, r, _ in MATRIX])
def test_pairing_matrix(closing, p_layout, d_layout, reads, expected):
    prefill = prefill_node(closing, indexer_layout=p_layout)
    if isinstance(expected, str):
        pool = make_pool(SHARED, size=64 * 16, sentinel=True, indexer_layout=d_layout)
        with pytest.raises(HandshakeError, match=expected):
            DecodeNode(pool, FakeBackend(), prefill.endpoint, index_reads=reads)
        assert prefill.counters.snapshot()["handshakes_refused"] == 1
        assert prefill.backend.writes == 0
        assert sentinel_intact(pool, np.arange(1, pool.num_kv_pages))
        return
    decode = decode_node(closing, prefill.endpoint, index_reads=reads, indexer_layout=d_layout)
    receiver = run([prefill], decode, room=7)
    assert receiver.poll() == KVPoll.Success, receiver.failure_exception()
    assert index_layers(receiver.components) == list(expected)
    assert [lid for lid, kind in receiver.components if kind == "kv"] == list(range(6))
    # the bytes of every buffer it filled, the sentinel in every buffer it holds but does not read
    assert count_mismatches(decode.pool, 7, np.array(DST), receiver.components) == 0
    assert receiver.nbytes == request_bytes(decode.pool, len(DST), receiver.components)
    assert prefill.counters.snapshot()["bytes"] == receiver.nbytes


def test_uniform_to_compact_moves_fewer_bytes(closing):
    prefill = prefill_node(closing)
    full = run([prefill], decode_node(closing, prefill.endpoint), room=1)
    compact = run([prefill], decode_node(closing, prefill.endpoint, indexer_layout="compact"), room=2)
    layout = prefill.pool.layout
    assert full.nbytes - compact.nbytes == 3 * len(DST) * layout.index_page_bytes


def test_reads_must_be_held(closing):
    prefill = prefill_node(closing)
    with pytest.raises(ValueError, match="index_reads: layer 2: decode cannot read an indexer it lacks"):
        decode_node(closing, prefill.endpoint, index_reads=(0, 2), indexer_layout="compact")


# ---- pipeline stages ------------------------------------------------------------------------
def test_two_stages_feed_one_request(closing):
    first = prefill_node(closing, start_layer=0, end_layer=3)
    second = prefill_node(closing, start_layer=3, end_layer=6, indexer_layout="compact")
    decode = decode_node(closing, [first.endpoint, second.endpoint], index_reads=(0, 1, 2, 3))
    receiver = run([first, second], decode, room=3)
    assert receiver.poll() == KVPoll.Success, receiver.failure_exception()
    assert index_layers(receiver.components) == [0, 1, 2, 3]
    assert count_mismatches(decode.pool, 3, np.array(DST), receiver.components) == 0
    kv, index = first.pool.layout.kv_page_bytes, first.pool.layout.index_page_bytes
    assert receiver.received == {first.endpoint: len(DST) * 3 * (kv + index),
                                 second.endpoint: len(DST) * (3 * kv + index)}


def test_success_waits_for_every_stage(closing):
    first = prefill_node(closing, start_layer=0, end_layer=3)
    second = prefill_node(closing, start_layer=3, end_layer=6)
    decode = decode_node(closing, [first.endpoint, second.endpoint])
    fill_request(first.pool, 4, np.array(SRC))
    receiver = decode.receiver(4)
    receiver.init(DST)
    sender = first.sender(4)
    sender.init(len(SRC))
    sender.send(SRC)
    wait_for(lambda: sender.poll() == KVPoll.Success)
    wait_for(lambda: first.endpoint in receiver.finished)
    assert receiver.poll() == KVPoll.Transferring  # the second stage has not written yet
    late = second.sender(4)
    fill_request(second.pool, 4, np.array(SRC))
    late.init(len(SRC))
    late.send(SRC)
    wait_for(lambda: receiver.poll() == KVPoll.Success)
    assert count_mismatches(decode.pool, 4, np.array(DST)) == 0


@pytest.mark.parametrize("ranges, message", [
    (((0, 4), (3, 6)), "layer 3 is held by both prefill"),
    (((0, 3), (4, 6)), "layer 3: none of the request's prefill nodes"),
])
def test_overlapping_or_missing_stages_are_refused_at_the_request(closing, ranges, message):
    stages = [prefill_node(closing, start_layer=a, end_layer=b) for a, b in ranges]
    full = prefill_node(closing)  # lets the handshake pass: every layer is held by someone
    decode = decode_node(closing, [full.endpoint, *(s.endpoint for s in stages)])
    with pytest.raises(ValueError, match=message):
        decode.receiver(1, [s.endpoint for s in stages])
    assert all(s.backend.writes == 0 for s in stages)


def test_a_layer_no_prefill_holds_is_refused_at_the_handshake(closing):
    stage = prefill_node(closing, start_layer=0, end_layer=3)
    with pytest.raises(HandshakeError, match="layer 3 is held by none of the prefill nodes"):
        decode_node(closing, stage.endpoint)


def test_a_prefill_layer_decode_lacks_is_refused_at_the_handshake(closing):
    prefill = prefill_node(closing)
    with pytest.raises(HandshakeError, match="prefill holds layer 0, which decode does not"):
        decode_node(closing, prefill.endpoint, start_layer=1, end_layer=6)


def test_a_stage_reporting_short_or_twice_fails_the_request(closing):
    """Per-component completion: a stage whose last chunk comes with fewer bytes than its part,
    or a second last chunk, fails the request instead of passing for Success."""
    first = prefill_node(closing, start_layer=0, end_layer=3)
    second = prefill_node(closing, start_layer=3, end_layer=6)
    decode = decode_node(closing, [first.endpoint, second.endpoint])
    receiver = decode.receiver(5)
    receiver.init(DST)
    peer = decode.peers[0]
    with decode._lock:  # what a buggy stage would send: one small "last" chunk
        decode._on_chunk_locked(peer, protocol.ChunkDone(5, 0, ok=True, last=True, nbytes=8),
                                time.monotonic())
    assert receiver.poll() == KVPoll.Failed
    assert "wrote 8 bytes, expected" in str(receiver.failure_exception())
    receiver = decode.receiver(6)
    receiver.init(DST)
    part = len(DST) * peer.page_bytes
    with decode._lock:
        decode._on_chunk_locked(peer, protocol.ChunkDone(6, 0, ok=True, last=True, nbytes=part),
                                time.monotonic())
        decode._on_chunk_locked(peer, protocol.ChunkDone(6, 1, ok=True, last=True, nbytes=part),
                                time.monotonic())
    assert receiver.poll() == KVPoll.Failed
    assert "reported its last chunk twice" in str(receiver.failure_exception())


# ---- SGLang's zero-row buffer infos -----------------------------------------------------------
def test_sglang_zero_row_infos_are_never_registered_or_planned(closing):
    """What SGLang 0.5.23's pool hands over for index sharing: a (0, 0, 0) state entry for each
    shared layer. Normalised by layer id to absent entries, they reach neither the engine's
    registration nor a plan, and the transfer into a compact decode is byte-exact."""
    from dsa_bridge.plugin.descriptors import BufferSet

    pool = make_pool(SHARED, indexer_layout="compact")
    kv = pool.get_contiguous_buf_infos()
    present = dict(zip(pool.state_layer_ids, zip(*pool.get_state_buf_infos(), strict=True), strict=True))
    state = tuple(list(x) for x in zip(*(present.get(lid, (0, 0, 0)) for lid in range(6)), strict=True))
    buffers = BufferSet.from_buf_infos(pool.layout, kv, pool.kv_layer_ids, state, list(range(6)))
    engine = FakeBackend()
    prefill = PrefillNode(buffers, engine, heartbeat_s=0.1)
    closing(prefill)
    assert len(engine.regions) == 6 + 3 and all(r.ptr > 0 and r.nbytes > 0 for r in engine.regions)
    decode = decode_node(closing, prefill.endpoint, indexer_layout="compact")
    fill_request(pool, 8, np.array(SRC))  # the model writes the pool behind the buffer infos
    receiver = decode.receiver(8)
    receiver.init(DST)
    sender = prefill.sender(8)
    sender.init(len(SRC))
    sender.send(SRC)
    wait_for(lambda: receiver.poll() in (KVPoll.Success, KVPoll.Failed), what="request end")
    assert receiver.poll() == KVPoll.Success, receiver.failure_exception()
    assert index_layers(receiver.components) == list(PRODUCERS)
    assert count_mismatches(decode.pool, 8, np.array(DST)) == 0
    assert receiver.descriptors == 3 * (6 + 3)  # runs (9 | 3,4,5 | ...) x the 9 real buffers


# ---- checksums over layer sets -----------------------------------------------------------------
def test_checksummed_stages_into_a_compact_decode(closing):
    """Each stage's checksums cover exactly the buffers it writes; a byte flipped by the second
    stage's engine fails the request naming that stage's layer."""
    from tests.faulty import FaultyBackend

    stages = []
    for start_layer, end_layer, engine in ((0, 3, FakeBackend()),
                                           (3, 6, FaultyBackend(FakeBackend(), flip_every=2))):
        node = PrefillNode(make_pool(SHARED, start_layer=start_layer, end_layer=end_layer), engine,
                           heartbeat_s=0.1, checksums=True)
        closing(node)
        stages.append(node)
    decode = DecodeNode(make_pool(SHARED, size=64 * 16, sentinel=True, indexer_layout="compact"),
                        FakeBackend(), [s.endpoint for s in stages], heartbeat_s=0.1, checksums=True)
    closing(decode)
    good = run(stages, decode, room=20)  # the second stage's first write: not flipped
    assert good.poll() == KVPoll.Success, good.failure_exception()
    assert good.checksums_verified == len(DST) * len(good.components) == len(DST) * (6 + 3)
    bad = run(stages, decode, room=21)  # its second write: one byte flipped after it landed
    assert bad.poll() == KVPoll.Failed
    assert "checksum mismatch: layer " in str(bad.failure_exception())
    layer = int(str(bad.failure_exception()).split("checksum mismatch: layer ")[1].split()[0])
    assert 3 <= layer < 6
