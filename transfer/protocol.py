"""Wire messages of the control plane: typed, versioned, msgpack-encoded tagged unions.

Decode connects to prefill and opens with ``Hello`` (its layout, the layout hash, its engine
metadata, the buffers it registered and the indexer layers its attention reads, its session id
and epoch); prefill answers ``HelloAck`` with its own layout. A later Hello of the same session
(decode re-handshaking with a prefill it had marked dead) ends the earlier epochs: prefill drops
their rooms and answers only once none of their writes can still run, so on the one connection
everything after the new HelloAck belongs to the new epoch. Then per request decode sends
``RequestPages`` and prefill answers with one ``ChunkDone`` per chunk it wrote (with the chunk's
page checksums when prefill runs with them). Either side may send ``Abort``; both send
``Heartbeat``. Data never travels here, only page ids, checksums and states.
"""

from __future__ import annotations

import msgspec

# 1: first version (layout + buffers handshake, per-chunk completion, abort, heartbeat).
# 2: layer sets: layouts carry index_layer_ids; Hello carries the indexer layers decode reads.
# 3: sessions: Hello carries decode's session id and epoch (a re-handshake after decode marked the
#    prefill dead), HelloAck echoes the epoch and names the rooms a failed write may still land in.
PROTOCOL_VERSION = 3
MAX_MESSAGE_BYTES = 16 * 1024 * 1024


class ProtocolError(ValueError):
    """A message that cannot be decoded or that breaks the protocol."""


class BufferInfo(msgspec.Struct, frozen=True, array_like=True):
    layer_id: int
    kind: str
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
    session: bytes = b""  # one per decode node: a later Hello of the same session replaces it
    epoch: int = 0  # counts decode's handshakes of this session with this prefill node


class HelloAck(msgspec.Struct, frozen=True, tag="hello_ack"):
    version: int
    ok: bool
    reason: str
    node: str
    layout: dict
    layout_hash: str
    auth: bytes = b""
    epoch: int = 0  # the Hello's: decode accepts only the answer to its latest Hello
    # rooms of the session's earlier epochs whose failed engine write may still land (all other
    # writes of those epochs have finished before this answer was sent)
    in_flight: list[int] = []


class RequestPages(msgspec.Struct, frozen=True, tag="request"):
    """Decode has allocated ``dst_pages`` for ``room``; prefill writes the request there."""

    room: int
    dst_pages: list[int]
    num_tokens: int


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
