"""The prefill node's requests: one ``PrefillRequest`` per room, and each one's way to the writer.

``RequestBook`` keeps the node's requests, room -> ``PrefillRequest`` (``prefill_request``: its
sender, where decode wants its pages, the decode nodes that reserved it, why its destination was
lost before a sender came), guarded by the node's lock, and forgets a room once nothing is left
of it.

One request's path: the application makes its sender (``new_sender``), ``init``s it and
``send``s its page ids in chunks; decode announces its pages (``announced_locked``: every decode
node that receives the request, when several do); once both are known, each queued chunk becomes
a writer ``Job`` per decode node (``_dispatch_locked``), counted in ``KVSender.busy``; a request
decode reads from another prefill rank (``nothing_to_send``) succeeds with its last chunk,
writing nothing. Deferred allocation: decode reserves the request first (``reserved_locked``),
and the application's ``prefill_complete`` (``KVSender``) tells each reserving decode node
(``PrefillReady``; one that reserves later, on arrival), which then announces its pages as
above; a deferred sender's deadline runs only from ``prefill_complete``. What becomes of the job
goes from the writer's lane to the ``ChunkReporter`` with the job's ``PrefillRequest``, not back
here; every failure and refusal is the reporter's too. Methods named ``_locked`` expect the node's
lock held; the others take it.
"""

from __future__ import annotations

import math
import queue
import threading
import time

import numpy as np

from ...plugin.descriptors import BufferDescriptor
from .. import protocol
from ..counters import Counters
from ..plan import PlanError, as_page_ids, check_aux_index, check_destination
from ..request import TERMINAL, KVPoll
from .outcomes import ChunkReporter
from .prefill_request import PrefillRequest
from .records import Chunk, DecodeDestination, DecodePeer, Destinations, IncomingRequest, KVSender
from .writer import Job, Writer


def _page_count_mismatch(prefill: int, decode: int) -> str:
    return f"page count mismatch: prefill has {prefill} pages, decode allocated {decode}"


def _announcement_problem(request: protocol.RequestPages) -> str | None:
    """Why decode's ``RequestPages`` cannot be taken on its own; None when it can."""
    if not 0 <= request.room <= protocol.MAX_ROOM:
        return f"room {request.room} is not in 0..2**63-1"
    if request.prefix_tokens < 0:
        return f"prefix_tokens {request.prefix_tokens} < 0"
    if not 1 <= request.copies <= protocol.MAX_COPIES:
        return f"copies {request.copies} is not in 1..{protocol.MAX_COPIES}"
    if request.nothing_to_send and (request.dst_pages or request.copies != 1
                                    or request.aux_index != -1 or request.index_pages is not None):
        return "nothing_to_send with pages, an aux slot or several copies"
    return None


def _share_problem(sender: KVSender, pages: np.ndarray, positions: np.ndarray,
                   through: object) -> str | None:
    """Why a chunk of a share (``KVSender.send_share``) does not continue ``sender``'s; None
    when it does."""
    if sender.shares is False:
        return "a share of the pages after a whole chunk"
    if isinstance(through, bool) or not isinstance(through, (int, np.integer)):
        return f"share chunk: through must be an int, got {through!r}"
    if not sender.pages_sent < through <= sender.num_pages:
        return (f"share chunk through page {through} after {sender.pages_sent} does not fit the "
                f"request's {sender.num_pages} pages")
    if pages.size != positions.size:
        return f"share chunk of {pages.size} pages at {positions.size} positions"
    if positions.size and (positions[0] < sender.pages_sent or positions[-1] >= through
                           or (positions[1:] <= positions[:-1]).any()):
        return (f"share chunk positions must ascend within [{sender.pages_sent}, {through}), got "
                f"{positions[:8].tolist()}{'...' if positions.size > 8 else ''}")
    return None


def aux_only(request: protocol.RequestPages) -> bool:
    """Whether decode announces no page for the request, only its aux slot or a prefix: its radix
    cache holds the whole page-aligned prompt, and prefill's sender is ``init(0)`` (a page count
    that differs fails the request). An empty list with neither is refused as empty."""
    return (not request.dst_pages and not request.index_pages
            and (request.aux_index >= 0 or request.prefix_tokens > 0))


