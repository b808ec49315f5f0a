"""Wire messages of the control plane: typed, versioned, msgpack-encoded tagged unions.

Decode connects to prefill and opens with ``Hello`` (its layout, the layout hash, its engine
metadata, the buffers it registered and the indexer layers its attention reads, its session id
and epoch); prefill answers ``HelloAck`` with its own layout. A later Hello of the same session
(decode re-handshaking with a prefill it had marked dead) ends the earlier epochs: prefill drops
their rooms and answers only once none of their writes can still run, so on the one connection
everything after the new HelloAck belongs to the new epoch. Then per request decode sends
``RequestPages`` and prefill answers with one ``ChunkDone`` per chunk it wrote (the last one
includes the request's aux slots when decode announced aux buffers and asked for a slot; each
carries the chunk's page checksums when prefill runs with them). A chunk prefill stages (its Hello
offered decode's ``StagingArea``) is preceded by one ``SliceWritten`` per slice it filled, each
answered by decode with ``SliceFree`` once scattered. Either side may send ``Abort``; both send
``Heartbeat``. Data never travels here, only page ids, checksums and states.

Deferred allocation (only between nodes whose application asks for it): decode holds a receiver
and sends ``Reserve`` before it allocates any page; prefill answers ``PrefillReady`` once the
request's prefill has finished (at once if it already had), and decode then sends its
``RequestPages`` as above. A prefill that fails the request first refuses the reservation
(``ChunkDone`` not ok).
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from ..plugin.descriptors import MAX_KIND_CHARS, BufferDescriptor

# 1: first version (layout + buffers handshake, per-chunk completion, abort, heartbeat).
# 2: layer sets: layouts carry index_layer_ids; Hello carries the indexer layers decode reads.
# 3: sessions: Hello carries decode's session id and epoch (a re-handshake after decode marked the
#    prefill dead), HelloAck echoes the epoch and names the rooms a failed write may still land in.
# The staged route added only optional fields (Hello.staging, ChunkDone.slices) and two messages
# sent only to a peer whose Hello offered a staging area: version 3 peers without it still pair.
# Different attention-TP widths added only optional fields (RequestPages.copies, .nothing_to_send),
# sent only by a decode whose width differs from its prefill's.
# Deferred decode allocation added two messages (Reserve, PrefillReady) sent only by nodes whose
# application asks for it: version 3 peers without it still pair.
# Page shares added one optional field (ChunkDone.positions), sent only by a prefill whose
# application writes a share of a request's pages (sglang's KV sharding, prefill CP's page split).
# Decode's own indexer pages added two optional fields (Hello.kv_page_zero, RequestPages.
# index_pages), set only by a decode whose application asks (sglang's HiSparse decode), and one
# more (Hello.kv_on_index_pages) for the KV layers such a decode keeps with its indexer.
# A refusal of pages from a decode node prefill dropped as silent added one optional field
# (ChunkDone.unpaired): such a decode re-handshakes at once instead of after prefill's silence.
PROTOCOL_VERSION = 3
MAX_MESSAGE_BYTES = 16 * 1024 * 1024  # of any message; each node's sockets take less (limits.py)

# Size bounds, checked by the decoder before it decodes a single element (a Hello of 600k buffers
# is refused in microseconds, not decoded in half a second). Global layer ids of one model: the
# largest DSA models have 62 (DeepSeek-V3.2) and 79 (GLM-5.2) layers with their draft layers.
MAX_LAYERS = 512
MAX_BUFFERS = 2 * MAX_LAYERS  # a KV and an indexer buffer per layer
# An engine's connection metadata (a peer runs the same engine): Mooncake's is a "host:port"
# session id; NIXL's grows with the regions registered: 542 bytes for 1 region, 75,467 for 1,000
# (CPU; GPU regions carry larger remote keys) - 1 MiB leaves room for MAX_BUFFERS of ~1 KiB each.
MAX_ENGINE_METADATA_BYTES = 1024 * 1024
MAX_NAME_CHARS = 256  # node, backend and algorithm names
MAX_REASON_CHARS = 4096  # why a request or a handshake failed; longer ones are cut on encode
MAX_TOKEN_BYTES = 64  # nonces, signatures
HASH_CHARS = 64  # sha256 hex
MAX_ROOMS = 4096  # rooms named in one HelloAck (those of a dropped session whose failed write may land)
MAX_AUX_BUFFERS = 64  # SGLang's metadata buffers: about ten
MAX_SLICES = 4096  # of one staging area (256 MiB in slices of 64 KiB)
MAX_ROOM = 2**63 - 1  # room ids are SGLang bootstrap rooms: non-negative 63-bit
MAX_COPIES = 64  # decode nodes one request goes to from one prefill node: the widest attention TP
MAX_POSITIONS = 1 << 20  # pages of one chunk's share (a 64M-token request in pages of 64)

Name = Annotated[str, msgspec.Meta(max_length=MAX_NAME_CHARS)]
Reason = Annotated[str, msgspec.Meta(max_length=MAX_REASON_CHARS)]
Token = Annotated[bytes, msgspec.Meta(max_length=MAX_TOKEN_BYTES)]
Hash = Annotated[str, msgspec.Meta(max_length=HASH_CHARS)]
Kind = Annotated[str, msgspec.Meta(max_length=MAX_KIND_CHARS)]
Room = Annotated[int, msgspec.Meta(ge=0, le=MAX_ROOM)]


class ProtocolError(ValueError):
    """A message that cannot be decoded or that breaks the protocol."""


class StagingArea(msgspec.Struct, frozen=True, array_like=True):
    """A registered staging area of decode's for one prefill node: ``slices`` slices of
    ``slice_bytes`` bytes from ``ptr`` (``staging.py``)."""

    ptr: int
    slice_bytes: int
    slices: Annotated[int, msgspec.Meta(ge=1, le=MAX_SLICES)]


class Hello(msgspec.Struct, frozen=True, tag="hello"):
    version: int
    node: Name
    backend: Name
    layout: dict
    layout_hash: Hash
    engine_metadata: Annotated[bytes, msgspec.Meta(max_length=MAX_ENGINE_METADATA_BYTES)]
    buffers: Annotated[list[BufferDescriptor], msgspec.Meta(max_length=MAX_BUFFERS)]
    index_reads: Annotated[list[int], msgspec.Meta(max_length=MAX_LAYERS)]
    nonce: Token = b""
    sent_at: float = 0.0
    auth: Token = b""
    session: Token = b""  # one per decode node: a later Hello of the same session replaces it
    epoch: int = 0  # counts decode's handshakes of this session with this prefill node
    aux_buffers: Annotated[list[BufferDescriptor], msgspec.Meta(max_length=MAX_AUX_BUFFERS)] = []
    staging: StagingArea | None = None  # where prefill may stage this node's chunks (optional)
    kv_page_zero: bool = False  # its KV buffers hold no padding page: page 0 may be written
    # the layers whose KV a request's index_pages address, as its indexer's (HiSparse's draft KV)
    kv_on_index_pages: Annotated[list[int], msgspec.Meta(max_length=MAX_LAYERS)] = []


class HelloAck(msgspec.Struct, frozen=True, tag="hello_ack"):
    version: int
    ok: bool
    reason: Reason
    node: Name
    layout: dict
    layout_hash: Hash
    auth: Token = b""
    epoch: int = 0  # the Hello's: decode accepts only the answer to its latest Hello
    # rooms of the session's earlier epochs whose failed engine write may still land (all other
    # writes of those epochs have finished before this answer was sent)
    in_flight: Annotated[list[int], msgspec.Meta(max_length=MAX_ROOMS)] = []


class RequestPages(msgspec.Struct, frozen=True, tag="request"):
    """Decode has allocated ``dst_pages`` for ``room``; prefill writes the request there, and
    its aux slots into decode's slot ``aux_index`` (-1: none). ``prefix_tokens``: the request's
    first tokens decode holds already (its radix cache); ``dst_pages`` are for the rest, and
    prefill sends only the rest. ``copies``: how many decode nodes each receive the whole
    request from this prefill (a decode wider than prefill's attention TP: each of its ranks
    announces its own pages, and prefill writes once all did). ``nothing_to_send``: this decode
    reads the request from another prefill rank (a prefill wider than decode's attention TP):
    no pages, and this prefill's sender succeeds with its last chunk, writing nothing.
    ``index_pages``: decode's indexer pages for the same pages of the request, where they are
    not ``dst_pages`` (sglang's HiSparse decode: KV in a host pool, the indexer on the device)."""

    room: int
    dst_pages: list[int]
    num_tokens: int
    aux_index: int = -1
    prefix_tokens: int = 0
    copies: int = 1
    nothing_to_send: bool = False
    index_pages: list[int] | None = None


class PageChecksums(msgspec.Struct, frozen=True, array_like=True):
    """One 64-bit checksum per (buffer, page) of a chunk (``checksum.py``): ``values`` holds
    little-endian uint64, buffer-major, buffers in the order of ``buffers`` ((layer id, kind)),
    pages in the chunk's order. The chunk covers decode's pages at ``[offset, offset + n)`` of
    the request."""

    algorithm: Name
    offset: int
    buffers: Annotated[list[tuple[int, Kind]], msgspec.Meta(max_length=MAX_BUFFERS)]
    values: bytes


class ChunkDone(msgspec.Struct, frozen=True, tag="chunk_done"):
    """Prefill finished (ok) or gave up on (not ok) a chunk; ``in_flight`` says whether a write
    into decode's pages may still land (engine failure or timeout) so decode must not reuse them yet.
    ``checksums`` (optional, so older peers still decode the message) come with an ok chunk from a
    prefill node that computes them. ``positions``: the chunk of a share writer (one of several
    prefill nodes that each write a share of the request's pages, every layer of each) names
    the request's pages it wrote, ascending; its checksums then cover those pages in that order
    (``offset`` 0). None: the chunk continues the request's pages where the last one ended.
    ``unpaired``: the refusal of pages from a decode node prefill dropped as silent (which may
    have been frozen, not gone), which re-handshakes at once."""

    room: int
    chunk: int
    ok: bool
    last: bool
    reason: Reason = ""
    nbytes: int = 0
    descriptors: int = 0
    write_seconds: float = 0.0
    in_flight: bool = False
    checksums: PageChecksums | None = None
    slices: int = 0  # staging slices that carried the chunk (``SliceWritten`` before this)
    positions: Annotated[list[int], msgspec.Meta(max_length=MAX_POSITIONS)] | None = None
    unpaired: bool = False  # refused because prefill dropped this decode node: re-handshake now


class SliceWritten(msgspec.Struct, frozen=True, tag="slice"):
    """Prefill wrote pages ``[offset, offset + pages)`` of request ``room`` (every buffer it
    writes, buffer-major) into decode's staging slice ``slice``: decode scatters them into its
    pages, then frees the slice (``SliceFree``). Sent only to a node whose Hello offered one."""

    room: int
    slice: int
    offset: int
    pages: int


class SliceFree(msgspec.Struct, frozen=True, tag="slice_free"):
    """Decode has scattered these staging slices: prefill may write into them again."""

    slices: Annotated[list[int], msgspec.Meta(max_length=MAX_SLICES)]


class Abort(msgspec.Struct, frozen=True, tag="abort"):
    """Either side gives up ``room``. ``before_pages``: decode gave up before it sent its pages
    (prefill's sender, now or later, fails at once; nothing to answer)."""

    room: int
    reason: Reason
    before_pages: bool = False


class Reserve(msgspec.Struct, frozen=True, tag="reserve"):
    """Decode holds a receiver for ``room`` and will allocate its pages (``RequestPages``) once
    prefill has computed the request (``PrefillReady``)."""

    room: Room


class PrefillReady(msgspec.Struct, frozen=True, tag="prefill_ready"):
    """The request's prefill has finished: decode may allocate and send its pages now. Sent
    once to each decode node that reserved ``room``."""

    room: Room


class Heartbeat(msgspec.Struct, frozen=True, tag="heartbeat"):
    sent_at: float


Message = (Hello | HelloAck | RequestPages | ChunkDone | SliceWritten | SliceFree | Abort
           | Reserve | PrefillReady | Heartbeat)

_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Message)


_TEXT_LIMITS = (("reason", MAX_REASON_CHARS), ("node", MAX_NAME_CHARS))


def bounded(message: Message) -> Message:
    """``message`` with a reason or node name longer than the decoder takes cut to fit (marked
    with a trailing "..."), so that what a node sends is never refused for its length."""
    cuts = {}
    for name, limit in _TEXT_LIMITS:
        text = getattr(message, name, None)
        if isinstance(text, str) and len(text) > limit:
            cuts[name] = text[:limit - 3] + "..."
    return msgspec.structs.replace(message, **cuts) if cuts else message


def encode(message: Message) -> bytes:
    return _encoder.encode(bounded(message))


def signed_bytes(message: Hello | HelloAck) -> bytes:
    """The bytes a signature covers: the message with its ``auth`` field empty."""
    return encode(msgspec.structs.replace(message, auth=b""))


def decode(data: bytes, max_bytes: int = MAX_MESSAGE_BYTES) -> Message:
    """Decode one message; any malformed, truncated or oversized input (more than ``max_bytes``,
    or a field beyond its bound) raises ProtocolError."""
    if len(data) > max_bytes:
        raise ProtocolError(f"message of {len(data)} bytes exceeds {max_bytes}")
    try:
        return _decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise ProtocolError(f"bad message: {exc}") from exc
