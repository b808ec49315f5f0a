"""One request on the decode side (``KVReceiver``, SGLang's BaseKVReceiver semantics): it asks its
prefill node(s) for the request, counts what they report, and settles itself.

A request is fed by one prefill node, by pipeline stages that each hold a part of the layers
(``stages``), or by share writers that each write a share of its pages, every layer of each
(``shares``: each chunk names its pages, ``fence.RequestParts.positions``). Its path, in order:

0. Deferred allocation only (a receiver made with ``reserve``): the node has sent each of its
   prefill nodes a ``Reserve``; each answers ``PrefillReady`` once the request's prefill has run
   (``prefill_ready_locked``), and once all did, ``prefill_ready`` is True and the request's
   deadline starts again: the application allocates its pages now. A refusal meanwhile fails it.
1. ``init`` (application thread) sends the pages decode allocated (and the aux slot, to the stage
   that holds the last layer) to each of its prefill nodes: WaitingForInput; or fails at once,
   releasing its pages, when one of them is marked dead.
2. ``chunk_reported_locked`` (control thread): each chunk report is counted, the request turns
   Transferring; a prefill's failure report fails it.
3. With checksums on, the node hands each counted chunk to the verifier, whose outcome comes back
   to ``chunk_verified`` (verifier thread): a mismatch, or a last chunk whose pages were not all
   verified, fails the request; otherwise the last chunk goes on to
4. ``part_done_locked``: the prefill's part must be complete and reported once; once every part is
   (share writers: and every page written by exactly one), the request turns Success.

A failure asks every prefill that may still write to stop (``Abort``) and holds the pages until
``fence.RequestFence`` lets them go (``_settle_locked``): a prefill's final word, proof that
a silent one can no longer write (``peer_gone_locked``), or the quarantine's upper bound (counted as
an expiry). The node's tick calls ``tick_locked`` for the deadline and that bound.

Locking: every request of a node shares the node's lock (``ReceiverContext.lock``). The methods the
application and the verifier call take it; those named ``..._locked`` expect it held.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import zmq

from ...plugin.descriptors import BufferDescriptor
from .. import checksum, protocol
from ..counters import Counters
from ..handshake import BufferKey
from ..plan import PlanError, as_page_ids, check_aux_index, check_page_lists, on_index_pages
from ..request import TERMINAL, KVPoll, RequestHandle
from .fence import RequestFence, RequestParts
from .sessions import PrefillPeer

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class PageLimits:
    """The pages of the buffers a request's KV pages address and of those its indexer pages
    address (0: none; ``plan.on_index_pages``), whether its KV buffers hold no padding page
    (page 0 is then a page), and the KV layers kept with the indexer."""

    kv: int
    index: int
    kv_page_zero: bool = False
    kv_on_index_pages: frozenset[int] = frozenset()

    @classmethod
    def of(cls, buffers: Sequence[BufferDescriptor], kv_page_zero: bool = False,
           kv_on_index_pages: frozenset[int] = frozenset()) -> PageLimits:
        """The smallest page count of each page list's buffers among ``buffers``."""
        by_list = ([b.num_items for b in buffers
                    if on_index_pages((b.layer_id, b.kind), kv_on_index_pages) == on_index]
                   for on_index in (False, True))
        kv, index = (min(pages, default=0) for pages in by_list)
        return cls(kv, index, kv_page_zero, kv_on_index_pages)

    def check(self, kv_pages: np.ndarray, index_pages: np.ndarray | None) -> None:
        """PlanError unless ``kv_pages`` fit the KV buffers and the indexer pages (``index_pages``,
        as many; None: ``kv_pages``) fit the indexer buffers."""
        check_page_lists(kv_pages, index_pages, self.kv, self.index,
                         kv_page_zero=self.kv_page_zero, names=("page_ids", "index_page_ids"))


@dataclass(frozen=True)
class ReceiverContext:
    """What the requests of one decode node share."""

    name: str  # the node's, for the log
    lock: threading.Lock  # the node's: guards every request's state, parts and fence
    counters: Counters
    send: Callable[[zmq.Socket, protocol.Message], None]  # queues a message for the control loop
    page_limits: PageLimits  # pages per buffer of the pool
    aux_buffers: Sequence[BufferDescriptor]
    request_timeout_s: float
    in_flight_grace_s: float
    quarantine_timeout_s: float


