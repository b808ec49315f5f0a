"""What the prefill side keeps about decode nodes and requests: plain records, and ``KVSender``.

- ``DecodePeer``: a paired decode node, one epoch of its session (what it announced at its
  handshake, the rooms it announced since);
- ``DecodeDestination``: where one decode node wants one request's pages (its peer, page ids,
  aux slot); ``Destinations``: every decode node one request goes to;
- ``Reservation``: a decode node that holds a receiver for a request and waits to be told that
  its prefill finished before it allocates its pages (deferred allocation);
- ``IncomingRequest``: a request decode announced that has no sender yet, as the application
  is offered it on ``PrefillNode.incoming``;
- ``Chunk``: a part of a request's prefill page ids, queued until decode's pages are known;
- ``KVSender``: one request on the prefill side (SGLang's BaseKVSender semantics), as the
  application holds it. Its calls go to the node's request book (``SenderBook``:
  ``requests.RequestBook``), which holds the node's lock while it changes the sender; the
  request's ``prefill_request.PrefillRequest`` owns it there.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from ..plan import BufferPair, PairTable
from ..protocol import StagingArea
from ..request import TERMINAL, RequestHandle


@dataclass
class DecodePeer:
    """A paired decode node: one epoch of its session, until a later Hello or silence ends it."""

    identity: bytes  # its control connection (ZMQ ROUTER identity)
    node: str
    engine_peer: str
    pairs: PairTable
    last_seen: float
    rooms: set[int] = field(default_factory=set)
    session: bytes = b""  # decode's session: a later Hello of it ends this epoch
    dropped_senders: list[KVSender] = field(default_factory=list)  # once dropped: its rooms' senders
    dropped_at: float = 0.0
    aux_pairs: list[BufferPair] = field(default_factory=list)
    staging: StagingArea | None = None  # decode's staging area for this node (the staged route)
    kv_page_zero: bool = False  # decode's KV buffers hold no padding page (its Hello)


@dataclass(eq=False)
class DecodeDestination:
    """Where one decode node wants a request's pages: its node, its page ids (and its own
    indexer page ids, where they differ) and its aux slot, and how many of the request's chunks
    were written there."""

    peer: DecodePeer
    dst_pages: np.ndarray
    num_tokens: int
    received_at: float
    aux_index: int | None = None  # decode's aux slot
    prefix_tokens: int = 0  # the request's first tokens decode holds already (not sent)
    chunks_written: int = 0
    finished: bool = False  # its last chunk was written
    index_pages: np.ndarray | None = None  # decode's indexer pages (None: ``dst_pages``)


@dataclass(eq=False)
class Destinations:
    """Every decode node a request goes to: ``copies`` of them, each announcing its own pages
    (a decode wider than prefill's attention TP needs the whole request on each of its ranks);
    prefill writes once all announced. ``nothing_to_send``: the one decode node reads the
    request from another prefill rank (a prefill wider than decode's attention TP)."""

    copies: int
    members: list[DecodeDestination]
    nothing_to_send: bool = False

    @property
    def complete(self) -> bool:
        return len(self.members) == self.copies

    @property
    def prefix_tokens(self) -> int:
        return self.members[0].prefix_tokens

    def of(self, peer: DecodePeer) -> DecodeDestination | None:
        return next((m for m in self.members if m.peer is peer), None)

    def to_write(self) -> list[DecodeDestination]:
        """The members prefill writes to (none when there is nothing to send)."""
        return [] if self.nothing_to_send else self.members


@dataclass(eq=False)
class Reservation:
    """A decode node's ``Reserve`` of a request: it allocates its pages once told the request's
    prefill finished (``told``), or gives up when refused (``refused``: the request failed)."""

    peer: DecodePeer
    received_at: float
    told: bool = False
    refused: bool = False


@dataclass(frozen=True)
class IncomingRequest:
    """A request (``room``) decode has allocated pages for, waiting for the application's sender."""

    room: int
    num_pages: int
    num_tokens: int
    peer: str
    prefix_tokens: int = 0  # the request's first tokens decode holds already: send the rest


@dataclass(frozen=True, eq=False)
class Chunk:
    """Prefill page ids of a request: ``offset`` of the first among the request's pages; ``last``:
    the chunk that completes them. A share writer's chunk (``positions``) names the request's
    pages it holds instead, ascending (``offset`` 0: its checksums index them)."""

    offset: int
    pages: np.ndarray
    last: bool
    positions: np.ndarray | None = None


class SenderBook(Protocol):
    """What a ``KVSender`` calls: the node's request book."""

    def init_sender(self, sender: KVSender, num_pages: int, aux_index: int | None) -> None: ...

    def send_chunk(self, sender: KVSender, page_ids: object) -> None: ...

    def send_share(self, sender: KVSender, page_ids: object, positions: object,
                   through: int) -> None: ...

    def abort(self, sender: KVSender, reason: str) -> None: ...

    def prefill_complete(self, sender: KVSender) -> None: ...


class KVSender(RequestHandle):
    """One request on the prefill side (SGLang's BaseKVSender semantics). A ``deferred`` one
    (its prefill runs before decode allocates) has no deadline until ``prefill_complete``."""

    def __init__(self, book: SenderBook, room: int, timeout_s: float, *, deferred: bool = False):
        super().__init__(room, timeout_s)
        self._book = book
        if deferred:
            self.state.deadline = math.inf
        self.completed = False  # ``prefill_complete`` was called
        self.num_pages: int | None = None
        self.pages_sent = 0  # of a share writer: the request's pages its chunks went through
        self.shares: bool | None = None  # writes a share of the pages (``send_share``); None: no chunk yet
        self.chunks_sent = 0
        self.nbytes = 0  # bytes its engine writes wrote, into every decode node
        self.pending: list[Chunk] = []  # chunks waiting for decode's pages
        self.busy = 0  # chunks queued for or inside the writer
        self.reported = False  # decode was told of the failure
        self.write_failed = False  # an engine write failed: its bytes may still land
        self.aux_index: int | None = None  # this request's aux slot, written with the last chunk
        self.decode_prefix_tokens = 0  # tokens decode holds already: the pages sent start there

    def init(self, num_pages: int, aux_index: int | None = None) -> None:
        self._book.init_sender(self, num_pages, aux_index)

    def send(self, page_ids) -> None:
        """Queue a chunk of this request's prefill page ids; the chunk that completes
        ``num_pages`` is the last one."""
        self._book.send_chunk(self, page_ids)

    def send_share(self, page_ids, positions, through: int) -> None:
        """Queue a chunk of this writer's share of the request's pages (one of several prefill
        nodes that each hold every layer and write a share of the pages: sglang's KV sharding,
        prefill CP's page split): ``page_ids`` are its prefill page ids for the request's pages
        ``positions`` (ascending), and the request's pages ``[0, through)`` are now sent by
        every writer. The chunk whose ``through`` reaches ``num_pages`` is the last, sent even
        without a page of this writer's; an empty chunk before it sends nothing."""
        self._book.send_share(self, page_ids, positions, through)

    def abort(self, reason: str = "aborted by prefill") -> None:
        self._book.abort(self, reason)

    def prefill_complete(self) -> None:
        """The request's prefill has finished: its deadline runs from now, and each decode node
        that reserved the request is told (``PrefillReady``; one that reserves later, on
        arrival). Idempotent; never raises; tells nobody once the request failed."""
        self._book.prefill_complete(self)

    def can_release(self) -> bool:
        """True once no write reading this request's pages can still be running."""
        return self.state.status in TERMINAL and self.busy == 0
