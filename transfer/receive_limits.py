"""The largest message a node can legitimately receive, computed from its layout and buffers:
the receive limit of its sockets (``control.limit_receive``, ZMQ_MAXMSGSIZE).

Every bound is an upper bound of the encoded message: the message's fixed part encoded with the
largest scalar values, plus, for each variable-length field, the protocol's bound on it at the
largest encoding of an element (a msgpack integer takes at most 9 bytes, a header at most 5, a
character at most 4). What varies with the node:

- a prefill node receives ``Hello`` (a layout with this node's geometry and at most
  ``MAX_LAYERS`` layers, at most ``MAX_BUFFERS`` buffers, the engine's metadata), ``RequestPages``
  (at most as many page ids as its own buffers hold pages: a request's prefill pages are distinct
  pages of its pool, and decode's page list has exactly as many), ``Abort`` and ``Heartbeat``;
- a decode node receives ``HelloAck`` and ``ChunkDone`` (its checksums cover at most every page of
  decode's buffers, in every buffer it holds, and never more than ``checksum.MAX_CHECKSUM_BYTES``),
  and ``Heartbeat``.

No limit exceeds ``protocol.MAX_MESSAGE_BYTES``.
"""

from __future__ import annotations

from collections.abc import Sequence

import msgspec

from ..plugin.descriptors import MAX_DEVICE_CHARS
from ..plugin.layout import DSALayout
from . import checksum, protocol
from .plan import BufferDescriptor
from .protocol import (
    MAX_AUX_BUFFERS,
    MAX_BUFFERS,
    MAX_ENGINE_METADATA_BYTES,
    MAX_LAYERS,
    MAX_NAME_CHARS,
    MAX_REASON_CHARS,
    MAX_ROOMS,
    MAX_TOKEN_BYTES,
    PROTOCOL_VERSION,
)

INT_BYTES = 9  # the most a msgpack integer (or float) takes
HEADER_BYTES = 5  # the most a msgpack str, bin or array header takes
LARGEST = 2**63 - 1  # an int that encodes to INT_BYTES
KIND_BYTES = 1 + protocol.MAX_KIND_CHARS  # a cache kind: "kv" or "index", ASCII
DEVICE_BYTES = 1 + MAX_DEVICE_CHARS  # "cpu", "cuda:N", ASCII
# a BufferDescriptor: [layer_id, kind, ptr, nbytes, item_len, device] (pool and aux buffers alike)
BUFFER_INFO_BYTES = 1 + 4 * INT_BYTES + KIND_BYTES + DEVICE_BYTES
BUFFER_KEY_BYTES = 1 + INT_BYTES + KIND_BYTES  # [layer_id, kind] of a chunk's checksums


def _text(chars: int) -> int:
    return HEADER_BYTES + 4 * chars


def _ints(count: int) -> int:
    return HEADER_BYTES + INT_BYTES * count


def _blob(nbytes: int) -> int:
    return HEADER_BYTES + nbytes


def layout_bytes(layout: DSALayout) -> int:
    """A peer's layout dict: this geometry, at most MAX_LAYERS layers and indexer layers."""
    fixed = {**layout.to_dict(), "layer_ids": [], "index_layer_ids": []}
    return len(msgspec.msgpack.encode(fixed)) + 2 * _ints(MAX_LAYERS)


def hello_bytes(layout: DSALayout, backend: str) -> int:
    fixed = protocol.Hello(PROTOCOL_VERSION, "", backend, {}, "0" * protocol.HASH_CHARS, b"", [], [],
                           sent_at=0.0)
    return (len(protocol.encode(fixed)) + _text(MAX_NAME_CHARS) + layout_bytes(layout)
            + _blob(MAX_ENGINE_METADATA_BYTES) + HEADER_BYTES + MAX_BUFFERS * BUFFER_INFO_BYTES
            + _ints(MAX_LAYERS) + 3 * _blob(MAX_TOKEN_BYTES) + INT_BYTES  # nonce, auth, session; epoch
            + HEADER_BYTES + MAX_AUX_BUFFERS * BUFFER_INFO_BYTES)


def request_pages_bytes(pages: int) -> int:
    largest = protocol.RequestPages(LARGEST, [], LARGEST, LARGEST, LARGEST, LARGEST, True)
    return len(protocol.encode(largest)) + _ints(pages)


def abort_bytes() -> int:
    return len(protocol.encode(protocol.Abort(LARGEST, "", before_pages=True))) + _text(MAX_REASON_CHARS)


def heartbeat_bytes() -> int:
    return len(protocol.encode(protocol.Heartbeat(0.0)))


def hello_ack_bytes(layout: DSALayout) -> int:
    fixed = protocol.HelloAck(PROTOCOL_VERSION, False, "", "", {}, "0" * protocol.HASH_CHARS)
    return (len(protocol.encode(fixed)) + _text(MAX_REASON_CHARS) + _text(MAX_NAME_CHARS)
            + layout_bytes(layout) + _blob(MAX_TOKEN_BYTES) + INT_BYTES + _ints(MAX_ROOMS))


def chunk_done_bytes(pages: int, buffers: int) -> int:
    """A chunk report with the checksums of ``pages`` pages in ``buffers`` buffers."""
    fixed = protocol.ChunkDone(LARGEST, LARGEST, ok=False, last=False, nbytes=LARGEST,
                               descriptors=LARGEST, checksums=protocol.PageChecksums("", LARGEST, [], b""))
    sums = min(8 * pages * buffers, checksum.MAX_CHECKSUM_BYTES)
    return (len(protocol.encode(fixed)) + _text(MAX_REASON_CHARS) + _text(MAX_NAME_CHARS)
            + HEADER_BYTES + buffers * BUFFER_KEY_BYTES + _blob(sums))


def _pages(buffers: Sequence[BufferDescriptor]) -> int:
    return max(b.num_items for b in buffers)


def prefill_receive_bytes(layout: DSALayout, backend: str, buffers: Sequence[BufferDescriptor]) -> int:
    """The receive limit of a prefill node with ``layout`` and its own ``buffers``."""
    largest = max(hello_bytes(layout, backend), request_pages_bytes(_pages(buffers)), abort_bytes(),
                  heartbeat_bytes())
    return min(largest, protocol.MAX_MESSAGE_BYTES)


def decode_receive_bytes(layout: DSALayout, buffers: Sequence[BufferDescriptor]) -> int:
    """The receive limit of a decode node with ``layout`` and its own ``buffers``."""
    largest = max(hello_ack_bytes(layout), chunk_done_bytes(_pages(buffers), len(buffers)),
                  heartbeat_bytes())
    return min(largest, protocol.MAX_MESSAGE_BYTES)