class KVReceiver(RequestHandle):
    """One request, fed by one prefill node, by several that each hold a part of the layers
    (pipeline stages), or by several that each write a share of the pages (``shares``).
    Success once every one of them has written all of its part, exactly once."""

    def __init__(self, room: int, peers: list[PrefillPeer], context: ReceiverContext, *,
                 reserve: bool = False, shares: bool = False):
        super().__init__(room, context.request_timeout_s)
        self.peers = peers
        self.reserved = reserve  # waits for its prefill nodes' ``PrefillReady``
        self._ready_from: set[str] = set()  # the prefill nodes that sent it
        self._prefill_ready = not reserve
        self._context = context
        self.parts = RequestParts((p.endpoint for p in peers), shares=shares)
        self.fence = RequestFence(p.endpoint for p in peers)
        self.page_ids: np.ndarray | None = None
        self.index_page_ids: np.ndarray | None = None  # the indexer's own pages, if not page_ids
        self.aux_index: int | None = None
        self.chunks = 0
        self.nbytes = 0
        self.descriptors = 0
        self.write_seconds = 0.0
        self.checksums_verified = 0
        self.started_at: float | None = None
        self.scatters = 0  # staged slices being scattered into its pages (``scatter``)

    @property
    def components(self) -> list[BufferKey]:
        """Every (layer, cache) buffer this request fills, in layer order."""
        return sorted(key for p in self.peers for key in p.keys)

    @property
    def stageable(self) -> bool:
        """Its chunks may come staged: one page list for every buffer, in the request's order
        (not shares, whose chunks name their pages, nor two page lists)."""
        return not self.parts.shares and self.index_page_ids is None

    @property
    def prefill_ready(self) -> bool:
        """Every prefill node of the request has computed it (always True without ``reserve``):
        its pages may be allocated and sent (``init``) now."""
        return self._prefill_ready

    @property
    def received(self) -> dict[str, int]:
        return self.parts.received

    @property
    def finished(self) -> set[str]:
        return self.parts.finished

    # ---- application thread ----------------------------------------------------------------

    def init(self, page_ids, num_tokens: int = 0, aux_index: int | None = None, *,
             prefix_tokens: int = 0, copies: int = 1, index_page_ids=None) -> None:
        """Send the pages decode allocated for this request (and its aux slot) to its prefill
        node(s). ``prefix_tokens``: the request's first tokens decode holds already (its radix
        cache): ``page_ids`` are for the rest, which is all prefill sends. ``copies``: how many
        decode nodes (this one included) each receive the whole request from the same prefill
        node (a decode wider than prefill's attention TP). ``index_page_ids``: the indexer's own
        pages for the same pages of the request, where they are not ``page_ids`` (the node's
        module docstring)."""
        context = self._context
        if not isinstance(prefix_tokens, int) or prefix_tokens < 0:
            raise ValueError(f"prefix_tokens must be a non-negative int, got {prefix_tokens!r}")
        if not isinstance(copies, int) or not 1 <= copies <= protocol.MAX_COPIES:
            raise ValueError(f"copies must be an int in 1..{protocol.MAX_COPIES}, got {copies!r}")
        try:
            self.aux_index = check_aux_index(context.aux_buffers, aux_index, "aux_index")
        except PlanError as exc:
            raise ValueError(str(exc)) from None
        if self.page_ids is not None:
            raise ValueError(f"room {self.room}: init called twice")
        try:
            pages = as_page_ids(page_ids, "page_ids")
            index = None if index_page_ids is None else as_page_ids(index_page_ids, "index_page_ids")
            if pages.size or (self.aux_index is None and not prefix_tokens) or (
                    index is not None and index.size):
                context.page_limits.check(pages, index)  # (no page: decode holds them all)
        except PlanError as exc:
            raise ValueError(str(exc)) from None
        with context.lock:
            now = time.monotonic()
            self.page_ids = pages
            self.index_page_ids = index
            self.parts.start(pages.size)
            self.started_at = now
            if self.state.status in TERMINAL:  # aborted before init: ask no prefill node
                return
            dead = [p.endpoint for p in self.peers if not p.alive]
            if dead:
                self._fail_locked(f"prefill {dead[0]} unreachable (awaiting its new handshake)", now,
                                  release_after_s=0.0)
                self.fence.nothing_sent()
                return
            self.state.advance(KVPoll.WaitingForInput, now)
        aux_peer = self._aux_peer()
        for peer in self.peers:
            aux = self.aux_index if peer is aux_peer else -1
            context.send(peer.socket, protocol.RequestPages(
                self.room, pages.tolist(), int(num_tokens), aux, prefix_tokens, copies,
                index_pages=None if index is None else index.tolist()))

    def abort(self, reason: str = "aborted by decode") -> None:
        with self._context.lock:
            self.abort_locked(reason, time.monotonic())

    def can_release(self) -> bool:
        """True once the request's pages may go back to the allocator (invariant 8)."""
        with self._context.lock:
            return self.releasable_locked(time.monotonic())

    def releasable_locked(self, now: float) -> bool:
        """No write into its pages can still land, and no scatter of a staged slice runs."""
        return self.state.can_release(now) and not self.scatters

    # ---- what its prefill nodes report (control thread, then verifier thread) ---------------

    def prefill_ready_locked(self, peer: PrefillPeer, now: float) -> None:
        """``peer`` has computed the request; once every prefill node has, the deadline runs
        again from now (the prefill's computation does not eat the transfer's time)."""
        if not self.reserved or self._prefill_ready or self.state.status in TERMINAL:
            return
        self._ready_from.add(peer.endpoint)
        if len(self._ready_from) == len(self.peers):
            self.state.deadline = now + self._context.request_timeout_s
            self._prefill_ready = True

    def chunk_reported_locked(self, peer: PrefillPeer, done: protocol.ChunkDone, now: float) -> bool:
        """``peer``'s report of a chunk: True when it counts toward the request (an ok chunk of a
        request still running), which is then Transferring."""
        context = self._context
        if not done.ok and self.page_ids is None:  # refused before any page was named
            self.abort_locked(f"prefill {peer.endpoint}: {done.reason}", now, told=peer)
            return False
        if not done.ok:  # the prefill's final word: none of its writes is still running...
            self.fence.confirmed(peer.endpoint, now, in_flight=done.in_flight,  # ...unless one may land
                                 grace_s=context.in_flight_grace_s)
            self._fail_sent_locked(f"prefill {peer.endpoint}: {done.reason}", now)
            return False
        if done.last:
            self.fence.confirmed(peer.endpoint, now)
        if self.state.status in TERMINAL:
            self._settle_locked(now)
            return False
        problem = self.parts.positions(peer.endpoint, done.positions)
        if not problem and done.slices and not self.stageable:
            problem = (f"prefill {peer.endpoint} staged a chunk of a request of shares or of two "
                       "page lists, which decode cannot scatter")
        if problem:  # later chunks may still be written: held until every prefill confirms
            self._fail_sent_locked(problem, now)
            return False
        self.chunks += 1
        self.nbytes += done.nbytes
        self.descriptors += done.descriptors
        self.write_seconds += done.write_seconds
        self.parts.chunk(peer.endpoint, done.nbytes)
        context.counters.record_write(done.write_seconds, done.nbytes, done.descriptors)
        if done.slices:
            context.counters.add(staged_chunks=1, staging_slices=done.slices)
        self.state.advance(KVPoll.Transferring, now)
        return True

    def chunk_verified(self, done: protocol.ChunkDone, peer: PrefillPeer, problem: str,
                       verified: int, seconds: float) -> None:
        """The verifier's outcome for one chunk of ``peer`` (verifier thread): ``problem`` or "",
        and the (buffer, page) checksums it verified in ``seconds``."""
        context = self._context
        with context.lock:
            now = time.monotonic()
            context.counters.add(checksums_verified=verified, checksum_seconds=seconds)
            self.checksums_verified += verified
            self.parts.verify(peer.endpoint, verified)
            if not problem and done.last:
                try:
                    checksum.check_coverage(self.parts.verified[peer.endpoint],
                                            self.parts.pages_of(peer.endpoint, self.page_ids.size),
                                            len(peer.keys))
                except checksum.ChecksumError as exc:
                    problem = str(exc)
            if problem:  # later chunks may still be written: held until every prefill confirms
                self._fail_sent_locked(problem, now)
            elif done.last and self.state.status not in TERMINAL:
                self.part_done_locked(peer, now)

    def part_done_locked(self, peer: PrefillPeer, now: float) -> None:
        """``peer``'s last chunk: its part must be complete, and reported only once."""
        aux_bytes = sum(b.item_len for b in self._context.aux_buffers) if peer is self._aux_peer() else 0
        pages = self.parts.pages_of(peer.endpoint, self.page_ids.size)
        problem = self.parts.part_done(peer.endpoint, pages * peer.page_bytes + aux_bytes,
                                       f"{len(peer.keys)} buffers x {pages} pages")
        if not problem and self.parts.complete:
            problem = self.parts.unwritten()
        if problem:
            self._fail_sent_locked(problem, now)
        elif self.parts.complete and self.state.advance(KVPoll.Success, now):
            self._context.counters.request_ok(self.state.finished_at - self.started_at)

    def slice_scattered_locked(self, problem: str, now: float) -> None:
        """The scatter thread copied a staged slice into its pages (``problem``: why it could not,
        which fails the request)."""
        self.scatters -= 1
        if problem:
            self.abort_locked(problem, now)

    def chunk_pages(self, done: protocol.ChunkDone) -> tuple[np.ndarray, np.ndarray | None]:
        """Decode's page ids a chunk's checksums index, of the KV and of the indexer (None: the
        KV's): the request's, or a share chunk's own."""
        lists = (self.page_ids, self.index_page_ids)
        if done.positions is None:
            return lists
        at = np.asarray(done.positions, dtype=np.int64)
        return tuple(None if pages is None else pages[at] for pages in lists)

    # ---- its prefill nodes' liveness, and the tick (control thread) -------------------------

    def peer_silent_locked(self, peer: PrefillPeer, reason: str, now: float) -> None:
        """``peer`` went silent: the pages it may still write into are quarantined (held until it
        is proven gone), and a running request fails with ``reason``."""
        if self.page_ids is not None and self.fence.silent(peer.endpoint):
            self._context.counters.add(quarantines=1, pages_quarantined=self.page_ids.size)
        if self.state.status in TERMINAL:
            self._settle_locked(now)
        else:
            self.abort_locked(reason, now)

    def peer_gone_locked(self, peer: PrefillPeer, now: float, *, in_flight: bool) -> None:
        """Proof that ``peer``'s old writes can no longer land (but a failed one, ``in_flight``,
        which the engine's own bound covers): lift its quarantine."""
        if peer.endpoint in self.fence.quarantined:
            self.fence.confirmed(peer.endpoint, now, in_flight=in_flight,
                                 grace_s=self._context.in_flight_grace_s)
            self._settle_locked(now)

    def tick_locked(self, now: float) -> None:
        """The deadline of a running request, and the quarantine's upper bound of a failed one."""
        status = self.state.status
        if status == KVPoll.Failed and self.state.release_at is None:
            self._settle_locked(now)  # the quarantine's upper bound
        elif status not in TERMINAL:
            dead = [p.endpoint for p in self.peers if not p.alive]
            if dead:  # made while its prefill was dead, not yet initialized
                self.abort_locked(f"prefill {dead[0]} unreachable", now)
            elif now > self.state.deadline:
                self.abort_locked(f"timed out after {self._context.request_timeout_s:.0f}s", now)

    # ---- failure and release -----------------------------------------------------------------

    def abort_locked(self, reason: str, now: float, *, told: PrefillPeer | None = None) -> None:
        """Fail the request and tell its prefill nodes (but ``told``, which refused it)."""
        if self.page_ids is None:  # nothing was asked of any prefill node: none can write, but
            if self._fail_locked(reason, now, release_after_s=0.0):  # each is told at once, so
                self.fence.nothing_sent()  # that its sender does not wait for decode's pages
                for peer in self.peers:  # (one counted dead: once its re-handshake is answered)
                    if peer is told:
                        continue
                    abort = protocol.Abort(self.room, reason, before_pages=True)
                    if peer.alive:
                        self._context.send(peer.socket, abort)
                    else:
                        peer.owed_aborts.append(abort)
            return
        self._fail_sent_locked(reason, now)

    def _fail_locked(self, reason: str, now: float, *, release_after_s: float | None) -> bool:
        if self.state.fail(reason, now, release_after_s=release_after_s):
            self._context.counters.request_failed(reason)
            log.warning("%s: room %d failed: %s", self._context.name, self.room, reason)
            return True
        return False

    def _fail_sent_locked(self, reason: str, now: float) -> None:
        """Fail a request whose pages the prefill nodes know: ask every one that may still write
        to stop, and hold the pages until the fence lets them go."""
        if self._fail_locked(reason, now, release_after_s=None):
            for peer in self.peers:
                if peer.endpoint in self.fence.outstanding and peer.alive:
                    self._context.send(peer.socket, protocol.Abort(self.room, reason))
        self._settle_locked(now)

    def _settle_locked(self, now: float) -> None:
        """Release a failed request's pages once no prefill can still write into them, or once
        the quarantine's upper bound has passed (counted as an expiry)."""
        if self.state.status != KVPoll.Failed:
            return
        bound_s = self._context.quarantine_timeout_s
        at, expired = self.fence.decide(self.state.finished_at, now, bound_s)
        if expired:
            self._context.counters.add(quarantine_expiries=1, pages_expired=self.page_ids.size)
            log.warning("%s: room %d: pages released after %.0fs without proof that no write "
                        "into them can still land", self._context.name, self.room, bound_s)
        if at is not None:
            self.state.allow_release(at)

    def _aux_peer(self) -> PrefillPeer | None:
        """The prefill that writes the aux slot: the one holding the last layer (the first of
        share writers, which all hold every layer)."""
        if self.aux_index is None:
            return None
        return max(self.peers, key=lambda p: max(p.layout.layer_ids))
