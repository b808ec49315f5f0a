"""Wire messages of the control plane: typed, versioned, msgpack-encoded tagged unions.

Decode connects to prefill and opens with ``Hello`` (its layout, the layout hash, its engine
metadata, the buffers it registered and the indexer layers its attention reads); prefill answers
``HelloAck`` with its own layout. Then per request decode sends ``RequestPages`` and prefill
answers with one ``ChunkDone`` per chunk it wrote (the last one includes the request's aux slots
when decode announced aux buffers and asked for a slot) (with the chunk's page checksums when prefill
runs with them). Either side may send ``Abort``; both send ``Heartbeat``. Data never travels
here, only page ids, checksums and states.
"""

from __future__ import annotations

import msgspec

# 1: first version (layout + buffers handshake, per-chunk completion, abort, heartbeat).
# 2: layer sets: layouts carry index_layer_ids; Hello carries the indexer layers decode reads.
PROTOCOL_VERSION = 2
MAX_MESSAGE_BYTES = 16 * 1024 * 1024


class ProtocolError(ValueError):
    """A message that cannot be decoded or that breaks the protocol."""


class BufferInfo(msgspec.Struct, frozen=True, array_like=True):
    layer_id: int
    kind: str
    ptr: int
    nbytes: int
    item_len: int


class AuxInfo(msgspec.Struct, frozen=True, array_like=True):
    """One aux buffer (one slot per request, ``item_len`` bytes each), paired by position."""

    ptr: int
    nbytes: int
    item_len: int


class Hello(msgspec.Struct, frozen=True, tag="hello"):
    version: int
    node: str
    backend: str
    layout: dict
    layout_hash: str
    engine_metadata: bytes
    buffers: list[BufferInfo]
    index_reads: list[int]
    nonce: bytes = b""
    sent_at: float = 0.0
    auth: bytes = b""
    aux_buffers: list[AuxInfo] = msgspec.field(default_factory=list)


class HelloAck(msgspec.Struct, frozen=True, tag="hello_ack"):
    version: int
    ok: bool
    reason: str
    node: str
    layout: dict
    layout_hash: str
    auth: bytes = b""


class RequestPages(msgspec.Struct, frozen=True, tag="request"):
    """Decode has allocated ``dst_pages`` for ``room``; prefill writes the request there, and
    its aux slots into decode's slot ``aux_index`` (-1: none)."""

    room: int
    dst_pages: list[int]
    num_tokens: int
    aux_index: int = -1


class PageChecksums(msgspec.Struct, frozen=True, array_like=True):
    """One 64-bit checksum per (buffer, page) of a chunk (``checksum.py``): ``values`` holds
    little-endian uint64, buffer-major, buffers in the order of ``buffers`` ((layer id, kind)),
    pages in the chunk's order. The chunk covers decode's pages at ``[offset, offset + n)`` of
    the request."""

    algorithm: str
    offset: int
    buffers: list[tuple[int, str]]
    values: bytes


class ChunkDone(msgspec.Struct, frozen=True, tag="chunk_done"):
    """Prefill finished (ok) or gave up on (not ok) a chunk; ``in_flight`` says whether a write
    into decode's pages may still land (engine failure or timeout) so decode must not reuse them yet.
    ``checksums`` (optional, so older peers still decode the message) come with an ok chunk from a
    prefill node that computes them."""

    room: int
    chunk: int
    ok: bool
    last: bool
    reason: str = ""
    nbytes: int = 0
    descriptors: int = 0
    write_seconds: float = 0.0
    in_flight: bool = False
    checksums: PageChecksums | None = None


class Abort(msgspec.Struct, frozen=True, tag="abort"):
    room: int
    reason: str


class Heartbeat(msgspec.Struct, frozen=True, tag="heartbeat"):
    sent_at: float


Message = Hello | HelloAck | RequestPages | ChunkDone | Abort | Heartbeat

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


def encode(message: Message) -> bytes:
    return _encoder.encode(message)


def signed_bytes(message: Hello | HelloAck) -> bytes:
    """The bytes a signature covers: the message with its ``auth`` field empty."""
    return encode(msgspec.structs.replace(message, auth=b""))


def decode(data: bytes) -> Message:
    """Decode one message; any malformed, truncated or oversized input raises ProtocolError."""
    if len(data) > MAX_MESSAGE_BYTES:
        raise ProtocolError(f"message of {len(data)} bytes exceeds {MAX_MESSAGE_BYTES}")
    try:
        return _decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ProtocolError(f"bad message: {exc}") from exc
