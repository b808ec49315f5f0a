"""Wire messages: round trips, and malformed input rejected with a clear error."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from dsa_bridge.plugin.descriptors import BufferDescriptor
from dsa_bridge.transfer import protocol
from dsa_bridge.transfer.protocol import ProtocolError

SAMPLES = [
    protocol.Hello(protocol.PROTOCOL_VERSION, "d", "mooncake", {"page_size": 64}, "abc",
                   b"127.0.0.1:15001", [BufferDescriptor(3, "kv", 4096, 8192, 4096)], [3]),
    protocol.HelloAck(1, False, "layout mismatch", "p", {}, ""),
    protocol.Hello(protocol.PROTOCOL_VERSION, "d", "nixl", {}, "", b"md", [], [],
                   aux_buffers=[BufferDescriptor(0, "aux", 4096, 64 * 8, 64)]),
    protocol.RequestPages(7, [1, 2, 9], 130),
    protocol.RequestPages(7, [1, 2, 9], 130, aux_index=5),
    protocol.ChunkDone(7, 0, ok=True, last=True, nbytes=10, descriptors=2),
    protocol.ChunkDone(7, 1, ok=True, last=False, nbytes=10, descriptors=1, slices=1),
    protocol.Hello(protocol.PROTOCOL_VERSION, "d", "nixl", {}, "", b"md", [], [],
                   staging=protocol.StagingArea(1 << 30, 1 << 20, 8)),
    protocol.SliceWritten(7, slice=3, offset=64, pages=10),
    protocol.SliceFree([3, 0]),
    protocol.Abort(7, "client went away"),
    protocol.Heartbeat(1.5),
]


@pytest.mark.parametrize("message", SAMPLES, ids=lambda m: type(m).__name__)
def test_round_trip(message):
    assert protocol.decode(protocol.encode(message)) == message


@pytest.mark.parametrize("message", SAMPLES, ids=lambda m: type(m).__name__)
def test_every_truncation_is_rejected(message):
    data = protocol.encode(message)
    for cut in range(len(data)):
        with pytest.raises(ProtocolError):
            protocol.decode(data[:cut])


@pytest.mark.parametrize("data", [
    b"", b"\xc1", b"\x80", b'{"type": "request"}',
    protocol.encode(protocol.Abort(1, "x")).replace(b"abort", b"zzzzz"),
])
def test_malformed_rejected(data):
    with pytest.raises(ProtocolError, match="bad message"):
        protocol.decode(data)


def test_wrong_field_types_rejected():
    import msgspec

    data = msgspec.msgpack.encode({"type": "request", "room": "7", "dst_pages": [1],
                                   "num_tokens": 3})
    with pytest.raises(ProtocolError, match="room"):
        protocol.decode(data)


def test_aux_fields_default_for_peers_that_do_not_send_them():
    import msgspec

    hello = msgspec.msgpack.encode({"type": "hello", "version": 2, "node": "d", "backend": "nixl",
                                    "layout": {}, "layout_hash": "", "engine_metadata": b"",
                                    "buffers": [], "index_reads": []})
    assert protocol.decode(hello).aux_buffers == []
    request = msgspec.msgpack.encode({"type": "request", "room": 7, "dst_pages": [1], "num_tokens": 3})
    assert protocol.decode(request).aux_index == -1


def test_staging_fields_default_and_are_ignored_by_peers_that_do_not_know_them():
    """A Hello without a staging area (an older decode) offers none; a ChunkDone without slices
    was not staged; a peer built before the staged route decodes both new fields away."""
    import msgspec

    hello = msgspec.msgpack.encode({"type": "hello", "version": 3, "node": "d", "backend": "nixl",
                                    "layout": {}, "layout_hash": "", "engine_metadata": b"",
                                    "buffers": [], "index_reads": []})
    assert protocol.decode(hello).staging is None
    done = msgspec.msgpack.encode({"type": "chunk_done", "room": 7, "chunk": 0, "ok": True,
                                   "last": True})
    assert protocol.decode(done).slices == 0

    class OldChunkDone(msgspec.Struct, tag="chunk_done"):
        room: int
        chunk: int
        ok: bool
        last: bool

    class OldHello(msgspec.Struct, tag="hello"):
        version: int
        node: str

    new_done = protocol.ChunkDone(7, 2, ok=True, last=False, slices=3)
    assert msgspec.msgpack.decode(protocol.encode(new_done), type=OldChunkDone).chunk == 2
    new_hello = protocol.Hello(3, "d", "nixl", {}, "", b"", [], [],
                               staging=protocol.StagingArea(4096, 4096, 2))
    assert msgspec.msgpack.decode(protocol.encode(new_hello), type=OldHello).node == "d"


@pytest.mark.parametrize("area", [(4096, 4096, 0), (4096, 4096, protocol.MAX_SLICES + 1)])
def test_a_staging_area_beyond_its_bounds_is_refused(area):
    hello = protocol.Hello(3, "d", "nixl", {}, "", b"", [], [], staging=protocol.StagingArea(*area))
    with pytest.raises(ProtocolError, match="staging"):
        protocol.decode(protocol.encode(hello))


def test_oversized_rejected():
    with pytest.raises(ProtocolError, match="exceeds"):
        protocol.decode(b"\x00" * (protocol.MAX_MESSAGE_BYTES + 1))


@settings(max_examples=500, deadline=None)
@given(st.binary(max_size=200))
def test_random_bytes_never_escape_as_other_errors(data):
    try:
        protocol.decode(data)
    except ProtocolError:
        pass
