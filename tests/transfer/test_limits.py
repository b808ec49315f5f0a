"""Receive limits: the largest legitimate message of each kind fits its node's limit; the
protocol's field bounds are checked before a single element is decoded; long texts are cut on
encode so that a node never sends what its peer refuses."""

from __future__ import annotations

import msgspec
import pytest

from dsa_bridge.plugin import DSALayout
from dsa_bridge.transfer import checksum, protocol
from dsa_bridge.transfer import receive_limits as limits
from dsa_bridge.transfer.handshake import pool_buffers
from dsa_bridge.transfer.plan import BufferDescriptor
from dsa_bridge.transfer.protocol import (
    MAX_BUFFERS,
    MAX_ENGINE_METADATA_BYTES,
    MAX_LAYERS,
    MAX_NAME_CHARS,
    MAX_REASON_CHARS,
    MAX_TOKEN_BYTES,
    PROTOCOL_VERSION,
    ProtocolError,
)

from .helpers import make_pool

DEEPSEEK = DSALayout.preset("deepseek-v3.2")
BIG = 2**64 - 1  # the largest integer msgpack carries: 9 bytes
WIDE = "\U0010ffff"  # a character of 4 UTF-8 bytes


def largest_layout(layout: DSALayout) -> dict:
    ids = [BIG - MAX_LAYERS + i for i in range(MAX_LAYERS)]
    return {**layout.to_dict(), "layer_ids": ids, "index_layer_ids": ids}


def largest_hello(layout: DSALayout, backend: str) -> protocol.Hello:
    buffers = [BufferDescriptor(BIG, "index", BIG, BIG, BIG)] * MAX_BUFFERS
    return protocol.Hello(PROTOCOL_VERSION, WIDE * MAX_NAME_CHARS, backend, largest_layout(layout),
                          "f" * 64, b"m" * MAX_ENGINE_METADATA_BYTES, buffers, [BIG] * MAX_LAYERS,
                          nonce=b"n" * MAX_TOKEN_BYTES, sent_at=1e300, auth=b"a" * MAX_TOKEN_BYTES)


@pytest.mark.parametrize("layout", [DEEPSEEK, DSALayout.preset("glm-5.2", indexer_layout="compact")],
                         ids=["deepseek", "glm-compact"])
def test_the_largest_legitimate_messages_fit_their_bounds(layout):
    hello = protocol.encode(largest_hello(layout, "mooncake"))
    assert len(hello) <= limits.hello_bytes(layout, "mooncake")
    assert protocol.decode(hello, limits.hello_bytes(layout, "mooncake")).buffers[0].ptr == BIG
    ack = protocol.HelloAck(PROTOCOL_VERSION, False, WIDE * MAX_REASON_CHARS, WIDE * MAX_NAME_CHARS,
                            largest_layout(layout), "f" * 64, auth=b"a" * MAX_TOKEN_BYTES)
    assert len(protocol.encode(ack)) <= limits.hello_ack_bytes(layout)
    pages = 5000
    request = protocol.RequestPages(2**63 - 1, [BIG] * pages, BIG)
    assert len(protocol.encode(request)) <= limits.request_pages_bytes(pages)
    abort = protocol.Abort(BIG, WIDE * MAX_REASON_CHARS)
    assert len(protocol.encode(abort)) <= limits.abort_bytes()
    buffers = 2 * layout.num_layers
    chunk = checksum.max_chunk_pages(buffers)
    sums = protocol.PageChecksums(WIDE * MAX_NAME_CHARS, BIG, [(BIG, "index")] * buffers,
                                  bytes(8 * chunk * buffers))
    done = protocol.ChunkDone(BIG, BIG, ok=False, last=True, reason=WIDE * MAX_REASON_CHARS,
                              nbytes=BIG, descriptors=BIG, write_seconds=1e300, in_flight=True,
                              checksums=sums)
    assert len(protocol.encode(done)) <= limits.chunk_done_bytes(chunk, buffers)
    assert len(protocol.encode(protocol.Heartbeat(1e300))) <= limits.heartbeat_bytes()