def _mismatch(destinations: Destinations, request: protocol.RequestPages) -> str | None:
    """Why another decode node's announcement of a request does not match the first one's."""
    if request.nothing_to_send or destinations.nothing_to_send:
        return "one decode node has nothing to receive, another has pages"
    if request.copies != destinations.copies:
        return (f"decode nodes disagree on how many receive the request: {destinations.copies} "
                f"and {request.copies}")
    if request.prefix_tokens != destinations.prefix_tokens:
        return (f"decode nodes disagree on the prefix they hold: {destinations.prefix_tokens} "
                f"and {request.prefix_tokens} tokens")
    return None


class RequestBook:
    """The node's requests, one ``PrefillRequest`` per room (see the module docstring)."""

    def __init__(self, name: str, lock: threading.Lock, *, reporter: ChunkReporter,
                 writer: Writer, counters: Counters, incoming: queue.Queue[IncomingRequest],
                 aux_buffers: list[BufferDescriptor], request_timeout_s: float):
        self.name = name
        self.requests: dict[int, PrefillRequest] = {}  # room -> its request, until idle
        self.aux_buffers = aux_buffers
        self.request_timeout_s = request_timeout_s
        self._lock = lock
        self._reporter = reporter
        self._writer = writer
        self._counters = counters
        self._incoming = incoming

    def _of_locked(self, room: int) -> PrefillRequest:
        """``room``'s request, made if the node knows nothing of it yet."""
        request = self.requests.get(room)
        if request is None:
            request = self.requests[room] = PrefillRequest(room)
        return request

    def _prune_locked(self, request: PrefillRequest) -> None:
        """Forget ``request`` once nothing is left of it."""
        if request.idle and self.requests.get(request.room) is request:
            del self.requests[request.room]

    def _sender_request_locked(self, sender: KVSender) -> PrefillRequest:
        """``sender``'s request; once forgotten, a request of the sender alone (nothing else of
        it is left)."""
        request = self.requests.get(sender.room)
        if request is not None and request.sender is sender:
            return request
        return PrefillRequest(sender.room, sender)

    # ---- the application's calls (its thread) ----------------------------------------------

    def new_sender(self, room: int, *, deferred: bool = False) -> KVSender:
        with self._lock:
            request = self.requests.get(room)
            if request is not None and request.sender is not None:
                raise ValueError(f"room {room} already has a sender")
            request = self._of_locked(room)
            sender = KVSender(self, room, self.request_timeout_s, deferred=deferred)
            lost = request.attach(sender)
            if request.writable:
                sender.state.advance(KVPoll.WaitingForInput, time.monotonic())
                sender.decode_prefix_tokens = request.destinations.prefix_tokens
            if lost is not None:  # its decode node was dropped before the application came
                self._reporter.fail_locked(request, lost.reason)
            return sender

    def init_sender(self, sender: KVSender, num_pages: int, aux_index: int | None) -> None:
        if num_pages < 0:  # 0: decode holds every page already (``aux_only``)
            raise ValueError(f"num_pages must not be negative, got {num_pages}")
        try:
            sender.aux_index = check_aux_index(self.aux_buffers, aux_index, "aux_index")
        except PlanError as exc:
            raise ValueError(str(exc)) from None
        with self._lock:
            if sender.num_pages is not None:
                raise ValueError(f"room {sender.room}: init called twice")
            sender.num_pages = num_pages
            request = self._sender_request_locked(sender)
            for destination in request.to_write():
                if len(destination.dst_pages) != num_pages:
                    self._reporter.fail_locked(request, _page_count_mismatch(
                        num_pages, len(destination.dst_pages)))
                    return

    def send_chunk(self, sender: KVSender, page_ids: object) -> None:
        pages = as_page_ids(page_ids, "page_ids")
        with self._lock:
            if not self._sendable_locked(sender):
                return
            request = self._sender_request_locked(sender)
            if sender.shares:
                self._reporter.fail_locked(request, "a whole chunk after a share of the pages")
                return
            # a request of no page: its one chunk is empty, the last (its aux slot alone)
            empty_last = sender.num_pages == 0 and sender.shares is None
            sender.shares = False
            if (pages.size == 0 and not empty_last) or sender.pages_sent + pages.size > sender.num_pages:
                self._reporter.fail_locked(
                    request, f"chunk of {pages.size} pages after {sender.pages_sent} does not fit "
                    f"the request's {sender.num_pages} pages")
                return
            offset = sender.pages_sent
            sender.pages_sent += pages.size
            sender.pending.append(Chunk(offset, pages, sender.pages_sent == sender.num_pages))
            self._dispatch_locked(request)

    def send_share(self, sender: KVSender, page_ids: object, positions: object,
                   through: int) -> None:
        """A chunk of ``sender``'s share of the pages (``KVSender.send_share``); one that does not
        continue its share fails the request, naming why."""
        pages = as_page_ids(page_ids, "page_ids")
        at = as_page_ids(positions, "positions")
        with self._lock:
            if not self._sendable_locked(sender):
                return
            request = self._sender_request_locked(sender)
            problem = _share_problem(sender, pages, at, through)
            if problem:
                self._reporter.fail_locked(request, problem)
                return
            sender.shares = True
            sender.pages_sent = through
            last = through == sender.num_pages
            if pages.size or last:
                sender.pending.append(Chunk(0, pages, last, at))
                self._dispatch_locked(request)

    @staticmethod
    def _sendable_locked(sender: KVSender) -> bool:
        """Whether ``sender`` takes chunks: False once it ended (they are dropped); ValueError
        before its ``init``."""
        if sender.state.status in TERMINAL:
            return False
        if sender.num_pages is None:
            raise ValueError(f"room {sender.room}: send before init")
        return True

    def abort(self, sender: KVSender, reason: str) -> None:
        with self._lock:
            self._reporter.fail_locked(self._sender_request_locked(sender), reason)

    def abort_all_locked(self, reason: str) -> int:
        """Fail every request whose sender has not finished, with ``reason``; how many."""
        live = [r for r in self.requests.values()
                if r.sender is not None and r.sender.state.status not in TERMINAL]
        for request in live:
            self._reporter.fail_locked(request, reason)
        return len(live)

    def prefill_complete(self, sender: KVSender) -> None:
        """``sender``'s prefill finished: its deadline runs from now, and each decode node that
        reserved the request and was not told yet is told (once; a later one on arrival)."""
        with self._lock:
            if sender.completed:
                return
            sender.completed = True
            request = self.requests.get(sender.room)
            if sender.state.status in TERMINAL or request is None or request.sender is not sender:
                return  # failed (nobody is told), finished, or forgotten
            sender.state.deadline = time.monotonic() + self.request_timeout_s
            for peer in request.untold():
                self._reporter.ready(peer, sender.room)

    def _dispatch_locked(self, request: PrefillRequest) -> None:
        """Hand queued chunks to the writer, one job per decode node, once every decode node's
        pages are known; with nothing to send, the last chunk ends the request."""
        sender = request.sender
        if not request.writable or not sender.pending:
            return
        now = time.monotonic()
        sender.state.advance(KVPoll.Transferring, now)
        for chunk in sender.pending:
            for destination in request.to_write():
                sender.busy += 1
                self._writer.submit(Job(request, destination, chunk))
            if chunk.last and request.destinations.nothing_to_send:
                sender.state.advance(KVPoll.Success, now)
        sender.pending.clear()

    # ---- decode's messages (the control loop) ----------------------------------------------

    def announced_locked(self, peer: DecodePeer, message: protocol.RequestPages) -> None:
        """One decode node's pages for a request: once every decode node that receives it
        announced (``copies``), offered on ``incoming`` until its sender comes, or dispatched."""
        room = message.room
        tell = not message.nothing_to_send  # such a decode node keeps no request to tell
        problem = _announcement_problem(message)
        if problem and not tell:
            raise protocol.ProtocolError(problem)  # dropped and counted (``bad_messages``)
        if problem:
            self._reporter.refuse(peer, room, problem)
            return
        request = self.requests.get(room)
        destinations = request.destinations if request is not None else None
        if destinations is not None:
            if destinations.of(peer) is not None or destinations.complete:
                self._duplicate_locked(peer, request, tell=tell)
                return
            mismatch = _mismatch(destinations, message)
            if mismatch:  # the decode ranks disagree: the request cannot be served
                self._reporter.refuse(peer, room, mismatch, tell=tell)
                self._decode_gave_up_locked(request, mismatch)
                return
        try:
            dst, index = (np.empty(0, np.int64), None) if message.nothing_to_send or aux_only(message) else (
                check_destination(peer.pairs, message.dst_pages, message.index_pages,
                                  kv_page_zero=peer.kv_page_zero))
            aux = check_aux_index([p.dst for p in peer.aux_pairs], message.aux_index,
                                  "decode's aux_index")
        except PlanError as exc:
            self._reporter.refuse(peer, room, f"bad pages: {exc}", tell=tell)
            return
        request = self._of_locked(room)
        request.announce(DecodeDestination(peer, dst, message.num_tokens, time.monotonic(), aux,
                                           message.prefix_tokens, index_pages=index),
                         message.copies, message.nothing_to_send)
        sender = request.sender
        if sender is not None and sender.state.status == KVPoll.Failed:  # before these pages
            if sender.reported:  # to the decode nodes that had announced: this one too
                self._reporter.refuse(peer, room, sender.state.reason, tell=tell)
            else:
                self._reporter.report_failure_locked(request, in_flight=False)
            return
        if not request.writable:
            return
        if sender is None:
            self._incoming.put(IncomingRequest(room, dst.size, message.num_tokens, peer.node,
                                               message.prefix_tokens))
            return
        sender.decode_prefix_tokens = message.prefix_tokens
        sender.state.advance(KVPoll.WaitingForInput, time.monotonic())
        for destination in request.to_write() if sender.num_pages is not None else []:
            if destination.dst_pages.size != sender.num_pages:
                self._reporter.fail_locked(request, _page_count_mismatch(
                    sender.num_pages, destination.dst_pages.size))
                return
        self._dispatch_locked(request)

    def reserved_locked(self, peer: DecodePeer, reserve: protocol.Reserve) -> None:
        """A decode node holds a receiver for ``room`` and waits to be told its prefill finished:
        told now if it has, refused if the request failed or its destination was lost, else
        recorded (a repeat of the same node's is ignored). A reservation after the room's sender
        succeeded is for the room's next request."""
        room = reserve.room
        request = self._of_locked(room)
        if any(r.peer is peer for r in request.reservations):
            return
        sender = request.sender
        if sender is not None and sender.state.status == KVPoll.Success:
            sender = None
        if sender is not None and sender.state.status == KVPoll.Failed:
            self._reporter.refuse(peer, room, sender.state.reason)
        elif sender is None and request.lost is not None:
            self._reporter.refuse(peer, room, request.lost.reason)
        else:
            request.reserve(peer, time.monotonic())
            for told in request.untold() if sender is not None and sender.completed else []:
                self._reporter.ready(told, room)
        self._prune_locked(request)

    def _duplicate_locked(self, peer: DecodePeer, request: PrefillRequest, *, tell: bool) -> None:
        """A room announced again. From a decode node that does not receive it, the newcomer's
        request is the one refused. From one that does, it no longer knows which pages it meant:
        the room fails, and, like any failure, is reported only once no write of ours into it
        can still land."""
        mine = request.destination_of(peer)
        if mine is None or request.sender is None:
            if mine is not None:
                request.leave(mine)
                self._prune_locked(request)
            self._reporter.refuse(peer, request.room, f"duplicate room {request.room}", tell=tell)
            return
        self._reporter.fail_locked(request, f"duplicate room {request.room}")

    def aborted_locked(self, peer: DecodePeer, abort: protocol.Abort) -> None:
        request = self.requests.get(abort.room)
        if abort.before_pages and request is not None:  # its reservation, if any, goes first:
            request.unreserve(peer)  # it needs no refusal
        destinations = request.destinations if request is not None else None
        member = destinations is not None and destinations.of(peer) is not None
        if abort.before_pages and not member and (destinations is None
                                                  or not destinations.complete):
            # nothing to answer (no page was asked of it); the request cannot be served
            self._decode_gave_up_locked(self._of_locked(abort.room),
                                        f"aborted by decode: {abort.reason}")
            return
        if destinations is not None and not member:
            raise protocol.ProtocolError(f"abort of room {abort.room}, which another decode "
                                         f"node announced")
        if destinations is None:
            if request is not None:
                self._prune_locked(request)
            self._reporter.refuse(peer, abort.room, f"aborted by decode: {abort.reason}")
            return
        if request.sender is None:  # a sender made later fails at once, as before its pages
            request.lose(f"aborted by decode: {abort.reason}", time.monotonic())
            self._drop_destinations_locked(request, f"aborted by decode: {abort.reason}")
            return
        self._reporter.fail_locked(request, f"aborted by decode: {abort.reason}")

    def from_dropped_locked(self, peer: DecodePeer, message: protocol.RequestPages,
                            reason: str) -> None:
        """Pages announced by a decode node dropped as silent (``peer``: its latest epoch): no
        write can serve them before it re-handshakes. Refused to it (``unpaired``: it
        re-handshakes at once), and the room's sender fails now, or at once when made."""
        self._reporter.refuse(peer, message.room, reason, tell=not message.nothing_to_send,
                              unpaired=True)
        self._decode_gave_up_locked(self._of_locked(message.room), reason)

    def _decode_gave_up_locked(self, request: PrefillRequest, reason: str) -> None:
        """Decode gave the request up before it sent its pages: its sender fails now, or at once
        when the application makes it."""
        if request.sender is None:
            request.lose(reason, time.monotonic())
        else:
            self._reporter.fail_locked(request, reason)

    def drop_peer_locked(self, peer: DecodePeer, reason: str, now: float) -> None:
        """Fail a dropped decode node's requests and forget its destinations; their senders
        are kept on the peer (``dropped_senders``) for the fence of its session's next Hello.
        The request's other decode nodes, if any, are told as usual. A room it only reserved
        fails too (no write into it can run): its sender now, or at once when made."""
        for request in list(self.requests.values()):
            if not request.unreserve(peer) or request.room in peer.rooms:  # announced: below
                self._prune_locked(request)
                continue
            if request.sender is None:
                request.lose(reason, now)
            else:
                self._reporter.fail_locked(request, reason)
        for room in list(peer.rooms):
            request = self.requests[room]
            sender = request.sender
            if sender is None:  # offered on ``incoming``: a sender made later fails at once
                request.lose(reason, now)
            else:
                peer.dropped_senders.append(sender)
                if sender.state.fail(reason, now):
                    self._counters.request_failed(reason)
            request.leave(request.destination_of(peer))
            if sender is not None:
                self._reporter.report_failure_locked(request, in_flight=False)

    def _drop_destinations_locked(self, request: PrefillRequest, reason: str) -> None:
        """Forget every decode node's destination of ``request`` and refuse it to each."""
        destinations = request.drop_destinations()
        self._prune_locked(request)
        for destination in destinations.members:
            self._reporter.refuse(destination.peer, request.room, reason,
                                  tell=not destinations.nothing_to_send)

    # ---- the tick (the control loop) -------------------------------------------------------

    def expire_locked(self, now: float) -> None:
        """Fail the requests past their deadline, forget the finished ones no write of which can
        still run, and the lost destinations older than the request timeout."""
        for request in list(self.requests.values()):
            sender = request.sender
            if sender is not None and sender.state.status not in TERMINAL \
                    and now > sender.state.deadline:
                self._reporter.fail_locked(request, f"timed out after {self.request_timeout_s:.0f}s")
            if sender is not None and sender.can_release() and (
                    sender.reported or now > self._kept_until(sender)
                    or sender.state.status == KVPoll.Success):
                self._finish_locked(request)
                continue
            request.forget_lost(now, self.request_timeout_s)
            self._prune_locked(request)

    def _kept_until(self, sender: KVSender) -> float:
        """Until when a failed request nobody was told of stays on record (so that decode's
        pages or reservation arriving later are refused): its deadline, or, for a deferred one
        that failed before ``prefill_complete`` (no deadline), the timeout after its failure."""
        if sender.state.deadline == math.inf and sender.state.finished_at is not None:
            return sender.state.finished_at + self.request_timeout_s
        return sender.state.deadline

    def refuse_unclaimed_locked(self, now: float) -> None:
        """Refuse the requests decode announced or reserved that no sender claimed within the
        timeout; a sender made for one later (within the timeout again) fails at once, as one
        whose destination was lost."""
        unclaimed = "no prefill request for this room"
        late = f"decode's request was refused: no sender came within {self.request_timeout_s:g}s"
        for request in list(self.requests.values()):
            if request.sender is not None:
                continue
            destinations = request.destinations
            if destinations is not None and \
                    now - destinations.members[0].received_at > self.request_timeout_s:
                request.lose(late, now)
                self._drop_destinations_locked(request, unclaimed)
            for reservation in list(request.reservations):
                if now - reservation.received_at > self.request_timeout_s:
                    request.lose(late, now)
                    request.unreserve(reservation.peer)
                    self._reporter.refuse(reservation.peer, request.room, unclaimed)
            self._prune_locked(request)

    def _finish_locked(self, request: PrefillRequest) -> None:
        """Forget a finished request (the application keeps its sender object and its state);
        the reservations that came after it succeeded stay, for the room's next request."""
        following = request.finish()
        if following is not None:
            self.requests[request.room] = following
        else:
            del self.requests[request.room]