def test_a_node_limit_covers_its_messages_and_stays_far_below_the_attacks():
    pool = make_pool()
    buffers = pool_buffers(pool)
    prefill = limits.prefill_receive_bytes(pool.layout, "nixl", buffers)
    decode = limits.decode_receive_bytes(pool.layout, buffers)
    pages = max(b.num_items for b in buffers)
    assert prefill >= max(limits.hello_bytes(pool.layout, "nixl"), limits.request_pages_bytes(pages))
    assert decode >= limits.chunk_done_bytes(pages, len(buffers))
    assert prefill < 2 * 1024 * 1024 and decode < 1024 * 1024  # a 12 MB Hello, 100 MiB: cut off
    assert limits.decode_receive_bytes(DEEPSEEK, [buffers[0]] * 122) <= protocol.MAX_MESSAGE_BYTES


def test_a_pool_of_many_pages_is_bounded_by_the_protocol():
    huge = pool_buffers(make_pool())
    big = [BufferDescriptor(b.layer_id, b.kind, b.ptr, b.item_len * 10**7, b.item_len) for b in huge]
    assert limits.prefill_receive_bytes(DEEPSEEK, "nixl", big) == protocol.MAX_MESSAGE_BYTES


@pytest.mark.parametrize(("change", "where"), [
    ({"buffers": [BufferDescriptor(0, "kv", 1, 1, 1)] * (MAX_BUFFERS + 1)}, r"\$.buffers"),
    ({"index_reads": [0] * (MAX_LAYERS + 1)}, r"\$.index_reads"),
    ({"engine_metadata": b"m" * (MAX_ENGINE_METADATA_BYTES + 1)}, r"\$.engine_metadata"),
    ({"nonce": b"n" * (MAX_TOKEN_BYTES + 1)}, r"\$.nonce"),
    ({"auth": b"a" * (MAX_TOKEN_BYTES + 1)}, r"\$.auth"),
    ({"layout_hash": "f" * 65}, r"\$.layout_hash"),
    ({"backend": "b" * (MAX_NAME_CHARS + 1)}, r"\$.backend"),
    ({"buffers": [BufferDescriptor(0, "k" * 9, 1, 1, 1)]}, r"\$.buffers\[0\]\[1\]"),
])
def test_fields_beyond_their_bounds_are_refused_by_the_decoder(change, where):
    hello = msgspec.structs.replace(largest_hello(DEEPSEEK, "nixl"), **change)
    with pytest.raises(ProtocolError, match=f"length <= \\d+ - at `{where}`"):
        protocol.decode(msgspec.msgpack.encode(hello))  # as a peer that does not cut them sends


def test_six_hundred_thousand_buffers_are_refused_at_the_count():
    hello = msgspec.structs.replace(largest_hello(DEEPSEEK, "nixl"),
                                    buffers=[BufferDescriptor(1, "kv", 1, 1, 1)] * 600_000)
    data = msgspec.msgpack.encode(hello)
    assert len(data) > 4_000_000
    with pytest.raises(ProtocolError, match=f"Expected `array` of length <= {MAX_BUFFERS}"):
        protocol.decode(data)


def test_long_texts_are_cut_on_encode_and_signed_as_sent():
    abort = protocol.decode(protocol.encode(protocol.Abort(1, "r" * (MAX_REASON_CHARS + 100))))
    assert len(abort.reason) == MAX_REASON_CHARS and abort.reason.endswith("...")
    hello = msgspec.structs.replace(largest_hello(DEEPSEEK, "nixl"), node="n" * 1000)
    sent = protocol.decode(protocol.encode(hello))
    assert len(sent.node) == MAX_NAME_CHARS
    assert protocol.signed_bytes(sent) == protocol.signed_bytes(hello)  # a signature still holds
    short = protocol.Abort(1, "why")
    assert protocol.bounded(short) is short


def test_decode_takes_a_smaller_limit():
    data = protocol.encode(protocol.Abort(1, "x" * 100))
    assert protocol.decode(data, len(data)).reason == "x" * 100
    with pytest.raises(ProtocolError, match=f"message of {len(data)} bytes exceeds {len(data) - 1}"):
        protocol.decode(data, len(data) - 1)
